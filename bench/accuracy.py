"""Benchmark: measured iperf3 bandwidth and all-reduce busbw against links shaped with tc to a known rate.

Every host's link to the bridge is shaped (tc tbf, both directions) to the same rate, which is then the
physical limit of every host-to-host path. preflight runs its real iperf3 and gloo all-reduce checks over
SSH (one rank per host) and the table gives what each measured as a fraction of the shaped rate. TCP over
Ethernet carries at most 1448 payload bytes per 1514-byte frame (95.6%), which is the best iperf3 can get.
Needs root. From the repository root:

    python3 bench/accuracy.py                        # 100, 1000, 2000 Mbit; 4 hosts; 3 repetitions
    python3 bench/accuracy.py --rates 1000 --reps 1 --out /tmp/accuracy.json

Sample output:

    shaped_mbit  iperf3_mbit  iperf3_ratio  busbw_mbit  busbw_ratio  busbw_at
            100         95.2          0.95        93.1         0.93   4 MiB
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, median, preflight, require_netcluster, table, write_json  # noqa: E402

CHECKS = "interfaces,iperf3,allreduce"


def measured(run: Any) -> Dict[str, Optional[float]]:
    """iperf3's median on the chosen network and all-reduce busbw at its largest size, both in Mbit/s."""
    cells = run.cells()
    iperf = cells.get(("*", "iperf3"), {}).get("metrics", {})
    nets = [n for n in iperf.get("networks") or [] if n.get("median_gbps")]
    allreduce = cells.get(("*", "allreduce"), {}).get("metrics", {})
    busbw = allreduce.get("busbw_GBps")
    return {"iperf3_mbit": nets[0]["median_gbps"] * 1000 if nets else None,
            "busbw_mbit": busbw * 8000 if busbw else None,  # GB/s (1e9 bytes) -> Mbit/s
            "busbw_at_bytes": allreduce.get("largest_bytes")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 1000, 2000], help="Mbit/s")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="JSON path (default bench/results/accuracy.json)")
    args = parser.parse_args()
    require_netcluster()
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, NetCluster(args.hosts) as cluster:
        work = Path(tmp)
        for rate in args.rates:
            for h in cluster.hosts:
                cluster.shape(h, rate)
            samples = []
            for rep in range(args.reps):
                run = preflight(cluster, work / f"{rate:g}-{rep}", "--checks", CHECKS)
                samples.append(measured(run))
                if run.problems():
                    print(f"{rate:g} Mbit rep {rep}: {run.problems()}", file=sys.stderr)
            iperf = [s["iperf3_mbit"] for s in samples if s["iperf3_mbit"]]
            busbw = [s["busbw_mbit"] for s in samples if s["busbw_mbit"]]
            row = {"shaped_mbit": rate, "iperf3_mbit": median(iperf), "busbw_mbit": median(busbw),
                   "busbw_at_bytes": max((s["busbw_at_bytes"] or 0) for s in samples), "samples": samples}
            row["iperf3_ratio"] = row["iperf3_mbit"] / rate
            row["busbw_ratio"] = row["busbw_mbit"] / rate
            rows.append(row)
            print(f"{rate:g} Mbit: iperf3 {row['iperf3_mbit']:.0f}, busbw {row['busbw_mbit']:.0f}", file=sys.stderr)
    print(table(["shaped_mbit", "iperf3_mbit", "iperf3_ratio", "busbw_mbit", "busbw_ratio", "busbw_at_MiB"],
                [[r["shaped_mbit"], r["iperf3_mbit"], r["iperf3_ratio"], r["busbw_mbit"], r["busbw_ratio"],
                  r["busbw_at_bytes"] // 2**20] for r in rows]))
    write_json("accuracy", {"hosts": args.hosts, "reps": args.reps, "checks": CHECKS, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
