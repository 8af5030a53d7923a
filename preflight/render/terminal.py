"""The terminal: progress while hosts work, then pytest-style lines, the matrix, the exports and the summary line.

Reads only the Report's structured results, like every renderer. Sample (HOST::CHECK STATUS - message; fix):

    node02::CHECK FAILED - what was found, against what was expected; fix: the command that fixes it
    ...matrix...
    export NCCL_SOCKET_IFNAME==eth1
    5 passed, 1 failed, 2 skipped, 1 error in 4.2s
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TextIO

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from preflight.hostside.display import CELL
from preflight.hostside.outcome import Status
from preflight.render import Settings
from preflight.results import CLUSTER, Report, Result, display_host
from preflight.runner import Progress
from preflight.text import plain

WORD = {Status.PASS: "PASSED", Status.WARN: "WARNED", Status.FAIL: "FAILED", Status.SKIP: "SKIPPED",
        Status.ERROR: "ERROR"}
STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim",
         Status.ERROR: "bold magenta"}
# Worst first: the summary line takes the colour of the worst status present.
SEVERITY = (Status.FAIL, Status.ERROR, Status.WARN, Status.SKIP, Status.PASS)

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

def result_line(r: Result, verbose: bool = False) -> str:
    """``node02::CHECK FAILED - message; fix: ...`` (plain text: the caller prints it without markup)."""
    line = f"{display_host(r.host)}::{r.check} {WORD[r.status]} - {r.message}"
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
    return ", ".join(parts) + f" in {report.duration_s:.1f}s"


def _grid(report: Report):
    """(row labels, column labels, cell(row, column) -> Result or None, row header) of the matrix.

    Hosts are rows and checks columns, the cluster-wide row last; with more checks than rows the matrix is
    transposed (checks as rows, hosts as columns), which is what keeps a few-host run narrow.
    """
    cells: Dict[str, Dict[str, Result]] = {}
    for r in report.results:
        cells.setdefault(r.host, {})[r.check] = r
    checks = [c for c in report.checks if any(c in row for row in cells.values())]
    hosts = [h.name for h in report.hosts] + ([CLUSTER] if CLUSTER in cells else [])
    hosts += [h for h in cells if h not in hosts]  # a result for a host not in the list still shows
    if len(checks) > len(hosts):
        return (checks, hosts, lambda row, col: cells.get(col, {}).get(row), "check")
    return (hosts, checks, lambda row, col: cells.get(row, {}).get(col), "host")


def _table(rows: List[str], cols: List[str], cell, corner: str, title: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False, title_justify="left")
    table.add_column(corner, overflow="fold")
    for col in cols:
        table.add_column(Text(plain(display_host(col))), justify="center", overflow="fold")
    for row in rows:
        label = Text(plain(display_host(row)), style="italic" if row == CLUSTER else "")
        out = [label]
        for col in cols:
            r = cell(row, col)
            out.append(Text(CELL[r.status], style=STYLE[r.status]) if r else Text("\u00b7", style="dim"))
        table.add_row(*out)
    return table


def matrix_tables(report: Report, console: Console) -> List[Table]:
    """The matrix as tables that each fit the console's width, so every name and status reads in full.

    Columns are packed greedily into as many tables as needed, each repeating the row labels (a wide
    cluster wraps into several blocks, like a long line). A single column wider than the terminal folds.
    """
    rows, cols, cell, corner = _grid(report)
    width = console.width
    groups: List[List[str]] = []
    for col in cols:
        if groups:
            trial = _table(rows, groups[-1] + [col], cell, corner, "")
            if Measurement.get(console, console.options, trial).maximum <= width:
                groups[-1].append(col)
                continue
        groups.append([col])
    groups = groups or [[]]
    tables = []
    for i, group in enumerate(groups, 1):
        part = f" ({i}/{len(groups)})" if len(groups) > 1 else ""
        tables.append(_table(rows, group, cell, corner, f"preflight matrix{part}"))
    return tables


def matrix(report: Report) -> Table:
    """The whole matrix as one table (no width limit)."""
    rows, cols, cell, corner = _grid(report)
    return _table(rows, cols, cell, corner, "preflight matrix")


def print_report(report: Report, console: Console, verbose: bool = False, quiet: bool = False) -> None:
    """Everything printed is a Text built from plain(): host text is never rich markup nor a raw escape."""
    if not quiet:
        for r in report.results:
            if r.status != Status.PASS or verbose:
                console.print(Text(result_line(r, verbose), style=STYLE[r.status] if r.status != Status.PASS else ""),
                              soft_wrap=True)
        for table in matrix_tables(report, console):
            console.print(table)
        if report.env:
            console.print(Text("recommended environment (also written by --env-file):", style="bold"))
            from preflight.recommend import export_lines, safe_env
            for key, line in zip(safe_env(report.env), export_lines(report.env)):
                console.print(Text(plain(line)), highlight=False, soft_wrap=True)
                if verbose:
                    console.print(Text(plain(f"    # {report.reasons.get(key, '')}"), style="dim"), soft_wrap=True)
        for note in report.notes if verbose else []:
            console.print(Text(plain(f"note: {note}"), style="dim"), soft_wrap=True)
    console.print(Text(summary_line(report), style=STYLE[worst(report)]))


# --------------------------------------------------------------------------------------- renderer

def write(report: Report, out: TextIO, settings: Settings) -> None:
    """The terminal renderer (``RENDERERS``' "terminal"): the report printed on ``out`` as print_report does."""
    print_report(report, console(out, settings.width), verbose=settings.verbose, quiet=settings.quiet)


def console(file: Optional[TextIO] = None, width: Optional[int] = None) -> Console:
    """A console that never interprets text as markup or emoji codes (paths, host names and errors contain
    ``[...]`` and ``:name:``); colour is styling given by the reporters, never parsed out of strings."""
    return Console(file=file, width=width, markup=False, emoji=False, highlight=False)


def stderr_console() -> Console:
    return console(sys.stderr)
