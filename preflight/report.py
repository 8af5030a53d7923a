"""Reporters: terminal (progress, pytest-style lines, matrix, exports, summary), JSON, JUnit XML, env file.

Every reporter reads only the Report's structured results. Sample of the terminal output:

    node02::libaio FAILED - libaio.so.1 not found; fix: apt-get install libaio-dev
    ...matrix...
    export NCCL_SOCKET_IFNAME==eth1
    5 passed, 1 failed, 2 skipped, 1 error in 4.2s
"""
from __future__ import annotations

import json
import sys
import threading
import time
import xml.etree.ElementTree as ET
from typing import Dict, Optional, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from preflight.checks.base import Status
from preflight.model import CLUSTER, Report, Result
from preflight.runner import Progress

WORD = {Status.PASS: "PASSED", Status.WARN: "WARNED", Status.FAIL: "FAILED", Status.SKIP: "SKIPPED",
        Status.ERROR: "ERROR"}
CELL = {Status.PASS: "PASS", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "skip", Status.ERROR: "ERROR"}
STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim",
         Status.ERROR: "bold magenta"}


# --------------------------------------------------------------------------------------- progress

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
        self._status = None

    def _line(self) -> str:
        return (f"[{time.monotonic() - self._t0:5.1f}s] {self._phase}: {self._done}/{self._total}"
                if self._total > 1 else f"[{time.monotonic() - self._t0:5.1f}s] {self._phase}")

    def phase(self, name: str, total: int) -> None:
        with self._lock:
            self._phase, self._total, self._done = name, total, 0
            if not self.console.is_terminal and not self.quiet:
                self.console.print(f"[{time.monotonic() - self._t0:5.1f}s] {name}", highlight=False)
            else:
                self._show()

    def advance(self, name: str, detail: str = "") -> None:
        with self._lock:
            self._done += 1
            if self.console.is_terminal:
                self._show()
            elif not self.quiet and self._total > 1:
                self.console.print(f"{self._line()}  {name} {detail}".rstrip(), highlight=False)

    def note(self, text: str) -> None:
        with self._lock:
            self._phase, self._total = text, 0
            self._show()

    def _show(self) -> None:
        if self.quiet:
            return
        if self.console.is_terminal:
            if self._status is None:
                self._status = self.console.status(self._line())
                self._status.start()
            else:
                self._status.update(self._line())
        else:
            self.console.print(self._line(), highlight=False)

    def done(self) -> None:
        with self._lock:
            if self._status is not None:
                self._status.stop()
                self._status = None


# --------------------------------------------------------------------------------------- terminal

def result_line(r: Result, verbose: bool = False) -> str:
    line = f"{r.nodeid} {WORD[r.status]} - {r.message}"
    if r.fix and r.status != Status.PASS:
        line += f"; fix: {r.fix}"
    if verbose and r.metrics.get("traceback"):
        line += "\n" + r.metrics["traceback"]
    return line


def summary_line(report: Report) -> str:
    c = report.counts()
    parts = [f"{c['pass']} passed", f"{c['fail']} failed"]
    if c["warn"]:
        parts.append(f"{c['warn']} warned")
    if c["skip"]:
        parts.append(f"{c['skip']} skipped")
    if c["error"]:
        parts.append(f"{c['error']} error" + ("s" if c["error"] > 1 else ""))
    return ", ".join(parts) + f" in {report.duration_s:.1f}s"


def matrix(report: Report) -> Table:
    """Hosts as rows, checks as columns; the cluster-wide results form the last row."""
    cells: Dict[str, Dict[str, Result]] = {}
    for r in report.results:
        cells.setdefault(r.host, {})[r.check] = r
    columns = [c for c in report.checks if any(c in row for row in cells.values())]
    table = Table(title="preflight matrix", show_lines=False, header_style="bold")
    table.add_column("host", no_wrap=True)
    for check in columns:
        table.add_column(check, justify="center", no_wrap=True)
    rows = [h.name for h in report.hosts] + ([CLUSTER] if CLUSTER in cells else [])
    for host in rows:
        label = "(cluster)" if host == CLUSTER else host
        row = [Text(label)]
        for check in columns:
            r = cells.get(host, {}).get(check)
            row.append(Text(CELL[r.status], style=STYLE[r.status]) if r else Text("·", style="dim"))
        table.add_row(*row)
    return table


def print_report(report: Report, console: Console, verbose: bool = False, quiet: bool = False) -> None:
    if not quiet:
        for r in report.results:
            if r.status != Status.PASS or verbose:
                console.print(Text(result_line(r, verbose), style=STYLE[r.status] if r.status != Status.PASS else ""),
                              soft_wrap=True)
        console.print(matrix(report))
        if report.env:
            console.print(Text("recommended environment (also written by --env-file):", style="bold"))
            from preflight.recommend import export_lines, safe_env
            for key, line in zip(safe_env(report.env), export_lines(report.env)):
                console.print(Text(line), highlight=False, soft_wrap=True)
                if verbose:
                    console.print(Text(f"    # {report.reasons.get(key, '')}", style="dim"), soft_wrap=True)
        for note in report.notes if verbose else []:
            console.print(Text(f"note: {note}", style="dim"), soft_wrap=True)
    style = "bold red" if report.exit_code else "bold green"
    console.print(Text(summary_line(report), style=style), highlight=False)


# --------------------------------------------------------------------------------------- files

def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str) + "\n"


def to_junit(report: Report) -> str:
    """One testcase per (host, check): classname = host, name = check."""
    c = report.counts()
    failures = c["fail"] + (c["warn"] if report.strict else 0)
    suite = ET.Element("testsuite", name="preflight", tests=str(len(report.results)), failures=str(failures),
                       errors=str(c["error"]), skipped=str(c["skip"]), time=f"{report.duration_s:.3f}",
                       timestamp=report.started_at)
    for r in report.results:
        case = ET.SubElement(suite, "testcase", classname=r.host, name=r.check, time=f"{r.duration_s:.3f}")
        text = r.message + (f"\nfix: {r.fix}" if r.fix else "")
        if r.status == Status.FAIL:
            ET.SubElement(case, "failure", message=r.message, type="fail").text = text
        elif r.status == Status.ERROR:
            ET.SubElement(case, "error", message=r.message, type="error").text = text
        elif r.status == Status.SKIP:
            ET.SubElement(case, "skipped", message=r.message)
        elif r.status == Status.WARN:
            if report.strict:
                ET.SubElement(case, "failure", message=r.message, type="warning").text = text
            else:
                ET.SubElement(case, "system-out").text = "WARN: " + text
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def to_html(report: Report) -> str:
    """The self-contained HTML page (preflight/html.py), imported only when a run asks for it."""
    from preflight.html import to_html as render
    return render(report)


def to_env_file(report: Report) -> str:
    """DeepSpeed's .deepspeed_env: KEY=VALUE lines and nothing else (a blank line crashes its launcher)."""
    from preflight.recommend import env_file_text
    return env_file_text(report.env)


def write_file(path: str, text: str, out: Optional[TextIO] = None) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False)
