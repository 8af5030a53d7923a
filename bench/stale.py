"""Which published figures describe code that has changed since they were measured.

Reads every table row of bench/README.md and docs/performance.md that cites a results file (`bench/results/...`)
or a commit (a backticked hex), takes the row's results commit (the commit it cites; else the commit that added its
results file) and its measured code (the paths the row names, and MEASURES below for its results file), and prints
one line for each row whose measured code has a commit after that one (`git log COMMIT..HEAD -- PATHS`). Rows under
a "Superseded" heading are history, not figures, and are left out. Exit status 0 always: run it before each stop.

    python3 bench/stale.py            # bench/README.md and docs/performance.md of this checkout
    python3 bench/stale.py --verbose  # also the current rows

Sample output:

    bench/README.md:79 [Scale: against pdsh and ClusterShell, 64 to 1,000 hosts] 64 | preflight | 3.79: measured
    at 2412752; since then 14 commits to preflight/remote.py, preflight/runner.py, ... (latest 5f27c7c)
"""
from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
FILES = ("bench/README.md", "docs/performance.md")

# The code each results file measures (fnmatch patterns on the results file's name, first match wins; git pathspecs,
# whose '*' crosses '/'). A row may name more (a backticked preflight/... or bench/... path).
_CONNECT = ["preflight/remote.py", "preflight/runner.py", "preflight/transport/*", "preflight/hostside/agent.py",
            "preflight/hostside/hello.py", "preflight/hostside/proc.py", "preflight/cli/*",
            "preflight/checks/python.py"]
MEASURES: Tuple[Tuple[str, List[str]], ...] = (
    ("gate*", ["preflight/*", "bench/gate.py"]),  # the whole default gate, end to end
    ("failfast*", ["preflight/*", "bench/failfast.py"]),  # the default gate, healthy and with a firewalled host
    ("scale-*", _CONNECT + ["bench/scale.py"]),
    ("profile-*", _CONNECT + ["bench/scale.py"]),
    ("old-vs-final-*", _CONNECT + ["bench/scale.py"]),
    ("slurm-scale*", _CONNECT + ["preflight/slurm.py", "preflight/checks/interfaces.py", "preflight/checks/memlock.py",
                                 "preflight/checks/ext_locks.py", "preflight/checks/versions.py",
                                 "preflight/checks/clock.py", "preflight/checks/ports.py", "bench/slurm_scale.py",
                                 "bench/slurm_model.py", "bench/slurm_vs_ssh.py"]),
    ("slurm*", _CONNECT + ["preflight/slurm.py", "bench/slurm_vs_ssh.py"]),
    ("straggler-allreduce-*", ["preflight/checks/allreduce/*", "preflight/hostside/*", "bench/straggler.py"]),
    ("straggler-*", ["preflight/checks/iperf3/*", "preflight/hostside/*",
                     "bench/straggler.py"]),
    ("severity*", ["preflight/checks/compute.py", "preflight/checks/iperf3/*", "preflight/checks/*.toml",
                   "preflight/hostside/*", "preflight/history/*", "bench/severity.py"]),
    ("compute_straggler*", ["preflight/checks/compute.py", "preflight/checks/compute.toml", "preflight/hostside/*",
                            "bench/compute_straggler.py"]),
    ("rehearse-overhead*", ["preflight/rehearse.py", "preflight/checks/launch/*", "preflight/hostside/rehearsal.py",
                            "preflight/hostside/jit.py", "bench/rehearse_overhead.py"]),
    ("device-*", ["preflight/checks/compute.py", "preflight/checks/gpu.py", "preflight/checks/driver_cuda.py",
                  "preflight/checks/python.py", "preflight/checks/allreduce/*", "preflight/hostside/nvidia.py",
                  "preflight/nodecheck.py", "bench/device_check.sh"]),
    ("readme-report*", ["preflight/*", "bench/readme_report.py"]),
    ("agent-startup*", ["preflight/hostside/agent.py", "preflight/hostside/hello.py", "preflight/remote.py",
                        "bench/agent_overhead.py"]),
    ("agent_overhead*", _CONNECT + ["bench/agent_overhead.py"]),
    ("agent-life*", _CONNECT + ["preflight/checks/nvme.py", "bench/agent_life.py"]),
    ("calibration*", ["preflight/hostside/stats.py", "preflight/hostside/mesh.py", "preflight/checks/compute.py",
                      "preflight/checks/compute.toml", "preflight/checks/iperf3/*",
                      "preflight/checks/allreduce/stragglers.py", "preflight/checks/allreduce/thresholds.toml",
                      "bench/calibration.py"]),
    ("healthy-fleet*", ["preflight/hostside/*", "preflight/checks/compute.py", "preflight/checks/compute.toml",
                        "preflight/checks/iperf3/*", "preflight/checks/allreduce/*", "preflight/history/*",
                        "bench/healthy_fleet.py"]),
)

_RESULTS = re.compile(r"`(bench/results/[^`]+)`")
_COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
_PATH = re.compile(r"`((?:preflight|bench)/[A-Za-z0-9_./*-]+)`")
_NUMBER = re.compile(r"\d\.\d")


@dataclass
class Row:
    file: str
    line: int
    section: str
    text: str
    results: List[str] = field(default_factory=list)
    commits: List[str] = field(default_factory=list)
    named: List[str] = field(default_factory=list)


def expand(spec: str) -> List[str]:
    """`bench/results/a-{1,2}.{json,txt}` -> its four names; `a{,-max}.json` -> a.json, a-max.json."""
    m = re.search(r"\{([^{}]*)\}", spec)
    if not m:
        return [spec]
    return [name for alt in m.group(1).split(",") for name in expand(spec[:m.start()] + alt + spec[m.end():])]


def rows(root: Path, files: Sequence[str] = FILES) -> List[Row]:
    """The figure rows of these Markdown files: table rows that cite a results file or a commit, or hold a decimal
    number (a figure that cites neither is reported as untraceable). Header and separator rows, and every table
    under a heading with "Superseded" in it, are left out."""
    out: List[Row] = []
    for name in files:
        path = root / name
        if not path.exists():
            continue
        section, header_next = "", False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("#"):
                section = line.lstrip("#").strip()
                continue
            if not line.startswith("|"):
                header_next = True
                continue
            if header_next:  # the first row of a table is its header
                header_next = False
                continue
            if re.fullmatch(r"[|\s:-]+", line) or "superseded" in section.lower():
                continue
            row = Row(name, number, section, line,
                      [r for spec in _RESULTS.findall(line) for part in spec.split("`, `") for r in expand(part)],
                      _COMMIT.findall(line),
                      [p for p in _PATH.findall(line) if not p.startswith("bench/results/")])
            if row.results or row.commits or _NUMBER.search(line):
                out.append(row)
    return out


def _git(root: Path, *args: str) -> str:
    res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else ""


def measured(row: Row, measures: Sequence[Tuple[str, List[str]]] = MEASURES) -> List[str]:
    """The paths whose changes make this row stale: what it names, and the MEASURES of each of its results files."""
    paths = list(row.named)
    for result in row.results:
        stem = Path(result).parts[2] if len(Path(result).parts) > 2 else Path(result).name
        for pattern, code in measures:
            if fnmatch.fnmatch(stem, pattern):
                paths += [p for p in code if p not in paths]
                break
    return paths


def results_commit(root: Path, row: Row) -> Optional[str]:
    """The commit the row's figure was measured at: the newest commit it cites; else the newest of the commits
    that added its results files."""
    candidates = [c for c in (_git(root, "rev-parse", "--verify", "--quiet", f"{c}^{{commit}}") for c in row.commits)
                  if c]
    if not candidates:
        for result in row.results:
            added = _git(root, "log", "--diff-filter=A", "--format=%H", "--", result).splitlines()
            if added:
                candidates.append(added[-1])
    if not candidates:
        return None
    return max(candidates, key=lambda c: int(_git(root, "log", "-1", "--format=%ct", c) or 0))


def stale(root: Path, files: Sequence[str] = FILES,
          measures: Sequence[Tuple[str, List[str]]] = MEASURES) -> List[Tuple[Row, str]]:
    """(row, why) for every figure row not known to describe the code as it is at HEAD."""
    found: List[Tuple[Row, str]] = []
    cache: Dict[Tuple[str, Tuple[str, ...]], List[str]] = {}
    for row in rows(root, files):
        commit = results_commit(root, row)
        paths = measured(row, measures)
        if commit is None:
            found.append((row, "cites no results file or commit that this repository has"))
            continue
        if not paths:
            found.append((row, f"measured at {commit[:7]}, but no code is declared for it (bench/stale.py MEASURES)"))
            continue
        key = (commit, tuple(paths))
        if key not in cache:
            cache[key] = _git(root, "log", "--format=%h", f"{commit}..HEAD", "--", *paths).splitlines()
        later = cache[key]
        if later:
            changed = _git(root, "diff", "--name-only", commit, "HEAD", "--", *paths).splitlines()
            shown = ", ".join(changed[:4]) + (f", +{len(changed) - 4} more" if len(changed) > 4 else "")
            found.append((row, f"measured at {commit[:7]}; since then {len(later)} commit(s) to "
                               f"{shown or ', '.join(paths)} (latest {later[0]})"))
    return found


def _cells(row: Row, width: int = 60) -> str:
    text = " | ".join(c.strip() for c in row.text.strip("|").split("|")[:3])
    return text if len(text) <= width else text[:width - 3] + "..."


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(ROOT), help="the checkout (default: this one)")
    parser.add_argument("--verbose", action="store_true", help="also list the current rows")
    args = parser.parse_args(argv)
    root = Path(args.root)
    found = stale(root)
    for row, why in found:
        print(f"{row.file}:{row.line} [{row.section}] {_cells(row)}: {why}")
    if args.verbose:
        flagged = {(r.file, r.line) for r, _ in found}
        for row in rows(root):
            if (row.file, row.line) not in flagged:
                print(f"current: {row.file}:{row.line} [{row.section}] {_cells(row)}")
    total = len(rows(root))
    print(f"{len(found)} of {total} figure rows stale", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
