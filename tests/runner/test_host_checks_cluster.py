"""Host checks for real on the namespace cluster: one broken host among healthy ones is named."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.cli.test_cli_cluster import preflight


def libaio_runtime() -> str:
    """The real file behind libaio.so.1 on this machine (what the dynamic loader opens)."""
    for pattern in ("/usr/lib/*/libaio.so.1*", "/lib/*/libaio.so.1*", "/usr/lib64/libaio.so.1*"):
        for path in glob.glob(pattern):
            if os.path.isfile(path) and not os.path.islink(path):
                return path
    pytest.skip("libaio runtime library not installed here (tests/install-deps.sh installs libaio-dev)")


def cells(path):
    return {(r["host"], r["check"]): r for r in json.loads(path.read_text())["results"]}


def test_broken_libaio_on_one_host_fails_libaio_and_ds_report(netcluster_factory, tmp_path, request):
    lib = libaio_runtime()
    # Not under /tmp: each host mounts a private tmpfs there before the setup commands run.
    empty = Path(tempfile.mkstemp(prefix="preflight-empty-", dir="/dev/shm")[1])
    request.addfinalizer(empty.unlink)
    # Inside node02's own mount namespace only: the library file becomes an empty file.
    cluster = netcluster_factory(n=3, setup={"node02": [["mount", "--bind", str(empty), lib]]})
    config = tmp_path / "t.toml"
    config.write_text('[ds_report]\nrequired_ops = ["async_io"]\n')
    checks = "libaio,ds_report" if importlib.util.find_spec("deepspeed") else "libaio"
    out = tmp_path / "r.json"
    proc = preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hf"), "--checks", checks,
                     "--config", config, "--json", out)
    assert proc.returncode == 1
    res = cells(out)
    assert res[("node02", "libaio")]["status"] == "fail"
    assert "load" in res[("node02", "libaio")]["message"]  # present but cannot be loaded, not "missing"
    assert res[("node01", "libaio")]["status"] == "pass" and res[("node03", "libaio")]["status"] == "pass"
    if "ds_report" in checks:
        assert res[("node02", "ds_report")]["status"] == "fail"
        assert "async_io" in res[("node02", "ds_report")]["message"]
        assert res[("node01", "ds_report")]["status"] in ("pass", "warn")
    assert "node02::libaio FAILED" in proc.stdout


def test_missing_nvme_path_on_one_host_fails_only_there_and_leaves_no_file(cluster3, tmp_path):
    path = "/tmp/preflight-nvme-test"
    for host in ("node01", "node03"):  # each host has a private /tmp: node02 lacks the directory
        cluster3.exec(host, ["mkdir", "-p", path], check=True)
    try:
        config = tmp_path / "t.toml"
        # Thresholds near zero: this test is about the missing path, not about the speed of a busy CI disk.
        config.write_text("[nvme]\ntest_mib = 16\nmin_test_mib = 8\nmin_write_gbps = 0.01\nmin_read_gbps = 0.01\n")
        out = tmp_path / "r.json"
        proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf"), "--checks", "nvme",
                         "--nvme-path", path, "--config", config, "--json", out)
        res = cells(out)
        assert proc.returncode == 1
        assert res[("node02", "nvme")]["status"] == "fail"
        assert path in res[("node02", "nvme")]["message"]
        for host in ("node01", "node03"):
            assert res[(host, "nvme")]["status"] == "pass", res[(host, "nvme")]["message"]
            measured = res[(host, "nvme")]["metrics"]["paths"][0]
            assert measured["write_Bps"] > 0 and measured["read_Bps"] > 0
            assert cluster3.exec(host, ["ls", "-A", path]).stdout == ""  # the dd test file is gone
    finally:
        for host in ("node01", "node03"):
            cluster3.exec(host, ["rm", "-rf", path])


def test_cpu_hosts_skip_gpu_checks_with_the_reason(cluster3, tmp_path):
    out = tmp_path / "r.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf"), "--checks", "driver_cuda,gpu",
                     "--json", out)
    assert proc.returncode == 0, proc.stdout
    for (host, check), r in cells(out).items():
        if check in ("driver_cuda", "gpu"):
            assert r["status"] == "skip" and "no NVIDIA driver" in r["message"], (host, check, r)


def test_gpus_expected_turns_the_skip_into_a_failure(cluster3, tmp_path):
    config = tmp_path / "t.toml"
    config.write_text("[gpu]\ngpus_expected = true\n")
    out = tmp_path / "r.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf", names=["node01"]),
                     "--checks", "driver_cuda", "--config", config, "--json", out)
    assert proc.returncode == 1
    assert cells(out)[("node01", "driver_cuda")]["status"] == "fail"
