"""Benchmark: what the agent costs before any check runs, and how soon the first host's results arrive.

Two interpreters on the hosts: the job's environment (torch + DeepSpeed installed, this Python) and a bare
venv of the same Python without them (created under bench/results/, visible to the namespace hosts). For
each it measures, against one namespace host over real SSH (tests/netcluster.py):

- ssh_connect_ms: TCP + SSH handshake + auth (paramiko), median of --reps;
- exec_true_ms: `true` run over the open connection: a channel, and the login shell's start-up (bash reads
  ~/.bashrc for SSH commands: a `pyenv init` or `conda init` there costs every call 100 ms or more);
- agent_noop_ms: one agent call that runs no check: start the interpreter, unpack the checks zip from stdin,
  answer (the fixed cost of every agent call);
- python_check_ms: the agent running only the `python` check (imports torch when it is there);
- host_checks_ms: the agent running every default host check once;
- first_result_s: from spawning `preflight run` (4 hosts, default host checks only) to the progress line
  of the first host's results, read live from its stderr, next to the whole run's wall time.

    python3 bench/agent_overhead.py            # --reps 5
    python3 bench/agent_overhead.py --reps 3 --out /tmp/agent.json

Sample output:

         python  ssh_connect_ms  exec_true_ms  agent_noop_ms  python_check_ms  host_checks_ms  first_result_s  run_s
    job (torch)           68.43        190.00         262.27          1592.13         3712.68            9.53  10.23
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, ROOT, NetCluster, median, require_netcluster, table, write_json  # noqa: E402

from preflight import checks as registry  # noqa: E402
from preflight.remote import Agent  # noqa: E402
from preflight.transport import SSHOptions, SSHTransport  # noqa: E402

HOST_CHECKS = [n for n in registry.ORDER if registry.load(n).SPEC.scope == "host" and registry.load(n).SPEC.default]
FIRST_RESULT = re.compile(r"host checks: 1/\d+")
TIMEOUT_S = 300


def bare_venv() -> Path:
    """A venv of this Python without torch/DeepSpeed (the hosts see the whole filesystem but /tmp)."""
    venv = RESULTS / "venv-bare"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        sys.exit(f"{venv} can import torch; remove it and rerun")
    return python


def api_timings(cluster: NetCluster, python: str, reps: int) -> Dict[str, float]:
    host = cluster.hosts[0].name
    opts = SSHOptions(key=str(cluster.user_key), config_path=str(cluster.ssh_config),
                      known_hosts=str(cluster.known_hosts))
    connect: List[float] = []
    bare_exec: List[float] = []
    noop: List[float] = []
    one: List[float] = []
    full: List[float] = []
    per_check: Dict[str, float] = {}
    params = {"host": host, "slots": 1, "gpus": None, "master": cluster.hosts[0].addresses[0],
              "master_name": host, "hosts": [cluster.hosts[0].addresses[0]], "nvme_paths": []}
    for _ in range(reps):
        transport = SSHTransport(host, opts)
        start = time.monotonic()
        transport.connect()
        connect.append(time.monotonic() - start)
        try:
            start = time.monotonic()
            transport.run(["true"], timeout=30)
            bare_exec.append(time.monotonic() - start)
            agent = Agent(transport, python, "preflight-bench")
            for names, sink in (([], noop), (["python"], one), (HOST_CHECKS, full)):
                start = time.monotonic()
                out = agent.collect(names, params, 120)
                sink.append(time.monotonic() - start)
                if names == HOST_CHECKS:
                    per_check = {k: v.get("duration_s") for k, v in out.items()}
                errors = {k: v["error"] for k, v in out.items() if "error" in v}
                if errors:
                    sys.exit(f"agent errors with {python}: {errors}")
        finally:
            transport.close()
    return {"ssh_connect_ms": median(connect) * 1000, "exec_true_ms": median(bare_exec) * 1000,
            "agent_noop_ms": median(noop) * 1000,
            "python_check_ms": median(one) * 1000, "host_checks_ms": median(full) * 1000,
            "per_check_s (last)": per_check}


def first_result(cluster: NetCluster, python: str, workdir: Path) -> Dict[str, float]:
    """Spawn the CLI and stamp the moment its stderr says the first host's host checks are in."""
    hostfile = cluster.hostfile(workdir / "hostfile")
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--python", python,
            "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", ",".join(HOST_CHECKS)]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first = None
    try:
        for line in proc.stderr:
            if first is None and FIRST_RESULT.search(line):
                first = time.monotonic() - start
        proc.wait(TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if first is None:
        sys.exit("the CLI never printed a host's results; run it by hand to see why")
    return {"first_result_s": first, "run_s": time.monotonic() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="JSON path (default bench/results/agent_overhead.json)")
    args = parser.parse_args()
    require_netcluster()
    pythons = {"job (torch)": sys.executable, "bare venv": str(bare_venv())}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, NetCluster(4) as cluster:
        for label, python in pythons.items():
            row = {"python": label, "executable": python}
            row.update(api_timings(cluster, python, args.reps))
            row.update(first_result(cluster, python, Path(tmp)))
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(f"{label}: done", file=sys.stderr)
    cols = ["ssh_connect_ms", "exec_true_ms", "agent_noop_ms", "python_check_ms", "host_checks_ms", "first_result_s", "run_s"]
    print(table(["python", *cols], [[r["python"], *(r[c] for c in cols)] for r in rows]))
    print(f"\nhost checks: {', '.join(HOST_CHECKS)}")
    for r in rows:
        slow = sorted(r["per_check_s (last)"].items(), key=lambda kv: -(kv[1] or 0))
        print(f"{r['python']}: " + ", ".join(f"{k} {v:.2f}s" for k, v in slow if v))
    write_json("agent_overhead", {"host_checks": HOST_CHECKS, "reps": args.reps, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
