"""versions: coordinate over recorded per-host facts, evaluate names the odd hosts and the majority value."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from preflight.checks import ds_report as dr
from preflight.checks import versions as v
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from preflight import testing

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "h100-host"


@pytest.fixture
def thresholds():
    return load_defaults()


def _h100_host_facts():
    """What the python, driver_cuda and ds_report checks record on the recorded H100 host."""
    torch_info = json.loads((FIX / "torchinfo.txt").read_text())
    nvml = json.loads((FIX / "nvml.txt").read_text())
    python = (FIX / "python-version.txt").read_text().split()[1]
    ds = dr.parse_ds_report((FIX / "ds_report.txt").read_text())
    return {
        "python": {"python": python, "torch": torch_info["torch"], "torch_cuda": torch_info["cuda"],
                   "nccl": torch_info["nccl"], "deepspeed": None, "nvidia_ml_py": "13.580.82"},
        "driver_cuda": {"driver": nvml["driver"], "torch": torch_info["torch"], "torch_cuda": torch_info["cuda"],
                        "nccl": torch_info["nccl"]},
        "ds_report": {"deepspeed": ds["deepspeed"], "torch": ds["torch"]},
    }


def _cluster(n=3, **per_host):
    facts = {}
    for i in range(1, n + 1):
        facts[f"node{i:02d}"] = copy.deepcopy(_h100_host_facts())
    for name, change in per_host.items():
        change(facts[name])
    return testing.FakeCluster(sorted(facts), facts=facts)


def test_coordinate_reads_other_checks_facts():
    facts = v.coordinate(_cluster(1))
    assert facts == {"hosts": {"node01": {"torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.9",
                                          "deepspeed": "0.19.8", "python": "3.12", "driver": "580"}}}
    json.dumps(facts)


def test_identical_hosts_pass(thresholds):
    out = v.evaluate(v.coordinate(_cluster(3)), thresholds)["*"]
    assert out.status == Status.PASS
    assert "all 3 hosts agree" in out.message and "2.11.0+cu130" in out.message and "580" in out.message


def test_one_host_with_other_torch_fails_naming_it(thresholds):
    def older(h):
        h["python"]["torch"] = "2.10.0+cu130"
    out = v.evaluate(v.coordinate(_cluster(3, node02=older)), thresholds)["*"]
    assert out.status == Status.FAIL
    assert "node02 has 2.10.0+cu130" in out.message and "expected 2.11.0+cu130" in out.message
    assert "node01, node03" in out.message
    assert "torch==2.11.0+cu130 on node02" in out.fix
    assert out.metrics["odd_hosts"] == {"node02": ["torch"]}


def test_driver_branch_compared_not_patch_level(thresholds):
    def patch(h):
        h["driver_cuda"]["driver"] = "580.95.05"
    assert v.evaluate(v.coordinate(_cluster(3, node03=patch)), thresholds)["*"].status == Status.PASS

    def branch(h):
        h["driver_cuda"]["driver"] = "570.124.06"
    out = v.evaluate(v.coordinate(_cluster(3, node03=branch)), thresholds)["*"]
    assert out.status == Status.FAIL and "node03 has 570" in out.message and "branch 580" in out.fix


def test_python_minor_compared_not_patch(thresholds):
    def patch(h):
        h["python"]["python"] = "3.12.7"
    assert v.evaluate(v.coordinate(_cluster(3, node01=patch)), thresholds)["*"].status == Status.PASS

    def minor(h):
        h["python"]["python"] = "3.11.9"
    out = v.evaluate(v.coordinate(_cluster(3, node01=minor)), thresholds)["*"]
    assert out.status == Status.FAIL and "node01 has 3.11" in out.message and "expected 3.12" in out.message


def test_missing_deepspeed_on_one_host_fails(thresholds):
    def missing(h):
        h["python"]["deepspeed"] = None
        h["ds_report"]["deepspeed"] = None
    out = v.evaluate(v.coordinate(_cluster(3, node02=missing)), thresholds)["*"]
    assert out.status == Status.FAIL and "node02 has not installed" in out.message
    assert "deepspeed==0.19.8 on node02" in out.fix


def test_absent_everywhere_is_fine(thresholds):
    def cpu(h):
        h["python"].update(torch_cuda=None, nccl=None, deepspeed=None)
        h["driver_cuda"].update(torch_cuda=None, nccl=None, driver=None)
        h["ds_report"]["deepspeed"] = None
    cluster = _cluster(3, node01=cpu, node02=cpu, node03=cpu)
    assert v.evaluate(v.coordinate(cluster), thresholds)["*"].status == Status.PASS


def test_host_whose_checks_errored_is_unknown_not_odd(thresholds):
    cluster = _cluster(3)
    cluster.facts["node03"] = {}  # every check errored there
    del cluster.facts["node02"]["python"]  # python check errored; driver_cuda still recorded torch
    facts = v.coordinate(cluster)
    assert facts["hosts"]["node03"] == {}
    assert facts["hosts"]["node02"]["torch"] == "2.11.0+cu130" and "python" not in facts["hosts"]["node02"]
    out = v.evaluate(facts, thresholds)["*"]
    assert out.status == Status.PASS
    assert out.metrics["versions"]["torch"]["unknown"] == ["node03"]


def test_no_majority_names_every_group(thresholds):
    def other(h):
        h["python"]["nccl"] = "2.27.3"
    out = v.evaluate(v.coordinate(_cluster(2, node02=other)), thresholds)["*"]
    assert out.status == Status.FAIL and "no majority" in out.message
    assert "2.27.3 on node02" in out.message and "2.28.9 on node01" in out.message


def test_ignore_threshold(thresholds):
    def older(h):
        h["python"]["torch"] = "2.10.0+cu130"
    t = copy.deepcopy(thresholds)
    t["versions"]["ignore"] = ["torch"]
    assert v.evaluate(v.coordinate(_cluster(3, node02=older)), t)["*"].status == Status.PASS


def test_several_fields_differ_on_several_hosts(thresholds):
    def cu128(h):
        h["python"].update(torch="2.11.0+cu128", torch_cuda="12.8")
    out = v.evaluate(v.coordinate(_cluster(5, node04=cu128, node05=cu128)), thresholds)["*"]
    assert out.status == Status.FAIL
    assert "node04, node05 has 2.11.0+cu128" in out.message and "node04, node05 has 12.8" in out.message
    assert out.metrics["odd_hosts"] == {"node04": ["torch", "cuda"], "node05": ["torch", "cuda"]}


def test_single_host(thresholds):
    out = v.evaluate(v.coordinate(_cluster(1)), thresholds)["*"]
    assert out.status == Status.PASS and "nothing to compare" in out.message
    assert v.SPEC.scope == "cluster"
