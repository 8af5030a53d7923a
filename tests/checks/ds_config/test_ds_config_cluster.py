"""ds_config on the namespace cluster: the config's nvme_path is checked on every host automatically."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.cli.test_cli_cluster import preflight

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


@pytest.fixture
def shared_dir():
    """A directory every namespace host sees at the same path (each host mounts a private /tmp, so pytest's
    tmp_path is the coordinator's alone): where a test writes the DeepSpeed config the ranks will open."""
    path = Path(tempfile.mkdtemp(prefix="pf-ds-", dir="/run"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_nvme_path_missing_on_one_host_fails_on_that_host(cluster3, tmp_path, shared_dir):
    path = "/tmp/preflight-ds-nvme"
    config = json.loads((CONFIGS / "zero3_nvme.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section]["nvme_path"] = path
    ds = shared_dir / "ds_config.json"  # the hosts open the path the launcher passes
    ds.write_text(json.dumps(config))
    thresholds = tmp_path / "t.toml"
    # Tiny dd and near-zero speed floors: this is about the path, not about the speed of a busy CI disk.
    thresholds.write_text("[nvme]\ntest_mib = 8\nmin_test_mib = 8\nmin_write_gbps = 0.01\nmin_read_gbps = 0.01\n")
    for host in ("node01", "node03"):  # private /tmp per host: node02 lacks the directory
        cluster3.exec(host, ["mkdir", "-p", path], check=True)
    try:
        out = tmp_path / "r.json"
        # No --nvme-path: the nvme check gets the path from the DeepSpeed config.
        proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf"), "--deepspeed-config", ds,
                         "--checks", "nvme,ds_config", "--config", thresholds, "--json", out)
        res = {(r["host"], r["check"]): r for r in json.loads(out.read_text())["results"]}
        assert proc.returncode == 1
        assert res[("node02", "nvme")]["status"] == "fail" and path in res[("node02", "nvme")]["message"]
        assert res[("node02", "ds_config")]["status"] == "fail"
        assert path in res[("node02", "ds_config")]["message"]
        for host in ("node01", "node03"):
            assert res[(host, "nvme")]["status"] == "pass", res[(host, "nvme")]["message"]
            assert (host, "ds_config") not in res or res[(host, "ds_config")]["status"] != "fail"
    finally:
        for host in ("node01", "node03"):
            cluster3.exec(host, ["rm", "-rf", path])


def test_valid_config_without_gpus_skips_memory_findings_with_the_reason(cluster3, tmp_path, shared_dir):
    out = tmp_path / "r.json"
    # Where every host sees it: the ranks open the config's path, and a checkout under /tmp is the coordinator's alone.
    config = shared_dir / "real_hf_zero2_auto.json"
    shutil.copy(CONFIGS / "real_hf_zero2_auto.json", config)
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf", slots=1), "--deepspeed-config",
                     config, "--model-params", "1e8", "--checks", "gpu,ds_config", "--json", out)
    res = {(r["host"], r["check"]): r for r in json.loads(out.read_text())["results"]}
    star = res[("*", "ds_config")]
    # A WARN may be real here (this machine's memlock limit is small for pinned offload); never a FAIL.
    assert star["status"] in ("pass", "skip", "warn"), star["message"]
    findings = star["metrics"]["findings"]
    assert any(f["status"] == "skip" and "GPU" in f["message"] for f in findings), findings
    assert proc.returncode == 0, proc.stdout


def test_ds_config_alone_probes_version_and_offload_paths_on_every_host(cluster3, tmp_path, shared_dir):
    """--checks ds_config without nvme/python/ds_report: the hosts' DeepSpeed version and the config's nvme_path are
    still known, from ds_config's own probe of each host, and a key the hosts' DeepSpeed removed is a FAIL."""
    path = "/tmp/preflight-ds-alone"
    config = json.loads((CONFIGS / "zero3_nvme.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section]["nvme_path"] = path
    config["amp"] = {"enabled": False}  # removed in DeepSpeed 0.19.8, which the hosts' interpreter has
    ds = shared_dir / "ds_config.json"  # the hosts open the path the launcher passes
    ds.write_text(json.dumps(config))
    for host in ("node01", "node03"):
        cluster3.exec(host, ["mkdir", "-p", path], check=True)
    try:
        out = tmp_path / "r.json"
        proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf"), "--deepspeed-config", ds,
                         "--checks", "ds_config", "--json", out)
        report = json.loads(out.read_text())
        res = {(r["host"], r["check"]): r for r in report["results"]}
        assert proc.returncode == 1
        assert {r["check"] for r in report["results"]} <= {"ssh", "ds_config"}
        assert res[("node02", "ds_config")]["status"] == "fail"
        assert path in res[("node02", "ds_config")]["message"] and "node02" in res[("node02", "ds_config")]["message"]
        star = res[("*", "ds_config")]
        msgs = " | ".join(f["message"] for f in star["metrics"]["findings"])
        assert "amp was removed in DeepSpeed 0.19.8" in msgs and "node01" in msgs, msgs
        assert "not tested" not in msgs, msgs
        for host in ("node01", "node03"):
            assert res.get((host, "ds_config"), {}).get("message", "").count(path) == 0
        for host in ("node01", "node02", "node03"):  # the probe's test file is gone
            ls = cluster3.exec(host, ["ls", "-A", path])
            assert ".preflight-ds-" not in ls.stdout
    finally:
        for host in ("node01", "node03"):
            cluster3.exec(host, ["rm", "-rf", path])
