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

--startup measures only what a host pays before the agent can take a request: from the agent's command being
started (`ssh exec`, or a local process) to its hello, against `python3 -c pass` started the same way on the same
host (to its exit), interleaved, the median of --reps (at least 20) of each; locally (Agent over LocalTransport)
and on one namespace host over SSH (the channel and the login shell are in both); and, locally, the CPU of each
(an agent to its exit, its imports after the hello included). --against COMMIT adds that commit's agent,
started the same way in the same rounds. Written to bench/results/agent-startup.json with the
commit it measured:

    python3 bench/agent_overhead.py --startup --reps 30 --against 74db874

Sample output:

         python  ssh_connect_ms  exec_true_ms  agent_noop_ms  python_check_ms  host_checks_ms  first_result_s  run_s
    job (torch)           68.43        190.00         262.27          1592.13         3712.68            9.53  10.23
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, ROOT, NetCluster, checkout, median, require_netcluster, table, write_json  # noqa: E402

from preflight import checks as registry  # noqa: E402
from preflight.hostside.agent import BOOTSTRAP  # noqa: E402
from preflight.remote import Agent, _Session, serve_input  # noqa: E402
from preflight.transport import LocalTransport, SSHOptions, SSHTransport, Transport  # noqa: E402

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


def _commit() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "preflight"], capture_output=True,
                           text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _old_agent(ref: str, into: Path) -> tuple:
    """An older commit's agent: its argv's BOOTSTRAP and the stdin it is started with, from its own code."""
    code = checkout(ref, into / ref)
    probe = ("import json, sys; from preflight.hostside.agent import BOOTSTRAP; from preflight.remote import "
             "serve_input; sys.stdout.buffer.write(json.dumps(BOOTSTRAP).encode() + b'\\n' + serve_input())")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(code)!r}); {probe}"],
                         capture_output=True, check=True).stdout
    bootstrap, _, stdin = out.partition(b"\n")
    return json.loads(bootstrap), stdin


def _hello_s(transport: Transport, argv: List[str], stdin: bytes) -> float:
    """From the agent's command being started to its hello frame read back (the coordinator's own _Session)."""
    start = time.monotonic()
    session = _Session(transport, argv, transport.start(argv, stdin, keep_stdin_open=True))
    hello = session.wait_ready(60)
    took = time.monotonic() - start
    session.close()
    if hello is None:
        sys.exit(f"no hello from {argv[0]} on {getattr(transport, 'name', '?')}")
    return took


def _cpu_ms(argv: List[str], stdin: Optional[bytes]) -> float:
    """CPU (user + system) of one local process: python -c pass to its exit, or an agent from its start through its
    hello to its exit when its stdin closes (its imports after the hello included: what the host pays in all)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.flush()
        if not proc.stdout.readline().startswith(b"@@PF 0 h "):
            sys.exit(f"no hello from {argv[0]}")
    proc.stdin.close()
    proc.wait(60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000


def startup_cpu(python: str, reps: int, old: Optional[tuple]) -> Dict[str, Any]:
    """The hosts' CPU per start, locally, interleaved as startup() is: what a shared-core bench's wall time follows."""
    tokens = (f"preflight-startup-cpu-{n}" for n in itertools.count())
    kinds = {"cpu_python_pass": lambda: _cpu_ms([python, "-c", "pass"], None),
             "cpu_agent": lambda: _cpu_ms([python, "-c", BOOTSTRAP, next(tokens)], serve_input())}
    if old is not None:
        kinds["cpu_old_agent"] = lambda: _cpu_ms([python, "-c", old[0], next(tokens)], old[1])
    samples: Dict[str, List[float]] = {k: [] for k in kinds}
    for _ in range(reps):
        for name, run in kinds.items():
            samples[name].append(run())
    return {f"{k}_ms": round(median(v), 1) for k, v in samples.items()}


def startup(transport: Transport, python: str, reps: int, old: Optional[tuple]) -> Dict[str, Any]:
    """Interleaved rounds: python -c pass, this agent's hello[, the older commit's hello], order rotated."""
    # A token per agent: a closing agent reaps the processes with its token whose environment is its own, and two
    # agents started one after the other by this process have the same environment.
    tokens = (f"preflight-startup-{n}" for n in itertools.count())
    kinds = {"python_pass": lambda: transport.run([python, "-c", "pass"], timeout=60).duration,
             "agent_hello": lambda: _hello_s(transport, [python, "-c", BOOTSTRAP, next(tokens)], serve_input())}
    if old is not None:
        kinds["old_agent_hello"] = lambda: _hello_s(transport, [python, "-c", old[0], next(tokens)], old[1])
    samples: Dict[str, List[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for rep in range(reps + 2):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            took = kinds[name]()
            if rep >= 2:  # two warm-up rounds: the page cache, the SSH connection's first channels
                samples[name].append(took)
    row: Dict[str, Any] = {f"{k}_ms": round(median(v) * 1000, 1) for k, v in samples.items()}
    row["hello_vs_pass"] = round(median(samples["agent_hello"]) / median(samples["python_pass"]), 2)
    if old is not None:
        row["old_hello_vs_pass"] = round(median(samples["old_agent_hello"]) / median(samples["python_pass"]), 2)
    row["samples_ms"] = {k: [round(x * 1000, 1) for x in v] for k, v in samples.items()}
    return row


def main_startup(args: argparse.Namespace) -> int:
    if args.reps < 20:
        sys.exit("--startup needs --reps 20 or more (medians of a loaded machine)")
    require_netcluster()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = _old_agent(args.against, Path(tmp)) if args.against else None
        local = LocalTransport()
        rows.append(dict(where="local process", **startup(local, sys.executable, args.reps, old)))
        rows[-1].update(startup_cpu(sys.executable, args.reps, old))
        with NetCluster(1) as cluster:
            host = cluster.hosts[0].name
            transport = SSHTransport(host, SSHOptions(key=str(cluster.user_key), config_path=str(cluster.ssh_config),
                                                      known_hosts=str(cluster.known_hosts)))
            transport.connect()
            try:
                rows.append(dict(where=f"namespace host {host} (ssh)",
                                 **startup(transport, sys.executable, args.reps, old)))
            finally:
                transport.close()
    cols = ["python_pass_ms", "agent_hello_ms", "hello_vs_pass"]
    if old is not None:
        cols += ["old_agent_hello_ms", "old_hello_vs_pass"]
    print(table(["where", *cols], [[r["where"], *(r[c] for c in cols)] for r in rows]))
    cpu = [k for k in rows[0] if k.startswith("cpu_")]
    print("\nlocal, CPU ms per start (user + system, to exit): " + ", ".join(f"{k[4:-3]} {rows[0][k]}" for k in cpu))
    load = Path("/proc/loadavg").read_text().split()[:3]
    write_json("agent-startup", {"commit": _commit(), "against": args.against, "reps": args.reps,
                                 "python": sys.executable, "load_after": load, "rows": rows}, args.out)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="JSON path (default bench/results/agent_overhead.json)")
    parser.add_argument("--startup", action="store_true", help="only the agent's start-up against python -c pass")
    parser.add_argument("--against", help="with --startup: an older commit's agent in the same rounds")
    args = parser.parse_args()
    if args.startup:
        return main_startup(args)
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
    cols = ["ssh_connect_ms", "exec_true_ms", "agent_noop_ms", "python_check_ms", "host_checks_ms", "first_result_s",
            "run_s"]
    print(table(["python", *cols], [[r["python"], *(r[c] for c in cols)] for r in rows]))
    print(f"\nhost checks: {', '.join(HOST_CHECKS)}")
    for r in rows:
        slow = sorted(r["per_check_s (last)"].items(), key=lambda kv: -(kv[1] or 0))
        print(f"{r['python']}: " + ", ".join(f"{k} {v:.2f}s" for k, v in slow if v))
    write_json("agent_overhead", {"host_checks": HOST_CHECKS, "reps": args.reps, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
