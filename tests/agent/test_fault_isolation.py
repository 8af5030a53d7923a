"""A fault stays on its host (issue 26 item 7): one host's dead sshd during the host checks leaves the other hosts'
cells exactly as in a healthy run, on namespace hosts over real SSH; and an agent whose lifeline closes reaps its
own processes only, never those of another agent of the same run on the same machine.

The namespace hosts share this machine's PID namespace, as one machine listed under two names does: before, the
agent of the host whose sshd died reaped every process with the run's token, the other hosts' agents in the middle
of their host checks among them (8 "not run: host checks exited with rc=-1" cells on the healthy hosts).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from preflight.hostside import agent

from tests.netcluster import _processes_in

ROOT = Path(__file__).resolve().parents[2]
# Host checks that take seconds (ds_report imports DeepSpeed), then a cluster check that needs every agent.
CHECKS = "python,ds_report,libaio,memlock,interfaces,clock"
HOST_CHECKS = ("python", "ds_report", "libaio", "memlock", "interfaces")


def _argv(cluster, hostfile, report):
    return [sys.executable, "-m", "preflight", "run", "--python", sys.executable,
            "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--hostfile", str(hostfile), "--checks", CHECKS,
            "--connect-timeout", "5", "--json", str(report)]


def _cells(report: Path):
    return {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _agents_and_workers(host):
    """({agent pid}, {worker pid}) of the run in the host's namespace: agents are the interpreters running the
    agent's BOOTSTRAP; a worker is one forked by an agent (its parent is an agent)."""
    procs = _processes_in([host.ns])
    # Interpreters only: a login shell that runs the command keeps the BOOTSTRAP in its argv too.
    agents = {pid for pid in procs if b"preflight.hostside.agent" in _cmdline(pid) and _comm(pid).startswith("python")}
    roots = {pid for pid in agents if procs[pid] not in agents}
    return roots, {pid for pid in agents if procs[pid] in roots}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_killing_one_hosts_sshd_during_the_host_checks_leaves_the_other_hosts_as_in_a_healthy_run(
        netcluster_factory, tmp_path):
    cluster = netcluster_factory(n=3)
    hostfile = cluster.hostfile(tmp_path / "hostfile")
    healthy_report, faulty_report = tmp_path / "healthy.json", tmp_path / "faulty.json"
    healthy = subprocess.run(_argv(cluster, hostfile, healthy_report), cwd=ROOT, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    healthy_cells = _cells(healthy_report)
    node01, node02, node03 = cluster.hosts

    proc = subprocess.Popen(_argv(cluster, hostfile, faulty_report), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    stopped = []
    workers = {}

    def freeze_healthy_then_find_node02():
        # The healthy hosts' requests stay in flight, frozen the moment their collect worker is seen, while node02's
        # agent meets its end, whatever the machine's speed (SIGKILL still reaches them, as the old reap's did).
        for host in (node01, node03):
            if host.name not in workers and (found := _agents_and_workers(host)[1]):
                for pid in found:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                workers[host.name] = found
        return len(workers) == 2 and _agents_and_workers(node02)[1]

    try:
        # Every host's host checks in flight: each agent has forked its collect worker.
        _wait(freeze_healthy_then_find_node02, 120, "every host's collect worker")
        for host in (node01, node03):
            assert all(_cmdline(pid) for pid in workers[host.name]), f"{host.name}'s host checks ended before the test"
        dying_agents = _agents_and_workers(node02)[0]
        sshd = [pid for pid in _processes_in([node02.ns]) if _comm(pid).startswith("sshd")]
        assert sshd and dying_agents
        for pid in sshd:  # the listener and the run's session: the agent itself lives on and sees its lifeline close
            os.kill(pid, signal.SIGKILL)
        # node02's agent has stopped its worker, reaped, and exited: whatever it does to others, it has done.
        _wait(lambda: not any(_cmdline(pid) for pid in dying_agents), 60, "node02's agent to exit")
        for host in (node01, node03):
            assert all(_cmdline(pid) for pid in workers[host.name]), f"{host.name}'s collect worker was killed"
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in out + err, out + err
    assert proc.returncode == 1, out + err

    cells = _cells(faulty_report)
    for host in ("node01", "node03"):
        statuses = {c: cells[(host, c)]["status"] for c in ("ssh",) + HOST_CHECKS + ("clock",)}
        assert statuses == {c: healthy_cells[(host, c)]["status"] for c in statuses}, (host, statuses)
        for check in HOST_CHECKS:
            assert "not run" not in cells[(host, check)]["message"], cells[(host, check)]
    # The fault did land on node02, and only there.
    assert cells[("node02", "ssh")]["status"] == "pass"  # it was up when the run connected
    assert all(cells[("node02", c)]["status"] == "error" for c in HOST_CHECKS), \
        {c: cells[("node02", c)] for c in HOST_CHECKS}


_FAKE_AGENT = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[4])
from preflight.hostside import agent
token, me = sys.argv[1], sys.argv[2]
os.environ[agent.RUN_ENV], os.environ[agent.AGENT_ENV] = token, me  # as agent.main() marks a real one
worker = os.fork()
if worker == 0:  # a forked worker: the agent's argv and environment
    time.sleep(120)
    os._exit(0)
command = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(json.dumps({"agent": os.getpid(), "worker": worker, "command": command.pid}), flush=True)
if sys.stdin.readline().strip() == "reap":
    print(json.dumps(agent.reap({"token": token, "agent": me}, None)), flush=True)
sys.stdin.readline()
"""


def test_an_agents_own_reap_spares_another_agent_of_the_same_run_on_the_same_machine():
    """Two agents of one run on one machine (two names of it, or namespace hosts): when one's lifeline closes it
    reaps its worker and the commands it started, and leaves the other agent, its worker and its command alone."""
    token = "preflight-test-" + uuid.uuid4().hex[:12]

    def start(name: str) -> subprocess.Popen:
        # Each agent's connection has its own environment (sshd's SSH_CONNECTION names the client's port).
        env = dict(os.environ, SSH_CONNECTION=f"198.18.0.254 {40000 + len(name)} 198.18.0.1 22")
        return subprocess.Popen([sys.executable, "-c", _FAKE_AGENT, token, f"{name}-{uuid.uuid4().hex[:8]}",
                                 "x", str(ROOT)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, start_new_session=True)

    first, second = start("a"), start("bb")
    try:
        mine = json.loads(first.stdout.readline())
        other = json.loads(second.stdout.readline())
        first.stdin.write("reap\n")
        first.stdin.flush()
        killed = json.loads(first.stdout.readline())["killed"]
        assert mine["worker"] in killed and mine["command"] in killed
        assert not {other["agent"], other["worker"], other["command"]} & set(killed), (killed, other)
        for pid in (other["agent"], other["worker"], other["command"]):
            os.kill(pid, 0)  # alive
        assert mine["agent"] not in killed  # never itself
        # The run-wide reap (the coordinator's last resort, by token) still takes everything of the run.
        everything = agent.reap({"token": token}, None)["killed"]  # type: ignore[arg-type]
        assert {other["agent"], other["worker"], other["command"]} <= set(everything)
    finally:
        for p in (first, second):
            p.kill()
            p.wait(10)
