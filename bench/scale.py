"""Benchmark: wall time of a default `preflight run` for 1, 4, 16 and 64 namespace hosts, and T(n)/T(1).

Every size gets a fresh namespace cluster (real sshd per host); the run is the real CLI with the default
checks (no --checks), timed from the outside. Besides the wall time, it reports the CPU seconds spent on the
hosts' side (every process in the hosts' namespaces: agents, iperf3, torch ranks) and by the coordinator,
because on one machine all "hosts" share its cores: a run whose hosts need 100 CPU-seconds cannot take less
than 50 s on 2 cores, however parallel the fan-out. `floor_s` is that bound, and `fanout_ratio` compares
T(n) - floor with T(1): what the coordinator adds as hosts are added. Needs root. From the repository root:

    python3 bench/scale.py                      # sizes 1 4 16 64
    python3 bench/scale.py --sizes 1 4 --out /tmp/scale.json
    python3 bench/scale.py --checks libaio,nvme,interfaces,versions,ports,launcher_ssh --out bench/results/scale-light.json

Sample output:

    hosts  wall_s  ratio  host_cpu_s  coord_cpu_s  floor_s  exit
        1    6.10   1.00        5.20         0.90     2.60     0
       64   90.00  14.75      160.00        12.00    80.00     1
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, preflight, require_netcluster, table, write_json  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
# Checks that cost the hosts little CPU (no torch import, no bulk traffic): what the coordinator's fan-out
# costs by itself, since on one machine the hosts' own work competes with it for the same cores.
LIGHT = "libaio,nvme,interfaces,versions,ports,launcher_ssh"


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (the preflight CLI is one)."""
    t = os.times()
    return t.children_user + t.children_system


def namespace_cpu(cluster: NetCluster) -> float:
    """CPU seconds consumed so far by the live processes in the hosts' namespaces, their dead children included.

    sshd forks a process per session; when a session ends its process is reaped by the host's sshd, whose
    cstime/cutime (fields 16, 17 of /proc/PID/stat) then hold it: the master sshd's own times cover them all.
    """
    total = 0
    for h in cluster.hosts:
        try:
            fields = Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After ")" field 3 (state) is index 0: utime=14, stime=15, cutime=16, cstime=17 -> 11..14.
        total += sum(int(v) for v in fields[11:15])
    return total / TICKS


def measure(n: int, workdir: Path, checks: str) -> dict:
    with NetCluster(n) as cluster:
        cpu0, ns0 = children_cpu(), namespace_cpu(cluster)
        run = preflight(cluster, workdir / f"n{n}", *(["--checks", checks] if checks else []))
        time.sleep(0.5)  # sshd reaps the session processes just after the channels close
        host_cpu = namespace_cpu(cluster) - ns0
        coord_cpu = children_cpu() - cpu0
    summary = run.report.get("summary", {})
    return {"hosts": n, "wall_s": run.wall_s, "exit_code": run.exit_code, "host_cpu_s": round(host_cpu, 2),
            "coordinator_cpu_s": round(coord_cpu, 2), "check_s": run.check_seconds(),
            "summary": {k: summary.get(k) for k in ("pass", "warn", "fail", "skip", "error")},
            "problems": run.problems()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--checks", default="", help="a --checks list instead of the default checks, e.g. the "
                        "host-light set %s" % LIGHT)
    parser.add_argument("--out", help="JSON path (default bench/results/scale.json)")
    args = parser.parse_args()
    require_netcluster()
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            rows.append(measure(n, Path(tmp), args.checks))
            print(f"{n} hosts: {rows[-1]['wall_s']:.1f} s", file=sys.stderr)
    base = rows[0]["wall_s"]
    for row in rows:
        row["ratio"] = round(row["wall_s"] / base, 2)
        # Everything the hosts and the coordinator burn shares this machine's cores.
        row["floor_s"] = round((row["host_cpu_s"] + row["coordinator_cpu_s"]) / cores, 2)
    print(table(["hosts", "wall_s", "ratio", "host_cpu_s", "coord_cpu_s", "floor_s", "exit"],
                [[r["hosts"], r["wall_s"], r["ratio"], r["host_cpu_s"], r["coordinator_cpu_s"], r["floor_s"],
                  r["exit_code"]] for r in rows]))
    checks = sorted({c for r in rows for c in r["check_s"]}, key=lambda c: -max(r["check_s"].get(c, 0) for r in rows))
    print("\nper check (s; cluster checks: their whole time)")
    print(table(["hosts", *checks], [[r["hosts"], *(r["check_s"].get(c, 0.0) for c in checks)] for r in rows]))
    write_json("scale", {"cores": cores, "checks": args.checks or "default", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
