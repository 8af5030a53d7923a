"""Command line: ``preflight run``, ``preflight list``, ``preflight config --defaults``, ``preflight --version``.

Exit codes: 0 no FAIL/ERROR (warnings allowed); 1 any FAIL or ERROR (or WARN with --strict);
2 usage or input error (nothing was run); 130 interrupted (after cleaning up on the hosts).
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from preflight import checks as registry
from preflight import __version__
from preflight import render
from preflight.config import ConfigError, default_page, load_thresholds
from preflight.inputs import MAX_DEEPSPEED_CONFIG_BYTES, MAX_SSH_FILE_BYTES, InputError, read_text_limited
from preflight.hostfile import (HostfileError, apply_filters, expanded_text, first_nodes, load_hostfile,
                                local_cluster, split_csv, with_slots)
from preflight.hostside.seams import CheckOptions
from preflight.results import CLUSTER_NAME
from preflight import transport as transports
from preflight.transport import SSHOptions

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
VERSION_LINE = f"preflight {__version__}"
# --transport's choices: the registered transports that reach other hosts ("local" is the run without a hostfile);
# a hostfile run outside a Slurm allocation uses the checks' default (CheckOptions.transport).
TRANSPORT_CHOICES = [name for name in transports.names() if name != "local"]
DEFAULT_TRANSPORT = CheckOptions.transport


class UsageError(Exception):
    pass


def _positive(kind: type, noun: str, most: float):
    """argparse type: a finite number of ``kind`` with 0 < value <= most; argparse names the option in the error."""
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value <= 0 or value > most:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; expected 0 < x <= {most:g}")
        return value
    return parse


# Upper bounds keep every deadline representable (time.time() + inf overflows) and every run finite.
_seconds = _positive(float, "a number of seconds", 86400.0)
_connect_seconds = _positive(float, "a number of seconds", 3600.0)
_positive_int = _positive(int, "an integer", 100000)
_count = _positive(float, "a number", 1e15)
_gbps = _positive(float, "a number", 1e6)


def _port(text: str) -> int:
    value = _positive(int, "an integer", 65535)(text)
    return value


def _master_addr(text: str) -> str:
    """An IP address or a host name (what DeepSpeed's --master_addr takes), one word."""
    value = text.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:_%-]{0,252}", value):
        raise argparse.ArgumentTypeError(f"expected an IP address or a host name, got {text[:60]!r}")
    return value


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the closest of choices (difflib), or "": one clause of a one-line error."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option, and where the help is (not the usage block).

    No abbreviations (``allow_abbrev=False``, also for the subcommands' parsers, which are of this class): argparse
    would read ``--host`` as ``--hostfile``. An unknown option or choice gets a did-you-mean instead."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        choice = re.search(r"invalid choice: '([^']*)'", message)
        if choice:  # argparse names the choices, but suggests none: `preflight rnu`, `--transport shh`
            valid = [str(c) for a in self._actions if a.choices for c in a.choices]
            message += did_you_mean(choice.group(1), valid)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; try '{self.prog} --help'\n")

    def unrecognized(self, extra: Sequence[str]) -> None:
        """Exit 2 for arguments no option takes; an unknown --option gets the closest real one (--hostfile)."""
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = [did_you_mean(word.split("=", 1)[0], options) for word in extra if word.startswith("--")]
        self.error(f"unrecognized arguments: {' '.join(extra)}{next((h for h in hints if h), '')}")


def build_parser() -> _Parser:
    parser = _Parser(
        prog="preflight", description="Check a GPU cluster before a DeepSpeed/PyTorch job is submitted.")
    parser.add_argument("-V", "--version", action="version", version=VERSION_LINE)
    sub = parser.add_subparsers(dest="command",
                                metavar="{run,rehearse,list,config,hostfile,node-check,history,diff,version}")

    commands = {"list": sub.add_parser("list", help="list every check with one line of description")}
    commands["list"].add_argument("--thresholds", action="store_true",
                                  help="print the thresholds' defaults instead (as `preflight config --defaults`)")
    commands["config"] = sub.add_parser("config", help="print the thresholds' defaults (--defaults), every check's "
                                        "section with its comments: one TOML page to edit and pass as --config")
    commands["config"].add_argument("--defaults", action="store_true", required=True,
                                    help="print the assembled defaults as one documented TOML page")

    hf = sub.add_parser("hostfile", help="check a hostfile as DeepSpeed reads it and list its hosts (exit 0, or 2 "
                        "with file:line of the first error); --expand writes its ranges out")
    hf.add_argument("file", nargs="?", metavar="FILE",
                    help="the hostfile to check: prints one line per host (its hostfile line, name and slots), then "
                         "the totals; warnings about text DeepSpeed reads otherwise go to stderr")
    hf.add_argument("--expand", metavar="FILE",
                    help="print FILE with every range (node[01-04]) written out, one 'HOSTNAME slots=N' line per "
                         "host: the hostfile DeepSpeed's launcher reads as preflight does")

    commands["hostfile"] = hf
    commands["version"] = sub.add_parser("version", help="print preflight's version (as --version does)")
    run = commands["run"] = sub.add_parser(
        "run", help="run the checks on every host of the hostfile (default: this machine)")
    g = run.add_argument_group("cluster")
    g.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile ('host slots=N'; node[01-04] ranges ok). "
                   "Without it the cluster is this machine alone, run without SSH")
    g.add_argument("--slots", "--num_gpus", type=_positive_int, metavar="N",
                   help="GPUs (ranks) per host: overrides the hostfile's slots and, without a hostfile, the visible "
                        "GPUs of this machine (--num_gpus: DeepSpeed's spelling of the same option)")
    g.add_argument("--num_nodes", "--num-nodes", type=_positive_int, metavar="N",
                   help="check the first N hosts of the hostfile, the ones DeepSpeed's --num_nodes N runs on")
    g.add_argument("-i", "--include", default="", metavar="SPEC", help="DeepSpeed syntax: 'host1:0,1@host2'")
    g.add_argument("-e", "--exclude", default="", metavar="SPEC", help="DeepSpeed syntax: 'host1:0,1@host2'")
    g.add_argument("--python", default="python3", metavar="PATH",
                   help="interpreter on the hosts: the job's environment (default: python3)")
    g = run.add_argument_group("checks")
    g.add_argument("--checks", default=None, metavar="A,B", help="run only these checks (see `preflight list`)")
    g.add_argument("--skip", default="", metavar="A,B", help="do not run these checks")
    g.add_argument("--config", metavar="FILE", help="thresholds TOML (`preflight config --defaults` prints them all)")
    g.add_argument("--timeout", type=_seconds, default=120.0, metavar="S",
                   help="deadline of each check on a host (default 120)")
    g.add_argument("--parallel", type=_positive(int, "an integer", 4096), default=32, metavar="N",
                   help="hosts connected to at once (default 32); waiting on hosts is not limited (docs/ssh.md)")
    g.add_argument("--nvme-path", action="append", default=[], metavar="DIR",
                   help="directory to measure with dd on every host (repeatable); the test file is removed")
    g.add_argument("--master-port", type=_port, default=29500, metavar="PORT",
                   help="torch.distributed master port to check (default 29500, DeepSpeed's default)")
    g.add_argument("--master-addr", type=_master_addr, metavar="ADDR",
                   help="the job's master address (DeepSpeed's --master_addr), probed from every host on the master "
                        "port (default: the one DeepSpeed's launcher picks, the first of `hostname -I` on the first "
                        "host)")
    g.add_argument("--deepspeed-config", metavar="FILE", help="DeepSpeed config to validate against the cluster")
    g.add_argument("--rehearse", action="store_true", default=None,
                   help="also rehearse the job's launch (the launch check, with --deepspeed-config): DeepSpeed's "
                        "launcher over pdsh starts a tiny model with the config on every slot (docs/rehearse.md)")
    g.add_argument("--model-params", type=_count, metavar="N",
                   help="model parameter count (e.g. 7e9) for the ZeRO memory estimate")
    g.add_argument("--largest-layer-params", type=_count, metavar="N",
                   help="parameters of the largest layer (ZeRO-3 estimate)")
    g.add_argument("--model-parallel-size", type=_positive_int, metavar="N",
                   help="tensor x pipeline parallel degree of the job (1: data parallel only), so the batch math "
                        "uses the data-parallel size: world size / N")
    g.add_argument("--min-busbw", type=_gbps, metavar="GBPS",
                   help="all-reduce bus bandwidth below this (GB/s) fails")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="the job's checkpoint directory: exists and writable on every host, free space for one "
                        "checkpoint (with --model-params), one shared filesystem; the test files are removed")
    g = run.add_argument_group("SSH")
    g.add_argument("--ssh-user", metavar="USER",
                   help="user to log in as on every host; wins over the User of --ssh-config (default: that User, "
                        "else your login name)")
    g.add_argument("--ssh-port", type=_port, metavar="PORT",
                   help="sshd port on every host; wins over the Port of --ssh-config (default: that Port, else 22)")
    g.add_argument("--launcher-ssh-port", type=_port, metavar="PORT",
                   help="port DeepSpeed's launcher will ssh to from the first host (DeepSpeed's --ssh_port), which "
                        "the launcher_ssh check probes (default: --ssh-port, else ssh's own: the Port of the first "
                        "host's ~/.ssh/config, else 22)")
    g.add_argument("--ssh-key", metavar="FILE", help="private key (default: ssh-agent, ~/.ssh/config, ~/.ssh/id_*)")
    g.add_argument("--ssh-config", default="~/.ssh/config", metavar="FILE",
                   help="OpenSSH client config read for each host's HostName, User, Port, IdentityFile, ProxyJump "
                        "(default ~/.ssh/config; /dev/null: none)")
    g.add_argument("--known-hosts", default="~/.ssh/known_hosts", metavar="FILE",
                   help="known_hosts file the host keys are verified against (default ~/.ssh/known_hosts); an "
                        "unknown or changed key fails the host's ssh check")
    g.add_argument("--accept-new-host-keys", action="store_true",
                   help="record unknown host keys in --known-hosts (like StrictHostKeyChecking=accept-new); "
                        "a changed key is always refused")
    g.add_argument("--connect-timeout", type=_connect_seconds, default=10.0, metavar="S",
                   help="TCP connect + SSH handshake deadline per host (default 10)")
    g = run.add_argument_group("output")
    for output in render.file_outputs():  # --json, --junit-xml, ...: preflight/render/__init__.py's RENDERERS
        g.add_argument(output.flag, metavar=output.metavar, help=output.help)
    g.add_argument("--write-hostfile", metavar="FILE",
                   help="write a DeepSpeed hostfile of the healthy hosts (input's slots; a failed GPU stays in it as "
                        "an -e HOST:SLOT the first line names), replaced atomically (docs/healthy-hostfile.md)")
    g.add_argument("--min-hosts", type=_min_hosts, default=None, metavar="N",
                   help="exit 0 when at least N hosts (or a fraction of them, e.g. 0.9) are healthy and nothing "
                        "failed cluster-wide: the gate passes with the healthy subset")
    g.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="print only the verdict (READY / NOT READY: ...) and the summary line")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="print every (host, check) result instead of one line per cause, reasons and tracebacks")
    _add_history_options(g)
    _add_slurm_options(run)
    commands["node-check"] = _add_node_check_parser(sub)
    _add_history_commands(sub, commands)
    commands["rehearse"] = _add_rehearse_parser(sub)
    parser.set_defaults(_commands=commands)
    return parser


def _configured_checks(thresholds: Optional[Dict[str, Dict[str, Any]]], key: str, config: Optional[str]) -> List[str]:
    """[checks] only/skip of --config: a list of check names, else a UsageError naming the file and key."""
    value = ((thresholds or {}).get("checks") or {}).get(key) or []
    where = f"{config or 'preflight/defaults.toml'}: checks.{key}"
    for name in value:
        if not isinstance(name, str):
            raise UsageError(f"{where} must be a list of check names (see `preflight list`), e.g. [\"nvme\"]")
        if name not in registry.ORDER:
            raise UsageError(f"{where}: unknown check {name[:60]!r}{did_you_mean(name, registry.ORDER)}; "
                             f"known checks: {', '.join(registry.ORDER)}")
    return list(value)


def _given(option_names: Sequence[str], options: Optional[CheckOptions]) -> bool:
    return options is not None and any(getattr(options, name, None) not in (None, "", [], ()) for name in option_names)


def select_checks(only: Optional[str], skip: Optional[str], options: Optional[CheckOptions],
                  thresholds: Optional[Dict[str, Dict[str, Any]]] = None, config: Optional[str] = None) -> List[str]:
    """Check ids to run, in registry order (a check of scope "connection" always runs: every other check needs the
    connection).

    only/skip are --checks/--skip (None: not given); the [checks] section of --config fills in what they leave
    out: --checks replaces both of its keys, --skip its skip. Without a list, the default checks run, and each
    opt-in check one of whose ``SPEC.selected_by`` options is given in options (--deepspeed-config's check)."""
    known = [n for n in registry.ORDER if registry.spec(n).scope != "connection"]
    wanted = list(split_csv(only or ""))
    skipped = list(split_csv(skip or ""))
    if only is not None and not wanted:
        raise UsageError("--checks is empty; name at least one check (see `preflight list`), or leave it out")
    for option, names in (("--checks", wanted), ("--skip", skipped)):
        for name in names:
            if name not in registry.ORDER:
                raise UsageError(f"unknown check {name!r} in {option}{did_you_mean(name, registry.ORDER)}; "
                                 f"known checks: {', '.join(registry.ORDER)}")
    configured_only = _configured_checks(thresholds, "only", config)
    configured_skip = _configured_checks(thresholds, "skip", config)
    if only is None:
        wanted = configured_only
        if not skip:
            skipped = configured_skip
    # Only one source contradicting itself is an error: the file's `only` less a --skip is a natural "the site's
    # set, but not this today".
    both = [n for n in wanted if n in skipped] if (only is None) == (not skip) else []
    if both:
        where = "--checks and --skip" if only is not None else f"{config}: checks.only and checks.skip"
        raise UsageError(f"{where} both name {', '.join(both)}; name each check in only one of them")
    if wanted:
        chosen = [n for n in known if n in wanted]
    else:
        chosen = [n for n in known if registry.spec(n).default or _given(registry.spec(n).selected_by, options)]
    return [n for n in chosen if n not in skipped]


# Where an existing "file" is a kernel interface: writing a report there fails at the end, or (/proc/sys, as root)
# changes a kernel setting.
KERNEL_FILESYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
                                "pstore", "efivarfs", "bpf", "fusectl", "binfmt_misc"})


def _filesystem_type(device: int) -> Optional[str]:
    """The type of the mounted filesystem whose st_dev is device (/proc/self/mountinfo's "0:21"), None if unknown."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:  # not Linux, or no /proc
        pass
    return None


def _check_output_path(option: str, path: Optional[str]) -> None:
    """The file an output option names can be written, or a UsageError naming the option: found before any host
    is contacted, not after every check has run (and the report is lost).

    The system call itself is the test, not os.access, which tells root yes for /proc and for a read-only
    filesystem: a new file is created (O_EXCL) and removed again; an existing regular file is opened for append
    (nothing written, nothing truncated). A FIFO or device (/dev/stdout, a shell's >(...)) is only checked for
    write permission: opening it would wait for its reader. The path is the one the renderer opens (no ~)."""
    if not path or path == render.STDOUT:
        return
    where = f"{option} {path}"
    target = path
    if os.path.islink(path) and not os.path.exists(path):
        target = os.path.realpath(path)  # a dangling link: open() creates the file it points to
    try:
        st: Optional[os.stat_result] = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:  # ENOTDIR (a file used as a directory), ELOOP, EACCES on a directory above it
        raise UsageError(f"{where}: cannot be written: {exc.strerror}") from None
    if st is None:
        parent = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(parent):
            raise UsageError(f"{where}: directory {parent} does not exist")
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOCTTY, 0o600)
        except FileExistsError:  # created since the stat: it can be written to, as far as this probe goes
            return
        except OSError as exc:  # EROFS, EACCES, ENOENT in /proc, ENAMETOOLONG, ...
            raise UsageError(f"{where}: cannot create a file in {parent}: {exc.strerror}") from None
        os.close(fd)
        os.unlink(target)
    elif stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{where}: is a directory; give a file name")
    elif stat.S_ISREG(st.st_mode):
        kernel = _filesystem_type(st.st_dev)
        if kernel in KERNEL_FILESYSTEMS:  # root may open /proc/version for writing; the write fails (EIO)
            raise UsageError(f"{where}: is a kernel file ({kernel} filesystem), not a file for a report")
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NOCTTY))
        except OSError as exc:
            raise UsageError(f"{where}: cannot be written: {exc.strerror}") from None
    elif not os.access(target, os.W_OK):
        raise UsageError(f"{where}: cannot be written: permission denied")


def _check_input_file(option: str, path: str, max_bytes: int) -> None:
    """A regular, readable, bounded UTF-8 file, or a UsageError naming the option (never a MemoryError)."""
    try:
        read_text_limited(path, option, max_bytes)
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{option} {path}: is a directory, not a file") from None
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not a UTF-8 text file") from None


def params_from_options(options: CheckOptions) -> Dict[str, Dict[str, Any]]:
    """{check: per-host params} from each check's ``SPEC.params_from_options`` (the nvme paths and ops a DeepSpeed
    config asks of every host). A check that cannot use an option it reads (a config DeepSpeed would refuse at
    start: nothing to check it against) is a UsageError, before any host is contacted, whether it runs or not."""
    out: Dict[str, Dict[str, Any]] = {}
    for spec in registry.all_specs():
        if spec.params_from_options is not None:
            try:
                out[spec.name] = spec.params_from_options(options)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    return out


def merge_params(into: Dict[str, Any], params: Dict[str, Any]) -> None:
    """Add one check's per-host params: a list extends the same key's list (without repeating an item)."""
    for key, value in params.items():
        if isinstance(value, list) and isinstance(into.get(key), list):
            into[key] += [v for v in value if v not in into[key]]
        else:
            into[key] = value


def build_options(args: argparse.Namespace):
    from preflight.runner import RunOptions
    outputs = render.file_outputs()
    for output in outputs:
        _check_output_path(output.flag, getattr(args, output.dest))
    if getattr(args, "write_hostfile", None) == render.STDOUT:
        raise UsageError("--write-hostfile -: give a file name (stdout holds the terminal report)")
    _check_output_path("--write-hostfile", getattr(args, "write_hostfile", None))
    if [getattr(args, output.dest) for output in outputs].count(render.STDOUT) > 1:
        raise UsageError(f"only one of {'/'.join(o.flag for o in outputs)} can be '-' (stdout)")
    thresholds = load_thresholds(args.config)
    notes: List[str] = []  # warnings about the input, printed before the run (e.g. text DeepSpeed ignores)
    info: List[str] = []  # what preflight decided for the user (e.g. where the local slot count came from)
    if args.slots is not None and (args.include or args.exclude):
        # DeepSpeed: "Cannot specify num_nodes/gpus with include/exclude"
        raise UsageError("--slots cannot be combined with --include/--exclude (as DeepSpeed's --num_gpus)")
    num_nodes = getattr(args, "num_nodes", None)
    if num_nodes is not None and (args.include or args.exclude):
        # DeepSpeed runner.py:462-464 raises the same for --num_nodes.
        raise UsageError("--num_nodes cannot be combined with --include/--exclude (DeepSpeed: \"Cannot specify "
                         "num_nodes/gpus with include/exclude\")")
    slurm_hosts, transport, host_source = _slurm_selection(args)
    if args.hostfile:
        hosts = apply_filters(load_hostfile(args.hostfile, notes), args.include, args.exclude)
        if num_nodes is not None:
            hosts = first_nodes(hosts, num_nodes, notes)
        if args.slots is not None:
            hosts = with_slots(hosts, args.slots)
        local = False
        if any(h.name == CLUSTER_NAME for h in hosts):
            raise UsageError(f"{args.hostfile}: a host named {CLUSTER_NAME!r} would share the name of the "
                             "cluster-wide results in the reports; use another name for it (e.g. its address)")
    elif slurm_hosts is not None:
        hosts, local = apply_filters(slurm_hosts, args.include, args.exclude), False
        if num_nodes is not None:
            hosts = first_nodes(hosts, num_nodes, notes)
    else:
        if args.include or args.exclude:
            raise UsageError("--include/--exclude need --hostfile")
        if num_nodes is not None and num_nodes > 1:
            # runner.py:476-477: "Num nodes is >1 but no extra nodes available via hostfile".
            raise UsageError(f"--num_nodes {num_nodes} needs a --hostfile: without one the cluster is this machine "
                             "(DeepSpeed: \"Num nodes is >1 but no extra nodes available via hostfile\")")
        hosts, local = local_cluster(args.slots, info), True
        if not shutil.which(args.python):
            raise UsageError(f"--python {args.python}: not found on this machine (without --hostfile the checks run "
                             "here); pass an existing interpreter")
    if args.deepspeed_config:
        _check_input_file("--deepspeed-config", args.deepspeed_config, MAX_DEEPSPEED_CONFIG_BYTES)
    check_options = CheckOptions(
        transport=transport, master_port=args.master_port, deepspeed_config=args.deepspeed_config,
        model_params=args.model_params, largest_layer_params=args.largest_layer_params,
        model_parallel_size=args.model_parallel_size, min_busbw=args.min_busbw, python=args.python,
        checkpoint_dir=args.checkpoint_dir, launcher_ssh_port=args.launcher_ssh_port or args.ssh_port,
        master_addr=args.master_addr, rehearse=args.rehearse, hostfile=args.hostfile)
    if args.rehearse and not args.deepspeed_config:
        raise UsageError("--rehearse needs --deepspeed-config FILE: the launch is rehearsed with the job's config")
    from_options = params_from_options(check_options)
    checks = select_checks(args.checks, args.skip, check_options, thresholds, args.config)
    host_params: Dict[str, Any] = {"nvme_paths": list(args.nvme_path)}
    for name in checks:
        merge_params(host_params, from_options.get(name, {}))
    ssh = SSHOptions(user=args.ssh_user, port=args.ssh_port, key=args.ssh_key, config_path=args.ssh_config,
                     known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys,
                     connect_timeout=args.connect_timeout)
    if args.ssh_key and not Path(args.ssh_key).expanduser().is_file():
        raise UsageError(f"--ssh-key {args.ssh_key}: no such file")
    for option, path in (("--ssh-config", args.ssh_config), ("--known-hosts", args.known_hosts)):
        # Optional files (a missing one means none), but an existing one is read whole: bounded, regular.
        if not local and path and os.path.lexists(os.path.expanduser(path)):
            _check_input_file(option, path, MAX_SSH_FILE_BYTES)
    if not local and transports.kind(transport).READS_SSH_CONFIG:
        from preflight import sshconfig
        try:  # read once here: a line it cannot parse stops the run; Match/Include it cannot honour are warned about
            notes.extend(sshconfig.load(args.ssh_config).warnings)
        except sshconfig.SSHConfigError as exc:
            raise UsageError(f"--ssh-config {exc}") from None
    return RunOptions(hosts=hosts, checks=checks, thresholds=thresholds, local=local, python=args.python, ssh=ssh,
                      timeout=args.timeout, parallel=args.parallel, strict=args.strict, transport=transport,
                      transport_options={o.dest: getattr(args, o.dest) for o in transports.options()},
                      host_params=host_params, host_source=host_source, info_notes=info,
                      input_notes=notes, check_options=check_options)


def cmd_config_defaults(out, err) -> int:
    """``preflight config --defaults``: the documented defaults page on stdout; it loads back as a --config."""
    try:
        page = default_page()
    except ConfigError as exc:  # a check's TOML missing from the install, or one that breaks its own rules
        print(f"preflight: error: {exc}", file=err)
        return EXIT_USAGE
    try:
        out.write(page)
        out.flush()
    except BrokenPipeError:  # `preflight config --defaults | head`
        _drop_stdout()
    return EXIT_OK


def cmd_list(out) -> int:
    width = max(len(n) for n in registry.ORDER)
    lines = []
    for name in registry.ORDER:
        module = registry.load(name)
        scope = {"host": "per host", "cluster": "cluster", "connection": "per host"}[module.SPEC.scope]
        default = "" if module.SPEC.default else "  (opt-in)"
        lines.append(f"{name:<{width}}  [{scope}]  {module.SPEC.description}{default}\n")
    try:
        out.write("".join(lines))
        out.flush()
    except BrokenPipeError:  # `preflight list | head -1`: the reader has what it wanted
        _drop_stdout()
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from preflight import launchable
    from preflight.render import terminal as rep
    from preflight.runner import Runner

    err = rep.stderr_console()
    try:
        options = build_options(args)
    except (UsageError, HostfileError, ConfigError, InputError) as exc:
        err.print(Text(rep.plain(f"preflight: error: {exc}")), soft_wrap=True)
        return EXIT_USAGE
    short = launchable.short_of_min_hosts(args.min_hosts or "", len(options.hosts))
    if short:  # no run can pass: said before any host is contacted, as the verdict (stdout) and its exit code
        try:
            print(short, flush=True)
        except BrokenPipeError:
            _drop_stdout()
        return EXIT_FAILED
    if options.host_source and not args.quiet:
        err.print(f"preflight: {options.host_source}", soft_wrap=True, highlight=False, markup=False)
    for note in options.info_notes:
        err.print(f"preflight: {note}", soft_wrap=True, highlight=False, markup=False)
    for note in options.input_notes:
        err.print(f"preflight: warning: {note}", soft_wrap=True, highlight=False, markup=False)
    _tune_interpreter()
    runner = Runner(options, rep.TerminalProgress(err, quiet=args.quiet))
    try:
        result = runner.run()
    except KeyboardInterrupt:
        err.print("preflight: interrupted; stopped the checks and cleaned up on the hosts")
        return EXIT_INTERRUPTED
    from preflight import history  # each host's figures against its own past (WARNs), then the run recorded
    history.record_report(result, options.thresholds, _history_path(args),
                          lambda text: err.print(Text(rep.plain(f"preflight: warning: {text}")), soft_wrap=True))
    # The files first: a terminal that goes away (`| head -1`, a closed ssh session) must not lose them.
    paths = {output.name: getattr(args, output.dest) for output in render.file_outputs()}
    for output in render.file_outputs():
        path = paths[output.name]
        if path:
            try:
                for change in output.to_path(result, path):  # what a merge changed (--env-file)
                    err.print(Text(rep.plain(f"preflight: {output.flag} {path}: {change}")), soft_wrap=True)
            except BrokenPipeError:
                _drop_stdout()
            except OSError as exc:
                err.print(Text(rep.plain(f"preflight: error: cannot write {path}: {exc.strerror}")))
                return EXIT_USAGE
    if render.STDOUT in paths.values():
        stream, width = sys.stderr, None  # stdout holds the report file alone
    else:
        # Piped output (CI logs, files) gets a wide fixed width unless COLUMNS says otherwise.
        tty = sys.stdout.isatty() or "COLUMNS" in os.environ
        stream, width = sys.stdout, None if tty else 240
    if args.write_hostfile:  # the healthy hosts (preflight/launchable.py), named in the verdict's launch command
        try:
            render.write_atomic(args.write_hostfile, lambda fh: launchable.write(result, fh))
        except OSError as exc:
            err.print(Text(rep.plain(f"preflight: error: cannot write {args.write_hostfile}: {exc.strerror}")))
            return EXIT_USAGE
    context = launchable.Context(args.hostfile or "", args.write_hostfile or "", _in_slurm(args),
                                 args.min_hosts or "")
    try:
        render.get("terminal").load()(result, stream, render.Settings(args.verbose, args.quiet, width, context))
        stream.flush()
    except BrokenPipeError:
        _drop_stdout()
    return launchable.exit_code(result, args.min_hosts or "")


def _in_slurm(args: argparse.Namespace) -> bool:
    from preflight import slurm
    return bool(args.slurm or slurm.in_allocation(os.environ))


def _min_hosts(text: str) -> str:
    from preflight import launchable
    return launchable.parse_min_hosts(text)


def cmd_hostfile(args: argparse.Namespace, out, err) -> int:
    """``preflight hostfile FILE``: the hosts as parsed, one line each, and the totals; ``preflight hostfile --expand
    IN``: the hostfile with its ranges written out. Either on stdout, exit 0; a bad hostfile is one line, exit 2."""
    if bool(args.file) == bool(args.expand):
        print("preflight hostfile: error: give one hostfile: `preflight hostfile FILE` checks it and lists its "
              "hosts, `preflight hostfile --expand FILE` writes its ranges out", file=err)
        return EXIT_USAGE
    path = args.expand or args.file
    notes: List[str] = []
    try:
        hosts = load_hostfile(path, notes)
    except HostfileError as exc:
        print(f"preflight: error: {exc}", file=err)
        return EXIT_USAGE
    for note in notes:
        if not (args.expand and "ranges expanded" in note):  # expanding them is what --expand asks for
            print(f"preflight: warning: {note}", file=err)
    if args.expand:
        text = expanded_text(hosts, path)
    else:
        width = max(len("host"), *(len(h.name) for h in hosts))
        lines = [f"{'line':>5}  {'host':<{width}}  slots"]
        lines += [f"{h.line:>5}  {h.name:<{width}}  {h.slots}" for h in hosts]
        lines.append(f"{path}: {len(hosts)} host{'s' if len(hosts) != 1 else ''}, "
                     f"{sum(h.slots for h in hosts)} slots")
        text = "\n".join(lines) + "\n"
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:  # `preflight hostfile big.txt | head`
        _drop_stdout()
    return EXIT_OK


def _drop_stdout() -> None:
    """The reader of stdout is gone: send what is left to /dev/null so the exit flush cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser, so the hint points at `preflight run --help`
        parser = args._commands.get(args.command, parser)
        parser.unrecognized(extra)
    if args.command == "list":
        return cmd_config_defaults(sys.stdout, sys.stderr) if args.thresholds else cmd_list(sys.stdout)
    if args.command == "config":
        return cmd_config_defaults(sys.stdout, sys.stderr)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "hostfile":
        return cmd_hostfile(args, sys.stdout, sys.stderr)
    if args.command == "version":
        print(VERSION_LINE)
        return EXIT_OK
    if args.command == "node-check":
        return cmd_node_check(args)
    if args.command in ("history", "diff"):
        return cmd_history(args)
    if args.command == "rehearse":
        from preflight import rehearse
        return rehearse.main(args)
    parser.print_help()
    return EXIT_USAGE


# ----------------------------------------------------------------------------------------------- rehearse

def _add_rehearse_parser(sub) -> Any:
    """``preflight rehearse``: its options live beside the code (preflight/rehearse.py), with the CLI's types."""
    from preflight import rehearse
    parser = sub.add_parser("rehearse", help="run the job's real launch (deepspeed --launcher pdsh) with a tiny model "
                            "for 2 steps: every rank's init and step times, every failure on its host and rank "
                            "(docs/rehearse.md)")
    # No --env-file: a rehearsal recommends nothing, and an empty file would replace the .deepspeed_env it reads.
    outputs = [o for o in render.file_outputs() if o.name != "env_file"]
    rehearse.add_arguments(parser, outputs, _positive_int, _seconds, _count, _port)
    return parser


# --------------------------------------------------------------------------------------------------- slurm

def _add_slurm_options(run: argparse.ArgumentParser) -> None:
    g = run.add_argument_group("slurm")
    g.add_argument("--slurm", action="store_true",
                   help="take the hosts from the Slurm allocation even if SLURM_JOB_ID is not set "
                        "(inside a job this is automatic; --hostfile still wins)")
    g.add_argument("--transport", choices=TRANSPORT_CHOICES, default=None,
                   help="how to reach the hosts: " + "; ".join(f"{name}: {transports.kind(name).HELP}"
                                                              for name in TRANSPORT_CHOICES))
    for option in transports.options():  # each transport's own flags (Transport.OPTIONS)
        g.add_argument(option.flag, dest=option.dest, choices=list(option.choices) or None, default=option.default,
                       help=option.help)
    g.add_argument("--gpus-per-node", type=_positive_int, metavar="N",
                   help="slots per allocated node (default: SLURM_GPUS_ON_NODE, else SLURM_TASKS_PER_NODE)")


def _slurm_selection(args: argparse.Namespace):
    """(allocation's hosts or None, transport, one line saying where the hosts came from)."""
    from preflight import slurm

    env = os.environ
    inside = args.slurm or slurm.in_allocation(env)
    transport = args.transport or transports.default_kind(inside, bool(args.hostfile), DEFAULT_TRANSPORT)
    unusable = transports.kind(transport).unusable(env)
    if unusable:
        raise UsageError(unusable)
    if args.hostfile:
        note = f"hosts: --hostfile {args.hostfile}" + (" (wins over the Slurm allocation)" if inside else "")
        return None, transport, note + f"; transport: {transport}"
    if not inside:
        return None, transport, ""
    try:
        alloc = slurm.allocation(env, args.gpus_per_node)
    except slurm.AllocationError as exc:
        raise UsageError(str(exc)) from None
    return alloc.hosts, transport, f"{alloc.source}; transport: {transport}"


# ---------------------------------------------------------------------------------------------- node-check

def _add_node_check_parser(sub) -> Any:
    nc = sub.add_parser("node-check", help="run the per-host checks on this node only (Slurm HealthCheckProgram "
                        "or prolog): exit 0/1 and one line fit for a drain reason")
    nc.add_argument("--checks", default=None, metavar="A,B", help="run only these per-host checks")
    nc.add_argument("--skip", default="", metavar="A,B", help="do not run these checks")
    nc.add_argument("--config", metavar="FILE", help="thresholds TOML, the same file `preflight run` takes")
    nc.add_argument("--python", default="python3", metavar="PATH",
                    help="the job's interpreter on this node (default: python3)")
    nc.add_argument("--deadline", type=_seconds, default=60.0, metavar="S",
                    help="total deadline of the node check (default 60, like NHC's watchdog)")
    nc.add_argument("--slots", "--num_gpus", type=_positive_int, default=1, metavar="N",
                    help="GPUs the job uses on this node (--num_gpus: DeepSpeed's spelling)")
    nc.add_argument("--nvme-path", action="append", default=[], metavar="DIR",
                    help="directory to measure with dd (repeatable); the test file is removed")
    nc.add_argument("--drain", action="store_true",
                    help="on failure run `scontrol update nodename=NODE state=drain reason=LINE`; on success "
                         "resume the node only if preflight drained it")
    nc.add_argument("--node-name", metavar="NAME",
                    help="Slurm NodeName of this node (default: $SLURMD_NODENAME, else `hostname -s`)")
    nc.add_argument("--strict", action="store_true", help="warnings fail too")
    nc.add_argument("--prom-textfile", metavar="FILE",
                    help="also write Prometheus metrics for node_exporter's textfile collector, replaced atomically "
                         "(docs/prometheus.md); a write that fails after the checks is a line on stderr, not a "
                         "failed node")
    _add_history_options(nc)
    nc.add_argument("-v", "--verbose", action="store_true", help="also print every check's result")
    return nc


def cmd_node_check(args: argparse.Namespace) -> int:
    from preflight import nodecheck

    try:
        thresholds = load_thresholds(args.config)
        names = select_checks(args.checks, args.skip, None, thresholds, args.config)
        cluster_only = [n for n in split_csv(args.checks or "") if registry.load(n).SPEC.scope != "host"]
        if cluster_only:
            raise UsageError(f"node-check runs per-host checks only; {', '.join(cluster_only)} "
                             "need(s) `preflight run` across hosts")
        if args.prom_textfile == render.STDOUT:
            raise UsageError("--prom-textfile -: node-check prints its verdict on stdout; name a file")
        _check_output_path("--prom-textfile", args.prom_textfile)
    except (UsageError, ConfigError) as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    options = nodecheck.NodeCheckOptions(
        checks=[n for n in names if registry.load(n).SPEC.scope == "host"], thresholds=thresholds, python=args.python,
        deadline=args.deadline, timeout=args.deadline, slots=args.slots, strict=args.strict, drain=args.drain,
        node_name=args.node_name, host_params={"nvme_paths": list(args.nvme_path)}, history=_history_path(args))
    verdict = nodecheck.run_checks(options)
    if args.prom_textfile:
        from preflight.render import prometheus
        try:  # the node's verdict stands either way: Slurm drains a node whose prolog fails, not for a metrics file
            prometheus.write_file(verdict.report(args.strict), args.prom_textfile, "node-check")
        except OSError as exc:
            print(f"preflight: error: cannot write {args.prom_textfile}: {exc.strerror or exc}", file=sys.stderr)
    if args.verbose:
        for check, outcome in verdict.outcomes:
            fix = f"; fix: {outcome.fix}" if outcome.fix and outcome.status.value != "pass" else ""
            print(f"{verdict.node}::{check} {outcome.status.word} - {outcome.message}{fix}")
    print(verdict.line)
    if args.drain:
        try:
            action = nodecheck.apply_drain(verdict)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"preflight: --drain: {exc}", file=sys.stderr)
            return EXIT_FAILED
        if action:
            print(f"preflight: node {verdict.node} {action}", file=sys.stderr)
    return EXIT_FAILED if verdict.failed else EXIT_OK


def _tune_interpreter() -> None:
    """Fewer garbage-collector passes for a run that holds a few hundred objects per host.

    The modules and configuration loaded so far are frozen out of the collector's scans (gc.freeze), and a
    young-generation pass runs every 20,000 net allocations instead of every 700: paramiko allocates a few
    messages per packet, and with the default thresholds the collector took 9% of the coordinator's
    GIL-holding samples (py-spy, 8 hosts, 120 connections). Cycles are still collected.
    The GIL is handed to a waiting thread every 50 ms instead of every 5 ms: with two reader threads per host
    (thousands at 1,000 hosts) most forced hand-offs only move the GIL between readers with little to do.
    A thread that blocks (a socket read, a lock) still gives the GIL up at once.
    Only the CLI does this: the pytest plugin runs inside someone else's process.
    """
    import gc
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    sys.setswitchinterval(0.05)


def entry() -> None:
    sys.exit(main())


# ------------------------------------------------------------------------------------------------- history

def _add_history_options(group: Any) -> None:
    group.add_argument("--history", metavar="PATH",
                       help="the history store this run is judged against and recorded in (SQLite; default "
                            "$PREFLIGHT_HISTORY, else ~/.local/share/preflight/history.db; docs/history.md)")
    group.add_argument("--no-history", action="store_true",
                       help="neither record this run nor compare the hosts with their own past runs")


def _history_path(args: argparse.Namespace) -> Optional[Path]:
    from preflight import history
    return history.choose_path(getattr(args, "history", None), getattr(args, "no_history", False))


def _add_history_commands(sub: Any, commands: Dict[str, Any]) -> None:
    hist = commands["history"] = sub.add_parser(
        "history", help="print the recorded runs, or one host's results over time (--prune --keep 90d: retention)")
    hist.add_argument("host", nargs="?", metavar="HOST", help="the host whose results to print ('cluster': the "
                      "cluster-wide row); without it, the runs")
    hist.add_argument("--check", metavar="C", help="only this check's results, with every figure it recorded")
    hist.add_argument("--since", metavar="AGE", help="only runs of the last AGE: 7d, 12h, 30m, 2w")
    hist.add_argument("--prune", action="store_true", help="delete the runs older than --keep AGE, then compact")
    hist.add_argument("--keep", metavar="AGE", help="with --prune: the runs to keep, e.g. 90d")
    diff = commands["diff"] = sub.add_parser(
        "diff", help="what changed between two recorded runs: new failures, fixed hosts, figures that moved")
    diff.add_argument("runs", nargs="*", metavar="RUN", help="two run ids (or unique prefixes; 'last'), or one "
                      "with --against last")
    diff.add_argument("--against", metavar="last", help="'last': compare the run (default: the newest) with the "
                      "run before it of the same kind that shares a host with it")
    for command in (hist, diff):
        command.add_argument("--history", metavar="PATH", help="the history store (default $PREFLIGHT_HISTORY, "
                             "else ~/.local/share/preflight/history.db)")
        command.add_argument("--config", metavar="FILE", help="thresholds TOML; its [history] section is used")


def cmd_history(args: argparse.Namespace) -> int:
    """``preflight history`` and ``preflight diff``: read the store; exit 0, or 2 with one line."""
    from preflight import history
    try:
        thresholds = load_thresholds(args.config)
    except ConfigError as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = history.choose_path(args.history)
    if path is None:
        print(f"preflight {args.command}: error: no history store: {history.ENV} is off; pass --history PATH",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "history":
            return history.main_history(path, args.host, args.check, args.since, args.prune, args.keep, sys.stdout,
                                        sys.stderr, thresholds)
        if len(args.runs) > 2:
            print("preflight diff: error: name at most two runs", file=sys.stderr)
            return EXIT_USAGE
        names = list(args.runs) + [None, None]
        return history.main_diff(path, names[0], names[1], args.against, sys.stdout, sys.stderr, thresholds)
    except BrokenPipeError:  # `preflight history | head`
        _drop_stdout()
        return EXIT_OK
