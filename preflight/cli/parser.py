"""The argument parser of ``preflight``: every subcommand's options, the shared groups (SSH, Slurm, history), the
argparse types that bound each number, and the exit codes. Sample: ``preflight run --hostfile hf --timeout 60``.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
from typing import Any, Dict, Sequence

from preflight import __version__
from preflight import render
from preflight.hostside.seams import CheckOptions
from preflight import transport as transports


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


def _min_hosts(text: str) -> str:
    from preflight import launchable
    return launchable.parse_min_hosts(text)


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


def _add_history_options(group: Any) -> None:
    group.add_argument("--history", metavar="PATH",
                       help="the history store this run is judged against and recorded in (SQLite; default "
                            "$PREFLIGHT_HISTORY, else ~/.local/share/preflight/history.db; docs/history.md)")
    group.add_argument("--no-history", action="store_true",
                       help="neither record this run nor compare the hosts with their own past runs")


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


def drop_stdout() -> None:
    """The reader of stdout is gone: send what is left to /dev/null so the exit flush cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
