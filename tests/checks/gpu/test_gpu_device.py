"""On a real NVIDIA GPU: the gpu, driver_cuda and compute checks' GPU code paths, held to physical facts.

Marked ``gpu``. On a machine without an NVIDIA GPU (CI, this project's build machine) the whole module skips at
import with the machine's reason, which CI's strict-skip rule accepts (tests/conftest.py, EXPECTED_SKIPS);
bench/device_check.sh runs it on the device machine. What it asserts there, e.g. for the H200 of
bench/results/device-h200/run.json::

    NVML, as the gpu check records it: name "NVIDIA H200", uuid "GPU-cf337573-...", memory, temperature, PCIe,
      ECC and row-remap fields present and typed; the same GPUs as `nvidia-smi -L`; evaluate PASS or WARN
    compute: bf16 GEMM 687 TFLOPS within [20%, 105%] of the published 989; HBM copy 4185 GB/s of 4800
    pinned H2D 54.2 GB/s within [25%, 100%] of PCIe Gen5 x16's 63.0 GB/s
    `python3 -m preflight node-check --checks driver_cuda,gpu`: exit 0
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from preflight.checks import compute, driver_cuda, gpu
from preflight.config import load_defaults
from preflight.hostside.outcome import Status
from preflight.hostside.seams import HostContext

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.gpu

# The start of every skip reason that describes the machine; tests/conftest.py's EXPECTED_SKIPS holds it.
NO_GPU = "no NVIDIA GPU on this machine"
# `nvidia-smi -L`: "GPU 0: NVIDIA H200 (UUID: GPU-cf337573-011c-fdff-15b0-6d54cb01c722)" (MIG devices are indented
# "  MIG 1g.18gb Device 0: (UUID: MIG-...)" lines, not matched).
LIST_LINE = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9A-Fa-f-]+)\)\s*$", re.M)


def _gpus_here() -> Tuple[List[Tuple[int, str, str]], Optional[str]]:
    """(index, name, uuid) of each GPU `nvidia-smi -L` lists, or why this machine has none (None if it has)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return [], NO_GPU + " (no /dev/nvidia0 or other /dev/nvidiaN device node)"
    try:
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], NO_GPU + f" (/dev/nvidia0 exists, but nvidia-smi -L failed: {exc})"
    listed = [(int(m[1]), m[2].strip(), m[3]) for m in LIST_LINE.finditer(proc.stdout)]
    if proc.returncode or not listed:
        said = " ".join((proc.stderr or proc.stdout).split())[:200]
        return [], NO_GPU + f" (/dev/nvidia0 exists, but nvidia-smi -L failed: rc={proc.returncode} {said})"
    return listed, None


LISTED, WHY_NOT = _gpus_here()
if WHY_NOT:
    pytest.skip(WHY_NOT, allow_module_level=True)

# torch's cuda:N must be NVML's GPU N, as compute.collect arranges it; set before torch starts CUDA here.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

# Published peaks by NVML name (nvmlDeviceGetName, the name `nvidia-smi -L` prints): dense bf16 Tensor Core TFLOPS
# (the datasheets list the 2:4-sparse figure; dense is half of it) and memory bandwidth in GB/s.
#   NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 1,979 sparse -> 989 TFLOPS, 3.35 TB/s HBM3;
#     PCIe 1,513 -> 756 TFLOPS, 2.0 TB/s; NVL 1,671 -> 835 TFLOPS, 3.9 TB/s.
#   NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM 1,979 -> 989 TFLOPS, NVL 1,671 -> 835 TFLOPS,
#     both 4.8 TB/s HBM3e.
#   NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): 312 TFLOPS bf16 dense; 80GB SXM 2,039 GB/s, 80GB PCIe
#     1,935 GB/s, 40GB (SXM and PCIe) 1,555 GB/s.
# The same figures are [compute] gpu_peaks in preflight/checks/compute.toml (keyed without "NVIDIA "); this table is
# the test's own, so that a wrong entry there does not move the bound here.
PEAKS: Dict[str, Tuple[float, float]] = {
    "NVIDIA H100 80GB HBM3": (989.0, 3350.0),
    "NVIDIA H100 PCIe": (756.0, 2000.0),
    "NVIDIA H100 NVL": (835.0, 3900.0),
    "NVIDIA H200": (989.0, 4800.0),
    "NVIDIA H200 NVL": (835.0, 4800.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 2039.0),
    "NVIDIA A100-SXM4-40GB": (312.0, 1555.0),
    "NVIDIA A100 80GB PCIe": (312.0, 1935.0),
    "NVIDIA A100-PCIE-40GB": (312.0, 1555.0),
}
# Measured against a published peak: above PEAK_OVER x peak is impossible (boost clocks included), below PEAK_FLOOR x
# peak is a broken measurement or GPU (a healthy H200 measured 69% of GEMM and 87% of HBM peak with this code).
PEAK_OVER, PEAK_FLOOR = 1.05, 0.20
# A model not in PEAKS: only > 0 and below twice the largest known peak.
UNKNOWN_OVER = 2.0

# PCIe per lane and direction in GB/s after line coding (PCI-SIG base specifications): Gen1 2.5 GT/s and Gen2 5 GT/s
# with 8b/10b; Gen3 8, Gen4 16, Gen5 32 GT/s with 128b/130b; Gen6 64 GT/s in 256-byte FLITs carrying 242 bytes.
# Gen5 x16: 32 x 16 x 128/130 / 8 = 63.0 GB/s.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8,
                  6: 64 * 242 / 256 / 8}
# Pinned copies reach 80-90% of the link's rate (the H200: 54.2 of 63.0 GB/s); below a quarter the link or the host
# is broken; above the theoretical rate is impossible.
PCIE_OVER, PCIE_FLOOR = 1.0, 0.25
# Grace Hopper/Blackwell superchips reach host memory over NVLink-C2C, not PCIe: 900 GB/s both ways (NVIDIA GH200
# datasheet), so at most 450 GB/s each way.
C2C_MODELS, C2C_GBPS = ("GH200", "GB200"), 450.0

COMPUTE_PARAMS = ("seconds", "chunks", "gpu_gemm_n", "hbm_mib", "pcie_mib", "cpu_gemm_n", "cpu_copy_mib",
                  "cpu_threads")


def _ctx(**params: Any) -> HostContext:
    return HostContext(params=params, deadline=time.monotonic() + 240)


@pytest.fixture(scope="module")
def defaults() -> Dict[str, Dict[str, Any]]:
    return load_defaults()


@pytest.fixture(scope="module")
def gpu_facts() -> Dict[str, Any]:
    facts = gpu.collect(_ctx(gpus_expected=True))
    json.dumps(facts)  # they travel from the host as JSON
    return facts


@pytest.fixture(scope="module")
def driver_facts() -> Dict[str, Any]:
    facts = driver_cuda.collect(_ctx(slots=1, gpus_expected=True))
    json.dumps(facts)
    return facts


@pytest.fixture(scope="module")
def pynvml_here() -> Any:
    try:
        import pynvml  # nvidia-ml-py, the checks' first source
    except Exception as exc:  # an install step, not the machine: not an accepted skip under CI's strict rule
        pytest.skip(f"nvidia-ml-py (pynvml) is not importable by {sys.executable} ({exc}): "
                    "pip install nvidia-ml-py to read NVML")
    return pynvml


@pytest.fixture(scope="module")
def torch_cuda() -> Any:
    try:
        import torch
    except Exception as exc:  # an install step: not an accepted skip under CI's strict rule
        pytest.skip(f"torch is not importable by {sys.executable} ({exc}): "
                    "install a CUDA build of torch to measure the GPU")
    if not torch.version.cuda or not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} cannot use the GPU here (torch.version.cuda {torch.version.cuda}, "
                    f"CUDA_VISIBLE_DEVICES {os.environ.get('CUDA_VISIBLE_DEVICES')!r}): install a CUDA build of torch")
    return torch


@pytest.fixture(scope="module")
def measured(torch_cuda: Any, defaults: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """compute.collect on this host with the default [compute] settings: _measure_gpus, hence _gpu_compute and
    _gpu_pcie on every GPU torch sees."""
    lim = defaults["compute"]
    params = {k: lim[k] for k in COMPUTE_PARAMS}
    facts = compute.collect(params, _ctx(**params))
    json.dumps(facts)
    return facts


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nvml_gpu(facts: Dict[str, Any], measured_gpu: Dict[str, Any]) -> Dict[str, Any]:
    """The gpu check's record of the GPU that torch measured as ``measured_gpu`` (by UUID; by index when torch has
    no UUID and every GPU is visible)."""
    if measured_gpu.get("uuid"):
        found = [g for g in facts["gpus"] if g.get("uuid") == measured_gpu["uuid"]]
    elif os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        found = [g for g in facts["gpus"] if g.get("index") == measured_gpu.get("index")]
    else:
        found = []
    assert len(found) == 1, (f"cannot tell which NVML GPU torch's cuda:{measured_gpu.get('index')} "
                             f"({measured_gpu.get('uuid')}) is among {[g.get('uuid') for g in facts['gpus']]}")
    return found[0]


# --- NVML: fields present and typed, the same GPUs as nvidia-smi, a verdict that passes ------------------------------

def test_the_gpu_check_sees_the_gpus_nvidia_smi_lists(gpu_facts, driver_facts):
    assert gpu_facts["driver_present"] is True and gpu_facts["source"] in ("nvml", "nvidia-smi"), gpu_facts
    seen = [(g["index"], g["name"], g["uuid"]) for g in gpu_facts["gpus"]]
    assert seen == LISTED, f"the gpu check: {seen}; nvidia-smi -L: {LISTED}"
    assert isinstance(gpu_facts["driver"], str) and re.fullmatch(r"\d+\.\d+(\.\d+)?", gpu_facts["driver"]), gpu_facts
    assert driver_facts["driver"] == gpu_facts["driver"] and driver_facts["gpu_count"] == len(LISTED), driver_facts
    if driver_facts["driver_source"] == "nvml":
        assert driver_facts["gpu_uuids"] == [uuid for _, _, uuid in LISTED], driver_facts


def test_nvml_fields_are_present_and_typed(gpu_facts, pynvml_here):
    assert gpu_facts["source"] == "nvml", f"pynvml imports but the gpu check fell back: {gpu_facts['nvml_error']}"
    problems: List[str] = []
    for i, g in enumerate(gpu_facts["gpus"]):
        def want(key: str, ok: bool, what: str, g: Dict[str, Any] = g, i: int = i) -> None:
            if not ok:
                problems.append(f"GPU {i} {key}={g.get(key)!r}: want {what}")

        known = g.get("name") in PEAKS  # datacenter HBM GPUs: ECC and (Ampere on) row remapping are supported
        want("handle_error", not g.get("handle_error"), "NVML to open the GPU")
        want("index", g.get("index") == i, f"its position {i}")
        want("name", isinstance(g.get("name"), str) and bool(g["name"].strip()), "a name")
        want("uuid", isinstance(g.get("uuid"), str) and bool(re.fullmatch(
            r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", g["uuid"], re.I)), "GPU-<uuid>")
        want("pci_bus_id", isinstance(g.get("pci_bus_id"), str) and bool(re.fullmatch(
            r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", g["pci_bus_id"])), "domain:bus:device.function")
        total, free, used = g.get("memory_total"), g.get("memory_free"), g.get("memory_used")
        want("memory_total", _is_int(total) and total > 1 << 30, "bytes, over 1 GiB")
        want("memory_free", _is_int(free) and free >= 0, "bytes")
        want("memory_used", _is_int(used) and used >= 0, "bytes")
        if _is_int(total) and _is_int(free) and _is_int(used):
            want("memory_free", free + used <= total, f"free + used <= total {total}")
        want("memory_reserved", g.get("memory_reserved") is None or _is_int(g["memory_reserved"]), "bytes or None")
        want("temp", _is_int(g.get("temp")) and 0 < g["temp"] < 130, "degrees C")
        want("temp_slowdown", g.get("temp_slowdown") is None or (_is_int(g["temp_slowdown"]) and
                                                                 0 < g["temp_slowdown"] < 150), "degrees C or None")
        for key in ("power_mw", "power_limit_mw"):
            want(key, g.get(key) is None or (_is_int(g[key]) and g[key] > 0), "milliwatts or None")
        for key in ("pcie_gen", "pcie_gen_max"):
            want(key, g.get(key) in PCIE_LANE_GBPS, f"a PCIe generation {sorted(PCIE_LANE_GBPS)}")
        for key in ("pcie_width", "pcie_width_max"):
            want(key, g.get(key) in (1, 2, 4, 8, 16, 32), "a link width")
        want("clock_event_reasons", _is_int(g.get("clock_event_reasons")) and g["clock_event_reasons"] >= 0,
             "a bit mask")
        want("persistence", g.get("persistence") in (0, 1), "0 or 1")
        want("compute_mode", g.get("compute_mode") in gpu.COMPUTE_MODES, f"one of {sorted(gpu.COMPUTE_MODES)}")
        cc = g.get("cc")
        want("cc", isinstance(cc, list) and len(cc) == 2 and all(_is_int(v) for v in cc) and cc[0] >= 3,
             "[major, minor]")
        want("mig", g.get("mig") is None or (isinstance(g["mig"], list) and len(g["mig"]) == 2
                                              and all(v in (0, 1) for v in g["mig"])), "[current, pending] or None")
        want("retired_pages_pending", g.get("retired_pages_pending") in (None, 0, 1), "0, 1 or None")
        want("processes", isinstance(g.get("processes"), list) and all(
            isinstance(p, dict) and _is_int(p.get("pid")) for p in g["processes"]), "a list of {pid, used_memory}")
        want("unsupported", isinstance(g.get("unsupported"), list) and all(
            isinstance(k, str) for k in g["unsupported"]), "a list of field names")
        ecc = g.get("ecc_mode")
        want("ecc_mode", (ecc is None and not known) or (isinstance(ecc, list) and len(ecc) == 2
                                                          and all(v in (0, 1) for v in ecc)),
             "[current, pending] (a datacenter GPU supports ECC)")
        counters = ("ecc_uncorrected_volatile", "ecc_corrected_volatile", "ecc_uncorrected_aggregate")
        for key in counters:
            if isinstance(ecc, list) and ecc[:1] == [1]:
                want(key, _is_int(g.get(key)) and g[key] >= 0, "a count (ECC is on)")
            else:
                want(key, g.get(key) is None or _is_int(g[key]), "a count or None")
        remaps = isinstance(cc, list) and cc[:1] >= [8] and known  # row remapping: A100 and later
        for key in ("remapped_rows_correctable", "remapped_rows_uncorrectable"):
            want(key, (g.get(key) is None and not remaps) or (_is_int(g.get(key)) and g[key] >= 0), "a row count")
        for key in ("remap_pending", "remap_failure"):
            want(key, (g.get(key) is None and not remaps) or isinstance(g.get(key), bool), "True or False")
    assert not problems, "\n".join(problems)


def test_the_gpu_check_passes_or_warns_on_this_idle_gpu(gpu_facts, defaults):
    assert bool(gpu_facts["kernel_log_source"]) != bool(gpu_facts["kernel_log_error"]), gpu_facts
    out = gpu.evaluate(gpu_facts, defaults)
    assert out.status in (Status.PASS, Status.WARN), (out.status, out.message, out.fix)
    assert out.metrics["gpu_count"] == len(LISTED) and out.metrics["source"] == gpu_facts["source"]


def test_driver_cuda_facts_are_typed_and_its_verdict_passes_or_warns(driver_facts, defaults):
    f = driver_facts
    assert f["driver_source"] in ("nvml", "nvidia-smi"), f  # nvidia-smi -L answers here, so one of them did
    assert _is_int(f["cuda_driver"]) and f["cuda_driver"] >= 9000, f["cuda_driver"]  # 13000 is CUDA 13.0
    assert f["proc_driver_version"] in (None, f["driver"]), f  # the kernel module is the library's version
    assert f["gpu_evidence"] and any("/dev/nvidia" in e for e in f["gpu_evidence"]), f["gpu_evidence"]
    if f["torch"] is not None and f["torch_cuda"]:
        assert f["cuda_available"] is True and _is_int(f["torch_gpu_count"]) and f["torch_gpu_count"] >= 1, f
        assert isinstance(f["nccl"], str) and re.fullmatch(r"\d+\.\d+\.\d+", f["nccl"]), f["nccl"]
    out = driver_cuda.evaluate(f, defaults)
    assert out.status in (Status.PASS, Status.WARN), (out.status, out.message, out.fix)
    assert out.metrics["driver"] == f["driver"]


# --- compute: the measuring functions, within the physical bounds of the GPU model ----------------------------------

def test_compute_measures_every_gpu_torch_sees_with_nothing_failed(measured, torch_cuda, gpu_facts):
    assert measured["torch"] == torch_cuda.__version__ and "cuda_error" not in measured, measured
    gpus = measured.get("gpus") or []
    assert [g["index"] for g in gpus] == list(range(torch_cuda.cuda.device_count())), measured
    for g in gpus:
        assert "error" not in g, g
        assert isinstance(g["memory_gib"], float) and g["memory_gib"] > 1, g
        for key, _, _ in compute.GPU_METRICS:
            assert isinstance(g[key], float) and g[key] > 0, (key, g)
            assert isinstance(g[key + "_noise"], float) and 0 <= g[key + "_noise"] < 1, (key, g)
        assert g["name"] == _nvml_gpu(gpu_facts, g)["name"], (g, gpu_facts["gpus"])
    assert isinstance(measured["elapsed_s"], float) and measured["elapsed_s"] > 0


def _peak_bounds(name: str, key: str) -> Tuple[float, float]:
    """(floor, ceiling) of a healthy measurement of ``key`` (gemm_tflops or hbm_gbps) on the model ``name``."""
    index = ("gemm_tflops", "hbm_gbps").index(key)
    if name in PEAKS:
        return PEAK_FLOOR * PEAKS[name][index], PEAK_OVER * PEAKS[name][index]
    return 0.0, UNKNOWN_OVER * max(p[index] for p in PEAKS.values())


def test_bf16_gemm_and_hbm_copy_are_within_the_models_published_peaks(measured):
    problems = []
    for g in measured["gpus"]:
        for key in ("gemm_tflops", "hbm_gbps"):
            low, high = _peak_bounds(g["name"], key)
            if not low < float(g[key]) <= high:
                problems.append(f"GPU {g['index']} {g['name']}: {key}={g[key]:.1f} outside ({low:.1f}, {high:.1f}]")
    assert not problems, "\n".join(problems)


def test_pinned_copies_are_within_the_pcie_links_theoretical_rate(measured, gpu_facts):
    problems = []
    for g in measured["gpus"]:
        if any(model in g["name"] for model in C2C_MODELS):
            low, high, link = 0.0, C2C_GBPS, "NVLink-C2C"
        else:
            nv = _nvml_gpu(gpu_facts, g)
            # An idle GPU may train its link down (the gpu check says so); the copies run it at full speed, so the
            # bound is the link's maximum.
            gens = [v for v in (nv.get("pcie_gen"), nv.get("pcie_gen_max")) if v in PCIE_LANE_GBPS]
            widths = [v for v in (nv.get("pcie_width"), nv.get("pcie_width_max")) if _is_int(v) and v > 0]
            if not gens or not widths:
                problems.append(f"GPU {g['index']} {g['name']}: no PCIe link in the gpu check's facts: {nv}")
                continue
            gen, width = max(gens), max(widths)
            theoretical = PCIE_LANE_GBPS[gen] * width
            low, high, link = PCIE_FLOOR * theoretical, PCIE_OVER * theoretical, f"PCIe Gen{int(gen)} x{width}"
        for key in ("h2d_gbps", "d2h_gbps"):
            if not low <= float(g[key]) <= high:
                problems.append(f"GPU {g['index']} {g['name']}: {key}={g[key]:.2f} outside [{low:.2f}, {high:.2f}] "
                                f"GB/s of {link}")
    assert not problems, "\n".join(problems)


def test_the_measuring_functions_called_directly_return_their_shapes(torch_cuda):
    # Small sizes: this is the functions' contract, the bounds above are the measurement's.
    params = {"gpu_gemm_n": 2048, "hbm_mib": 256, "pcie_mib": 64}
    listed = compute._measure_gpus(torch_cuda, 1, params, 0.2, 3, time.monotonic() + 120)
    assert len(listed) == 1 and listed[0]["index"] == 0 and "error" not in listed[0], listed
    assert {k for k, _, _ in compute.GPU_METRICS} <= set(listed[0]), listed
    direct = dict(compute._gpu_compute(torch_cuda, 0, 0.2, 3, 2048, 256),
                  **compute._gpu_pcie(torch_cuda, 0, 0.1, 3, 64))
    keys = [k for k, _, _ in compute.GPU_METRICS]
    assert set(direct) >= set(keys) | {k + "_noise" for k in keys}, direct
    assert all(direct[k] > 0 for k in keys), direct
    # The ceilings only: small problems need not reach the floor a full-size one must.
    for key in ("gemm_tflops", "hbm_gbps"):
        assert direct[key] <= _peak_bounds(listed[0]["name"], key)[1], (key, direct)


def test_compute_evaluate_passes_or_warns_this_gpu_host(measured, defaults):
    out = compute.evaluate({"hosts": ["me"], "by_host": {"me": measured}, "errors": {}, "unreachable": []}, defaults)
    me = out["me"]
    assert me.status in (Status.PASS, Status.WARN), (me.status, me.message, me.fix)
    devices = me.metrics["devices"]
    assert [d["gemm_tflops"] for d in devices] == [g["gemm_tflops"] for g in measured["gpus"]], devices
    assert all(d["device"] == "gpu" for d in devices) and out["*"].status == Status.PASS, out["*"].message


# --- node-check -------------------------------------------------------------------------------------------------------

def test_node_check_of_the_gpu_checks_exits_0_on_this_healthy_gpu():
    # The GPU checks only: the rest of a node's checks (libaio, nvme...) judge its software, not its GPUs (the device
    # machine lacks libaio, so its full node-check FAILs).
    proc = subprocess.run([sys.executable, "-m", "preflight", "node-check", "--checks", "driver_cuda,gpu",
                           "--python", sys.executable, "-v"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text and proc.returncode == 0, text
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("preflight: ok"), text
    for check in ("driver_cuda", "gpu"):
        assert [ln for ln in lines if re.match(rf"\S+::{check} (PASS|WARN)(ED)? - ", ln)], text
