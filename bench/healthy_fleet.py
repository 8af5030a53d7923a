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

      run  named  wall_s
        0      0    31.2
        1      0    29.8
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


def one_run(cluster: NetCluster, workdir: Path, run: int, timeout: float = 400) -> Tuple[Named, float, str]:
    """One `preflight run` of CHECKS: the results that named a host, the wall time, and stderr's tail when no report
    was written (the named list is then empty: the caller asserts on the report's existence)."""
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
        return [], wall, proc.stderr[-3000:] or f"exit {proc.returncode}, no report"
    results = json.loads(out.read_text())["results"]
    named = [(r["host"], r["check"], r["status"], r["message"]) for r in results
             if r["check"] in CHECKS and r["status"] in ("warn", "fail", "error")]
    return named, wall, ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "healthy-fleet.json")
    args = ap.parse_args(argv)
    if reason := NetCluster.unavailable_reason():
        print(f"healthy_fleet: {reason}", file=sys.stderr)
        return 2
    import tempfile
    rows: List[Dict[str, Any]] = []
    with NetCluster(HOSTS) as cluster, tempfile.TemporaryDirectory() as tmp:
        shape(cluster)
        try:
            print(f"{'run':>5}  {'named':>5}  {'wall_s':>6}")
            for run in range(args.runs):
                named, wall, error = one_run(cluster, Path(tmp), run)
                rows.append({"run": run, "named": named, "wall_s": round(wall, 1), "error": error,
                             "load_1m": round(os.getloadavg()[0], 1)})
                print(f"{run:>5}  {len(named):>5}  {wall:>6.1f}" + (f"  {error.splitlines()[-1]}" if error else ""))
        finally:
            unshape(cluster)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "hosts": HOSTS, "spread": SPREAD, "rate_mbit": RATE, "cores": CORES,
              "config": CONFIG, "runs": rows, "named_runs": sum(bool(r["named"] or r["error"]) for r in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['named_runs']} of {len(rows)} runs named a host or failed; {args.out}")
    return 1 if result["named_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
