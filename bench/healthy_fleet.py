"""Benchmark: healthy hosts that differ a little stay unnamed, run after run (the namespace half of the calibration).

Builds 6 namespace hosts (real sshd each) whose links are shaped by tc to 200 Mbit/s minus 0-3% and whose CPU quotas
(cgroup v2, 1.8 cores shared out) are 0-3% apart, host by host, and runs ``preflight run --checks
compute,iperf3,allreduce`` --runs times with short measurements (CONFIG). A healthy fleet's hosts differ by this much;
the peer statistics (preflight/hostside/stats.py, the 3% prior) must name nobody. Records every WARN, FAIL or ERROR of
those checks per run and each run's wall time; exit 1 when any run named anyone. Needs root.
tests/verdict/test_calibration.py runs 3 of these runs in the suite; this runs the full 10 (bench/calibration.py
simulates the same on fleets of up to 1,024 hosts).

    python3 bench/healthy_fleet.py                      # 10 runs -> bench/results/healthy-fleet.json
    python3 bench/healthy_fleet.py --runs 3 --out /tmp/healthy.json

Sample output:

      run  named  fleet  wall_s
        0      0      0    31.2
        1      0      0    29.8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.netcluster import NetCluster  # noqa: E402

HOSTS = 6
SPREAD = 0.03  # the first host at the full rate and quota, the last 3% below, the rest in between
RATE = 200.0  # Mbit/s, as tests/checks/iperf3/test_iperf3.py
CORES = 1.8  # the 2 cores of the 2-core machine shared out
CHECKS = ("compute", "iperf3", "allreduce")
# Small sizes so that a run takes under a minute: 1-s iperf3 tests, a short all-reduce sweep, half-second compute
# measured together (align_s) with one thread per host.
CONFIG = ("[compute]\nalign_s = 10.0\nseconds = 0.5\nchunks = 5\ncpu_threads = 1\n"
          "[iperf3]\nduration_s = 1.0\n"
          "[allreduce]\nmin_bytes = 65536\nmax_bytes = 1048576\niters = 2\n")
Named = List[Tuple[str, str, str, str]]  # (host, check, status, message)


def shape(cluster: NetCluster) -> None:
    """Each host's link rate and CPU quota, 0-SPREAD below the first host's."""
    n = len(cluster.hosts)
    for i, h in enumerate(cluster.hosts):
        cluster.shape(h, round(RATE * (1 - SPREAD * i / (n - 1)), 1))
        cluster.throttle(h, cores=CORES / n * (1 - SPREAD * i / (n - 1)))


def unshape(cluster: NetCluster) -> None:
    for h in cluster.hosts:
        cluster.unthrottle(h)
        cluster.unshape(h)


def one_run(cluster: NetCluster, workdir: Path, run: int, timeout: float = 400
            ) -> Tuple[Named, float, str, List[Tuple[str, str]]]:
    """One `preflight run` of CHECKS: the results that named a host, the wall time, stderr's tail when no report
    was written (the named list is then empty: the caller asserts on the report's existence), and the history's
    fleet-wide drops (check, line)."""
    config = workdir / "config.toml"
    config.write_text(CONFIG)
    out = workdir / f"run{run}.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(workdir / "hosts")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", ",".join(CHECKS), "--config", str(config),
            "--json", str(out)]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=dict(os.environ))
    wall = time.monotonic() - start
    if not out.exists():
        return [], wall, proc.stderr[-3000:] or f"exit {proc.returncode}, no report", []
    results = json.loads(out.read_text())["results"]
    named = [(r["host"], r["check"], r["status"], r["message"]) for r in results
             if r["check"] in CHECKS and r["status"] in ("warn", "fail", "error") and not _fleet_warning(r)]
    # A drop the whole fleet shared against its own past (preflight/history/baseline.py Drift): one WARN on the
    # check's cluster row that names no host. Counted apart: it says the machine changed, not a host.
    fleet = [(r["check"], r["message"]) for r in results if r["check"] in CHECKS and _fleet_warning(r)]
    return named, wall, "", fleet


def _fleet_warning(result: Dict[str, Any]) -> bool:
    """A cluster row that WARNs with the history's fleet-wide drop (its other WARNs name hosts on their own rows)."""
    drift = (result.get("metrics") or {}).get("fleet_drift")
    return result["host"] == "*" and result["status"] == "warn" and bool(drift)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "healthy-fleet.json")
    ap.add_argument("--history", type=Path, help="the runs' history file (kept; default: PREFLIGHT_HISTORY, else a "
                    "new file in /tmp, kept, so that what the history judged can be read again)")
    args = ap.parse_args(argv)
    if reason := NetCluster.unavailable_reason():
        print(f"healthy_fleet: {reason}", file=sys.stderr)
        return 2
    import tempfile
    # Its own history file, kept: the judgement against each host's own past starts at run 6 (min_runs 5), and what
    # it said can be replayed from the file (the user's history is not a baseline of these hosts).
    history = args.history or Path(os.environ.get("PREFLIGHT_HISTORY") or
                                   tempfile.mkstemp(prefix="healthy-fleet-history-", suffix=".db")[1])
    os.environ["PREFLIGHT_HISTORY"] = str(history)
    rows: List[Dict[str, Any]] = []
    with NetCluster(HOSTS) as cluster, tempfile.TemporaryDirectory() as tmp:
        shape(cluster)
        try:
            print(f"{'run':>5}  {'named':>5}  {'fleet':>5}  {'wall_s':>6}")
            for run in range(args.runs):
                named, wall, error, fleet = one_run(cluster, Path(tmp), run)
                rows.append({"run": run, "named": named, "fleet_drift": fleet, "wall_s": round(wall, 1),
                             "error": error, "load_1m": round(os.getloadavg()[0], 1)})
                print(f"{run:>5}  {len(named):>5}  {len(fleet):>5}  {wall:>6.1f}"
                      + (f"  {error.splitlines()[-1]}" if error else ""))
        finally:
            unshape(cluster)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "hosts": HOSTS, "spread": SPREAD, "rate_mbit": RATE, "cores": CORES,
              "config": CONFIG, "history": str(history), "runs": rows,
              "named_runs": sum(bool(r["named"] or r["error"]) for r in rows),
              "fleet_drift_runs": sum(bool(r["fleet_drift"]) for r in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['named_runs']} of {len(rows)} runs named a host or failed, {result['fleet_drift_runs']} said the "
          f"whole fleet dropped against its own past; {args.out}; history {history}")
    return 1 if result["named_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
