"""gpu: NVML/nvidia-smi normalisers and Xid parser on the recorded H100 outputs, evaluate with faults, real collect."""
from __future__ import annotations

import copy
import json
import os
import time

import pytest

from preflight.checks import gpu as g
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

from tests.h100 import FIX, read as _read
UUID = "GPU-fe97e4af-eedf-d1a1-0b31-d7e310aee1d8"


@pytest.fixture
def healthy():
    """Facts as collect records them on the recorded H100 (NVML readings normalised, dmesg readable, no Xid)."""
    nvml = json.loads(_read("nvml.txt"))
    return {
        "source": "nvml", "driver": nvml["driver"], "driver_present": True,
        "gpus": [g.normalize_nvml_gpu(raw, i) for i, raw in enumerate(nvml["gpus"])],
        "nvml_error": None, "smi_error": None, "tool_timeout": None, "proc_driver": True,
        "kernel_log_source": "dmesg", "kernel_log_error": None,
        "xid_lines": [ln for ln in _read("dmesg-xid.txt").splitlines() if "NVRM: Xid" in ln],
        "xid_lines_total": 0, "gpus_expected": None,
    }


def _gpu(facts):
    return facts["gpus"][0]


# --- parsers / normalisers on the fixtures ---------------------------------------------------------

def test_normalize_nvml_fixture():
    raw = json.loads(_read("nvml.txt"))["gpus"][0]
    gpu = g.normalize_nvml_gpu(raw, 0)
    assert gpu["index"] == 0 and gpu["uuid"] == UUID and gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["memory_total"] == 85520809984 and gpu["memory_used"] == 503316480
    assert gpu["memory_free"] == 85017493504
    assert gpu["cc"] == [9, 0]
    assert gpu["clock_event_reasons"] == g.CLOCK_GPU_IDLE
    assert (gpu["pcie_gen"], gpu["pcie_gen_max"], gpu["pcie_width"], gpu["pcie_width_max"]) == (5, 5, 16, 16)
    assert gpu["remap_pending"] is False and gpu["remap_failure"] is False
    assert gpu["retired_pages_pending"] is None and "retired_pages_pending" in gpu["unsupported"]
    assert gpu["pci_bus_id"] == "00000000:00:06.0"
    assert gpu["mig"] == [0, 0] and gpu["compute_mode"] == 0 and gpu["persistence"] == 1
    json.dumps(gpu)


def test_nvidia_smi_csv_fixture_agrees_with_nvml():
    rows = g.parse_nvidia_smi_csv(_read("nvidia-smi-csv.txt"))
    assert len(rows) == 1
    assert rows[0]["memory.total"] == "81559 MiB" and rows[0]["clocks_event_reasons.active"] == "0x0000000000000001"
    smi = g.normalize_smi_gpu(rows[0])
    nvml = g.normalize_nvml_gpu(json.loads(_read("nvml.txt"))["gpus"][0], 0)
    for key in ("index", "uuid", "name", "memory_total", "temp", "pcie_gen", "pcie_gen_max", "pcie_width",
                "pcie_width_max", "ecc_uncorrected_volatile", "clock_event_reasons", "persistence", "mig"):
        assert smi[key] == nvml[key], key
    assert smi["memory_used"] == 0  # nvidia-smi leaves the driver's reservation out
    assert smi["power_mw"] == 73010


def test_parse_xid():
    assert g.parse_xid(_read("dmesg-xid.txt")) == []
    text = ("[ 1234.5] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
            "[ 99.1] some other line\n"
            "6,1234,5678,-;NVRM: Xid (PCI:0000:00:06): 48, pid=1896, name=python, An uncorrectable double bit error\n")
    events = g.parse_xid(text)
    assert [e["xid"] for e in events] == [79, 48]
    assert events[0]["pci"] == "0000:3b:00" and "fallen off the bus" in events[0]["detail"]


# --- evaluate ---------------------------------------------------------------------------------

def test_healthy_h100_passes_idle_clock_reason_is_normal(healthy, thresholds):
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.PASS, out.message
    assert "1 GPU(s) healthy" in out.message and "NVIDIA H100 80GB HBM3" in out.message
    assert "no Xid errors" in out.message


def _only(out, status):
    bad = [f for f in out.findings if f.status != Status.PASS]
    assert out.status == status, out.message
    return bad


def test_pcie_width_downtrained_fails(healthy, thresholds):
    _gpu(healthy)["pcie_width"] = 8
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "x8" in out.message and "x16" in out.message and "GPU 0" in out.message and UUID in out.message
    assert "lspci" in out.fix and "00000000:00:06.0" in out.fix


def test_pcie_gen_below_max_warns(healthy, thresholds):
    _gpu(healthy)["pcie_gen"] = 3
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "Gen3" in out.message and "Gen5" in out.message


def test_uncorrectable_ecc_fails(healthy, thresholds):
    _gpu(healthy)["ecc_uncorrected_volatile"] = 2
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "2 uncorrectable ECC" in out.message and UUID in out.message and "nvidia-smi -r -i 0" in out.fix


def test_thermal_slowdown_fails_and_sw_thermal_warns(healthy, thresholds):
    _gpu(healthy)["clock_event_reasons"] = g.CLOCK_HW_THERMAL | g.CLOCK_GPU_IDLE
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "HW thermal slowdown" in out.message and "0x41" in out.message
    _gpu(healthy)["clock_event_reasons"] = g.CLOCK_SW_THERMAL
    assert g.evaluate(healthy, thresholds).status == Status.WARN
    _gpu(healthy)["clock_event_reasons"] = g.CLOCK_HW_POWER_BRAKE
    assert "power brake" in g.evaluate(healthy, thresholds).message
    _gpu(healthy)["clock_event_reasons"] = g.CLOCK_SW_POWER_CAP | g.CLOCK_GPU_IDLE  # normal
    assert g.evaluate(healthy, thresholds).status == Status.PASS


def test_xid_79_in_dmesg_fails_naming_gpu(healthy, thresholds):
    healthy["xid_lines"] = ["[ 812.3] NVRM: Xid (PCI:0000:00:06): 79, pid='<unknown>', name=<unknown>, "
                            "GPU has fallen off the bus."]
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL
    assert "Xid 79" in out.message and "GPU 0" in out.message and UUID in out.message
    assert "fallen off the bus" in out.message


def test_other_xids_warn_and_ignored_xids_pass(healthy, thresholds):
    healthy["xid_lines"] = ["NVRM: Xid (PCI:0000:00:06): 13, pid=77, name=python, Graphics Exception"]
    assert g.evaluate(healthy, thresholds).status == Status.WARN
    healthy["xid_lines"] = ["NVRM: Xid (PCI:0000:00:06): 45, pid=77, name=python, Ch 00000010"]
    assert g.evaluate(healthy, thresholds).status == Status.PASS
    healthy["xid_lines"] = ["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."]
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "PCI 0000:3b:00" in out.message  # a GPU NVML no longer lists


def test_unreadable_kernel_log_warns_with_the_reason_never_a_silent_pass(healthy, thresholds):
    healthy.update(kernel_log_source=None, xid_lines=[],
                   kernel_log_error="dmesg: read kernel buffer failed: Operation not permitted; "
                                    "/dev/kmsg: Permission denied")
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN  # issue 26: it was PASS, and a GPU that fell off the bus looked healthy
    assert "Xid scan skipped" in out.message and "Operation not permitted" in out.message
    assert "kernel.dmesg_restrict=0" in out.fix
    _gpu(healthy)["persistence"] = 0
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "Xid scan skipped" in out.message and "persistence" in out.message.lower()


def _lost(raw):
    return {k: "ERR NVMLError_GpuIsLost GPU is lost" for k in raw}


def test_a_gpu_whose_every_nvml_query_failed_fails_naming_the_error(healthy, thresholds):
    raw = json.loads(_read("nvml.txt"))["gpus"][0]
    healthy["gpus"] = [g.normalize_nvml_gpu(_lost(raw), 0)]
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "every query of the GPU failed" in out.message and "GpuIsLost" in out.message


def test_nvml_field_errors_warn_naming_the_fields_and_not_supported_stays_quiet(healthy, thresholds):
    raw = json.loads(_read("nvml.txt"))["gpus"][0]
    raw.update(ecc_uncorrected_volatile="ERR NVMLError_Unknown Unknown Error",
               remapped_rows="ERR NVMLError_Timeout Timeout")
    healthy["gpus"] = [g.normalize_nvml_gpu(raw, 0)]
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "2 of its health fields could not be read" in out.message
    assert "ecc_uncorrected_volatile: NVMLError_Unknown" in out.message and "remapped_rows" in out.message
    assert g.normalize_nvml_gpu(json.loads(_read("nvml.txt"))["gpus"][0], 0)["query_errors"] == {}


def test_nvidia_smi_field_errors_are_errors_too():
    rows = g.parse_nvidia_smi_csv(_read("nvidia-smi-csv.txt"))
    rows[0]["temperature.gpu"] = "[Unknown Error]"
    assert g.normalize_smi_gpu(rows[0])["query_errors"] == {"temperature.gpu": "[Unknown Error]"}


def test_persistence_off_warns(healthy, thresholds):
    _gpu(healthy)["persistence"] = 0
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "persistence mode is off" in out.message and "-pm 1" in out.fix


def test_mig_enabled_fails_unless_allowed(healthy, thresholds):
    _gpu(healthy)["mig"] = [1, 1]
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "MIG" in out.message and "-mig 0" in out.fix
    allowed = copy.deepcopy(thresholds)
    allowed["gpu"]["allow_mig"] = True
    assert g.evaluate(healthy, allowed).status == Status.PASS


def test_compute_mode(healthy, thresholds):
    _gpu(healthy)["compute_mode"] = 3
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "Exclusive_Process" in out.message and "-c DEFAULT" in out.fix
    _gpu(healthy)["compute_mode"] = 2
    assert g.evaluate(healthy, thresholds).status == Status.FAIL


def test_memory_used_by_other_process_warns(healthy, thresholds):
    gpu = _gpu(healthy)
    gpu["memory_used"] = 40 * 1024 ** 3
    gpu["processes"] = [{"pid": 4242, "used_memory": 40 * 1024 ** 3 - 503316480}]
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "pid 4242" in out.message and "40960 MiB" in out.message
    gpu["memory_used"], gpu["memory_reserved"] = 1500 * 1024 ** 2, 600 * 1024 ** 2  # 900 MiB by processes
    assert g.evaluate(healthy, thresholds).status == Status.PASS


def test_temperature(healthy, thresholds):
    _gpu(healthy)["temp"] = 84
    assert g.evaluate(healthy, thresholds).status == Status.WARN
    _gpu(healthy)["temp"] = 91
    assert g.evaluate(healthy, thresholds).status == Status.FAIL
    _gpu(healthy).update(temp=86, temp_slowdown=85)
    assert g.evaluate(healthy, thresholds).status == Status.FAIL


def test_row_remapping(healthy, thresholds):
    _gpu(healthy).update(remap_pending=True, remapped_rows_uncorrectable=1)
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.WARN and "remap is pending" in out.message
    _gpu(healthy)["remap_failure"] = True
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "RMA" in out.fix


def test_retired_pages_pending_warns(healthy, thresholds):
    _gpu(healthy)["retired_pages_pending"] = 1
    assert g.evaluate(healthy, thresholds).status == Status.WARN


def test_several_gpus_each_named(healthy, thresholds):
    second = copy.deepcopy(_gpu(healthy))
    second.update(index=1, uuid="GPU-second", pcie_width=4)
    healthy["gpus"].append(second)
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and "GPU 1 (GPU-second)" in out.message and "GPU 0 (" not in out.message
    assert "2 GPU(s)" not in out.message


def test_no_driver_skips_or_fails_when_expected(thresholds):
    facts = {"source": None, "driver": None, "driver_present": False, "gpus": [],
             "nvml_error": "nvmlInit: NVML Shared Library Not Found", "smi_error": "rc=127: nvidia-smi: command not found",
             "proc_driver": False, "gpus_expected": None}
    out = g.evaluate(facts, thresholds)
    assert out.status == Status.SKIP and "no NVIDIA driver" in out.message
    expected = copy.deepcopy(thresholds)
    expected["gpu"]["gpus_expected"] = True
    assert g.evaluate(facts, expected).status == Status.FAIL
    assert g.evaluate(dict(facts, gpus_expected=True), thresholds).status == Status.FAIL


def test_driver_loaded_but_unqueryable(thresholds):
    facts = {"source": None, "driver": None, "driver_present": True, "gpus": [], "proc_driver": True,
             "nvml_error": "cannot import pynvml", "smi_error": "rc=127: nvidia-smi: command not found",
             "tool_timeout": None}
    assert g.evaluate(facts, thresholds).status == Status.FAIL
    facts.update(smi_error="rc=124: timed out", tool_timeout="nvidia-smi timed out")
    assert g.evaluate(facts, thresholds).status == Status.ERROR


# --- collect, for real, on this machine --------------------------------------------------------

def test_collect_on_this_machine():
    facts = g.collect(HostContext(params={"gpus_expected": False}, deadline=time.monotonic() + 120))
    json.dumps(facts)
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver; the no-driver path is covered by the unit tests")
    assert facts["driver_present"] is False and facts["gpus"] == [] and facts["nvml_error"]
    out = g.evaluate(facts, load_defaults())
    assert out.status == Status.SKIP and "no NVIDIA driver" in out.message


FAKE_SMI = r"""#!/bin/sh
# Stands in for nvidia-smi: replays the recorded H100 outputs; rejects fields the recorded driver did not show,
# the way an older nvidia-smi rejects unknown --query-gpu fields.
case "$*" in
  *--query-gpu=*compute_cap*) echo 'Field "compute_cap" is not a valid field to query.'; exit 2 ;;
  *--query-gpu=*clocks_event_reasons.active*) cat "FIX/nvidia-smi-csv.txt" ;;
  *--query-remapped-rows=*) printf 'gpu_uuid, remapped_rows.correctable, remapped_rows.uncorrectable, remapped_rows.pending, remapped_rows.failure\nGPU-fe97e4af-eedf-d1a1-0b31-d7e310aee1d8, 0, 1, Yes, No\n' ;;
  "") cat "FIX/nvidia-smi.txt" ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("a real NVIDIA driver is present: NVML would answer instead of the fallback")
    script = tmp_path / "nvidia-smi"
    script.write_text(FAKE_SMI.replace("FIX", str(FIX)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    return script


def test_collect_falls_back_to_nvidia_smi_csv(fake_nvidia_smi, thresholds):
    facts = g.collect(HostContext(params={}, deadline=time.monotonic() + 120))
    json.dumps(facts)
    assert facts["source"] == "nvidia-smi" and facts["driver"] == "580.159.04" and facts["driver_present"]
    gpu = facts["gpus"][0]
    assert gpu["uuid"] == UUID and gpu["memory_total"] == 85520809984 and gpu["clock_event_reasons"] == 1
    assert gpu["remap_pending"] is True and gpu["remapped_rows_uncorrectable"] == 1
    assert facts["kernel_log_source"] or facts["kernel_log_error"]
    out = g.evaluate(facts, thresholds)
    assert out.status == Status.WARN and "remap is pending" in out.message


def test_kernel_log_reader_on_this_machine():
    facts = {}
    g._collect_kernel_log(HostContext(params={}, deadline=time.monotonic() + 60), facts)
    json.dumps(facts)
    assert bool(facts.get("kernel_log_source")) != bool(facts.get("kernel_log_error"))
    if facts.get("kernel_log_source"):
        assert isinstance(facts["xid_lines"], list) and facts["xid_lines_total"] == len(facts["xid_lines"])
    text, why = g._read_kmsg(time.monotonic() + 5)
    assert (text is None) == (why is not None)


def test_failed_gpus_names_the_gpus_whose_own_findings_fail_and_not_a_host_wide_fault(healthy, thresholds):
    """What the healthy hostfile's -e host:slot needs (preflight/launchable.py): the failing GPUs' indices."""
    second = copy.deepcopy(_gpu(healthy))
    second["index"] = 1
    healthy["gpus"].append(second)
    healthy["gpus"][1]["ecc_uncorrected_volatile"] = 3
    out = g.evaluate(healthy, thresholds)
    assert out.status == Status.FAIL and out.metrics["failed_gpus"] == [1]
    healthy["xid_lines"] = ["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."]
    assert "failed_gpus" not in g.evaluate(healthy, thresholds).metrics  # host-wide: the host goes, not a slot
