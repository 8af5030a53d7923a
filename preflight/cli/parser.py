"""The argument parser of ``preflight``: every subcommand's options, the shared groups (SSH, Slurm, history), the
argparse types that bound each number, and the exit codes. Sample: ``preflight run --hostfile hf --timeout 60``.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, Dict, NoReturn, Sequence

from preflight import __version__
from preflight import flags
from preflight import render
from preflight.hostside.seams import CheckOptions, positive


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


VERSION_LINE = f"preflight {__version__}"


# --transport's choices (preflight/flags.py's Slurm group); a hostfile run outside a Slurm allocation uses the
# checks' default (CheckOptions.transport).
TRANSPORT_CHOICES = flags.TRANSPORT_CHOICES


DEFAULT_TRANSPORT = CheckOptions.transport


class UsageError(Exception):
    pass


# The argparse types, declared with the shared options in preflight/flags.py.
_positive = positive
_seconds = flags.seconds
_connect_seconds = flags.connect_seconds
_positive_int = flags.positive_int
_count = flags.count
_port = flags.port
_master_addr = flags.master_addr


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

    def error(self, message: str) -> NoReturn:
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
    commands: Dict[str, argparse.ArgumentParser] = {}
    _add_listing_commands(sub, commands)
    commands["run"] = _add_run_parser(sub)
    commands["node-check"] = _add_node_check_parser(sub)
    _add_history_commands(sub, commands)
    commands["rehearse"] = _add_rehearse_parser(sub)
    parser.set_defaults(_commands=commands)
    return parser


def _add_listing_commands(sub: Any, commands: Dict[str, argparse.ArgumentParser]) -> None:
    """``list``, ``config``, ``hostfile`` and ``version``: the commands that read no host."""
    commands["list"] = sub.add_parser("list", help="list every check with one line of description")
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


def _add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """``preflight run``: the shared groups and every check's own options (preflight/flags.py), then the outputs."""
    run: argparse.ArgumentParser = sub.add_parser(
        "run", help="run the checks on every host of the hostfile (default: this machine)")
    flags.add_all(run.add_argument_group("cluster"), flags.HOSTS)
    g = run.add_argument_group("checks")
    flags.add_all(g, flags.SELECTION + flags.JOB)
    flags.add_check_options(run.add_argument_group("the checks' own options", "declared by each check "
                                                   "(CheckSpec.options; docs/checks.md)"), "run")
    flags.add_all(run.add_argument_group("SSH"), flags.SSH)
    _add_run_outputs(run.add_argument_group("output"))
    flags.add_slurm(run.add_argument_group("slurm"))
    return run


def _add_run_outputs(g: Any) -> None:
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


def _min_hosts(text: str) -> str:
    from preflight import launchable
    return launchable.parse_min_hosts(text)


def _add_rehearse_parser(sub: Any) -> argparse.ArgumentParser:
    """``preflight rehearse``: its options live beside the code (preflight/rehearse.py), with the CLI's types."""
    from preflight import rehearse
    parser: argparse.ArgumentParser = sub.add_parser(
        "rehearse", help="run the job's real launch (deepspeed --launcher pdsh) with a tiny model for 2 steps: every "
        "rank's init and step times, every failure on its host and rank (docs/rehearse.md)")
    # No --env-file: a rehearsal recommends nothing, and an empty file would replace the .deepspeed_env it reads.
    outputs = [o for o in render.file_outputs() if o.name != "env_file"]
    rehearse.add_arguments(parser, outputs)
    return parser


def _add_node_check_parser(sub: Any) -> argparse.ArgumentParser:
    nc: argparse.ArgumentParser = sub.add_parser(
        "node-check", help="run the per-host checks on this node only (Slurm HealthCheckProgram or prolog): exit "
        "0/1 and one line fit for a drain reason")
    flags.add_all(nc, flags.NODE_CHECK)
    nc.add_argument("--deadline", type=_seconds, default=60.0, metavar="S",
                    help="total deadline of the node check (default 60, like NHC's watchdog)")
    flags.add_check_options(nc, "node-check")
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
