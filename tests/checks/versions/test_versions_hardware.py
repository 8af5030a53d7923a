"""versions: the GPUs are the same on every host (model, memory, count, compute capability), from the gpu check's
facts on the recorded H100 host and modified copies; and the NCCL version floor of each host's GPUDirect RDMA path,
from the interfaces facts of the recorded host (tests/checks/interfaces/test_interfaces_gdr.py)."""
from __future__ import annotations

import copy
import json

import pytest

from preflight import testing
from preflight.checks import gpu as gpu_check
from preflight.checks import versions as v
from preflight.config import ConfigError, load_defaults, load_thresholds
from preflight.hostside.outcome import Status
from tests.checks.interfaces.test_interfaces_gdr import PEERMEM_LINE, gpu_host
from tests.h100 import read as fixture
from tests.checks.versions.test_versions import _h100_host_facts

A100_80 = {"name": "NVIDIA A100-SXM4-80GB", "memory_total": 85899345920, "cc": [8, 0]}


@pytest.fixture
def thresholds():
    return load_defaults()


def h100_gpu_facts(count=1):
    """The gpu check's facts on the recorded H100 host (nvml.txt through its own normalizer), `count` GPUs."""
    nvml = json.loads(fixture("nvml.txt"))
    gpus = [gpu_check.normalize_nvml_gpu(nvml["gpus"][0], i) for i in range(count)]
    return {"source": "nvml", "driver": nvml["driver"], "driver_present": True, "gpus": gpus}


def cluster(n=3, **per_host):
    facts = {}
    for i in range(1, n + 1):
        facts[f"node{i:02d}"] = dict(copy.deepcopy(_h100_host_facts()), gpu=h100_gpu_facts())
    for name, change in per_host.items():
        change(facts[name])
    return testing.FakeCluster(sorted(facts), facts=facts)


def run(c, thresholds):
    return v.evaluate(v.coordinate(c), thresholds)["*"]


def test_recorded_h100_hosts_agree(thresholds):
    facts = v.coordinate(cluster(3))
    assert facts["hosts"]["node01"] == {"torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.9",
                                        "deepspeed": "0.19.8", "python": "3.12", "driver": "580",
                                        "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory": "80 GiB",
                                        "gpu_count": "1", "gpu_cc": "9.0"}
    out = v.evaluate(facts, thresholds)["*"]
    assert out.status == Status.PASS, out.message
    for part in ("GPU model NVIDIA H100 80GB HBM3", "GPU memory 80 GiB", "GPU count 1", "GPU compute capability 9.0"):
        assert part in out.message
    assert "gdr" not in facts  # no IB on the recorded host


def test_other_model_warns_naming_the_host_and_why(thresholds):
    def a100(h):
        h["gpu"]["gpus"][0].update(A100_80)
    out = run(cluster(3, node03=a100), thresholds)
    assert out.status == Status.WARN
    assert ("GPU model differs: node03 has NVIDIA A100-SXM4-80GB, expected NVIDIA H100 80GB HBM3 like the other 2 "
            "host(s) (node01, node02): mixed GPU models in one job: synchronous data-parallel steps go at the "
            "slowest GPU's pace") in out.message
    assert "GPU compute capability differs: node03 has 8.0, expected 9.0" in out.message
    assert "GPU memory differs" not in out.message  # 80 GiB both
    assert out.metrics["odd_hosts"] == {"node03": ["gpu_model", "gpu_cc"]}
    assert "leave node03 out of the hostfile" in out.fix and "TORCH_CUDA_ARCH_LIST" in out.fix


def test_other_memory_warns(thresholds):
    def small(h):
        h["gpu"]["gpus"][0]["memory_total"] = 42949672960  # a 40 GB part
    out = run(cluster(3, node02=small), thresholds)
    assert out.status == Status.WARN
    assert "GPU memory differs: node02 has 40 GiB, expected 80 GiB" in out.message
    assert "the smallest GPU memory sets the micro-batch" in out.message
    assert "train_micro_batch_size_per_gpu" in out.fix


def test_other_count_warns_with_the_hostfile_fix(thresholds):
    def eight(h):
        h["gpu"] = h100_gpu_facts(8)
    out = run(cluster(3, node01=eight), thresholds)
    assert out.status == Status.WARN
    assert "GPU count differs: node01 has 8, expected 1" in out.message and "slots=N" in out.message
    assert "write each host's own count in the hostfile (node01 slots=8)" in out.fix  # issue 30: no HOST


def test_a_host_mixing_models_differs_from_uniform_hosts(thresholds):
    def mixed(h):
        h["gpu"] = h100_gpu_facts(2)
        h["gpu"]["gpus"][1].update(A100_80)
    c = cluster(3, node02=mixed)
    facts = v.coordinate(c)
    assert facts["hosts"]["node02"]["gpu_model"] == "NVIDIA A100-SXM4-80GB + NVIDIA H100 80GB HBM3"
    assert facts["hosts"]["node02"]["gpu_cc"] == "8.0 + 9.0"
    assert v.evaluate(facts, thresholds)["*"].status == Status.WARN


def test_hardware_status_fail_and_ignore(thresholds):
    def a100(h):
        h["gpu"]["gpus"][0].update(A100_80)
    strict = copy.deepcopy(thresholds)
    strict["versions"]["hardware_status"] = "fail"
    assert run(cluster(3, node03=a100), strict).status == Status.FAIL
    lenient = copy.deepcopy(thresholds)
    lenient["versions"]["ignore"] = ["gpu_model", "gpu_cc"]
    assert run(cluster(3, node03=a100), lenient).status == Status.PASS


def test_cpu_host_among_gpu_hosts_and_unknown_hosts(thresholds):
    def cpu(h):
        h["gpu"] = {"source": None, "driver_present": False, "gpus": []}
    def errored(h):
        del h["gpu"]
    facts = v.coordinate(cluster(4, node02=cpu, node04=errored))
    assert facts["hosts"]["node02"]["gpu_count"] == "0" and facts["hosts"]["node02"]["gpu_model"] is None
    assert "gpu_count" not in facts["hosts"]["node04"]  # unknown: not compared
    out = v.evaluate(facts, thresholds)["*"]
    assert out.status == Status.WARN and "GPU count differs: node02 has 0, expected 1" in out.message
    assert "GPU model differs: node02 has no GPU" in out.message
    assert out.metrics["versions"]["gpu_count"]["unknown"] == ["node04"]
    # driver_cuda's count stands in where the gpu check recorded nothing
    def only_driver(h):
        del h["gpu"]
        h["driver_cuda"]["gpu_count"] = 1
    assert v.coordinate(cluster(1, node01=only_driver))["hosts"]["node01"]["gpu_count"] == "1"


def test_broken_gpu_facts_are_unknown_not_a_crash(thresholds):
    def odd(h):
        h["gpu"]["gpus"] = [{"name": 7, "memory_total": "lots", "cc": ["9", 0]}]
    facts = v.coordinate(cluster(2, node02=odd))
    assert facts["hosts"]["node02"]["gpu_count"] == "1"
    assert not {"gpu_model", "gpu_memory", "gpu_cc"} & set(facts["hosts"]["node02"])
    assert v.evaluate(facts, thresholds)["*"].status == Status.PASS


# --- NCCL for GPUDirect RDMA ---------------------------------------------------------------------------

def with_ib(tmp_path, nccl=None, lsmod=None):
    """The recorded H100 host's interfaces facts with an active IB port (DMA-BUF path: open module, 6.18 kernel;
    the peermem path with `lsmod`), and its NCCL set to `nccl`."""
    def change(h):
        h["interfaces"] = gpu_host(tmp_path / str(id(h)), lsmod=lsmod)
        if nccl is not None:
            h["python"]["nccl"] = h["driver_cuda"]["nccl"] = nccl
    return change


def test_dmabuf_host_with_old_nccl_warns(tmp_path, thresholds):
    c = cluster(3, node01=with_ib(tmp_path), node02=with_ib(tmp_path, "2.12.12"), node03=with_ib(tmp_path))
    facts = v.coordinate(c)
    assert facts["gdr"] == {"node01": "dmabuf", "node02": "dmabuf", "node03": "dmabuf"}
    out = v.evaluate(facts, thresholds)["*"]
    assert out.status == Status.FAIL  # the NCCL mismatch itself is a FAIL, as before
    assert ("node02 relies on GPUDirect RDMA through DMA-BUF (no nvidia_peermem; NVIDIA's open kernel module) but "
            "runs NCCL 2.12.12 (expected >= 2.13)") in out.message
    assert "modprobe nvidia_peermem" in out.fix
    assert out.metrics["gdr"]["node01"] == {"path": "dmabuf", "nccl": "2.28.9"}


def test_every_host_old_nccl_is_a_warn_naming_all(tmp_path, thresholds):
    old = {f"node0{i}": with_ib(tmp_path, "2.12.12") for i in (1, 2, 3)}
    out = run(cluster(3, **old), thresholds)
    assert out.status == Status.WARN
    assert "node01, node02, node03 rely on GPUDirect RDMA through DMA-BUF" in out.message
    assert "run NCCL 2.12.12 (expected >= 2.13)" in out.message


def test_recorded_nccl_is_new_enough_for_both_paths(tmp_path, thresholds):
    dmabuf = run(cluster(2, node01=with_ib(tmp_path), node02=with_ib(tmp_path)), thresholds)
    assert dmabuf.status == Status.PASS, dmabuf.message
    peer = PEERMEM_LINE + fixture("lsmod.txt")
    c = cluster(2, node01=with_ib(tmp_path, lsmod=peer), node02=with_ib(tmp_path, lsmod=peer))
    assert v.coordinate(c)["gdr"] == {"node01": "peermem", "node02": "peermem"}
    assert v.evaluate(v.coordinate(c), thresholds)["*"].status == Status.PASS


def test_peermem_host_with_nccl_before_2_4_warns(tmp_path, thresholds):
    peer = PEERMEM_LINE + fixture("lsmod.txt")
    c = cluster(2, node01=with_ib(tmp_path, "2.3.7", peer), node02=with_ib(tmp_path, "2.3.7", peer))
    out = run(c, thresholds)
    assert out.status == Status.WARN
    assert "node01, node02 rely on GPUDirect RDMA through nvidia_peermem but run NCCL 2.3.7 (expected >= 2.4)" \
        in out.message and "NCCL_IB_GDR_LEVEL" in out.fix


def test_unknown_nccl_is_not_judged(tmp_path, thresholds):
    def no_nccl(h):
        with_ib(tmp_path)(h)
        h["python"]["nccl"] = h["driver_cuda"]["nccl"] = None
    out = run(cluster(2, node01=no_nccl, node02=no_nccl), thresholds)
    assert out.status == Status.PASS and out.metrics["gdr"]["node01"] == {"path": "dmabuf", "nccl": None}


def test_spec_reads_the_gpu_and_interfaces_facts():
    assert {"gpu", "driver_cuda", "interfaces", "python"} <= set(v.SPEC.reads)


def test_hardware_status_and_ignore_take_only_their_choices(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[versions]\nhardware_status = "FAIL"\nignore = ["gpu_count", "GPU_CC"]\n')
    merged = load_thresholds(str(cfg))
    assert merged["versions"]["hardware_status"] == "fail" and merged["versions"]["ignore"] == ["gpu_count", "gpu_cc"]
    cfg.write_text('[versions]\nhardware_status = "maybe"\n')
    with pytest.raises(ConfigError, match=r"versions.hardware_status = 'maybe' is not allowed; "
                                          r"expected one of \"warn\", \"fail\"$"):
        load_thresholds(str(cfg))
