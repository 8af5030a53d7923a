"""Input checked before any host is contacted: which checks run (--checks/--skip/[checks] of --config), the files
an output option will write and an input option will read, the per-host params the checks take from the options.
Sample: ``--checks gpu,nvme --skip nvme`` is one line naming both options, exit 2.
"""
from __future__ import annotations

import os
import stat
from typing import Any, Dict, List, Optional

from preflight import checks as registry
from preflight import render
from preflight.cli.parser import UsageError, did_you_mean
from preflight.flags import given
from preflight.hostfile import split_csv
from preflight.hostside.seams import CheckOptions
from preflight.inputs import read_text_limited


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
        chosen = [n for n in known if registry.spec(n).default or given(options, registry.spec(n).selected_by)]
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


def check_output_path(option: str, path: Optional[str]) -> None:
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


def check_input_file(option: str, path: str, max_bytes: int) -> None:
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


def params_from_options(options: CheckOptions, command: str = "run") -> Dict[str, Dict[str, Any]]:
    """{check: per-host params} from each check's ``SPEC.params_from_options`` (the nvme paths and ops a DeepSpeed
    config asks of every host), given the check's own inputs (``CheckOptions.for_check``). A check that cannot use
    an option it reads (a config DeepSpeed would refuse at start: nothing to check it against) is a UsageError,
    before any host is contacted, whether it runs or not. node-check asks only the checks whose options it offers
    (the run's launch environment, ./.deepspeed_env, is not the node's)."""
    out: Dict[str, Dict[str, Any]] = {}
    for spec in registry.all_specs():
        offered = command == "run" or any(command in o.commands for o in spec.options)
        if spec.params_from_options is not None and offered:
            try:
                out[spec.name] = spec.params_from_options(options.for_check(spec))
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
