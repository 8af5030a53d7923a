"""What every benchmark shares: run the real CLI against a namespace cluster, print a table, write JSON.

Benchmarks are scripts, not tests: they build real namespace hosts (tests/netcluster.py, real sshd per
host), run `python -m preflight run` as a user would, and time it from the outside.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.netcluster import NetCluster  # noqa: E402

# Every preflight a benchmark starts records into a history file of the benchmark's own, removed at its exit (unless
# PREFLIGHT_HISTORY names one): on the user's history a loaded run's compute figures were compared with that user's
# quiet past (bench/failfast.py named three healthy hosts), and the bench's runs would stay in the user's baselines.
if "PREFLIGHT_HISTORY" not in os.environ:
    _history = tempfile.mkdtemp(prefix="pf-bench-history-")
    os.environ["PREFLIGHT_HISTORY"] = os.path.join(_history, "history.db")
    atexit.register(shutil.rmtree, _history, True)


@dataclass
class Run:
    wall_s: float
    exit_code: int
    report: Dict[str, Any]
    stdout: str
    stderr: str

    def cells(self) -> Dict[tuple, Dict[str, Any]]:
        return {(r["host"], r["check"]): r for r in self.report.get("results", [])}

    def problems(self, limit: int = 600) -> list:
        """Every result that is not a pass, shortened: what a benchmark must explain next to its timing."""
        return [{"host": r["host"], "check": r["check"], "status": r["status"], "message": r["message"][:limit]}
                for r in self.report.get("results", []) if r["status"] != "pass"]

    def check_seconds(self) -> Dict[str, float]:
        """Each check's own time; cluster checks carry their whole duration on each cell, so max, not sum."""
        out: Dict[str, float] = {}
        for r in self.report.get("results", []):
            out[r["check"]] = max(out.get(r["check"], 0.0), r["duration_s"])
        return out


def require_netcluster() -> None:
    reason = NetCluster.unavailable_reason()
    if reason:
        sys.exit(f"cannot build namespace hosts here: {reason}")


def checkout(ref: str, into: Path) -> Path:
    """The code of a commit, runnable as `python -m preflight` from the returned folder (for A/B runs against
    an older commit: `git archive`, no worktree left in .git; a commit from before the checks moved into
    preflight/checks has its top-level checks/ copied there, so that the folder imports without an install)."""
    into.mkdir(parents=True, exist_ok=True)
    paths = ["preflight"] + (["checks"] if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}:checks"],
                                                          capture_output=True).returncode == 0 else [])
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, "--", *paths],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    if "checks" in paths:
        shutil.copytree(into / "checks", into / "preflight" / "checks")
    return into


def preflight(cluster: NetCluster, workdir: Path, *args: Any, slots: int = 1, timeout: float = 1800,
              hostfile_names: Optional[Sequence[str]] = None, code: Optional[Path] = None) -> Run:
    """One `preflight run` over real SSH against the cluster; the JSON report is read back. code: a folder from
    checkout() to run instead of this checkout (bench/scale.py's preflight@DIR runs such a folder too)."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "report.json"
    report.unlink(missing_ok=True)
    hostfile = cluster.hostfile(workdir / "hostfile", names=hostfile_names, slots=slots)
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--python", sys.executable,
            "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--json", str(report), "-q", *map(str, args)]
    start = time.monotonic()  # `python -m` puts its working directory first on the path: code's preflight runs
    proc = subprocess.run(argv, cwd=code or ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    wall = time.monotonic() - start
    data = json.loads(report.read_text()) if report.exists() else {}
    if not data:
        print(f"preflight wrote no report (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    return Run(round(wall, 3), proc.returncode, data, proc.stdout, proc.stderr)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain right-aligned text table (benchmarks print to logs, not terminals)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)
    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in text]
    return "\n".join(lines)


def write_json(name: str, data: Dict[str, Any], out: Optional[str] = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path
