"""The public test doubles (preflight.testing) behave as the parts they stand in for: the module's own sample runs,
a FakeService keeps a service's contract, and a FakeTransport carries a real Agent's conversation."""
from __future__ import annotations

import json
import textwrap
import time

import pytest

import preflight.testing
from preflight.hostside.seams import ClusterView, validate_spec
from preflight.remote import Agent
from preflight.testing import FakeCluster, FakeService, FakeTransport, fake_check
from preflight.transport import RC_TIMEOUT, CommandResult


def test_the_module_sample_runs():
    doc = preflight.testing.__doc__ or ""
    sample = textwrap.dedent(doc.split("::\n", 1)[1])
    assert "ports.coordinate(cluster)" in sample and "FakeTransport(" in sample
    exec(compile(sample, "preflight/testing.py (docstring)", "exec"), {})


def test_fake_cluster_is_a_cluster_view_with_reachable_and_unreachable_hosts():
    cluster = FakeCluster(3, unreachable=["node02"], addresses={"node03": "10.0.0.3"})
    assert isinstance(cluster, ClusterView)
    assert [h.name for h in cluster.all_hosts] == ["node01", "node02", "node03"]
    assert [h.name for h in cluster.hosts] == ["node01", "node03"] and cluster.master.name == "node01"
    assert cluster.address("node01") == "198.18.0.1" and cluster.address("node03") == "10.0.0.3"
    assert cluster.facts == {"node01": {}, "node02": {}, "node03": {}}


def test_call_all_returns_each_hosts_value_or_exception_and_records_every_call():
    def answer(host, params, timeout):
        if host == "node02":
            raise TimeoutError("no answer")
        return {"host": host, "n": params["n"]}

    rounds = []
    cluster = FakeCluster(3, handlers={"x.answer": answer}, on_round=lambda f, p, t: rounds.append((f, sorted(p))))
    got = cluster.call_all("x.answer", {h: {"n": i} for i, h in enumerate(["node01", "node02", "node03"])}, 5)
    assert got["node01"] == {"host": "node01", "n": 0} and got["node03"] == {"host": "node03", "n": 2}
    assert isinstance(got["node02"], TimeoutError)
    assert sorted((c.host, c.func, c.params["n"]) for c in cluster.calls) == [
        ("node01", "x.answer", 0), ("node02", "x.answer", 1), ("node03", "x.answer", 2)]
    assert rounds == [("x.answer", ["node01", "node02", "node03"])]


def test_without_a_handler_the_host_function_runs_here():
    # hostside.agent.loaded: what the agent answers on a host, here in this process
    value = FakeCluster(1).call("node01", "hostside.agent.loaded", {"names": ["json", "no_such_module"]}, 5)
    assert value["modules"] == {"json": True, "no_such_module": False}


def test_scripted_service():
    ok = FakeService(ready={"port": 5201}, result={"served": 3}, func="iperf3.serve")
    assert ok.wait_ready(1) == {"port": 5201}
    with pytest.raises(RuntimeError, match="iperf3.serve timed out after 0s"):
        ok.result(0.05)  # a server ends only when stopped
    assert ok.stop(1) == {"served": 3} and ok.stopped and not ok.killed

    bad = FakeService(error="iperf3 is not installed on this host", func="iperf3.serve")
    for call in (lambda: bad.wait_ready(1), lambda: bad.stop(1)):
        with pytest.raises(RuntimeError, match="iperf3.serve failed on the host: iperf3 is not installed"):
            call()
    bad.kill()
    assert bad.stopped and bad.killed


def test_running_service_is_the_host_function_with_the_agents_ready_and_wait_stop():
    cluster = FakeCluster(1)
    service = cluster.start("node01", "ports.listen", {"count": 2, "addresses": ["127.0.0.1"]}, 30)
    info = service.wait_ready(10)
    assert len(info["ports"]) == 2
    started = time.monotonic()
    result = service.stop(10)
    assert time.monotonic() - started < 5 and service.stopped
    assert result["ports"] == info["ports"] and result["bound"] == ["127.0.0.1"]
    assert result["stopped_by"] == "coordinator"  # ctx.wait_stop returned True when stop() was called

    broken = cluster.start("node01", "ports.no_such_function", {}, 30)
    with pytest.raises(RuntimeError, match="ports.no_such_function failed on the host: AttributeError"):
        broken.wait_ready(10)
    assert [c.func for c in cluster.calls] == ["ports.listen", "ports.no_such_function"]


def _agent_host(command):
    """A host whose agent says hello and answers every call with its params, framed as serve() frames them."""
    hello = json.dumps({"hostname": "node01", "pid": 4242}).encode()
    command.reply(b"a noisy login shell\n@@PF 0 h %d\n" % len(hello) + hello)

    def on_send(data):
        request = json.loads(data)
        result = json.dumps({"ok": True, "value": {"echo": request["params"]}, "host": {}})
        out = f"@@PREFLIGHT-RESULT {result}\n".encode()
        command.reply(b"@@PF %d o %d\n" % (request["id"], len(out)) + out + b"@@PF %d x 1\n0" % request["id"])

    command.on_send = on_send


def test_fake_transport_carries_an_agent_conversation():
    transport = FakeTransport(_agent_host)
    agent = Agent(transport, token="preflight-abc123")
    assert agent.open(5) == {"hostname": "node01", "pid": 4242}
    assert agent.call("clock.now", {"n": 1}, 5) == {"echo": {"n": 1}}
    agent.close()
    [command] = transport.commands
    assert command.argv[0] == "python3" and command.argv[-1] == "preflight-abc123"
    assert b'{"op": "serve"' in command.stdin and b'"func": "clock.now"' in command.stdin
    assert command.stdin_closed.is_set() and not command.killed  # the agent's lifeline closed, nothing killed


def test_an_agent_that_never_says_hello_is_killed_by_its_token_where_a_kill_cannot_reach():
    transport = FakeTransport(lambda c: None if c.argv[0] == "python3" else CommandResult(0, "", "", 0.0),
                              kill_reaches_host=False)
    agent = Agent(transport, token="preflight-abc123")
    assert agent.open(0.2) is None
    agent.close()
    first, pkill = transport.commands
    assert first.killed and first.rc == RC_TIMEOUT
    assert pkill.argv == ["pkill", "-KILL", "-f", "--", "[p]reflight-abc123"]


def test_a_command_left_running_times_out_and_close_ends_the_rest():
    transport = FakeTransport(lambda command: None)
    res = transport.run(["sleep", "60"], timeout=0.2)
    assert res.timed_out and transport.commands[0].killed
    running = transport.start(["cat"], b"first", keep_stdin_open=True)
    running.send(b" second")
    assert bytes(transport.commands[1].stdin) == b"first second"
    transport.close()
    res = running.wait(1)
    assert res.rc == 255 and "connection to node01 was closed" in res.error
    with pytest.raises(TypeError, match="CommandResult or None"):
        FakeTransport(lambda command: (0, "", "")).start(["true"])  # type: ignore[arg-type,return-value]


def test_fake_check_is_a_valid_cluster_check():
    module = fake_check("probe", lambda cluster: {"ok": len(cluster.hosts) == 2}, quiet=True)
    spec = validate_spec(module.SPEC, module.__name__)
    assert spec.scope == "cluster" and spec.quiet and module.NAME == "probe"
    facts = module.coordinate(FakeCluster(2))
    assert module.evaluate(facts, {}).status.value == "pass"
    assert module.evaluate(module.coordinate(FakeCluster(3)), {}).status.value == "fail"
