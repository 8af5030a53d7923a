"""Benchmark: at which deficit preflight names a slow host (straggler), and how often it blames a healthy one.

All hosts' links are shaped (tc) to --base-mbit; one host, a different one each repetition, is shaped to a
fraction of it (90%, 75%, 50%); the 100% case slows nobody and counts false positives only. preflight runs
its real iperf3 check over SSH each time. Detection: the slow host's iperf3 cell is WARN or FAIL (named as a
straggler); a false positive: any other host's cell is. The thresholds are preflight's defaults
([iperf3] straggler_warn_fraction = 0.7, straggler_fail_fraction = 0.5), so a host at 90% or 75% is meant to
pass and one at 50% must never pass. Needs root. From the repository root:

    python3 bench/straggler.py                       # 4 hosts, 1000 Mbit, 10 repetitions per deficit
    python3 bench/straggler.py --reps 3 --fractions 1.0 0.5 --out /tmp/straggler.json

Sample output:

    slow_at  detected  warn  fail  false_pos  errors  measured_ratio   min   max
       1.00       n/a     0     0          0       0            1.00  1.00  1.00
       0.50     10/10     2     8          0       0            0.50  0.50  0.50
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, median, preflight, require_netcluster, table, write_json  # noqa: E402

CHECKS = "interfaces,iperf3"
NAMED = ("warn", "fail")


def one_rep(cluster: NetCluster, workdir: Path, slow: str, fraction: float, base: float) -> Dict[str, Any]:
    for h in cluster.hosts:
        cluster.shape(h, base * fraction if h.name == slow else base)
    run = preflight(cluster, workdir, "--checks", CHECKS)
    cells = run.cells()
    status = {h.name: cells.get((h.name, "iperf3"), {}).get("status") for h in cluster.hosts}
    slow_metrics = cells.get((slow, "iperf3"), {}).get("metrics", {})
    others = [h.name for h in cluster.hosts if h.name != slow]
    # The slow host's own median over the others' medians: what the shaping actually did to the measurement.
    other_medians = [cells.get((h, "iperf3"), {}).get("metrics", {}).get("median_gbps") for h in others]
    other_medians = [m for m in other_medians if m]
    ratio = (slow_metrics.get("median_gbps") / median(other_medians)
             if slow_metrics.get("median_gbps") and other_medians else None)
    errors = [p for p in run.problems() if p["status"] == "error"]
    return {"slow": slow, "fraction": fraction, "status": status, "measured_ratio": ratio,
            "false_positives": [h for h in others if status[h] in NAMED], "errors": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.9, 0.75, 0.5])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--base-mbit", type=float, default=1000)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", help="JSON path (default bench/results/straggler.json)")
    args = parser.parse_args()
    require_netcluster()
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, NetCluster(args.hosts) as cluster:
        for fraction in args.fractions:
            reps = []
            for rep in range(args.reps):
                slow = cluster.hosts[rep % len(cluster.hosts)].name  # every position: master, ring ends, ...
                reps.append(one_rep(cluster, Path(tmp) / f"{fraction:g}-{rep}", slow, fraction, args.base_mbit))
            slowed = fraction < 1.0
            # At 100% too: how far an unshaped host's own median strays from the others' (the noise floor).
            ratios = [r["measured_ratio"] for r in reps if r["measured_ratio"]]
            row = {"fraction": fraction, "reps": reps,
                   "detected": sum(r["status"][r["slow"]] in NAMED for r in reps) if slowed else None,
                   "warn": sum(r["status"][r["slow"]] == "warn" for r in reps) if slowed else 0,
                   "fail": sum(r["status"][r["slow"]] == "fail" for r in reps) if slowed else 0,
                   # Without a slowed host, a named "slow" host is a false positive too.
                   "false_positives": sum(len(r["false_positives"]) + (0 if slowed else r["status"][r["slow"]] in NAMED)
                                          for r in reps),
                   "errors": sum(len(r["errors"]) for r in reps),
                   "measured_ratio": median(ratios), "ratio_min": min(ratios, default=None),
                   "ratio_max": max(ratios, default=None)}
            rows.append(row)
            found = "n/a" if row["detected"] is None else f"{row['detected']}/{args.reps}"
            print(f"slow at {fraction:.0%}: detected {found}, "
                  f"false positives {row['false_positives']}", file=sys.stderr)
    n = args.reps
    print(table(["slow_at", "detected", "warn", "fail", "false_pos", "errors", "measured_ratio", "min", "max"],
                [[r["fraction"], "n/a" if r["detected"] is None else f"{r['detected']}/{n}", r["warn"], r["fail"],
                  r["false_positives"], r["errors"], r["measured_ratio"], r["ratio_min"], r["ratio_max"]]
                 for r in rows]))
    write_json("straggler", {"hosts": args.hosts, "base_mbit": args.base_mbit, "reps": n, "checks": CHECKS,
                             "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
