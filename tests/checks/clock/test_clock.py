"""The clock check: offsets from recorded exchanges, and a namespace host whose clock runs 30 s ahead."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.checks import clock
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from tests.netcluster import NetCluster

REPO = Path(__file__).resolve().parents[3]
TH = load_defaults()
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

# Recorded on the namespace cluster: node02 ran under libfaketime "+30s"; exchanges take 30-60 ms over SSH.
RECORDED = {"hosts": ["node01", "node02"], "errors": {}, "unreachable": [], "samples": {
    "node01": [{"t0": 100.000, "host": 100.021, "t1": 100.045}, {"t0": 100.050, "host": 100.069, "t1": 100.083}],
    "node02": [{"t0": 100.000, "host": 130.040, "t1": 100.062}, {"t0": 100.070, "host": 130.088, "t1": 100.101}]}}


def test_offset_takes_the_shortest_round_trip():
    o = clock.offset(RECORDED["samples"]["node02"])
    assert o["rtt_s"] == pytest.approx(0.031) and o["offset_s"] == pytest.approx(30.0025)
    assert o["uncertainty_s"] == pytest.approx(0.0155)
    assert clock.offset([]) is None


def test_skewed_host_warns_with_direction_and_fix():
    out = clock.evaluate(RECORDED, TH)
    assert out["node01"].status == Status.PASS and "ahead of the coordinator's by 0.003 s" in out["node01"].message
    bad = out["node02"]
    assert bad.status == Status.WARN and bad.message.startswith("node02: clock ahead of the coordinator's by 30.00")
    assert "chronyc" in bad.fix and bad.metrics["offset_s"] == pytest.approx(30.0025)
    assert "within 30.000 s of each other" in out["*"].message
    relaxed = dict(TH, clock=dict(TH["clock"], max_skew_s=60.0))
    assert clock.evaluate(RECORDED, relaxed)["node02"].status == Status.PASS


def test_a_skew_within_the_uncertainty_is_not_named():
    slow_link = {"hosts": ["a"], "errors": {}, "unreachable": [],
                 "samples": {"a": [{"t0": 0.0, "host": 2.0, "t1": 3.0}]}}  # offset 0.5 s +- 1.5 s
    assert clock.evaluate(slow_link, TH)["a"].status == Status.PASS
    broken = {"hosts": ["a"], "errors": {"a": "agent died"}, "unreachable": ["b"], "samples": {"a": []}}
    out = clock.evaluate(broken, TH)
    assert out["a"].status == Status.ERROR and out["b"].status == Status.ERROR


@pytest.mark.skipif(NetCluster.unavailable_reason() is not None, reason=str(NetCluster.unavailable_reason()))
@pytest.mark.skipif(not FAKETIME.exists(), reason="libfaketime is not installed (apt-get install faketime)")
def test_namespace_host_with_a_clock_30s_ahead_is_named(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3, names=["node01", "node02", "node03"])
    # The job's --python on node02 (its hostname) runs under libfaketime +30 s: that host's clock, as its ranks see it.
    wrapper = cluster.dir / "python-faketime"  # the hosts' /tmp is their own; the cluster's state dir is shared
    wrapper.write_text(f"#!/bin/sh\nif [ \"$(hostname)\" = node02 ]; then export LD_PRELOAD={FAKETIME} FAKETIME=+30s; "
                       f"fi\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", str(wrapper), "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "clock", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=dict(os.environ))
    assert out.exists(), proc.stderr[-2000:]
    cells = {r["host"]: r for r in json.loads(out.read_text())["results"] if r["check"] == "clock"}
    assert cells["node02"]["status"] == "warn", cells["node02"]["message"]
    # The estimate carries the exchange's own error (29.998 s +- 0.015 under load): 30 s within it, not "30." text.
    assert cells["node02"]["message"].startswith("node02: clock ahead of the coordinator's by ")
    assert abs(cells["node02"]["metrics"]["offset_s"] - 30.0) < 0.5, cells["node02"]["metrics"]
    for h in ("node01", "node03"):
        assert cells[h]["status"] == "pass" and abs(cells[h]["metrics"]["offset_s"]) < 1.0, cells[h]["message"]
