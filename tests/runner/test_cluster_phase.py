"""The cluster phase's schedule (runner._cluster_checks): checks run in ORDER, neighbours that are both QUIET run
together, a measuring check runs alone, and a quiet check that never returns costs its own cell only.

Fake cluster checks (preflight.testing.fake_check) stand in for ports/launcher_ssh (quiet) and iperf3 (measuring);
each records when it ran.
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


def test_quiet_neighbours_run_together_and_a_measuring_check_alone_in_order():
    both = threading.Barrier(2, timeout=10)  # passes only if the two quiet neighbours run at the same time
    log: List[str] = []

    def quiet(name: str, wait: bool = True):
        def coordinate(cluster: Any) -> Dict[str, Any]:
            log.append(name + " start")
            try:
                if wait:
                    both.wait()
                ok = True
            except threading.BrokenBarrierError:  # run one after the other: the other never came
                ok = False
            log.append(name + " end")
            return {"ok": ok}
        return coordinate

    def measuring(cluster: Any) -> Dict[str, Any]:
        log.append("measuring")
        return {"ok": True}

    runner = _runner()
    runner._cluster_checks([fake_check("ports", quiet("ports"), quiet=True).SPEC,
                            fake_check("launcher_ssh", quiet("launcher_ssh"), quiet=True).SPEC,
                            fake_check("measuring", measuring).SPEC,
                            fake_check("checkpoint", quiet("checkpoint", False), quiet=True).SPEC])
    cells = {r.check: r for r in runner.results}
    assert cells["ports"].status == Status.PASS and cells["launcher_ssh"].status == Status.PASS, cells
    assert cells["measuring"].status == Status.PASS and cells["checkpoint"].status == Status.PASS
    assert set(log[:2]) == {"ports start", "launcher_ssh start"}, log
    # the measuring check after both quiet neighbours ended, the later quiet check after it (its place in ORDER)
    assert log[4:] == ["measuring", "checkpoint start", "checkpoint end"], log


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
