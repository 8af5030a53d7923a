"""The memlock check: the verdict on recorded limits, this machine's real limit, and a namespace host's."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.checks import memlock
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from tests.netcluster import NetCluster

REPO = Path(__file__).resolve().parents[3]
TH = load_defaults()
MiB = 1 << 20

# Recorded: the H100 host of tests/fixtures/h100-host (ulimit.txt: "max locked memory (kbytes, -l) unlimited",
# 8 mlx5 ports), a stock Ubuntu login (8 MiB, systemd's default since v253), and a container left at 64 KiB.
H100 = {"soft_bytes": None, "hard_bytes": None, "rdma_devices": [f"mlx5_{i}" for i in range(8)]}
UBUNTU = {"soft_bytes": 8 * MiB, "hard_bytes": 8 * MiB, "rdma_devices": []}
CONTAINER_IB = {"soft_bytes": 64 * 1024, "hard_bytes": 64 * 1024, "rdma_devices": ["mlx5_0"]}


def test_unlimited_with_rdma_passes_and_says_so():
    out = memlock.evaluate(H100, TH)
    assert out.status == Status.PASS and "may lock unlimited" in out.message and "mlx5_0" in out.message
    assert out.metrics["ulimit_l"] == "unlimited"


def test_a_small_limit_is_a_fact_and_warns_below_a_configured_floor():
    out = memlock.evaluate(UBUNTU, TH)
    assert out.status == Status.PASS and "may lock 8192 KiB (hard limit 8192 KiB)" in out.message
    assert out.metrics["ulimit_l"] == "8192"
    strict = dict(TH, memlock=dict(TH["memlock"], min_gib=1.0))
    out = memlock.evaluate(UBUNTU, strict)
    assert out.status == Status.WARN and "may lock 8192 KiB (hard limit 8192 KiB), below 1 GiB" in out.message
    assert "memlock unlimited" in out.fix


def test_rdma_hosts_need_unlimited():
    out = memlock.evaluate(CONTAINER_IB, TH)
    assert out.status == Status.WARN and "RDMA devices (mlx5_0)" in out.message and "expected unlimited" in out.message
    big = dict(CONTAINER_IB, soft_bytes=512 << 30, hard_bytes=None)
    assert memlock.evaluate(big, TH).status == Status.WARN
    off = dict(TH, memlock=dict(TH["memlock"], rdma_requires_unlimited=False))
    assert memlock.evaluate(big, off).status == Status.PASS


def test_collect_reads_this_process_limit():
    facts = memlock.collect(HostContext(params={}, deadline=time.monotonic() + 10))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert facts["soft_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert isinstance(facts["rdma_devices"], list)


@pytest.mark.skipif(NetCluster.unavailable_reason() is not None, reason=str(NetCluster.unavailable_reason()))
def test_namespace_host_with_a_lowered_limit_is_named(netcluster_factory, tmp_path):
    # node02's sshd (and so every session it starts) gets a 64 KiB limit, as a host missing limits.conf has.
    cluster = netcluster_factory(2, names=["node01", "node02"])
    config = tmp_path / "memlock.toml"
    config.write_text("[memlock]\nmin_gib = 1.0\n")
    for pid in _pids_in(cluster, "node02"):  # its sshd among them
        subprocess.run(["prlimit", "--pid", str(pid), "--memlock=65536:65536"], check=False)
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "memlock", "--config", str(config),
            "--json", str(out)]
    subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    cells = {r["host"]: r for r in json.loads(out.read_text())["results"] if r["check"] == "memlock"}
    assert cells["node02"]["status"] == "warn" and "may lock 64 KiB" in cells["node02"]["message"]
    assert cells["node02"]["metrics"]["ulimit_l"] == "64"
    assert cells["node01"]["metrics"]["soft_bytes"] != 65536 and "may lock 64 KiB" not in cells["node01"]["message"]


def _pids_in(cluster, name):
    from tests.netcluster import _processes_in
    return list(_processes_in([cluster.host(name).ns]))
