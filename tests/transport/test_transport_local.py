"""The local transport and the agent protocol, for real on this machine."""
import os
import sys
import time

import pytest

from preflight.remote import Agent, AgentError
from preflight.transport import LocalTransport


def test_run_reads_large_stdout_and_stderr_concurrently():
    t = LocalTransport()
    # 4 MiB on each stream: a reader that drains one stream first would deadlock on the other's pipe.
    code = "import sys; sys.stdout.write('o'*(4<<20)); sys.stderr.write('e'*(4<<20))"
    res = t.run([sys.executable, "-c", code], timeout=30)
    assert res.rc == 0 and len(res.stdout) == 4 << 20 and len(res.stderr) == 4 << 20


def test_deadline_kills_the_whole_process_tree(tmp_path):
    marker = tmp_path / "child.pid"
    t = LocalTransport()
    start = time.monotonic()
    res = t.run(["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"], timeout=1)
    assert res.timed_out and res.rc == 124
    assert time.monotonic() - start < 10
    child = int(marker.read_text())
    for _ in range(50):
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the background child survived the deadline")


def test_missing_interpreter_is_an_agent_error_not_a_crash():
    agent = Agent(LocalTransport(), "/nonexistent/python3", "tok")
    try:
        agent.collect(["python"], {}, 10)
    except AgentError as exc:
        assert "not found" in str(exc)
    else:
        raise AssertionError("expected AgentError")


def test_agent_collects_facts_and_reports_check_errors_per_check():
    agent = Agent(LocalTransport(), sys.executable, "tok")
    out = agent.collect(["python", "no_such_check"], {}, 30)
    assert out["python"]["facts"]["python"].startswith(f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert "ModuleNotFoundError" in out["no_such_check"]["error"]
    assert agent.hostinfo["hostname"]


def test_one_persistent_agent_serves_every_request_and_preloads_torch():
    pytest.importorskip("torch")
    agent = Agent(LocalTransport(), sys.executable, "tok")
    try:
        first = agent.call("hostside.agent.loaded", {"names": ["torch"]}, 30)
        assert first["modules"] == {"torch": False}  # a fresh worker imports only the agent
        agent.preload(["torch"])
        second = agent.call("hostside.agent.loaded", {"names": ["torch"]}, 120)
        assert second["modules"] == {"torch": True}  # forked after the preload: inherited, not imported
        assert second["agent"] == first["agent"]  # the same agent process answered both
        out = agent.collect(["python"], {}, 60)
        assert out["python"]["facts"]["torch"] and agent.hostinfo["pid"] != first["agent"]
    finally:
        agent.close()


def test_a_command_that_stops_reading_its_stdin_fails_the_send_and_is_killed(monkeypatch):
    """A frozen host, or an srun whose step stopped taking input: send() must not block its caller for ever (a
    shared srun step's every sender waits behind it). Past the stall limit the command is failed and killed."""
    from preflight.transport import base as transport

    from tests.stdin_flood import flood_until_it_fails
    monkeypatch.setattr(transport, "SEND_STALL_S", 1.0)
    cmd = LocalTransport().start(["sleep", "600"], b"", keep_stdin_open=True)
    outcome = flood_until_it_fails(cmd.send)  # 64 MiB against a 64 KiB pipe that nobody reads
    assert outcome and isinstance(outcome[0], transport.StdinStalled), outcome
    result = cmd.wait(10)
    assert result.timed_out and "stopped reading its stdin" in result.error, result
    # The line that was cut is not followed by more: a later send says the command is gone.
    with pytest.raises(OSError):
        cmd.send(b"y\n")


_STARTS_A_COMMAND = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from preflight.transport.base import ProcessCommand
cmd = ProcessCommand(["sleep", "60"], b"", True, None, die_with_parent=sys.argv[2] == "1")
print(cmd._proc.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_a_command_started_to_die_with_its_parent_goes_when_the_coordinator_is_killed(die_with_parent):
    """The shared srun step's client is started this way: a kill -9 of the coordinator ends it at once (the kernel's
    PR_SET_PDEATHSIG), where an ordinary command (the other case, the control) outlives its killed parent."""
    import signal
    import subprocess
    from pathlib import Path

    from tests.netcluster import _is_alive as _alive  # zombies (killed, not yet reaped) count as gone
    root = str(Path(__file__).resolve().parents[2])
    parent = subprocess.Popen([sys.executable, "-c", _STARTS_A_COMMAND, root, "1" if die_with_parent else "0"],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        if die_with_parent:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and _alive(child):
                time.sleep(0.05)
        else:
            time.sleep(1)  # the control: still there a second later
        assert _alive(child) is not die_with_parent
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)

