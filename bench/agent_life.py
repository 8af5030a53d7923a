"""Benchmark: what one host pays for the agent's whole life in bench/scale.py's host-light run, against pdsh's work.

bench/scale.py --versus runs `preflight run --checks nvme` (connect, the host's agent, the nvme check with no path,
the run's reap, exit) against `pdsh ... python -c 'import platform'` on the same hosts. On one machine every
simulated host shares its cores, so what each host's processes cost decides the wall. This bench measures that
cost per process on a few namespace hosts (tests/netcluster.py) over real SSH: each interpreter is started by a
wrapper under /usr/bin/time (given as preflight's --python, and as the command pdsh would run), which appends its
user and system CPU, minor page faults and peak RSS to a log outside the hosts' private /tmp. The agent's figures
include the workers it forked and reaped (the nvme collect, the reap).

--foreign N first starts N sleeping processes, each in a UTS namespace of its own, as the other hosts' sshd and
agents are in a 1,000-host scale run: the simulated hosts share one PID namespace, so each host's end-of-run process
scan (hostside/proc.py) reads a link for every process of the machine, where a real host sees only its own.
Needs root:

    python3 bench/agent_life.py                                  # 8 hosts, 3 reps, 0 and 4,000 foreign processes
    python3 bench/agent_life.py --hosts 8 --foreign 0 4000 --out bench/results/agent-life.json

Sample output (ms of CPU per process, the median rep's mean over the hosts):

    foreign  process                      user_ms  sys_ms  cpu_ms  minflt  maxrss_mb
          0  agent (nvme run, to exit)       54.0    16.0    70.0    4866       15.3
          0  python -c 'import platform'     19.0    11.0    30.0    1350       10.6
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import NetCluster, preflight, require_netcluster, table, write_json  # noqa: E402

PROCESSES = ("agent (nvme run, to exit)", "python -c 'import platform'")


def _wrapper(where: Path, log: Path) -> Path:
    """A --python that runs this interpreter under /usr/bin/time, appending "user sys minflt maxrss_kb" to log."""
    path = where / "python-timed"
    path.write_text(f"#!/bin/sh\nexec /usr/bin/time -a -o {log} -f '%U %S %R %M' {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return path


def _read(log: Path) -> Dict[str, float]:
    """The mean over the logged processes, in ms and MB."""
    rows = [[float(x) for x in line.split()] for line in log.read_text().splitlines() if line[:1].isdigit()]
    if not rows:
        raise SystemExit(f"no process was logged in {log}: did the wrapper run on the hosts?")
    mean = [sum(r[i] for r in rows) / len(rows) for i in range(4)]
    return {"procs": len(rows), "user_ms": 1000 * mean[0], "sys_ms": 1000 * mean[1],
            "cpu_ms": 1000 * (mean[0] + mean[1]), "minflt": mean[2], "maxrss_mb": mean[3] / 1024}


def _one_rep(cluster: NetCluster, wrapper: Path, log: Path, work: Path) -> Dict[str, Dict[str, float]]:
    out = {}
    log.write_text("")
    # common.preflight's own --python is this interpreter: the later one, the wrapper, is the one the run takes.
    result = preflight(cluster, work, "--python", wrapper, "--checks", "nvme", timeout=600)
    if result.exit_code != 0:
        raise SystemExit(f"preflight exited {result.exit_code}: {result.stderr[-1000:]}")
    out[PROCESSES[0]] = _read(log)
    log.write_text("")
    for host in cluster.hosts:  # as pdsh runs it: one ssh exec per host
        subprocess.run(["ssh", "-F", str(cluster.ssh_config), "-i", str(cluster.user_key),
                        "-o", f"UserKnownHostsFile={cluster.known_hosts}", host.name,
                        f"{wrapper} -c 'import platform'"], capture_output=True, timeout=60, check=True)
    out[PROCESSES[1]] = _read(log)
    return out


def run(hosts: int, foreign: List[int], reps: int) -> List[Dict[str, object]]:
    rows = []
    # Outside /tmp: each host mounts a private tmpfs there, and the wrapper must be seen by every host.
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="agent-life-") as tmp, NetCluster(hosts) as cluster:
        where = Path(tmp)
        os.chmod(where, 0o755)
        log = where / "rusage.log"
        wrapper = _wrapper(where, log)
        for n in foreign:
            sleepers = [subprocess.Popen(["unshare", "--uts", "sleep", "3600"]) for _ in range(n)]
            try:
                samples = [_one_rep(cluster, wrapper, log, where) for _ in range(reps)]
            finally:
                for s in sleepers:
                    s.kill()
                for s in sleepers:
                    s.wait()
            for what in PROCESSES:
                by_cpu = sorted((s[what] for s in samples), key=lambda r: r["cpu_ms"])
                row = dict(by_cpu[len(by_cpu) // 2])  # the median rep, whole
                row.update(foreign=n, process=what, cpu_ms_reps=[round(r["cpu_ms"], 1) for r in by_cpu])
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--foreign", type=int, nargs="+", default=[0, 4000])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="JSON path (default bench/results/agent-life.json)")
    args = parser.parse_args()
    require_netcluster()
    rows = run(args.hosts, args.foreign, args.reps)
    print(table(["foreign", "process", "user_ms", "sys_ms", "cpu_ms", "minflt", "maxrss_mb"],
                [[r["foreign"], r["process"], r["user_ms"], r["sys_ms"], r["cpu_ms"], round(r["minflt"]),
                  r["maxrss_mb"]] for r in rows]))
    agent = {r["foreign"]: r["cpu_ms"] for r in rows if r["process"] == PROCESSES[0]}
    plain = {r["foreign"]: r["cpu_ms"] for r in rows if r["process"] == PROCESSES[1]}
    ratios = {n: round(agent[n] / plain[n], 2) for n in agent if plain.get(n)}
    print("agent / python -c 'import platform', CPU per process: "
          + ", ".join(f"{ratios[n]}x with {n} foreign processes" for n in ratios))
    write_json("agent-life", {"hosts": args.hosts, "reps": args.reps, "rows": rows, "ratio_by_foreign": ratios},
               args.out)


if __name__ == "__main__":
    main()
