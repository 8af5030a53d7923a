"""The cluster phase's schedule (runner.Schedule): two checks run at once only when neither loads what the other
measures (SPEC.measures/loads), a check starts after the checks it reads, an early one beside the host checks, and a
quiet check that never returns costs its own cell only.

Fake cluster checks (preflight.testing.fake_check) stand in for the real ones, with their declared usage; each records
when it ran. The run's own timeline (Report.timeline) shows the same on namespace hosts: tests/test_gate_overlap.py.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Dict, List

import pytest

from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from preflight.hostfile import HostSpec
from preflight.runner import RunOptions, Runner
from preflight.testing import fake_check


def _runner(timeout: float = 120.0) -> Runner:
    runner = Runner(RunOptions(hosts=[HostSpec("localhost", 1, 0)], checks=[], thresholds=load_defaults(),
                               local=True, timeout=timeout))
    runner.nodes = [runner._make_node(spec) for spec in runner.o.hosts]
    for node in runner.nodes:
        runner._connect(node)
    return runner


class Spans:
    """When each fake check ran: {name: (start, end)} of time.monotonic()."""

    def __init__(self) -> None:
        self.at: Dict[str, List[float]] = {}

    def check(self, name: str, seconds: float = 0.3, meet: Any = None, then: Any = None):
        def coordinate(cluster: Any) -> Dict[str, Any]:
            self.at[name] = [time.monotonic()]
            ok = True
            if meet is not None:  # a barrier that passes only if its parties run at the same time
                try:
                    meet.wait()
                except threading.BrokenBarrierError:
                    ok = False
            time.sleep(seconds)
            self.at[name + " measuring"] = [self.at[name][0], time.monotonic()]
            if then is not None:
                ok = then(cluster) and ok
            self.at[name].append(time.monotonic())
            return {"ok": ok}
        return coordinate

    def overlap(self, a: str, b: str) -> bool:
        return self.at[a][0] < self.at[b][1] and self.at[b][0] < self.at[a][1]


def test_quiet_checks_run_together_and_a_measuring_check_alone():
    """Undeclared usage (fake checks): a measuring check measures and loads everything, a quiet one loads
    everything but measures nothing, so the quiet ones run together and the measuring one beside none of them."""
    both = threading.Barrier(2, timeout=10)
    spans = Spans()
    runner = _runner()
    runner._cluster_checks([fake_check("ports", spans.check("ports", meet=both), quiet=True).SPEC,
                            fake_check("launcher_ssh", spans.check("launcher_ssh", meet=both), quiet=True).SPEC,
                            fake_check("measuring", spans.check("measuring")).SPEC,
                            fake_check("checkpoint", spans.check("checkpoint"), quiet=True).SPEC])
    cells = {r.check: r for r in runner.results}
    assert all(c.status == Status.PASS for c in cells.values()), cells  # the barrier passed: together
    assert not any(spans.overlap("measuring", other) for other in ("ports", "launcher_ssh", "checkpoint")), spans.at
    assert [r.check for r in runner.results] == ["ports", "launcher_ssh", "measuring", "checkpoint"]  # ORDER


def test_compute_measures_beside_ports_but_not_beside_launcher_ssh():
    """The real checks' declared usage (SPEC.measures/loads): compute's timed loops run while ports probes (a few
    connections load nothing), and never while launcher_ssh's SSH handshakes load the first host's CPU."""
    from preflight.checks import compute, launcher_ssh, ports

    def declared(name: str, spec: Any, coordinate: Any) -> Any:
        return fake_check(name, coordinate, quiet=spec.quiet, measures=spec.measures, loads=spec.loads).SPEC

    meet = threading.Barrier(2, timeout=10)
    spans = Spans()
    runner = _runner()
    runner._cluster_checks([declared("compute", compute.SPEC, spans.check("compute", 1.0, meet)),
                            declared("ports", ports.SPEC, spans.check("ports", meet=meet)),
                            declared("launcher_ssh", launcher_ssh.SPEC, spans.check("launcher_ssh"))])
    cells = {r.check: r for r in runner.results}
    assert cells["compute"].status == Status.PASS and cells["ports"].status == Status.PASS, cells
    assert spans.overlap("compute", "ports"), spans.at
    assert not spans.overlap("compute", "launcher_ssh"), spans.at


def test_an_early_check_runs_beside_the_host_checks_and_waits_for_what_it_reads_later():
    """An early check (iperf3's SPEC: early, waits for ports) starts while the host checks run, a check that measures
    the CPU does not start beside it, ports starts only after the host checks (it reads their facts), and the early
    check's wait_for returns once ports' facts are there."""
    from preflight.checks import compute, iperf3, ports

    spans = Spans()
    seen: Dict[str, Any] = {}

    def reads_ports(cluster: Any) -> bool:
        seen["ran"] = cluster.wait_for("ports")
        seen["facts"] = (cluster.facts.get("*") or {}).get("ports")
        return True

    runner = _runner()
    early = fake_check("iperf3", spans.check("iperf3", 0.5, then=reads_ports), measures=iperf3.SPEC.measures,
                       loads=iperf3.SPEC.loads, early=iperf3.SPEC.early, reads=("ports",), waits=iperf3.SPEC.waits).SPEC
    checks = [fake_check("compute", spans.check("compute"), measures=compute.SPEC.measures,
                         loads=compute.SPEC.loads).SPEC,
              fake_check("ports", spans.check("ports"), quiet=True, loads=ports.SPEC.loads).SPEC, early]
    schedule = runner._schedule(checks)
    host_start = time.monotonic()
    schedule.start_early()
    time.sleep(1.0)  # the host checks
    host_end = time.monotonic()
    schedule.host_checks_done({})
    schedule.finish()
    assert spans.at["iperf3"][0] < host_end and spans.at["iperf3"][0] - host_start < 0.5, spans.at
    assert spans.at["ports"][0] >= host_end and spans.at["compute"][0] >= host_end
    # compute may start while iperf3 waits for ports (a waiting check loads nothing), never while it measures
    assert not spans.overlap("iperf3 measuring", "compute"), spans.at
    assert seen == {"ran": True, "facts": {"ok": True}}, seen
    assert spans.at["iperf3"][1] >= spans.at["ports"][1]


def test_a_check_starts_after_the_checks_it_reads():
    spans = Spans()
    runner = _runner()
    runner._cluster_checks([fake_check("ports", spans.check("ports", 0.5), quiet=True, loads=()).SPEC,
                            fake_check("reader", spans.check("reader"), quiet=True, loads=(), reads=("ports",)).SPEC])
    assert spans.at["reader"][0] >= spans.at["ports"][1], spans.at


def test_a_quiet_check_that_never_returns_costs_its_own_cell_only(monkeypatch):
    release = threading.Event()

    def hangs(cluster: Any) -> Dict[str, Any]:
        release.wait(60)
        return {"ok": True}

    def fine(cluster: Any) -> Dict[str, Any]:
        return {"ok": True}

    runner = _runner()
    monkeypatch.setattr(Runner, "QUIET_BACKSTOP_S", 1.0)
    start = time.monotonic()
    try:
        runner._cluster_checks([fake_check("ports", hangs, quiet=True).SPEC,
                                fake_check("launcher_ssh", fine, quiet=True).SPEC, fake_check("measuring", fine).SPEC])
    finally:
        release.set()
    cells = {r.check: r for r in runner.results}
    assert cells["ports"].status == Status.ERROR and "did not finish" in cells["ports"].message, cells["ports"]
    assert cells["launcher_ssh"].status == Status.PASS and cells["measuring"].status == Status.PASS
    assert time.monotonic() - start < 30


def test_a_local_run_preloads_torch_at_connect_as_a_remote_one_does():
    """Without a hostfile the agent runs here, started at connect; when a check uses torch, that agent imports it
    once there, so that every worker and rank forked later has it."""
    pytest.importorskip("torch")
    runner = Runner(RunOptions(hosts=[HostSpec("localhost", 1, 0)], checks=[], thresholds=load_defaults(),
                               local=True, python=sys.executable))
    runner.preload = True
    runner.nodes = [runner._make_node(spec) for spec in runner.o.hosts]
    try:
        runner._connect(runner.nodes[0])
        loaded = runner.nodes[0].agent.call("hostside.agent.loaded", {"names": ["torch"]}, 120)
        assert loaded["modules"] == {"torch": True}, loaded
    finally:
        runner.nodes[0].agent.close()
