"""Benchmark: how long a default run takes with one firewalled host, against the same cluster healthy.

Builds one namespace cluster (real sshd per host), runs a default `preflight run` (every default check) on it
healthy, then with one host dropping new inbound TCP above 1023 (tests/netcluster.py `firewall`: SSH and
established flows still pass, as a host firewall that forgot NCCL's ports does), and prints both wall times,
their ratio and the diagnosis of each run (which checks name which host). The target of issue 14 is a ratio of
at most 1.5 with the firewalled host named. `--compare-old` adds a third run with `[allreduce]
exclude_unreachable = false` (the all-reduce waits out its init timeout, then localizes pairwise). Needs root:

    python3 bench/failfast.py                           # 4 hosts, node04 firewalled
    python3 bench/failfast.py --hosts 4 --firewall node01 --compare-old --out /tmp/failfast.json

Sample output:

          run  wall_s  ratio  exit  named (host: checks)
      healthy    31.2   1.00     0  -
    firewall     38.0   1.22     1  node04: allreduce,iperf3,ports
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, Run, preflight, require_netcluster, table, write_json  # noqa: E402

OLD_CONFIG = "[allreduce]\nexclude_unreachable = false\n"


def named(run: Run) -> Dict[str, List[str]]:
    """{host: [checks that FAIL or WARN it]}, the cluster row left out: the run's diagnosis."""
    out: Dict[str, List[str]] = {}
    for r in run.report.get("results", []):
        if r["host"] != "*" and r["status"] in ("fail", "warn"):
            out.setdefault(r["host"], []).append(r["check"])
    return {h: sorted(c) for h, c in sorted(out.items())}


def summarize(label: str, run: Run) -> Dict[str, Any]:
    return {"run": label, "wall_s": run.wall_s, "exit_code": run.exit_code, "named": named(run),
            "per_check_s": run.check_seconds(), "summary": run.report.get("summary", {}),
            # Every WARN and FAIL line, so that a host named in the healthy run can be read, not only counted.
            "lines": [f"{r['host']} {r['check']} {r['status']}: {r['message'][:400]}"
                      for r in run.report.get("results", []) if r["status"] in ("fail", "warn")],
            "allreduce": next((r["message"][:400] for r in run.report.get("results", [])
                               if r["check"] == "allreduce" and r["host"] == "*"), None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--firewall", default=None, help="host to firewall (default: the last one)")
    parser.add_argument("--compare-old", action="store_true",
                        help="also time the firewalled run without fail-fast (exclude_unreachable = false)")
    parser.add_argument("--out", help="JSON path (default bench/results/failfast.json)")
    args = parser.parse_args()
    require_netcluster()
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, NetCluster(args.hosts) as cluster:
        bad = args.firewall or cluster.hosts[-1].name
        rows.append(summarize("healthy", preflight(cluster, Path(tmp) / "healthy")))
        print(f"healthy: {rows[-1]['wall_s']} s", file=sys.stderr)
        cluster.firewall(bad)
        try:
            rows.append(summarize("firewalled", preflight(cluster, Path(tmp) / "firewalled")))
            print(f"firewalled: {rows[-1]['wall_s']} s", file=sys.stderr)
            if args.compare_old:
                config = Path(tmp) / "old.toml"
                config.write_text(OLD_CONFIG)
                rows.append(summarize("firewalled, no fail-fast",
                                      preflight(cluster, Path(tmp) / "old", "--config", config)))
                print(f"old: {rows[-1]['wall_s']} s", file=sys.stderr)
        finally:
            cluster.unfirewall(bad)
    healthy = rows[0]["wall_s"]
    for row in rows:
        row["ratio"] = round(row["wall_s"] / healthy, 3) if healthy else None
    print(table(["run", "wall_s", "ratio", "exit", "named (host: checks)"],
                [[r["run"], r["wall_s"], r["ratio"], r["exit_code"],
                  "; ".join(f"{h}: {','.join(c)}" for h, c in r["named"].items()) or "-"] for r in rows]))
    fw = rows[1]
    # The diagnosis: what the firewall added to the healthy run's findings names the firewalled host only.
    before = {(h, c) for h, cs in rows[0]["named"].items() for c in cs}
    added = {(h, c) for h, cs in fw["named"].items() for c in cs} - before
    only_bad = bool(added) and {h for h, _ in added} == {bad}
    ok = fw["ratio"] is not None and fw["ratio"] <= 1.5 and only_bad
    print(f"firewalled host {bad}: ratio {fw['ratio']} (target <= 1.5); newly named: "
          f"{sorted(added)}; only {bad}: {only_bad}")
    write_json("failfast", {"hosts": args.hosts, "firewalled": bad, "rows": rows, "target_met": ok}, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
