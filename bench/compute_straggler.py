"""Benchmark: does the compute check name a host whose CPU is limited, and never a healthy one?

Builds 4 namespace hosts (real sshd each) and runs `preflight run --checks compute` --reps times with one host (a
different one each time) in a cgroup limited to --cores CPUs (tests/netcluster.py `throttle`: cgroup v2 cpu.max,
or v1 cpu.cfs_quota_us where the cpu controller is there), then --reps times with no host limited. Detection: the
limited host's cell is WARN or FAIL; a false positive: any other host's is. The hosts share this machine's cores,
so they are measured one at a time with one thread each (`parallel_hosts = 1`, `cpu_threads = 1`, `rounds` as
given): a healthy host then gets up to a core, the limited one --cores. Every host is in a cgroup of its own (the
healthy ones limited to all of this machine's cores, i.e. not limited): the kernel shares CPU between cgroups as
groups, so a limited host alone in a cgroup would compete as one group against each other process on the machine
(and escape the bench's `nice`), while the healthy hosts' processes competed one by one. --no-equal-cgroups gives
the old setup. Needs root:

    python3 bench/compute_straggler.py                         # 4 hosts, half a core, 10 + 10 runs
    python3 bench/compute_straggler.py --reps 3 --cores 0.5 --rounds 2 --out /tmp/compute.json
    python3 bench/compute_straggler.py --together --cores 0.2      # as the test: 4 hosts at once, 1/5 core

Sample output:

      case  named  false_pos  errors  ratio_median  ratio_min  ratio_max  wall_s_median
    0.5 cpu  10/10          0       0          0.26       0.21       0.33           41.0
    healthy    n/a          0       0           n/a        n/a        n/a           30.2
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, median, preflight, require_netcluster, table, write_json  # noqa: E402

NAMED = ("warn", "fail")


def one_run(cluster: NetCluster, workdir: Path, config: Path, slow: Optional[str]) -> Dict[str, Any]:
    run = preflight(cluster, workdir, "--checks", "compute", "--config", config)
    cells = {h: c for (h, check), c in run.cells().items() if check == "compute"}
    status = {h.name: cells.get(h.name, {}).get("status") for h in cluster.hosts}
    gemm = {h: ((c.get("metrics") or {}).get("devices") or [{}])[0].get("gemm_gflops") for h, c in cells.items()
            if h != "*"}
    others = [g for h, g in gemm.items() if h != slow and g]
    ratio = gemm.get(slow) / median(others) if slow and gemm.get(slow) and others else None
    return {"slow": slow, "status": status, "gemm_gflops": gemm, "ratio": ratio, "wall_s": run.wall_s,
            "false_positives": [h for h, s in status.items() if s in NAMED and h != slow],
            "errors": [p for p in run.problems() if p["status"] == "error"],
            "message": cells.get(slow, {}).get("message") if slow else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--cores", type=float, default=0.5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--together", action="store_true",
                        help="measure all hosts at once (each gets cores/hosts), as the namespace test does")
    parser.add_argument("--no-equal-cgroups", dest="equal_cgroups", action="store_false",
                        help="only the limited host in a cgroup (the other hosts' processes compete one by one)")
    parser.add_argument("--confirm", type=int, help="[compute] confirm (default: preflight/checks/compute.toml's)")
    parser.add_argument("--out", help="JSON path (default bench/results/compute_straggler.json)")
    args = parser.parse_args()
    require_netcluster()
    cases: Dict[str, List[Dict[str, Any]]] = {"limited": [], "healthy": []}
    with tempfile.TemporaryDirectory() as tmp, NetCluster(args.hosts) as cluster:
        config = Path(tmp) / "compute.toml"
        if args.together:
            # As tests/checks/compute/test_compute.py: all hosts at once from one start time, so other work slows them alike.
            config.write_text("[compute]\nalign_s = 15.0\nseconds = 1.0\nchunks = 5\ncpu_threads = 1\n")
        else:
            config.write_text(f"[compute]\nparallel_hosts = 1\nrounds = {args.rounds}\nseconds = 1.0\nchunks = 5\n"
                              "cpu_threads = 1\n")
        if args.confirm is not None:
            config.write_text(config.read_text() + f"confirm = {args.confirm}\n")
        everything = float(os.cpu_count() or 1)

        def limit(slow: Optional[str]) -> None:
            for h in cluster.hosts:
                if h.name == slow:
                    cluster.throttle(h.name, cores=args.cores)
                elif args.equal_cgroups:
                    cluster.throttle(h.name, cores=everything)  # a cgroup of its own, without a real limit

        def unlimit() -> None:
            for h in cluster.hosts:
                cluster.unthrottle(h.name)

        load_before = os.getloadavg()
        for rep in range(args.reps):
            slow = cluster.hosts[rep % len(cluster.hosts)].name
            limit(slow)
            try:
                cases["limited"].append(one_run(cluster, Path(tmp) / f"limited-{rep}", config, slow))
            finally:
                unlimit()
            print(f"limited {rep}: {cases['limited'][-1]['status']}", file=sys.stderr)
        load_mid = os.getloadavg()
        for rep in range(args.reps):
            limit(None)
            try:
                cases["healthy"].append(one_run(cluster, Path(tmp) / f"healthy-{rep}", config, None))
            finally:
                unlimit()
            print(f"healthy {rep}: {cases['healthy'][-1]['status']}", file=sys.stderr)
    load_after = os.getloadavg()
    loads = {"limited": (load_before, load_mid), "healthy": (load_mid, load_after)}
    rows = []
    for name, reps in cases.items():
        ratios = [r["ratio"] for r in reps if r["ratio"]]
        limited = name == "limited"
        rows.append({"case": f"{args.cores:g} cpu" if limited else "healthy",
                     "named": f"{sum(r['status'][r['slow']] in NAMED for r in reps)}/{len(reps)}" if limited else "n/a",
                     # without a limited host, any named host is a false positive
                     "false_positives": sum(len(r["false_positives"]) for r in reps),
                     "errors": sum(len(r["errors"]) for r in reps),
                     "ratio_median": median(ratios) if ratios else None,
                     "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
                     "wall_s_median": median([r["wall_s"] for r in reps]),
                     "load_1m": f"{loads[name][0][0]:.1f}-{loads[name][1][0]:.1f}"})
    print(table(["case", "named", "false_pos", "errors", "ratio_median", "ratio_min", "ratio_max", "wall_s_median",
                 "load_1m"],
                [[r["case"], r["named"], r["false_positives"], r["errors"],
                  "n/a" if r["ratio_median"] is None else round(r["ratio_median"], 2),
                  "n/a" if r["ratio_min"] is None else round(r["ratio_min"], 2),
                  "n/a" if r["ratio_max"] is None else round(r["ratio_max"], 2), r["wall_s_median"], r["load_1m"]]
                 for r in rows]))
    write_json("compute_straggler", {"hosts": args.hosts, "cores": args.cores, "rounds": args.rounds,
                                     "together": args.together, "equal_cgroups": args.equal_cgroups,
                                     "confirm": args.confirm, "rows": rows,
                                     "runs": cases}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
