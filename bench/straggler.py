"""Benchmark: at which deficit preflight names a slow host (straggler), and how often it blames a healthy one.

All hosts' links are shaped (tc tbf) to --base-mbit; one host, a different one each repetition, is shaped to a
fraction of it (90%, 75%, 50%); "clean" slows nobody and counts false positives only, "jitter" slows nobody but
puts a netem delay of 1 ms +- 0.5 ms (normal) on every link, and "noise" re-draws every link's rate from 85-100%
of the base every 0.3 s (for kernels without sch_netem). preflight runs its real iperf3 check over SSH
each time, with the default thresholds: WARN when the deficit is significant (moderated t, Holm-adjusted p < 0.01;
hostside/stats.py) and at least 5%, FAIL below 50%. Detection: the slow host's iperf3 cell is
WARN or FAIL; a false positive: any other host's is. Also the iperf3 phase's own seconds. Needs root:

    python3 bench/straggler.py                       # 4 and 8 hosts, 1000 Mbit, 10 runs per row
    python3 bench/straggler.py --hosts 4 --reps 3 --rows 0.9 clean --out /tmp/straggler.json
    python3 bench/straggler.py --hosts 4 --rows clean noise 0.9 0.75 --compare-old   # README's table
    python3 bench/straggler.py --check allreduce --hosts 4 --rows clean noise 0.9 0.75 --before \
        --out bench/results/straggler-allreduce-4.json                                # README's all-reduce table

--check allreduce judges the all-reduce instead (``--checks allreduce``, default thresholds): its straggler rounds
time every ring pair after the sweep; detection is the slow host's all-reduce cell WARN or FAIL; measured_ratio is
its best pair's rate over the other hosts' median; check_s the all-reduce's seconds and stragglers_s those of its
rounds. --before runs every repetition a second time with straggler_rounds = false, interleaved (old_check_s), so
that added_ratio = check_s / old_check_s comes from one bench run.

--compare-old runs every clean repetition a second time with the pre-detector configuration (statistics off,
iperf3's default 1 s report interval), interleaved, so that both iperf3 phase times come from one bench run.
The JSON is rewritten after every row, with the load average before and after it.

Sample output:

    hosts      row  detected  warn  fail  false_pos  errors  measured_ratio   min   max  iperf3_s
        4    clean       n/a     0     0          0       0            1.00  1.00  1.00       7.9
        4     0.90     10/10    10     0          0       0            0.90  0.90  0.91       7.8
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, median, preflight, require_netcluster, table, write_json  # noqa: E402

CHECKS = {"iperf3": "interfaces,iperf3", "allreduce": "allreduce"}
NAMED = ("warn", "fail")
# --check allreduce --before: the same repetition without the straggler rounds, for their added time.
BEFORE_CONFIG = "[allreduce]\nstraggler_rounds = false\n"


JITTER = ("1ms", "0.5ms")  # the example: delay 1ms 0.5ms distribution normal
# "noise": every link's rate is re-drawn from 85-100% of the base every 0.3 s while preflight runs (cross traffic
# that comes and goes), for kernels without sch_netem, where the "jitter" row cannot be built.
ROWS = {"clean": (1.0, None), "jitter": (1.0, JITTER), "noise": (1.0, "noise"), "0.9": (0.9, None),
        "0.75": (0.75, None), "0.5": (0.5, None)}


def _flap(cluster: NetCluster, base: float, stop: threading.Event) -> None:
    rng = random.Random(1)
    while not stop.wait(0.3):
        for h in cluster.hosts:
            cluster.shape(h, round(base * rng.uniform(0.85, 1.0), 1))


# The pre-detector configuration, for --compare-old: statistics off (max_p = 1) and only a 30% deficit named, and
# iperf3's own default report interval (1 s) instead of the detector's 0.25 s; the same 2 s tests in the same rounds.
OLD_CONFIG = "[iperf3]\nmax_p = 1.0\nmin_deficit = 0.3\ninterval_s = 1.0\n"


def _allreduce_view(run: Any, cluster: NetCluster, slow: str) -> Dict[str, Any]:
    """The all-reduce's verdict per host (a host without its own cell passed), the slow host's best-pair rate over
    the others' median, and the seconds of the check and of its straggler rounds."""
    cells = run.cells()
    star = cells.get(("*", "allreduce"), {})
    status = {h.name: cells.get((h.name, "allreduce"), {}).get("status", "pass" if star else None)
              for h in cluster.hosts}
    rounds = (star.get("metrics") or {}).get("stragglers") or {}
    rates = {h: r.get("busbw_GBps") for h, r in (rounds.get("hosts") or {}).items()}
    others = [v for h, v in rates.items() if h != slow and v]
    ratio = rates[slow] / median(others) if rates.get(slow) and others else None
    # A host the statistics left unnamed but at least min_deficit slower: the cluster line says so (weak evidence).
    unsure = sorted(rounds.get("unsure") or {})
    return {"status": status, "measured_ratio": ratio, "check_s": run.check_seconds().get("allreduce"),
            "unsure": unsure,
            "stragglers_s": rounds.get("duration_s"), "cluster": star.get("status"),
            "message": cells.get((slow, "allreduce"), {}).get("message") or star.get("message")}


def one_rep(cluster: NetCluster, workdir: Path, slow: str, fraction: float, base: float,
            jitter: Any, config: Any = None, check: str = "iperf3") -> Dict[str, Any]:
    netem = jitter if isinstance(jitter, tuple) else None
    for h in cluster.hosts:
        cluster.shape(h, base * fraction if h.name == slow else base, jitter=netem)
    stop = threading.Event()
    flapper = threading.Thread(target=_flap, args=(cluster, base, stop), daemon=True)
    if jitter == "noise":
        flapper.start()
    try:
        run = preflight(cluster, workdir, "--checks", CHECKS[check], *(("--config", config) if config else ()))
    finally:
        stop.set()
        if flapper.is_alive():
            flapper.join(5)
    errors = [p for p in run.problems() if p["status"] == "error"]
    if check == "allreduce":
        view = _allreduce_view(run, cluster, slow)
        others = [h.name for h in cluster.hosts if h.name != slow]
        return dict(view, slow=slow, fraction=fraction, errors=errors,
                    false_positives=[h for h in others if view["status"][h] in NAMED])
    cells = run.cells()
    status = {h.name: cells.get((h.name, "iperf3"), {}).get("status") for h in cluster.hosts}
    slow_metrics = cells.get((slow, "iperf3"), {}).get("metrics", {})
    others = [h.name for h in cluster.hosts if h.name != slow]
    # The slow host's own median over the others' medians: what the shaping actually did to the measurement.
    other_medians = [cells.get((h, "iperf3"), {}).get("metrics", {}).get("median_gbps") for h in others]
    other_medians = [m for m in other_medians if m]
    ratio = (slow_metrics.get("median_gbps") / median(other_medians)
             if slow_metrics.get("median_gbps") and other_medians else None)
    return {"slow": slow, "fraction": fraction, "status": status, "measured_ratio": ratio,
            "false_positives": [h for h in others if status[h] in NAMED], "errors": errors,
            "iperf3_s": run.check_seconds().get("iperf3"), "message": cells.get((slow, "iperf3"), {}).get("message"),
            # Every named host's line (its z and p), so that a false positive can be read, not only counted.
            "named": {h: cells.get((h, "iperf3"), {}).get("message") for h in status if status[h] in NAMED},
            "load_1m": round(os.getloadavg()[0], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["clean", "jitter", "0.9", "0.75"], choices=list(ROWS),
                        help="jitter needs the kernel's sch_netem; use noise where it is missing")
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--base-mbit", type=float, default=1000)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--compare-old", action="store_true",
                        help="in the clean row, also run each repetition with the pre-detector configuration "
                             "(fixed fractions only, iperf3's default 1 s interval), interleaved, for the phase time")
    parser.add_argument("--check", choices=list(CHECKS), default="iperf3",
                        help="whose verdict counts: the iperf3 map (default) or the all-reduce's straggler rounds")
    parser.add_argument("--before", nargs="*", choices=list(ROWS), metavar="ROW",
                        help="--check allreduce: also run each repetition with straggler_rounds = false, "
                             "interleaved, for the rounds' added time; in the rows named (none named: every row)")
    parser.add_argument("--out", help="JSON path (default bench/results/straggler.json, or straggler-allreduce.json)")
    args = parser.parse_args()
    if args.check == "allreduce" and args.compare_old:
        parser.error("--compare-old is for --check iperf3; use --before with --check allreduce")
    if args.check == "iperf3" and args.before is not None:
        parser.error("--before is for --check allreduce; use --compare-old with --check iperf3")
    require_netcluster()
    secs = "iperf3_s" if args.check == "iperf3" else "check_s"
    name_json = "straggler" if args.check == "iperf3" else "straggler-allreduce"
    rows: List[Dict[str, Any]] = []
    for n_hosts in args.hosts:
        with tempfile.TemporaryDirectory() as tmp, NetCluster(n_hosts) as cluster:
            old_config = Path(tmp) / "old.toml"
            old_config.write_text(OLD_CONFIG if args.check == "iperf3" else BEFORE_CONFIG)
            for name in args.rows:
                fraction, jitter = ROWS[name]
                reps, old_reps = [], []
                load_before = os.getloadavg()
                for rep in range(args.reps):
                    slow = cluster.hosts[rep % len(cluster.hosts)].name  # every position: master, ring ends, ...
                    reps.append(one_rep(cluster, Path(tmp) / f"{name}-{rep}", slow, fraction, args.base_mbit, jitter,
                                        check=args.check))
                    if (args.compare_old and name == "clean") or (args.before is not None
                                                                  and (not args.before or name in args.before)):
                        old_reps.append(one_rep(cluster, Path(tmp) / f"old-{rep}", slow, fraction, args.base_mbit,
                                                jitter, old_config, check=args.check))
                slowed = fraction < 1.0
                # Unslowed too: how far one host's own median strays from the others' (the noise floor).
                ratios = [r["measured_ratio"] for r in reps if r["measured_ratio"]]
                row = {"hosts": n_hosts, "row": name, "fraction": fraction, "jitter": jitter, "reps": reps,
                       "detected": sum(r["status"][r["slow"]] in NAMED for r in reps) if slowed else None,
                       "warn": sum(r["status"][r["slow"]] == "warn" for r in reps) if slowed else 0,
                       "fail": sum(r["status"][r["slow"]] == "fail" for r in reps) if slowed else 0,
                       # Without a slowed host, a named "slow" host is a false positive too.
                       "false_positives": sum(len(r["false_positives"])
                                              + (0 if slowed else r["status"][r["slow"]] in NAMED) for r in reps),
                       "errors": sum(len(r["errors"]) for r in reps),
                       "measured_ratio": median(ratios), "ratio_min": min(ratios, default=None),
                       "ratio_max": max(ratios, default=None),
                       secs: median([r[secs] for r in reps if r[secs]]),
                       "load_before": [round(x, 2) for x in load_before],
                       "load_after": [round(x, 2) for x in os.getloadavg()]}
                if args.check == "allreduce":
                    row["stragglers_s"] = median([r["stragglers_s"] for r in reps if r["stragglers_s"]])
                    # The slow host said on weak evidence (not named), and any other host said so.
                    row["said_weak"] = sum(r["slow"] in (r.get("unsure") or []) for r in reps) if slowed else None
                    row["others_said_weak"] = sum(
                        len([h for h in r.get("unsure") or [] if h != r["slow"] or not slowed]) for r in reps)
                if old_reps:
                    row["old_reps"] = old_reps
                    row["old_" + secs] = median([r[secs] for r in old_reps if r[secs]])
                    # Without the rounds the all-reduce names no straggler (busbw is not flagged without
                    # --min-busbw): the old false positives are those of the cluster row's own judgement.
                    row["old_false_positives"] = sum(len(r["false_positives"]) + (0 if slowed else
                                                                                  r["status"][r["slow"]] in NAMED)
                                                     for r in old_reps)
                    if args.check == "allreduce":
                        row["added_ratio"] = row[secs] / row["old_" + secs] if row["old_" + secs] else None
                rows.append(row)
                # Written after every row, so a killed bench still leaves the rows it finished.
                write_json(name_json, {"hosts": args.hosts, "base_mbit": args.base_mbit, "reps": args.reps,
                                       "checks": CHECKS[args.check], "rows": rows, "partial": True}, args.out)
                found = "n/a" if row["detected"] is None else f"{row['detected']}/{args.reps}"
                print(f"{n_hosts} hosts, {name}: detected {found}, false positives {row['false_positives']}",
                      file=sys.stderr)
    n = args.reps
    extra = ["stragglers_s", "added_ratio", "said_weak", "others_said_weak"] if args.check == "allreduce" else []
    print(table(["hosts", "row", "detected", "warn", "fail", "false_pos", "errors", "measured_ratio", "min", "max",
                 secs, "old_" + secs, *extra, "load_1m"],
                [[r["hosts"], r["row"], "n/a" if r["detected"] is None else f"{r['detected']}/{n}", r["warn"],
                  r["fail"], r["false_positives"], r["errors"], r["measured_ratio"], r["ratio_min"], r["ratio_max"],
                  r[secs], r.get("old_" + secs, "-"), *[r.get(k, "-") for k in extra],
                  f"{r['load_before'][0]:.1f}-{r['load_after'][0]:.1f}"] for r in rows]))
    write_json(name_json, {"hosts": args.hosts, "base_mbit": args.base_mbit, "reps": n, "checks": CHECKS[args.check],
                           "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
