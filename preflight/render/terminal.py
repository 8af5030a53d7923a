"""The terminal: progress while hosts work, then one line per cause, the matrix, the exports, the verdict and
the summary line.

Reads only the Report's structured results (grouped by ``preflight.causes``), like every renderer. Sample
(HOSTS::CHECK STATUS - message; fix, the hosts as a NodeSet):

    node[03-04]::CONNECTION ERROR - could not reach <address> ... (blocks 12 other checks on each); fix: ...
        node03: address 198.18.0.3
        node04: address 198.18.0.4
    node02::CHECK FAILED - what was found, against what was expected (blocks CHECK on cluster); fix: the command
    every host::CHECK FAILED - a fault fixed in no host (seen on node[01-04]); fix: ...
    ...matrix...
    export NCCL_SOCKET_IFNAME==eth1
    NOT READY: fix on every host (CHECK: ...); 3 hosts need fixing (node02 CHECK, node[03-04] unreachable)
    5 passed, 1 failed, 2 skipped, 1 error, 28 blocked in 4.2s

``-v`` prints every (host, check) line instead of the causes; ``-q`` only the last two lines.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from preflight.causes import Cause, causes, verdict
from preflight.hostside.display import CELL
from preflight.hostside.outcome import Status
from preflight.render import Settings
from preflight.results import CLUSTER, Report, Result, display_host
from preflight.runner import Progress
from preflight.text import plain

# A matrix cell by (row label, column label): the Result there, or None where the check did not run on the host.
CellAt = Callable[[str, str], Optional[Result]]

WORD = {Status.PASS: "PASSED", Status.WARN: "WARNED", Status.FAIL: "FAILED", Status.SKIP: "SKIPPED",
        Status.ERROR: "ERROR"}
STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim",
         Status.ERROR: "bold magenta"}
# Worst first: the summary line takes the colour of the worst status present.
SEVERITY = (Status.FAIL, Status.ERROR, Status.WARN, Status.SKIP, Status.PASS)
BLOCKED = "BLOCKED"  # the word of a blocked cell's line (-v): its host's connection failed, so it did not run
NO_CELL = "\u00b7"  # the matrix cell of a blocked check, or of one that does not run on that row
MATRIX_CAPTION = (f"{NO_CELL} = blocked (its host could not be reached, or it follows from another result's fault: "
                  "its cause's line says which), or no result on that row")

# --------------------------------------------------------------------------------------- progress

class _Ticking:
    """A status text that rich re-renders on each refresh (plain text, never markup)."""

    def __init__(self, line: Callable[[], str]):
        self._line = line

    def __rich__(self) -> Text:
        return Text(self._line())


class TerminalProgress(Progress):
    """One status line on stderr while hosts work (redrawn on a TTY, plain lines otherwise)."""

    def __init__(self, console: Console, quiet: bool = False):
        self.console = console
        self.quiet = quiet
        self._lock = threading.Lock()
        self._phase = ""
        self._total = 0
        self._done = 0
        self._t0 = time.monotonic()
        self._status: Optional[Any] = None  # rich.status.Status while a phase runs on a terminal

    def _line(self) -> str:
        return (f"[{time.monotonic() - self._t0:5.1f}s] {self._phase}: {self._done}/{self._total}"
                if self._total > 1 else f"[{time.monotonic() - self._t0:5.1f}s] {self._phase}")

    def phase(self, name: str, total: int) -> None:
        with self._lock:
            self._phase, self._total, self._done = plain(name), total, 0
            if not self.console.is_terminal and not self.quiet:
                self.console.print(Text(plain(f"[{time.monotonic() - self._t0:5.1f}s] {name}")))
            else:
                self._show()

    def advance(self, name: str, detail: str = "") -> None:
        with self._lock:
            self._done += 1
            if self.console.is_terminal:
                self._show()
            elif not self.quiet and self._total > 1:
                self.console.print(Text(plain(f"{self._line()}  {name} {detail}".rstrip())))

    def note(self, text: str) -> None:
        with self._lock:
            self._phase, self._total = plain(text), 0
            self._show()

    def warning(self, text: str) -> None:
        """``preflight: warning: ...`` as a line of its own (kept above the status line), unless quiet."""
        if self.quiet:
            return
        with self._lock:
            self.console.print(Text(plain(f"preflight: warning: {text}"), style="yellow"), soft_wrap=True)

    def _show(self) -> None:
        if self.quiet:
            return
        if self.console.is_terminal:
            if self._status is None:
                # A renderable, not a str (a str would be parsed as markup), re-rendered on every refresh, so the
                # elapsed time keeps ticking while a long phase (a cluster check's rounds) waits on hosts.
                self._status = self.console.status(_Ticking(self._line))
                self._status.start()
        else:
            self.console.print(Text(self._line()))

    def done(self) -> None:
        with self._lock:
            if self._status is not None:
                self._status.stop()
                self._status = None


# --------------------------------------------------------------------------------------- terminal

def result_line(r: Result, verbose: bool = False, victim: Optional[bool] = None) -> str:
    """``node02::CHECK FAILED - message; fix: ...`` (plain text: the caller prints it without markup); a victim's
    word is BLOCKED (``victim``: the report's ``victims()`` says so; by default, any blocked result)."""
    victim = r.blocked if victim is None else victim
    line = f"{display_host(r.host)}::{r.check} {BLOCKED if victim else WORD[r.status]} - {r.message}"
    if victim and r.blocked_host is not None:
        line += f" (blocked by {display_host(r.blocked_host)}::{r.blocked_by})"
    if r.fix and r.status != Status.PASS:
        line += f"; fix: {r.fix}"
    if verbose and r.metrics.get("traceback"):
        line += "\n" + str(r.metrics["traceback"])
    return plain(line)


def worst(report: Report) -> Status:
    present = {r.status for r in report.results}
    return next((s for s in SEVERITY if s in present), Status.PASS)


def summary_line(report: Report) -> str:
    c = report.counts()
    parts = [f"{c['pass']} passed", f"{c['fail']} failed", f"{c['warn']} warned"]
    if c["skip"]:
        parts.append(f"{c['skip']} skipped")
    if c["error"]:
        parts.append(f"{c['error']} error" + ("s" if c["error"] > 1 else ""))
    if c["blocked"]:
        parts.append(f"{c['blocked']} blocked")
    return ", ".join(parts) + f" in {report.duration_s:.1f}s"


def verdict_style(report: Report) -> str:
    if report.exit_code:
        return "bold red"
    return "bold yellow" if report.counts()["warn"] else "bold green"


def cause_style(cause: Cause) -> str:
    return STYLE[cause.status] if cause.status != Status.PASS else ""


def _grid(report: Report) -> Tuple[List[str], List[str], CellAt, str]:
    """(row labels, column labels, cell(row, column) -> Result or None, row header) of the matrix.

    Hosts are rows and checks columns, the cluster-wide row last; with more checks than rows the matrix is
    transposed (checks as rows, hosts as columns, the cluster-wide column last), which is what keeps a
    few-host run narrow.
    """
    cells: Dict[str, Dict[str, Result]] = {}
    victims = report.victims()
    for i, r in enumerate(report.results):
        # A blocked result that is no victim (its blocker passed) shows its status: it is a cause of its own.
        cells.setdefault(r.host, {})[r.check] = r if r.blocked == (i in victims) else _no_victim(r)
    checks = [c for c in report.checks if any(c in row for row in cells.values())]
    hosts = [h.name for h in report.hosts] + ([CLUSTER] if CLUSTER in cells else [])
    hosts += [h for h in cells if h not in hosts]  # a result for a host not in the list still shows
    if len(checks) > len(hosts):
        return (checks, hosts, lambda row, col: cells.get(col, {}).get(row), "check")
    return (hosts, checks, lambda row, col: cells.get(row, {}).get(col), "host")


def _no_victim(r: Result) -> Result:
    """A blocked result that the report holds as a cause of its own, as the matrix shows it."""
    return Result(r.host, r.check, r.status, r.message, r.fix, r.metrics, r.duration_s, where=r.where)


def _cell(r: Optional[Result]) -> Text:
    if r is None or r.blocked:
        return Text(NO_CELL, style="dim")
    return Text(CELL[r.status], style=STYLE[r.status])


def _frame(title: str) -> Table:
    return Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, title_justify="left")


def _name(name: str, shown: Dict[str, str]) -> str:
    return shown.get(name) or plain(display_host(name))


def _table(rows: List[str], cols: List[str], cell: CellAt, corner: str, title: str,
           shown: Optional[Dict[str, str]] = None) -> Table:
    """Names never wrap: matrix_tables fits them, abbreviating (``shown``) only what cannot fit at all."""
    shown = shown or {}
    table = _frame(title)
    table.add_column(corner, no_wrap=True)
    for col in cols:
        table.add_column(Text(_name(col, shown)), justify="center", no_wrap=True)
    for row in rows:
        label = Text(_name(row, shown), style="italic" if row == CLUSTER else "")
        table.add_row(label, *(_cell(cell(row, col)) for col in cols))
    return table


class _Fit:
    """The natural width of a table of some of the matrix's columns, measured on one row that stands for all: the
    longest row label and each column's widest cell (measuring the whole matrix once per column took 17 s at
    1,000 hosts). Measured without the console's limit, which would clamp it to fit."""

    def __init__(self, rows: List[str], cols: List[str], cell: CellAt, corner: str, console: Console):
        self.rows, self.corner, self.console = rows, corner, console
        self.cells = {col: max((_cell(cell(row, col)).cell_len for row in rows), default=1) for col in cols}

    def width(self, cols: List[str], shown: Dict[str, str]) -> int:
        probe = _frame("")
        probe.add_column(self.corner, no_wrap=True)
        for col in cols:
            probe.add_column(Text(_name(col, shown)), justify="center", no_wrap=True)
        label = max((_name(row, shown) for row in self.rows), key=len, default="")
        probe.add_row(Text(label), *(Text("x" * self.cells[col]) for col in cols))
        options = self.console.options.update(max_width=10**6)
        return Measurement.get(self.console, options, probe).maximum

    def fits(self, cols: List[str], shown: Dict[str, str]) -> bool:
        return self.width(cols, shown) <= self.console.width


def _abbreviations(rows: List[str], cols: List[str], fit: _Fit) -> Dict[str, str]:
    """{name: short key} for the names that cannot fit whole even in a table of one column: the longest first,
    until the row labels and the widest column fit the terminal. Usually empty."""
    shown: Dict[str, str] = {}
    names = sorted(set(rows) | set(cols), key=lambda n: -len(display_host(n)))
    for name in names:
        if all(fit.fits([col], shown) for col in cols or []) and (cols or fit.fits([], shown)):
            break
        shown[name] = "#" + "9" * len(str(len(names)))  # as wide as the key it gets below
    # Numbered in the order the names show: rows, then columns.
    return {name: f"#{n}" for n, name in enumerate((x for x in dict.fromkeys(rows + cols) if x in shown), 1)}


def matrix_tables(report: Report, console: Console) -> List[Table]:
    """The matrix as tables that each fit the console's width, so every name and status reads in full.

    Columns are packed greedily into as many tables as needed, each repeating the row labels (a wide cluster
    wraps into several blocks, like a long line). A name too long for even one column beside the row labels is
    shown as a key (``#1``) that matrix_legend spells out; no name is ever split or cut.
    """
    rows, cols, cell, corner = _grid(report)
    fit = _Fit(rows, cols, cell, corner, console)
    shown = _abbreviations(rows, cols, fit)
    groups: List[List[str]] = []
    for col in cols:
        if groups and fit.fits(groups[-1] + [col], shown):
            groups[-1].append(col)
            continue
        groups.append([col])
    groups = groups or [[]]
    tables = []
    for i, group in enumerate(groups, 1):
        part = f" ({i}/{len(groups)})" if len(groups) > 1 else ""
        tables.append(_table(rows, group, cell, corner, f"preflight matrix{part}", shown))
    return tables


def matrix_legend(report: Report, console: Console) -> List[str]:
    """``#1 = the-full-name`` for each name the matrix abbreviated, and what a dot means where one shows."""
    rows, cols, cell, corner = _grid(report)
    lines = [plain(f"{key} = {display_host(name)}") for name, key in
             _abbreviations(rows, cols, _Fit(rows, cols, cell, corner, console)).items()]
    if any(c is None or c.blocked for c in (cell(row, col) for row in rows for col in cols)):
        lines.append(MATRIX_CAPTION)
    return lines


def matrix(report: Report) -> Table:
    """The whole matrix as one table (no width limit)."""
    rows, cols, cell, corner = _grid(report)
    return _table(rows, cols, cell, corner, "preflight matrix")


def print_report(report: Report, console: Console, verbose: bool = False, quiet: bool = False,
                 relaunch: Any = None) -> None:
    """Everything printed is a Text built from plain(): host text is never rich markup nor a raw escape.

    One line per cause (FAIL and ERROR, then WARN, then SKIP), or with -v one per (host, check); the matrix; the
    environment; then always the verdict and the count line, which are all that -q prints.
    """
    found = causes(report)
    if not quiet:
        if verbose:
            victims = report.victims()
            for i, r in enumerate(report.results):
                style = "dim" if i in victims else STYLE[r.status] if r.status != Status.PASS else ""
                console.print(Text(result_line(r, verbose, i in victims), style=style), soft_wrap=True)
        else:
            for cause in found:
                console.print(Text(cause.line(), style=cause_style(cause)), soft_wrap=True)
        for table in matrix_tables(report, console):
            console.print(table)
        for line in matrix_legend(report, console):  # a name in full, even one wider than the terminal
            console.print(Text(line, style="dim"), soft_wrap=line.startswith("#"))
        if report.env:
            console.print(Text("recommended environment (also written by --env-file):", style="bold"))
            from preflight.recommend import diff_line, export_lines, safe_env
            # Against what the launcher passes the ranks today: each line's state when anything is inherited.
            diff = report.env_diff if any(d.get("state") != "set" for d in report.env_diff.values()) else {}
            for key, line in zip(safe_env(report.env), export_lines(report.env)):
                console.print(Text(plain(line)), highlight=False, soft_wrap=True)
                if key in diff:
                    console.print(Text(plain(f"    # {diff_line(diff[key])}"), style="dim"), soft_wrap=True)
                if verbose:
                    console.print(Text(plain(f"    # {report.reasons.get(key, '')}"), style="dim"), soft_wrap=True)
            for key, entry in diff.items():
                if entry.get("state") == "not set":
                    console.print(Text(plain(f"# {key}: {diff_line(entry)}"), style="dim"), soft_wrap=True)
            if report.env_diff and not diff:
                none = "# none of these is set today in the shell that runs deepspeed or a .deepspeed_env"
                console.print(Text(none, style="dim"), soft_wrap=True)
        for note in report.notes if verbose else []:
            console.print(Text(plain(f"note: {note}"), style="dim"), soft_wrap=True)
    line, style = verdict(report, found), verdict_style(report)
    if relaunch is not None:  # the run's context (preflight/launchable.py): the job still possible, --min-hosts
        from preflight import launchable
        line = launchable.verdict_line(report, relaunch, line)
        if launchable.subset_passes(report, relaunch.min_hosts):
            style = "bold yellow"
    console.print(Text(line, style=style), soft_wrap=True)
    console.print(Text(summary_line(report), style=STYLE[worst(report)]))


# --------------------------------------------------------------------------------------- renderer

def write(report: Report, out: TextIO, settings: Settings) -> None:
    """The terminal renderer (``RENDERERS``' "terminal"): the report printed on ``out`` as print_report does."""
    print_report(report, console(out, settings.width), verbose=settings.verbose, quiet=settings.quiet,
                 relaunch=settings.relaunch)


class _Console(Console):
    """rich's Console, except where its reader went away (``preflight run | head -1``): rich's own answer is
    SystemExit(1), the exit code of NOT READY, whatever the verdict. Here the console goes quiet, its descriptor
    is pointed at /dev/null (the interpreter's last flush cannot fail either), and the run ends with the verdict's
    exit code."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        try:
            fd = self.file.fileno()
        except (AttributeError, OSError, ValueError):  # a StringIO or a closed stream: nothing to point elsewhere
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def console(file: Optional[TextIO] = None, width: Optional[int] = None) -> Console:
    """A console that never interprets text as markup or emoji codes (paths, host names and errors contain
    ``[...]`` and ``:name:``); colour is styling given by the reporters, never parsed out of strings. A closed
    reader (``| head``) makes it quiet, never exits the process (``_Console``)."""
    return _Console(file=file, width=width, markup=False, emoji=False, highlight=False)


def stderr_console() -> Console:
    return console(sys.stderr)
