"""Benchmark: wall time of the cross-host checks for 2, 4, 8 and 16 namespace hosts.

Builds a real namespace cluster per size (tests/netcluster.py: real sshd per host), runs the real CLI with
the cross-host checks, and prints a table of the total wall time and each check's own time (from the JSON
report), then writes the figures as JSON. Needs root. Run from the repository root:

    python3 bench/cross_host.py                       # sizes 2 4 8 16
    python3 bench/cross_host.py --sizes 2 4 --checks ports,iperf3 --out bench/results/cross_host.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, preflight, require_netcluster, write_json  # noqa: E402

DEFAULT_CHECKS = "interfaces,ports,launcher_ssh,iperf3,allreduce"


def run_once(n: int, checks: str, workdir: Path) -> dict:
    with NetCluster(n) as cluster:
        run = preflight(cluster, workdir / f"n{n}", "--checks", checks)
    return {"hosts": n, "wall_s": round(run.wall_s, 2), "exit_code": run.exit_code,
            "per_check_s": run.check_seconds(), "summary": run.report.get("summary", {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--checks", default=DEFAULT_CHECKS)
    parser.add_argument("--out", help="JSON path (default bench/results/cross_host.json)")
    args = parser.parse_args()
    require_netcluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            rows.append(run_once(n, args.checks, Path(tmp)))
            print(f"{n} hosts done in {rows[-1]['wall_s']} s", file=sys.stderr)
    checks = args.checks.split(",")
    print(f"{'hosts':>5} {'wall s':>7} " + " ".join(f"{c:>12}" for c in checks) + "  exit")
    for row in rows:
        print(f"{row['hosts']:>5} {row['wall_s']:>7.1f} "
              + " ".join(f"{row['per_check_s'].get(c, float('nan')):>12.1f}" for c in checks)
              + f"  {row['exit_code']}")
    write_json("cross_host", {"checks": checks, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
