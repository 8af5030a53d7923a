"""driver_cuda: parsers on the recorded H100 outputs, evaluate on facts built from them plus faults, real collect."""
from __future__ import annotations

import copy
import json
import os
import time

import pytest

from preflight.checks import driver_cuda as dc
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

from tests.h100 import FIX, read as _read


@pytest.fixture
def healthy():
    """Facts as collect records them on the recorded H100 host (NVML dump + torch info + nvcc + /proc)."""
    nvml = json.loads(_read("nvml.txt"))
    torch_info = json.loads(_read("torchinfo.txt"))
    return {
        "driver": nvml["driver"], "driver_source": "nvml", "cuda_driver": nvml["cuda_driver"],
        "gpu_count": len(nvml["gpus"]), "gpu_uuids": [g["uuid"] for g in nvml["gpus"]],
        "nvml_error": None, "smi_error": None,
        "proc_driver_version": dc.parse_proc_driver_version(_read("proc-driver-version.txt")),
        "cuda_visible_devices": None, "nvcc": dc.parse_nvcc_version(_read("nvcc.txt")),
        "nvcc_path": "/usr/local/cuda/bin/nvcc", "nvcc_error": None, "tool_timeout": None,
        "torch": torch_info["torch"], "torch_cuda": torch_info["cuda"], "torch_hip": None,
        "cuda_available": torch_info["available"], "torch_gpu_count": torch_info["count"],
        "nccl": torch_info["nccl"], "torch_error": None, "torch_cuda_warning": None,
        "slots": 1, "gpus_expected": None,
    }


# --- parsers on the real fixture files ------------------------------------------------------------

def test_parse_proc_driver_version_fixture_and_legacy_format():
    assert dc.parse_proc_driver_version(_read("proc-driver-version.txt")) == "580.159.04"
    legacy = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version: 12\n"
    assert dc.parse_proc_driver_version(legacy) == "535.104.05"
    assert dc.parse_proc_driver_version("") is None
    assert dc.parse_proc_driver_version("GCC version: gcc 15.3.0\n") is None


def test_parse_nvidia_smi_header_fixture():
    head = dc.parse_nvidia_smi_header(_read("nvidia-smi.txt"))
    assert head == {"driver": "580.159.04", "cuda": "13.0", "gpu_count": 1}
    assert dc.parse_nvidia_smi_header("NVIDIA-SMI has failed because it couldn't communicate")["driver"] is None


def test_parse_nvcc_fixture():
    assert dc.parse_nvcc_version(_read("nvcc.txt")) == "13.0"
    assert dc.parse_nvcc_version("Cuda compilation tools, release 12.4, V12.4.131") == "12.4"
    assert dc.parse_nvcc_version("bash: nvcc: command not found") is None


def test_nvml_cuda_int_and_driver_table():
    nvml = json.loads(_read("nvml.txt"))
    assert dc.cuda_version_from_int(nvml["cuda_driver"]) == "13.0"
    assert dc.cuda_version_from_int(12080) == "12.8"
    assert dc.max_cuda_for_driver(nvml["driver"]) == "13.0"
    assert dc.max_cuda_for_driver("535.104.05") == "12.2"
    assert dc.max_cuda_for_driver("550.54.15") == "12.4"
    assert dc.max_cuda_for_driver("570.26") == "12.8"
    assert dc.max_cuda_for_driver("418.40") is None


def test_driver_table_rows_kept_true():
    # 11.0 GA needs 450.51.05; 450.36.06 was the release candidate's driver
    assert dc.max_cuda_for_driver("450.36.06") is None
    assert dc.max_cuda_for_driver("450.51.05") == "11.0"
    # 13.3 GA ships with 610.43.02; the same branch stays 13.3, a newer branch is beyond the table
    assert dc.max_cuda_for_driver("610.43.01") == "13.2"
    assert dc.max_cuda_for_driver("610.43.02") == "13.3"
    assert dc.max_cuda_for_driver("610.99.01") == "13.3"
    assert dc.max_cuda_for_driver("620.10.03") == dc.NEWER_THAN_TABLE == "unknown, newer than the table"


def test_driver_newer_than_the_table_without_nvml_cuda_is_not_capped(healthy, thresholds):
    healthy.update(driver="620.10.03", cuda_driver=None, driver_source="proc")
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.PASS, out.message
    assert "CUDA <= unknown, newer than the table" in out.message and "13.3" not in out.message


def test_format_nccl_version():
    assert dc.format_nccl_version((2, 28, 9)) == "2.28.9"
    assert dc.format_nccl_version(22809) == "2.28.9"
    assert dc.format_nccl_version(2708) == "2.7.8"


def test_count_visible_honours_cuda_visible_devices():
    uuids = ["GPU-fe97e4af-eedf-d1a1-0b31-d7e310aee1d8", "GPU-0000aaaa-0000"]
    assert dc.count_visible(None, 2, uuids) == 2
    assert dc.count_visible("", 2, uuids) == 0
    assert dc.count_visible("1", 2, uuids) == 1
    assert dc.count_visible("1,0", 2, uuids) == 2
    assert dc.count_visible("0,5,1", 2, uuids) == 1  # CUDA stops at the first invalid ordinal
    assert dc.count_visible("0,0", 2, uuids) == 1
    assert dc.count_visible("GPU-fe97e4af", 2, uuids) == 1
    assert dc.count_visible("GPU-ffff", 2, uuids) == 0


# --- evaluate ---------------------------------------------------------------------------------

def test_healthy_h100_passes(healthy, thresholds):
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.PASS, out.message
    assert "580.159.04" in out.message and "2.11.0+cu130" in out.message and "13.0" in out.message
    assert out.metrics["visible_gpus"] == 1
    assert out.metrics["nccl"] == "2.28.9"


def test_old_driver_535_with_torch_12_8_only_minor_compat(healthy, thresholds):
    """535 (CUDA 12.2) >= 525.60.13, same major: CUDA minor-version compatibility, WARN by default."""
    healthy.update(driver="535.104.05", cuda_driver=12020, torch="2.7.0+cu128", torch_cuda="12.8", nvcc=None)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.WARN, out.message
    assert "minor-version" in out.message and "12.2" in out.message and "12.8" in out.message
    assert "570.26" in out.fix
    strict = copy.deepcopy(thresholds)
    strict["driver_cuda"]["minor_compat_status"] = "fail"
    assert dc.evaluate(healthy, strict).status == Status.FAIL


def test_driver_550_with_torch_12_6_warns_minor_compat(healthy, thresholds):
    healthy.update(driver="550.54.15", cuda_driver=12040, torch="2.6.0+cu126", torch_cuda="12.6", nvcc=None)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.WARN
    assert "minor-version compatibility" in out.message and "560.28.03" in out.message
    assert "whl/cu124" in out.fix  # the newest torch wheel a CUDA 12.4 driver fully supports


def test_minor_compat_from_driver_table_when_nvml_gave_no_number(healthy, thresholds):
    healthy.update(driver="550.54.15", cuda_driver=None, driver_source="proc", torch_cuda="12.6", nvcc=None)
    assert dc.evaluate(healthy, thresholds).status == Status.WARN


def test_driver_of_older_major_fails(healthy, thresholds):
    healthy.update(driver="470.82.01", cuda_driver=11040, torch="2.7.0+cu128", torch_cuda="12.8", nvcc=None)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "470.82.01" in out.message and "12.8" in out.message
    assert "570.26" in out.fix
    assert "download.pytorch.org" not in out.fix  # no torch wheel exists for CUDA 11.4: only the driver helps


def test_cuda13_torch_on_575_driver_fails(healthy, thresholds):
    """13.x minor-version compatibility needs >= 580: a 12.9 driver cannot run torch cu130."""
    healthy.update(driver="575.57.08", cuda_driver=12090)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "580.65.06" in out.fix


def test_nvcc_minor_mismatch_warns(healthy, thresholds):
    healthy.update(torch="2.7.0+cu128", torch_cuda="12.8", nvcc="12.4", nvcc_path="/usr/local/cuda-12.4/bin/nvcc")
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.WARN
    assert "nvcc 12.4" in out.message and "12.8" in out.message and "accepts" in out.message
    assert "CUDA_HOME=/usr/local/cuda-12.8" in out.fix


def test_nvcc_major_mismatch_warns_with_ds_exception(healthy, thresholds):
    healthy.update(nvcc="12.8")
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.WARN
    assert "CUDAMismatchException" in out.message


def test_slots_above_visible_gpus_fails(healthy, thresholds):
    healthy.update(slots=8)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "slots=8" in out.message and "invalid device ordinal" in out.message
    assert "slots=1" in out.fix


def test_cuda_visible_devices_hides_gpus(healthy, thresholds):
    healthy.update(cuda_visible_devices="", cuda_available=False, torch_gpu_count=0, slots=1)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "CUDA_VISIBLE_DEVICES=''" in out.message and "0 GPU(s) visible" in out.message


def test_cpu_only_torch_on_gpu_host_fails(healthy, thresholds):
    healthy.update(torch="2.13.0+cpu", torch_cuda=None, cuda_available=False, torch_gpu_count=0, nccl=None)
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "CPU-only" in out.message and "whl/cu130" in out.fix


def test_torch_cannot_init_cuda_fails(healthy, thresholds):
    healthy.update(cuda_available=False, torch_gpu_count=0, torch_cuda_warning="CUDA initialization: error 999")
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "error 999" in out.message


def test_torch_missing_still_checks_slots(healthy, thresholds):
    healthy.update(torch=None, torch_cuda=None, cuda_available=None, torch_gpu_count=None,
                   torch_error="ModuleNotFoundError: No module named 'torch'")
    assert dc.evaluate(healthy, thresholds).status == Status.PASS
    healthy["slots"] = 2
    assert dc.evaluate(healthy, thresholds).status == Status.FAIL


def test_driver_library_mismatch_fails(healthy, thresholds):
    healthy.update(driver=None, nvml_error="nvmlInit: RM has detected an NVML/RM version mismatch.")
    out = dc.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "reboot" in out.fix


def test_no_driver_skips_or_fails_when_expected(healthy, thresholds):
    facts = dict(healthy, driver=None, driver_source=None, cuda_driver=None, gpu_count=None, gpu_uuids=[],
                 proc_driver_version=None, nvml_error="nvmlInit: NVML Shared Library Not Found",
                 smi_error="rc=127: nvidia-smi: command not found")
    out = dc.evaluate(facts, thresholds)
    assert out.status == Status.SKIP and "no NVIDIA driver" in out.message
    expected = copy.deepcopy(thresholds)
    expected["gpu"]["gpus_expected"] = True
    out = dc.evaluate(facts, expected)
    assert out.status == Status.FAIL and "580.65.06" in out.fix  # torch cu130 needs >= 580.65.06
    assert dc.evaluate(dict(facts, gpus_expected=True), thresholds).status == Status.FAIL
    assert dc.evaluate(dict(facts, gpus_expected=False), expected).status == Status.SKIP


def test_nvidia_smi_timeout_is_error(healthy, thresholds):
    facts = dict(healthy, driver=None, nvml_error="cannot import pynvml", tool_timeout="nvidia-smi timed out")
    assert dc.evaluate(facts, thresholds).status == Status.ERROR


# --- collect, for real, on this machine --------------------------------------------------------

def test_collect_on_this_machine():
    ctx = HostContext(params={"slots": 1, "gpus_expected": None}, deadline=time.monotonic() + 120)
    facts = dc.collect(ctx)
    json.dumps(facts)  # JSON-serialisable
    assert facts["slots"] == 1
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver; the no-driver path is covered by the unit tests")
    assert facts["driver"] is None and facts["cuda_driver"] is None
    assert facts["nvml_error"]
    out = dc.evaluate(facts, load_defaults())
    assert out.status == Status.SKIP
    assert "no NVIDIA driver" in out.message


def test_collect_reads_driver_from_nvidia_smi_when_nvml_is_unavailable(tmp_path, monkeypatch):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("a real NVIDIA driver is present: NVML would answer instead of the fallback")
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat '{FIX / 'nvidia-smi.txt'}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    facts = dc.collect(HostContext(params={"slots": 2}, deadline=time.monotonic() + 120))
    json.dumps(facts)
    assert facts["driver"] == "580.159.04" and facts["driver_source"] == "nvidia-smi"
    assert facts["cuda_driver"] == 13000 and facts["gpu_count"] == 1
    assert facts["cuda_visible_devices"] == "0"
    out = dc.evaluate(facts, load_defaults())
    assert out.status == Status.FAIL and "slots=2" in out.message  # 1 GPU for 2 slots, whatever torch is here
