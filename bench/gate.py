"""Benchmark: the default gate's critical path on 4 namespace hosts against its floor.

The critical path is the wall time of a default `preflight run` (no --checks), timed from the outside. The
floor is what such a run cannot avoid: one `import deepspeed` on a host (the python and ds_report checks
need it; timed alone on an idle host, median of 3), the iperf3 rounds (rounds x duration_s, from the
report's cluster facts) and the all-reduce sweep (the timed sizes, sum of time_s x iters, from the report).
Everything else (connecting, the agent, torch in the all-reduce ranks, ports, clean-up) is overhead. On
this 2-core machine the 4 hosts' imports share the cores, so the ratio also holds that contention.

    python3 bench/gate.py                 # --reps 3
    python3 bench/gate.py --reps 1 --out /tmp/gate.json

Sample output:

    rep  wall_s  import_ds_s  iperf3_s  sweep_s  floor_s  ratio  exit
      1    24.1         4.10      6.00     0.90    11.00   2.19     0
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, preflight, require_netcluster, table, write_json  # noqa: E402


def import_seconds(cluster: NetCluster, module: str, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.monotonic()
        cluster.exec(cluster.hosts[0], [sys.executable, "-c", f"import {module}"], timeout=300)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def cluster_metrics(report: dict, check: str) -> dict:
    for r in report.get("results", []):
        if r["check"] == check and r["host"] not in {h["name"] for h in report.get("hosts", [])}:
            return r.get("metrics") or {}
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--out", help="JSON path (default bench/results/gate.json)")
    args = parser.parse_args()
    require_netcluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, NetCluster(args.hosts) as cluster:
        import_ds = import_seconds(cluster, "deepspeed")
        for rep in range(args.reps):
            run = preflight(cluster, Path(tmp) / f"r{rep}")
            iperf = cluster_metrics(run.report, "iperf3")
            nets = max(1, len(iperf.get("networks", [])))
            iperf_s = float(iperf.get("rounds", 0)) * float(iperf.get("duration_s", 0.0)) * nets
            sizes = cluster_metrics(run.report, "allreduce").get("sizes", [])
            sweep_s = sum(float(s.get("time_s", 0.0)) * int(s.get("iters", 1)) for s in sizes)
            floor = import_ds + iperf_s + sweep_s
            rows.append({"rep": rep + 1, "wall_s": run.wall_s, "import_deepspeed_s": round(import_ds, 2),
                         "iperf3_s": round(iperf_s, 2), "sweep_s": round(sweep_s, 2), "floor_s": round(floor, 2),
                         "ratio": round(run.wall_s / floor, 2) if floor else None, "exit_code": run.exit_code,
                         "check_s": run.check_seconds(), "problems": run.problems()})
            print(f"rep {rep + 1}: {run.wall_s:.1f} s, floor {floor:.1f} s", file=sys.stderr)
    print(table(["rep", "wall_s", "import_ds_s", "iperf3_s", "sweep_s", "floor_s", "ratio", "exit"],
                [[r["rep"], r["wall_s"], r["import_deepspeed_s"], r["iperf3_s"], r["sweep_s"], r["floor_s"],
                  r["ratio"], r["exit_code"]] for r in rows]))
    med = statistics.median(r["ratio"] for r in rows if r["ratio"])
    print(f"median ratio {med:.2f}")
    write_json("gate", {"hosts": args.hosts, "median_ratio": med, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
