"""agent.reap: the last-resort clean-up finds this run's processes by the token in argv or in the environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from preflight.hostside import agent


def _spawn(argv, env=None) -> subprocess.Popen:
    # A new session, as a daemon that escaped its parent would have: only the scan can find it.
    return subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _stop(*procs: subprocess.Popen) -> None:
    """Whatever the test left running goes (a process reap already killed is only waited for)."""
    for p in procs:
        p.kill()
        p.wait(10)


def test_reap_kills_by_argv_and_by_environment_and_spares_the_rest():
    token = "preflight-test-" + uuid.uuid4().hex[:12]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    by_argv = _spawn(sleeper + [token])
    by_env = _spawn(sleeper, env=dict(os.environ, **{agent.RUN_ENV: token}))
    other_token = _spawn(sleeper, env=dict(os.environ, **{agent.RUN_ENV: token + "-other"}))
    bystander = _spawn(sleeper)
    try:
        killed = agent.reap({"token": token}, None)["killed"]  # type: ignore[arg-type]
        assert by_argv.pid in killed and by_env.pid in killed
        assert by_argv.wait(10) == -9 and by_env.wait(10) == -9
        assert other_token.pid not in killed and bystander.pid not in killed
        assert other_token.poll() is None and bystander.poll() is None
    finally:
        _stop(by_argv, by_env, other_token, bystander)


def test_reap_spares_the_launcher_whose_argv_carries_an_agents_argv():
    """The srun client of a shared step is `srun ... -- PYTHON -c BOOTSTRAP TOKEN`: the run's token is one of its
    words, yet it is no agent. Killing it (a node's reap on the machine that runs srun: a batch script's first
    node) left the step and one agent running for the allocation's lifetime; it must be spared, the agent not."""
    token = "preflight-test-" + uuid.uuid4().hex[:12]
    code = "import time; time.sleep(60)"
    the_agent = _spawn([sys.executable, "-c", code, token])
    launcher = _spawn([sys.executable, "-c", code, "--overlap", "--", sys.executable, "-c", code, token])
    try:
        killed = agent.reap({"token": token}, None)["killed"]  # type: ignore[arg-type]
        assert the_agent.pid in killed and the_agent.wait(10) == -9
        assert launcher.pid not in killed and launcher.poll() is None
    finally:
        _stop(the_agent, launcher)


def test_reap_spares_an_agent_of_the_same_run_in_another_hosts_uts_namespace(monkeypatch):
    """Namespace hosts that share one PID namespace (the Slurm test bed: one slurmd per host) each have their own
    UTS namespace. A node's reap killed the other nodes' agents before they answered their own reap, and the
    shared srun step saw no end of them: 2 runs in 6 waited out the coordinator's 25 s clean-up. Only this host's
    processes go; the control, an agent in this UTS namespace, is killed. And another namespace's processes cost
    the scan one readlink each, no read of their argv or environment (at 1,000 such hosts, the two scans at the
    end of a run cost each host ~100 ms of CPU when they read them all)."""
    read = []
    real_read = agent._read_proc
    monkeypatch.setattr(agent, "_read_proc", lambda path: read.append(path) or real_read(path))
    token = "preflight-test-" + uuid.uuid4().hex[:12]
    code = "import time; time.sleep(60)"
    here = _spawn([sys.executable, "-c", code, token])
    elsewhere = _spawn(["unshare", "--uts", sys.executable, "-c", code, token])
    try:
        deadline = time.monotonic() + 10  # unshare enters the new namespace, then execs the agent: wait for both
        while time.monotonic() < deadline and not _exec_done(elsewhere.pid):
            time.sleep(0.05)
        assert os.readlink(f"/proc/{elsewhere.pid}/ns/uts") != os.readlink("/proc/self/ns/uts")
        other = token + "-other"  # kills nothing here: only what the scans read is looked at
        for params in ({"token": other}, {"token": other, "agent": "1-ab"}):  # run-wide, then an agent's own
            agent.reap(params, None)  # type: ignore[arg-type]
            assert read and not [p for p in read if p.startswith(f"/proc/{elsewhere.pid}/")], read
            read.clear()
        killed = agent.reap({"token": token}, None)["killed"]  # type: ignore[arg-type]
        assert here.pid in killed and here.wait(10) == -9
        assert elsewhere.pid not in killed and elsewhere.poll() is None
    finally:
        _stop(here, elsewhere)


def _exec_done(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().split(b"\0")[1:2] == [b"-c"]


# Runs the agent as `python -c BOOTSTRAP TOKEN` does, with an audit hook that reports each scan of /proc (a reap)
# made by the agent process itself, not by its forked workers.
SCANS = r"""
import sys, os
me = os.getpid()
def hook(event, args):
    if event == "os.listdir" and args and str(args[0]) == "/proc" and os.getpid() == me:
        os.write(2, b"@@SCAN\n")
sys.addaudithook(hook)
exec(compile(BOOTSTRAP, "<bootstrap>", "exec"))
"""


def _frames_until_exit(out, rid: int) -> None:
    while True:
        head = out.readline().split()
        assert head, "the agent ended before answering"
        out.read(int(head[3]))
        if int(head[1]) == rid and head[2] == b"x":
            return


@pytest.mark.parametrize("requests, scans", [
    ([], 1),  # no run-wide reap: the agent's own at its exit
    (["reap"], 0),  # the run's reap ran last (in a worker): nothing is left for the agent's own to find
    (["reap", "collect"], 1),  # a worker started after it: the agent's own reap again
])
def test_the_agents_exit_scans_proc_unless_the_runs_reap_came_last(requests, scans):
    """At a thousand namespace hosts (one /proc for all), each /proc scan cost every host ~10 ms of CPU; the run's
    reap (the coordinator's last request) and the agent's own at its exit found the same processes."""
    from preflight.hostside.agent import BOOTSTRAP
    from preflight.remote import serve_input
    token = "preflight-test-" + uuid.uuid4().hex[:12]
    proc = subprocess.Popen([sys.executable, "-c", SCANS.replace("BOOTSTRAP", repr(BOOTSTRAP)), token],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(serve_input())
        proc.stdin.flush()
        head = proc.stdout.readline().split()
        assert head[2] == b"h", head
        proc.stdout.read(int(head[3]))
        for rid, name in enumerate(requests, 1):
            request = ({"op": "call", "func": "hostside.agent.reap", "params": {"token": token}, "timeout": 10}
                       if name == "reap" else {"op": "collect", "checks": [], "params": {}, "timeout": 10})
            proc.stdin.write(json.dumps(dict(request, id=rid)).encode() + b"\n")
            proc.stdin.flush()
            _frames_until_exit(proc.stdout, rid)
        proc.stdin.close()
        assert proc.wait(30) == 0
        assert proc.stderr.read().decode().count("@@SCAN") == scans
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
