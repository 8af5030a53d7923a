"""The report's outputs, registered once: ``RENDERERS`` lists every renderer, and the CLI's output flags
(``preflight run --json FILE``) and the pytest plugin's (``--preflight-json=FILE``) are generated from it.

A renderer writes a finished Report to a stream: ``write(report, out, settings)``, one module each beside this
one. Adding an output is that module plus one line below, e.g.::

    Renderer("json", "--json", "write the JSON report ...", "preflight.render.json:write", pytest_help="...")

This module imports nothing heavy: the pytest plugin reads the list in every pytest session on the machine, so a
renderer's module (rich, the checks' HTML sections) is imported only when its output is written.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, TextIO, Tuple, Union

if TYPE_CHECKING:
    from preflight.results import Report

STDOUT = "-"  # as a path: write to stdout (``--json -``); then the terminal report goes to stderr


@dataclass(frozen=True)
class Settings:
    """How the user asked for output: ``-v`` / ``-q``, the terminal's width (None: the stream's own), and what the
    verdict's job command names (the hostfiles, Slurm, --min-hosts)."""

    verbose: bool = False
    quiet: bool = False
    width: Optional[int] = None
    relaunch: Any = None  # preflight.launchable.Context: the verdict line's command that starts the job on the
    # healthy hosts (``preflight run``)


Write = Callable[["Report", TextIO, Settings], None]


@dataclass(frozen=True)
class Renderer:
    """One output format.

    name: its id; flag: ``preflight run``'s option that names the file (``--json``), "" for the terminal, which
    is always written; help: that option's help. write: the function, or ``"module:function"`` imported when
    the output is written. pytest_help: the help of the plugin's ``--preflight-<flag>``; None: the plugin does
    not offer it (pytest's own ``--junitxml`` already writes a testcase per result).
    """

    name: str
    flag: str
    help: str
    write: Union[str, Write]
    pytest_help: Optional[str] = None
    metavar: str = "FILE"
    atomic: bool = False  # replace the file by a rename (write_atomic): its reader must never see half of it
    # For a file the user edits too (.deepspeed_env): ``merge(report, the file's text or None) -> (new text, what
    # changed)``, or ``"module:function"``. The file is then replaced atomically with the merged text, and
    # ``to_path`` returns what changed, for the caller to say.
    merge: Union[str, Callable[["Report", Optional[str]], Tuple[str, List[str]]], None] = None

    @property
    def dest(self) -> str:
        """The argparse destination of ``flag``: ``--junit-xml`` -> ``junit_xml``."""
        return self.flag[2:].replace("-", "_")

    def load(self) -> Write:
        if callable(self.write):
            return self.write
        module, _, function = self.write.partition(":")
        found: Write = getattr(importlib.import_module(module), function)
        return found

    def to_path(self, report: "Report", path: str, settings: Optional[Settings] = None,
                stdout: Optional[TextIO] = None) -> List[str]:
        """Write to a file, or to stdout for ``-``. A lone surrogate from a host is written escaped, never a crash.
        Returns what a merge changed in the file (``merge``); [] otherwise."""
        if self.merge is not None and path != STDOUT:
            merge = self.merge
            if isinstance(merge, str):
                module, _, function = merge.partition(":")
                merge = getattr(importlib.import_module(module), function)
            old: Optional[str] = None
            if os.path.isfile(path):  # a regular file only: reading /dev/stdout or a FIFO would block
                with open(path, encoding="utf-8", errors="replace") as fh:
                    old = fh.read()
            text, changed = merge(report, old)
            write_atomic(path, lambda fh: fh.write(text))
            return list(changed)
        write, settings = self.load(), settings or Settings()
        if path == STDOUT:
            stream = stdout or sys.stdout
            write(report, stream, settings)
            stream.flush()
            return []
        if self.atomic:
            write_atomic(path, lambda fh: write(report, fh, settings))
            return []
        with open(path, "w", encoding="utf-8", errors="backslashreplace") as fh:
            write(report, fh, settings)
        return []


def _umask() -> int:
    try:  # Linux 4.7+: read without changing it (os.umask's set-and-restore races another thread's open)
        with open("/proc/self/status", encoding="ascii") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def write_atomic(path: str, write: Callable[[TextIO], Any]) -> None:
    """Write ``path`` as a temporary file beside it (a dot name, so node_exporter's *.prom glob skips it), fsync,
    then rename it over ``path``: a reader sees the old file or the new one, never a part. The new file gets the
    mode the old one had, else what open() would give (0666 less the umask; mkstemp's 0600 would hide it from a
    collector running as another user). A path that is not a regular file (/dev/stdout, a FIFO) is written in
    place: it cannot be renamed over."""
    target = os.path.realpath(path)  # a symlink's file is replaced, the link stays
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(path, "w", encoding="utf-8", errors="backslashreplace") as fh:
            write(fh)
        return
    folder, name = os.path.split(target)
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(temp, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable too; some filesystems cannot fsync a directory
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


RENDERERS: List[Renderer] = [
    Renderer("terminal", "", "the lines of what is not a pass, the matrix, the recommended environment and the "
             "summary line", "preflight.render.terminal:write"),
    Renderer("json", "--json", "write the JSON report (contract: docs/json-contract.md); '-': stdout, and the "
             "terminal report goes to stderr", "preflight.render.json:write",
             pytest_help="also write preflight's JSON report (contract: docs/json-contract.md)"),
    Renderer("junit", "--junit-xml", "write JUnit XML: one testcase per (host, check)", "preflight.render.junit:write"),
    Renderer("env_file", "--env-file", "write the recommended environment as .deepspeed_env lines; an existing file "
             "keeps its other lines, only the variables preflight sets are replaced, and what changed is said",
             "preflight.render.env_file:write", pytest_help="write the recommended environment as .deepspeed_env "
             "lines (merged into an existing file)", merge="preflight.render.env_file:merge"),
    Renderer("html", "--html", "write a self-contained HTML report: matrix, details, environment and the checks' "
             "own sections, such as plots (no external assets)", "preflight.render.html:write",
             pytest_help="write preflight's self-contained HTML report (matrix, details, the checks' plots)"),
    Renderer("prometheus", "--prom-textfile", "write Prometheus metrics for node_exporter's textfile collector, "
             "replaced atomically (docs/prometheus.md)", "preflight.render.prometheus:write", atomic=True,
             pytest_help="write Prometheus metrics for node_exporter's textfile collector (docs/prometheus.md)"),
]


def register(renderer: Renderer) -> Renderer:
    """Add an output (a plugin's, or a test's): its flag then appears in the CLI and, with ``pytest_help``, the
    pytest plugin. ValueError if its name or flag is taken or the flag is not a long option."""
    if renderer.flag and not (renderer.flag.startswith("--") and renderer.dest.isidentifier()):
        raise ValueError(f"renderer {renderer.name!r}: flag {renderer.flag!r} must be a long option like --json")
    for other in RENDERERS:
        if other.name == renderer.name or (renderer.flag and other.flag == renderer.flag):
            raise ValueError(f"renderer {renderer.name!r}: name or flag already taken by {other.name!r}")
    RENDERERS.append(renderer)
    return renderer


def get(name: str) -> Renderer:
    return next(r for r in RENDERERS if r.name == name)


def file_outputs() -> List[Renderer]:
    """The renderers that write a file a flag names, in the order the CLI lists them."""
    return [r for r in RENDERERS if r.flag]


def pytest_outputs() -> List[Renderer]:
    """The file outputs the pytest plugin offers as ``--preflight-<flag>``."""
    return [r for r in file_outputs() if r.pytest_help is not None]
