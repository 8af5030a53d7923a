"""Benchmark: wall time of the cross-host checks for 2, 4, 8 and 16 namespace hosts.

Builds a real namespace cluster per size (tests/netcluster.py: real sshd per host), runs the real CLI with
the cross-host checks, and prints a table of the total wall time and each check's own time (from the JSON
report), then writes the figures as JSON. Needs root. Run from the repository root:

    python3 bench/cross_host.py                       # sizes 2 4 8 16
    python3 bench/cross_host.py --sizes 2 4 --checks ports,iperf3 --out bench/results/cross_host.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.netcluster import NetCluster  # noqa: E402

DEFAULT_CHECKS = "interfaces,ports,launcher_ssh,iperf3,allreduce"


def run_once(n: int, checks: str, workdir: Path) -> dict:
    with NetCluster(n) as cluster:
        report = workdir / f"report-{n}.json"
        argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(workdir / f"hf{n}")),
                "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key",
                str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--checks", checks,
                "--json", str(report), "-q"]
        start = time.monotonic()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              stdin=subprocess.DEVNULL)
        wall = time.monotonic() - start
    data = json.loads(report.read_text())
    per_check: dict = {}
    for r in data["results"]:
        # Cluster checks carry their whole duration on each of their cells: take the max, not the sum.
        per_check[r["check"]] = max(per_check.get(r["check"], 0.0), r["duration_s"])
    return {"hosts": n, "wall_s": round(wall, 2), "exit_code": proc.returncode, "per_check_s": per_check,
            "summary": data["summary"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--checks", default=DEFAULT_CHECKS)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cross_host.json"))
    args = parser.parse_args()
    reason = NetCluster.unavailable_reason()
    if reason:
        print(f"cannot build namespace hosts here: {reason}", file=sys.stderr)
        return 2
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checks": checks, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
