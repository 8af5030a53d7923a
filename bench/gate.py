"""Benchmark: the default gate's critical path on 4 namespace hosts against its floor.

The critical path is the wall time of a default `preflight run` (no --checks), timed from the outside. The
floor is what such a run cannot avoid: one `import deepspeed` on a host (the python and ds_report checks
need it; timed alone on an idle host, median of 3), the iperf3 rounds (rounds x duration_s, from the
report's cluster facts) and the all-reduce sweep (the timed sizes, sum of time_s x iters, from the report).
Everything else (connecting, the agent, torch in the all-reduce ranks, ports, clean-up, iperf3's confirm repeats)
is overhead. On this 2-core machine the 4 hosts' imports share the cores, so the ratio also holds that contention.
The iperf3 rounds are those the run measured: the ring alone where its links agreed (iperf3 agree_deficit), so a
run that cut them has a smaller floor too; `beside` is how long iperf3 measured beside the host checks (the
report's timeline: iperf3 starts while the hosts import torch and DeepSpeed).

A second floor adds the measuring that checks added after that floor was set do: the all-reduce's straggler
rounds (`rnd_s`) and compute's timed loops (`cmp_n` times). `floor2_s` is that floor, `ratio2` the wall time
against it. `shared` and `shared2` are the two ratios with the import timed on every host at once instead of
on one idle host: what the hosts of this machine really do in a run, sharing its 2 cores.

    python3 bench/gate.py                 # --reps 3
    python3 bench/gate.py --reps 1 --out /tmp/gate.json
    python3 bench/gate.py --against 48c8d74 --reps 3   # that commit and this code, interleaved on one cluster
    python3 bench/gate.py --against 5b20250 --shape-mbit 2000   # links limited to 2 Gbit/s: iperf3 network-bound

On this machine iperf3 over the namespaces' veth pairs is bound by the 2 shared cores, as the hosts' imports are:
running both at once saves nothing here. With --shape-mbit the links are the limit, as a real host's NIC is.

Sample output (--against 5b20250 --reps 3, abridged; the 2-core machine at a load average of 40 to 90):

       code  rep  wall_s  import_s  iperf_s  beside  sweep_s  floor_s  ratio  rnd_s  cmp_n  floor2_s  ratio2 ...
    5b20250    1   72.95      8.56     6.00    0.00    10.34    24.90   2.93   3.32      3     30.02    2.43 ...
       this    1   58.24      8.56     6.00    6.46    12.18    26.74   2.18   1.65      3     30.19    1.93 ...
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, checkout, preflight, require_netcluster, table, write_json  # noqa: E402

from preflight.hostside.proc import parallel_map  # noqa: E402
from preflight.config import load_defaults  # noqa: E402

COMPUTE_SECONDS = float(load_defaults()["compute"]["seconds"])


def import_seconds(cluster: NetCluster, module: str, reps: int = 3, every_host: bool = False) -> float:
    """Median seconds of `import module` on the first host alone, or on every host at once (every_host: until the
    last is done; on this machine the hosts then share its cores, as they do in a run)."""
    hosts = cluster.hosts if every_host else cluster.hosts[:1]
    times = []
    for _ in range(reps):
        start = time.monotonic()
        parallel_map(lambda h: cluster.exec(h, [sys.executable, "-c", f"import {module}"], timeout=300), hosts,
                     len(hosts), 300)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def cluster_metrics(report: dict, check: str) -> dict:
    for r in report.get("results", []):
        if r["check"] == check and r["host"] not in {h["name"] for h in report.get("hosts", [])}:
            return r.get("metrics") or {}
    return {}


def one_run(cluster: NetCluster, workdir: Path, import_ds: float, import_all: float, code: Optional[Path]
            ) -> Dict[str, Any]:
    run = preflight(cluster, workdir, code=code)
    iperf = cluster_metrics(run.report, "iperf3")
    nets = max(1, len(iperf.get("networks", [])))
    iperf_s = float(iperf.get("rounds", 0)) * float(iperf.get("duration_s", 0.0)) * nets
    allreduce = cluster_metrics(run.report, "allreduce")
    sweep_s = sum(float(s.get("time_s", 0.0)) * int(s.get("iters", 1)) for s in allreduce.get("sizes", []))
    floor = import_ds + iperf_s + sweep_s
    # The measuring that checks added after issue 11 set the floor do: the all-reduce's straggler rounds (each
    # round as long as its slowest pair's timed iterations) and compute's timed loops (a CPU GEMM for `seconds`
    # and a copy for half of it, per measurement of the hosts).
    rounds: Dict[int, float] = {}
    for pair in (allreduce.get("stragglers") or {}).get("pairs") or []:
        rounds[pair["round"]] = max(rounds.get(pair["round"], 0.0), sum(pair.get("iter_s") or []))
    # (None from code older than the count: no second floor for it)
    measurements = cluster_metrics(run.report, "compute").get("measurements")
    added = sum(rounds.values()) + measurements * 1.5 * COMPUTE_SECONDS if measurements is not None else None
    # The same floors with the hosts' imports as they really overlap here: all hosts at once on this machine's cores
    shared = import_all - import_ds
    # How long iperf3 measured beside the host checks (their imports), from the report's timeline (absent before it)
    spans = {t["phase"]: t for t in run.report.get("timeline") or []}
    host, net = spans.get("host checks"), spans.get("iperf3")
    beside = max(0.0, min(host["end_s"], net["end_s"]) - max(host["start_s"], net["start_s"])) if host and net else 0.0
    return {"wall_s": run.wall_s, "import_deepspeed_s": round(import_ds, 2), "iperf3_s": round(iperf_s, 2),
            "iperf3_beside_host_checks_s": round(beside, 2), "iperf3_rounds": iperf.get("rounds"),
            "iperf3_remeasured": sum((iperf.get("remeasured") or {}).values()),
            "timeline": run.report.get("timeline"),
            "import_deepspeed_every_host_s": round(import_all, 2),
            "ratio_shared_cores": round(run.wall_s / (floor + shared), 2) if floor else None,
            "ratio2_shared_cores": round(run.wall_s / (floor + added + shared), 2) if floor and added is not None
            else None,
            "sweep_s": round(sweep_s, 2), "floor_s": round(floor, 2),
            "ratio": round(run.wall_s / floor, 2) if floor else None,
            "straggler_rounds_s": round(sum(rounds.values()), 2), "compute_measurements": measurements,
            "floor_with_added_s": round(floor + added, 2) if added is not None else None,
            "ratio_with_added": round(run.wall_s / (floor + added), 2) if floor and added is not None else None,
            "exit_code": run.exit_code, "check_s": run.check_seconds(), "problems": run.problems()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--against", metavar="REF", help="also run this commit's code, interleaved (A/B)")
    parser.add_argument("--out", help="JSON path (default bench/results/gate.json)")
    parser.add_argument("--shape-mbit", type=float, default=0.0,
                        help="limit every host's link to this rate (tc tbf): iperf3 then waits on the network, as "
                             "on real hosts, instead of on this machine's shared cores")
    args = parser.parse_args()
    require_netcluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, NetCluster(args.hosts) as cluster:
        codes: List[Tuple[str, Optional[Path]]] = [("this", None)]
        if args.against:
            codes.insert(0, (args.against, checkout(args.against, Path(tmp) / "against")))
        for host in cluster.hosts if args.shape_mbit else []:
            cluster.shape(host, args.shape_mbit)
        import_ds = import_seconds(cluster, "deepspeed")
        import_all = import_seconds(cluster, "deepspeed", every_host=True)
        for rep in range(args.reps):
            for name, code in codes:
                row = dict(code=name, rep=rep + 1,
                           **one_run(cluster, Path(tmp) / f"r{rep}", import_ds, import_all, code))
                rows.append(row)
                print(f"{name} rep {rep + 1}: {row['wall_s']:.1f} s, floor {row['floor_s']:.1f} s", file=sys.stderr)
    print(table(["code", "rep", "wall_s", "import_s", "iperf_s", "beside", "sweep_s", "floor_s", "ratio", "rnd_s",
                 "cmp_n", "floor2_s", "ratio2", "shared", "shared2", "exit"],
                [[r["code"], r["rep"], r["wall_s"], r["import_deepspeed_s"], r["iperf3_s"],
                  r["iperf3_beside_host_checks_s"], r["sweep_s"],
                  r["floor_s"], r["ratio"], r["straggler_rounds_s"], r["compute_measurements"],
                  r["floor_with_added_s"], r["ratio_with_added"], r["ratio_shared_cores"],
                  r["ratio2_shared_cores"], r["exit_code"]] for r in rows]))
    summary = {}
    for name, _ in codes:
        mine = [r for r in rows if r["code"] == name and r["ratio"]]
        second = [r["ratio_with_added"] for r in mine if r["ratio_with_added"]]
        shared2 = [r["ratio2_shared_cores"] for r in mine if r["ratio2_shared_cores"]]
        summary[name] = {"median_wall_s": statistics.median(r["wall_s"] for r in mine),
                         "median_ratio": statistics.median(r["ratio"] for r in mine),
                         "median_ratio_with_added": statistics.median(second) if second else None,
                         "median_ratio_shared_cores": statistics.median(r["ratio_shared_cores"] for r in mine),
                         "median_ratio2_shared_cores": statistics.median(shared2) if shared2 else None}
        print(f"{name}: median wall {summary[name]['median_wall_s']:.2f} s, ratio {summary[name]['median_ratio']:.2f}"
              + (f" (with the added measuring: {statistics.median(second):.2f})" if second else ""))
    write_json("gate", {"hosts": args.hosts, "shape_mbit": args.shape_mbit or None,
                        "interleaved": [n for n, _ in codes], "summary": summary,
                        "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
