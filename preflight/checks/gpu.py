"""Per-GPU health from NVML (ECC, row remapping, PCIe link, clock slowdowns, temperature, modes) and Xids in dmesg.

Reads NVML through nvidia-ml-py; falls back to ``nvidia-smi --query-gpu=... --format=csv``:

    index, name, uuid, driver_version, memory.total [MiB], memory.used [MiB], temperature.gpu, ...
    0, NVIDIA H100 80GB HBM3, GPU-fe97e4af-..., 580.159.04, 81559 MiB, 0 MiB, 35, ..., 0x0000000000000001, Enabled

and scans the kernel log (``dmesg``, else /dev/kmsg) for lines like:

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.

Thresholds: [gpu] in gpu.toml beside this module (gpus_expected, temp_warn_c, temp_fail_c, memory_used_warn_mib,
allow_mig, xid_fail, xid_ignore).
"""
from __future__ import annotations

import errno
import os
import re
import shlex
import time
from typing import Any, Dict, List, Optional, Tuple

from ..hostside.outcome import Finding, Outcome, Status, combine, error, limits, skip
from ..hostside.seams import CheckSpec, HostContext
from ..hostside.nvidia import NVMLUnavailable, as_str, gpu_evidence, gpus_expected, nvml_session
from ..hostside.proc import read_text, sh

NAME = "gpu"


# nvml.h nvmlClocksEventReason* (same bits as the older nvmlClocksThrottleReason*).
CLOCK_GPU_IDLE = 0x1
CLOCK_APPLICATIONS_SETTING = 0x2
CLOCK_SW_POWER_CAP = 0x4
CLOCK_HW_SLOWDOWN = 0x8
CLOCK_SYNC_BOOST = 0x10
CLOCK_SW_THERMAL = 0x20
CLOCK_HW_THERMAL = 0x40
CLOCK_HW_POWER_BRAKE = 0x80
CLOCK_DISPLAY_SETTING = 0x100
# Reasons that mean trouble before a job starts; idle, app clocks, SW power cap, sync boost are normal.
CLOCK_TROUBLE = {
    CLOCK_HW_SLOWDOWN: ("HW slowdown", Status.FAIL),
    CLOCK_HW_THERMAL: ("HW thermal slowdown", Status.FAIL),
    CLOCK_HW_POWER_BRAKE: ("HW power brake slowdown", Status.FAIL),
    CLOCK_SW_THERMAL: ("SW thermal slowdown", Status.WARN),
}

COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}

# nvidia-smi --query-gpu fields, most complete first; older drivers reject unknown names, so fall back.
_SMI_FIELDS_FULL = ("index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used,memory.free,"
                    "temperature.gpu,power.draw,power.limit,pcie.link.gen.current,pcie.link.gen.max,"
                    "pcie.link.width.current,pcie.link.width.max,ecc.errors.uncorrected.volatile.total,"
                    "ecc.errors.corrected.volatile.total,clocks_event_reasons.active,persistence_mode,"
                    "mig.mode.current,mig.mode.pending,compute_mode,compute_cap,retired_pages.pending")
# A str.format template, filled in when queried: {reasons} = this driver's name for the clock event reasons.
_SMI_FIELDS_BASIC = ("index,name,uuid,pci.bus_id,driver_version,memory.total,memory.used,memory.free,"
                     "temperature.gpu,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
                     "pcie.link.width.max,ecc.errors.uncorrected.volatile.total,{reasons},persistence_mode,"
                     "mig.mode.current,compute_mode")

MIB = 1024 * 1024


# --- pure parsers / normalisers ----------------------------------------------------------------

def parse_nvidia_smi_csv(text: Optional[str]) -> List[Dict[str, str]]:
    """``--format=csv`` output -> one dict per GPU, keyed by field name without the unit ('memory.total')."""
    if not text:
        return []
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = [re.sub(r"\s*\[[^\]]*\]$", "", h.strip()) for h in lines[0].split(",")]
    rows = []
    for line in lines[1:]:
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(header):
            continue
        rows.append(dict(zip(header, values)))
    return rows


def _smi_number(value: Optional[str]) -> Optional[float]:
    if value is None:
        return None
    m = re.match(r"^\s*(-?\d+(?:\.\d+)?)", value)
    return float(m.group(1)) if m else None


def _smi_int(value: Optional[str]) -> Optional[int]:
    num = _smi_number(value)
    return int(num) if num is not None else None


def _smi_mib(value: Optional[str]) -> Optional[int]:
    num = _smi_number(value)
    return int(num * MIB) if num is not None else None


def _smi_flag(value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("enabled", "yes", "on", "1"):
        return 1
    if v in ("disabled", "no", "off", "0"):
        return 0
    return None


def normalize_smi_gpu(row: Dict[str, str]) -> Dict[str, Any]:
    """One row of parse_nvidia_smi_csv -> the facts["gpus"] schema (fields nvidia-smi lacks are None)."""
    reasons = row.get("clocks_event_reasons.active", row.get("clocks_throttle_reasons.active"))
    cc = row.get("compute_cap")
    cc_list = [int(p) for p in cc.split(".")[:2]] if cc and re.fullmatch(r"\d+\.\d+", cc) else None
    mode = (row.get("compute_mode") or "").replace(" ", "_").lower()
    compute_mode = {v.lower(): k for k, v in COMPUTE_MODES.items()}.get(mode)
    power = _smi_number(row.get("power.draw"))
    limit = _smi_number(row.get("power.limit"))
    mig_cur = _smi_flag(row.get("mig.mode.current"))
    mig_pend = _smi_flag(row.get("mig.mode.pending"))
    gpu = {
        "index": _smi_int(row.get("index")),
        "uuid": row.get("uuid"),
        "name": row.get("name"),
        "pci_bus_id": row.get("pci.bus_id"),
        "memory_total": _smi_mib(row.get("memory.total")),
        "memory_free": _smi_mib(row.get("memory.free")),
        "memory_used": _smi_mib(row.get("memory.used")),
        "memory_reserved": None,
        "cc": cc_list,
        "temp": _smi_int(row.get("temperature.gpu")),
        "temp_slowdown": None,
        "power_mw": int(power * 1000) if power is not None else None,
        "power_limit_mw": int(limit * 1000) if limit is not None else None,
        "pcie_gen": _smi_int(row.get("pcie.link.gen.current")),
        "pcie_gen_max": _smi_int(row.get("pcie.link.gen.max")),
        "pcie_width": _smi_int(row.get("pcie.link.width.current")),
        "pcie_width_max": _smi_int(row.get("pcie.link.width.max")),
        "ecc_mode": None,
        "ecc_uncorrected_volatile": _smi_int(row.get("ecc.errors.uncorrected.volatile.total")),
        "ecc_corrected_volatile": _smi_int(row.get("ecc.errors.corrected.volatile.total")),
        "ecc_uncorrected_aggregate": None,
        "remapped_rows_correctable": None,
        "remapped_rows_uncorrectable": None,
        "remap_pending": None,
        "remap_failure": None,
        "retired_pages_pending": _smi_flag(row.get("retired_pages.pending")),
        "clock_event_reasons": int(reasons, 16) if reasons and re.fullmatch(r"0x[0-9a-fA-F]+", reasons) else None,
        "persistence": _smi_flag(row.get("persistence_mode")),
        "mig": [mig_cur, mig_pend if mig_pend is not None else mig_cur] if mig_cur is not None else None,
        "compute_mode": compute_mode,
        "processes": [],
        "unsupported": sorted(k for k, v in row.items() if v in ("[N/A]", "N/A", "[Not Supported]")),
        # '[Unknown Error]', '[GPU requires reset]', '[GPU is lost]': nvidia-smi could not read the field.
        "query_errors": {k: v[:200] for k, v in sorted(row.items())
                         if isinstance(v, str) and v.startswith("[") and v not in ("[N/A]", "[Not Supported]")},
        "queried": len(row),
    }
    return gpu


def _nvml_value(value: Any) -> Any:
    """The raw NVML dump writes 'ERR <exception>' for a query NVML refused (NotSupported...): None here."""
    if isinstance(value, str) and value.startswith("ERR"):
        return None
    return value


def normalize_nvml_gpu(raw: Dict[str, Any], index: int) -> Dict[str, Any]:
    """Raw NVML readings (the shape of tests/fixtures/h100-host/nvml.txt's gpus[i]) -> facts["gpus"] schema."""
    mem = _nvml_value(raw.get("memory")) or {}
    pci = _nvml_value(raw.get("pci")) or {}
    rows = _nvml_value(raw.get("remapped_rows"))
    rows = list(rows) if isinstance(rows, (list, tuple)) and len(rows) == 4 else None
    ecc_mode = _nvml_value(raw.get("ecc_mode"))
    mig = _nvml_value(raw.get("mig"))
    cc = _nvml_value(raw.get("cc"))
    return {
        "index": index,
        "uuid": _nvml_value(raw.get("uuid")),
        "name": _nvml_value(raw.get("name")),
        "pci_bus_id": pci.get("busId") if isinstance(pci, dict) else None,
        "memory_total": mem.get("total"),
        "memory_free": mem.get("free"),
        "memory_used": mem.get("used"),
        "memory_reserved": mem.get("reserved"),
        "cc": list(cc) if isinstance(cc, (list, tuple)) else None,
        "temp": _nvml_value(raw.get("temp")),
        "temp_slowdown": _nvml_value(raw.get("temp_slowdown")),
        "power_mw": _nvml_value(raw.get("power_mw")),
        "power_limit_mw": _nvml_value(raw.get("power_limit_mw")),
        "pcie_gen": _nvml_value(raw.get("pcie_gen")),
        "pcie_gen_max": _nvml_value(raw.get("pcie_gen_max")),
        "pcie_width": _nvml_value(raw.get("pcie_width")),
        "pcie_width_max": _nvml_value(raw.get("pcie_width_max")),
        "ecc_mode": list(ecc_mode) if isinstance(ecc_mode, (list, tuple)) else None,
        "ecc_uncorrected_volatile": _nvml_value(raw.get("ecc_uncorrected_volatile")),
        "ecc_corrected_volatile": _nvml_value(raw.get("ecc_corrected_volatile")),
        "ecc_uncorrected_aggregate": _nvml_value(raw.get("ecc_uncorrected_aggregate")),
        "remapped_rows_correctable": rows[0] if rows else None,
        "remapped_rows_uncorrectable": rows[1] if rows else None,
        "remap_pending": bool(rows[2]) if rows else None,
        "remap_failure": bool(rows[3]) if rows else None,
        "retired_pages_pending": _nvml_value(raw.get("retired_pages_pending")),
        "clock_event_reasons": _nvml_value(raw.get("throttle")),
        "persistence": _nvml_value(raw.get("persistence")),
        "mig": list(mig) if isinstance(mig, (list, tuple)) else None,
        "compute_mode": _nvml_value(raw.get("compute_mode")),
        "processes": list(_nvml_value(raw.get("processes")) or []),
        "unsupported": sorted(k for k, v in raw.items() if isinstance(v, str) and v.startswith("ERR")
                              and "NotSupported" in v),
        # Any other refusal (GpuIsLost, Unknown, Timeout...) is a query that failed: evidence, never a silent None.
        "query_errors": {k: v[4:][:200] for k, v in sorted(raw.items())
                         if isinstance(v, str) and v.startswith("ERR") and "NotSupported" not in v},
        "queried": len(raw),
    }


_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.\d)?\):\s*(\d+),\s*(.*)")


def parse_xid(text: Optional[str]) -> List[Dict[str, Any]]:
    """Kernel log text -> [{"xid": 79, "pci": "0000:3b:00", "detail": "pid=..., GPU has fallen off the bus."}]."""
    events = []
    for line in (text or "").splitlines():
        m = _XID_RE.search(line)
        if m:
            events.append({"xid": int(m.group(2)), "pci": m.group(1).lower(), "detail": m.group(3).strip()[:300]})
    return events


def _pci_key(bus_id: Optional[str]) -> Optional[Tuple[int, int, int]]:
    """'00000000:00:06.0' or '0000:00:06' -> (domain, bus, device)."""
    if not bus_id:
        return None
    m = re.match(r"^([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})", bus_id.strip())
    if not m:
        return None
    return int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)


# --- host side -------------------------------------------------------------------------------

def _nvml_call(raw: Dict[str, Any], key: str, fn: Any, *args: Any) -> Any:
    try:
        value = fn(*args)
    except Exception as exc:  # noqa: BLE001 - NotSupported etc. is a fact about this GPU
        raw[key] = f"ERR {type(exc).__name__} {exc}"
        return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    raw[key] = value
    return value


def _read_nvml_gpu(pynvml: Any, handle: Any) -> Dict[str, Any]:
    raw: Dict[str, Any] = {}
    _nvml_call(raw, "name", pynvml.nvmlDeviceGetName, handle)
    _nvml_call(raw, "uuid", pynvml.nvmlDeviceGetUUID, handle)
    _nvml_call(raw, "serial", pynvml.nvmlDeviceGetSerial, handle)
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        raw["memory"] = {"total": int(mem.total), "free": int(mem.free), "used": int(mem.used)}
        # v1: used = total - free, including the driver/firmware reservation (480 MiB on an idle H100);
        # v2 reports that reservation separately, and evaluate subtracts it.
        try:
            mem2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            raw["memory"]["reserved"] = int(mem2.reserved)
        except Exception:  # noqa: BLE001
            pass
    except Exception as exc:  # noqa: BLE001
        raw["memory"] = f"ERR {type(exc).__name__} {exc}"
    _nvml_call(raw, "temp", pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
    _nvml_call(raw, "temp_slowdown", pynvml.nvmlDeviceGetTemperatureThreshold, handle,
               pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    _nvml_call(raw, "power_mw", pynvml.nvmlDeviceGetPowerUsage, handle)
    _nvml_call(raw, "power_limit_mw", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    _nvml_call(raw, "pcie_gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
    _nvml_call(raw, "pcie_gen_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    _nvml_call(raw, "pcie_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
    _nvml_call(raw, "pcie_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
    _nvml_call(raw, "ecc_mode", lambda h: list(pynvml.nvmlDeviceGetEccMode(h)), handle)
    _nvml_call(raw, "ecc_uncorrected_volatile", pynvml.nvmlDeviceGetTotalEccErrors, handle,
               pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    _nvml_call(raw, "ecc_corrected_volatile", pynvml.nvmlDeviceGetTotalEccErrors, handle,
               pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
    _nvml_call(raw, "ecc_uncorrected_aggregate", pynvml.nvmlDeviceGetTotalEccErrors, handle,
               pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC)
    _nvml_call(raw, "remapped_rows", lambda h: [int(v) for v in pynvml.nvmlDeviceGetRemappedRows(h)], handle)
    reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    _nvml_call(raw, "throttle", reasons_fn, handle)
    _nvml_call(raw, "persistence", pynvml.nvmlDeviceGetPersistenceMode, handle)
    _nvml_call(raw, "mig", lambda h: list(pynvml.nvmlDeviceGetMigMode(h)), handle)
    _nvml_call(raw, "compute_mode", pynvml.nvmlDeviceGetComputeMode, handle)
    _nvml_call(raw, "cc", lambda h: list(pynvml.nvmlDeviceGetCudaComputeCapability(h)), handle)
    _nvml_call(raw, "sm_clock", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
    _nvml_call(raw, "sm_clock_max", pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM)
    try:
        info = pynvml.nvmlDeviceGetPciInfo(handle)
        bus = as_str(info.busId)
        raw["pci"] = {"busId": bus}
    except Exception as exc:  # noqa: BLE001
        raw["pci"] = f"ERR {type(exc).__name__} {exc}"
    _nvml_call(raw, "retired_pages_pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    _nvml_call(raw, "processes", lambda h: [
        {"pid": int(p.pid), "used_memory": (int(p.usedGpuMemory) if p.usedGpuMemory is not None else None)}
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)], handle)
    return raw


def _collect_nvml(facts: Dict[str, Any]) -> bool:
    try:
        with nvml_session() as pynvml:
            try:
                facts["driver"] = as_str(pynvml.nvmlSystemGetDriverVersion())
                gpus = []
                for i in range(int(pynvml.nvmlDeviceGetCount())):
                    try:
                        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    except Exception as exc:  # noqa: BLE001 - a GPU NVML cannot open is itself a finding
                        gpus.append(dict(normalize_nvml_gpu({}, i), handle_error=f"{type(exc).__name__} {exc}"))
                        continue
                    gpus.append(normalize_nvml_gpu(_read_nvml_gpu(pynvml, handle), i))
                facts["gpus"] = gpus
                facts["source"] = "nvml"
                return True
            except Exception as exc:  # noqa: BLE001
                facts["nvml_error"] = f"NVML query: {str(exc) or type(exc).__name__}"
                return False
    except NVMLUnavailable as exc:
        facts["nvml_error"] = str(exc)
        return False


def _collect_smi(ctx: HostContext, facts: Dict[str, Any]) -> None:
    attempts = [_SMI_FIELDS_FULL, _SMI_FIELDS_BASIC.format(reasons="clocks_event_reasons.active"),
                _SMI_FIELDS_BASIC.format(reasons="clocks_throttle_reasons.active")]
    res = None
    for fields in attempts:
        res = sh(["nvidia-smi", "--query-gpu=" + fields, "--format=csv"], timeout=ctx.remaining(30))
        if res.ok or res.rc in (124, 126, 127):
            break
    assert res is not None
    if res.rc == 124:
        facts["tool_timeout"] = "nvidia-smi timed out"
    if not res.ok:
        facts["smi_error"] = f"rc={res.rc}: {(res.err or res.out).strip()}"[:500]
        return
    rows = parse_nvidia_smi_csv(res.out)
    facts["gpus"] = [normalize_smi_gpu(r) for r in rows]
    facts["source"] = "nvidia-smi"
    if rows:
        facts["driver"] = rows[0].get("driver_version")
    remap = sh(["nvidia-smi", "--query-remapped-rows=gpu_uuid,remapped_rows.correctable,"
                "remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure", "--format=csv"],
               timeout=ctx.remaining(30))
    if remap.ok:
        by_uuid = {r.get("gpu_uuid"): r for r in parse_nvidia_smi_csv(remap.out)}
        for gpu in facts["gpus"]:
            r = by_uuid.get(gpu.get("uuid"))
            if r:
                gpu["remapped_rows_correctable"] = _smi_int(r.get("remapped_rows.correctable"))
                gpu["remapped_rows_uncorrectable"] = _smi_int(r.get("remapped_rows.uncorrectable"))
                pending, failure = _smi_flag(r.get("remapped_rows.pending")), _smi_flag(r.get("remapped_rows.failure"))
                gpu["remap_pending"] = bool(pending) if pending is not None else None
                gpu["remap_failure"] = bool(failure) if failure is not None else None


def _read_kmsg(deadline: float) -> Tuple[Optional[str], Optional[str]]:
    """All records of /dev/kmsg without blocking; (text, None) or (None, reason)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return None, f"/dev/kmsg: {exc.strerror or exc}"
    chunks: List[str] = []
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    break
                if exc.errno == errno.EPIPE:  # a record was overwritten while reading: go on
                    continue
                return None, f"/dev/kmsg: {exc.strerror or exc}"
            if not data:
                break
            line = data.decode(errors="replace")
            if "NVRM" in line:
                chunks.append(line.split(";", 1)[-1])
    finally:
        os.close(fd)
    return "".join(chunks), None


def _collect_kernel_log(ctx: HostContext, facts: Dict[str, Any]) -> None:
    res = sh(["dmesg"], timeout=ctx.remaining(20))
    text: Optional[str] = None
    if res.ok:
        text, facts["kernel_log_source"] = res.out, "dmesg"
    else:
        last = ((res.err or res.out).strip().splitlines() or [f"rc={res.rc}"])[-1]
        reasons = [f"dmesg: {last[:200]}"]
        text, why = _read_kmsg(time.monotonic() + ctx.remaining(10))
        if text is None:
            reasons.append(why or "/dev/kmsg unreadable")
            facts["kernel_log_error"] = "; ".join(reasons)
            return
        facts["kernel_log_source"] = "/dev/kmsg"
    lines = [ln.strip() for ln in text.splitlines() if "NVRM: Xid" in ln]
    facts["xid_lines"] = lines[-200:]
    facts["xid_lines_total"] = len(lines)


def collect(ctx: HostContext) -> Dict[str, Any]:
    facts: Dict[str, Any] = {
        "source": None, "driver": None, "driver_present": False, "gpus": [],
        "nvml_error": None, "smi_error": None, "tool_timeout": None,
        "proc_driver": read_text("/proc/driver/nvidia/version") is not None,
        "kernel_log_source": None, "kernel_log_error": None, "xid_lines": [], "xid_lines_total": 0,
        "gpus_expected": ctx.params.get("gpus_expected"),
    }
    if not _collect_nvml(facts):
        _collect_smi(ctx, facts)
    facts["driver_present"] = bool(facts["source"] or facts["proc_driver"])
    if facts["driver_present"]:
        _collect_kernel_log(ctx, facts)
    else:
        facts["gpu_evidence"] = gpu_evidence()
    return facts


# --- evaluation ------------------------------------------------------------------------------

def _label(gpu: Dict[str, Any]) -> str:
    return f"GPU {gpu.get('index')} ({gpu.get('uuid') or 'uuid unknown'})"


def _gpu_findings(gpu: Dict[str, Any], thresholds: Dict[str, Any]) -> List[Finding]:
    label = _label(gpu)
    i = shlex.quote(str(gpu.get("index")))  # host-reported: one shell word in every printed command
    reset = f"sudo nvidia-smi -r -i {i} (GPU reset, needs the GPU idle) or reboot"
    f, unreadable = _readability(gpu, label, i, reset)
    if unreadable:
        return f
    lim = limits(thresholds, NAME)
    for found in (_memory_health(gpu, label, reset), _pcie_link(gpu, label, i), _clocks(gpu, label, i),
                  _temperature(gpu, label, lim), _modes(gpu, label, i, reset, lim), _memory_in_use(gpu, label, lim)):
        f.extend(found)
    return f


def _readability(gpu: Dict[str, Any], label: str, i: str, reset: str) -> Tuple[List[Finding], bool]:
    """(findings, whether nothing else can be judged): NVML could not open the GPU, or every query failed; a
    WARN when only some health fields could not be read."""
    if gpu.get("handle_error"):
        return [Finding(Status.FAIL, f"{label}: NVML cannot open the GPU: {gpu['handle_error']}",
                        f"check `nvidia-smi -i {i} -q` and `dmesg | grep -i xid`; {reset}")], True
    errors = gpu.get("query_errors") or {}
    if not errors:
        return [], False
    shown = "; ".join(f"{k}: {v}" for k, v in list(errors.items())[:4])
    if len(errors) >= int(gpu.get("queried") or 0) > 0:
        return [Finding(Status.FAIL, f"{label}: every query of the GPU failed ({shown})",
                        f"check `nvidia-smi -i {i} -q` and `dmesg | grep -i xid`; {reset}")], True
    return [Finding(Status.WARN, f"{label}: {len(errors)} of its health fields could not be read, so they were not "
                                 f"checked ({shown})",
                    f"check `nvidia-smi -i {i} -q`; a field that errors on an idle GPU often precedes a GPU that "
                    "falls off the bus")], False


def _memory_health(gpu: Dict[str, Any], label: str, reset: str) -> List[Finding]:
    """Uncorrectable ECC errors, failed or pending row remaps, pending page retirement."""
    f: List[Finding] = []
    unc = gpu.get("ecc_uncorrected_volatile")
    if unc:
        f.append(Finding(Status.FAIL, f"{label}: {int(unc)} uncorrectable ECC error(s) since the driver loaded "
                                      "(volatile); expected 0",
                         f"drain the host; {reset}, re-run preflight; RMA the GPU if errors return"))
    if gpu.get("remap_failure"):
        f.append(Finding(Status.FAIL, f"{label}: row remapping failed (no spare rows left); expected no failure",
                         "drain the host and RMA the GPU (nvidia-smi -q -d ROW_REMAPPER shows the failure)"))
    if gpu.get("remap_pending"):
        f.append(Finding(Status.WARN, f"{label}: a memory row remap is pending "
                                      f"({gpu.get('remapped_rows_uncorrectable')} uncorrectable, "
                                      f"{gpu.get('remapped_rows_correctable')} correctable rows remapped); it takes "
                                      "effect only after a GPU reset",
                         reset))
    if gpu.get("retired_pages_pending"):
        f.append(Finding(Status.WARN, f"{label}: retired memory pages are pending; they are retired only after a "
                                      "GPU reset", reset))
    return f


def _pcie_link(gpu: Dict[str, Any], label: str, i: str) -> List[Finding]:
    """A link narrower than the GPU's maximum (FAIL) or slower (WARN: idle GPUs may lower it)."""
    f: List[Finding] = []
    gen, gen_max = gpu.get("pcie_gen"), gpu.get("pcie_gen_max")
    width, width_max = gpu.get("pcie_width"), gpu.get("pcie_width_max")
    if width is not None and width_max and width < width_max:
        bus = shlex.quote(str(gpu.get("pci_bus_id") or "BUS_ID"))
        f.append(Finding(Status.FAIL, f"{label}: PCIe link downtrained to x{int(width)} (expected x{int(width_max)}): "
                                      f"host<->GPU bandwidth is cut to {int(100 * width // width_max)}%",
                         f"reseat the GPU/riser or replace the cable; check `sudo lspci -vv -s {bus} | grep -i "
                         "LnkSta` and the BIOS PCIe settings"))
    if gen is not None and gen_max and gen < gen_max:
        f.append(Finding(Status.WARN, f"{label}: PCIe link at Gen{int(gen)}, expected Gen{int(gen_max)} (idle GPUs "
                                      "may lower the link speed to save power; downtrained if it stays low under "
                                      "load)",
                         f"check under load: nvidia-smi -i {i} --query-gpu=pcie.link.gen.current,"
                         "pcie.link.gen.max --format=csv; if still low, reseat the GPU and check the BIOS "
                         "PCIe speed setting"))
    return f


def _clocks(gpu: Dict[str, Any], label: str, i: str) -> List[Finding]:
    """Each clock event reason of CLOCK_TROUBLE that holds the clocks down before the job."""
    f: List[Finding] = []
    reasons = gpu.get("clock_event_reasons")
    if reasons:
        for bit, (name, status) in sorted(CLOCK_TROUBLE.items()):
            if reasons & bit:
                f.append(Finding(status, f"{label}: clocks held down by {name} (clock event reasons 0x{reasons:x}, "
                                         f"temp {gpu.get('temp')} C, power {_watts(gpu.get('power_mw'))} W); "
                                         "expected none before the job",
                                 f"check cooling/airflow and PSU/power capping (nvidia-smi -q -i {i} -d "
                                 "PERFORMANCE,TEMPERATURE,POWER); drain the host if it persists"))
    return f


def _temperature(gpu: Dict[str, Any], label: str, lim: Dict[str, Any]) -> List[Finding]:
    """FAIL at temp_fail_c (or the GPU's own slowdown threshold, if lower), WARN at temp_warn_c."""
    temp = gpu.get("temp")
    warn_c, fail_c = lim["temp_warn_c"], lim["temp_fail_c"]
    slowdown = gpu.get("temp_slowdown")
    if isinstance(slowdown, (int, float)) and slowdown > 0:
        fail_c = min(fail_c, slowdown)
    if temp is None:
        return []
    if temp >= fail_c:
        shown_slowdown = slowdown if slowdown else "unknown"
        return [Finding(Status.FAIL, f"{label}: temperature {int(temp)} C >= {int(fail_c)} C (slowdown threshold "
                                     f"{shown_slowdown} C)",
            "check fans/airflow/coolant for this host; the GPU will throttle under load")]
    if temp >= warn_c:
        return [Finding(Status.WARN, f"{label}: temperature {int(temp)} C >= {int(warn_c)} C before the job started",
                        "check fans/airflow/coolant; an idle GPU should run well below this")]
    return []


def _modes(gpu: Dict[str, Any], label: str, i: str, reset: str, lim: Dict[str, Any]) -> List[Finding]:
    """Persistence mode off, MIG on (or a change pending), a compute mode other than Default."""
    f: List[Finding] = []
    if gpu.get("persistence") == 0:
        f.append(Finding(Status.WARN, f"{label}: persistence mode is off (each job pays driver init, and GPU state "
                                      "can reset between jobs)",
                         f"sudo nvidia-smi -i {i} -pm 1 (better: sudo systemctl enable --now nvidia-persistenced)"))

    mig = gpu.get("mig")
    if mig and mig[0] == 1 and not lim["allow_mig"]:
        f.append(Finding(Status.FAIL, f"{label}: MIG mode is enabled: the GPU is split into instances and NCCL "
                                      "cannot communicate between MIG instances",
                         f"sudo nvidia-smi -i {i} -mig 0 && {reset} (or set [gpu] allow_mig = true)"))
    elif mig and len(mig) > 1 and mig[1] is not None and mig[0] != mig[1]:
        f.append(Finding(Status.WARN, f"{label}: a MIG mode change is pending (current {mig[0]}, pending {mig[1]})",
                         reset))

    mode = gpu.get("compute_mode")
    if mode is not None and mode != 0:
        name = COMPUTE_MODES.get(mode, str(mode))
        status = Status.FAIL if mode == 2 else Status.WARN
        why = ("no process can create a CUDA context" if mode == 2 else
               "only one process may hold a context; anything else on the GPU (another rank, a monitor, a "
               "leftover process) makes the job fail")
        f.append(Finding(status, f"{label}: compute mode is {name}, expected Default: {why}",
                         f"sudo nvidia-smi -i {i} -c DEFAULT"))
    return f


def _memory_in_use(gpu: Dict[str, Any], label: str, lim: Dict[str, Any]) -> List[Finding]:
    """A WARN when more than memory_used_warn_mib (beyond the driver's reservation) is in use before the job."""
    used = gpu.get("memory_used")
    if used is None:
        return []
    in_use = max(0, used - (gpu.get("memory_reserved") or 0))
    limit = int(lim["memory_used_warn_mib"]) * MIB
    if in_use <= limit:
        return []
    procs = gpu.get("processes") or []
    who = ", ".join(f"pid {p.get('pid')} ({_mib(p.get('used_memory'))} MiB)" for p in procs[:5])
    in_use_mib, total_mib = int(in_use // MIB), int((gpu.get("memory_total") or 0) // MIB)
    owners = ": " + who if who else ""
    return [Finding(Status.WARN, f"{label}: {in_use_mib} MiB of {total_mib} MiB already in use before the job "
                                 f"(threshold {limit // MIB} MiB){owners}",
                    "find the owners with `nvidia-smi --query-compute-apps=pid,process_name,used_memory "
                    "--format=csv` and stop them (kill PID) before launching")]


def _watts(mw: Any) -> str:
    return f"{mw / 1000.0:.0f}" if isinstance(mw, (int, float)) else "?"


def _mib(b: Any) -> str:
    return str(b // MIB) if isinstance(b, int) else "?"


def _xid_findings(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> List[Finding]:
    lim = limits(thresholds, NAME)
    fail_set = set(int(x) for x in lim["xid_fail"])
    ignore = set(int(x) for x in lim["xid_ignore"])
    by_pci = {}
    for gpu in facts.get("gpus") or []:
        key = _pci_key(gpu.get("pci_bus_id"))
        if key:
            by_pci[key] = gpu
    grouped: Dict[Tuple[int, str], List[Dict[str, Any]]] = {}
    for ev in parse_xid("\n".join(facts.get("xid_lines") or [])):
        if ev["xid"] in ignore:
            continue
        grouped.setdefault((ev["xid"], ev["pci"]), []).append(ev)
    findings = []
    for (xid, pci), events in sorted(grouped.items()):
        gpu = by_pci.get(_pci_key(pci))  # type: ignore[arg-type]
        where = _label(gpu) if gpu else f"GPU at PCI {pci}"
        index = gpu.get("index") if gpu else "N"
        last = events[-1]["detail"]
        if xid in fail_set:
            findings.append(Finding(
                Status.FAIL, f"{where}: Xid {xid} in the kernel log ({len(events)} time(s) since boot; last: "
                             f"{last}); expected none of the hardware Xids {sorted(fail_set)}",
                f"drain the host; reset the GPU (sudo nvidia-smi -r -i {index}) or power-cycle the host for Xid "
                f"79, check `nvidia-smi -q -i {index}`, RMA if it recurs (the lines stay in dmesg until reboot)"))
        else:
            findings.append(Finding(
                Status.WARN, f"{where}: Xid {xid} in the kernel log ({len(events)} time(s) since boot; last: "
                             f"{last})",
                f"look up Xid {xid} in NVIDIA's Xid catalog; most non-hardware Xids come from an earlier job's "
                "fault; add it to [gpu] xid_ignore if it is expected here"))
    return findings


def _unqueried(facts: Dict[str, Any], expected: bool, why_expected: str, metrics: Dict[str, Any]) -> Optional[Outcome]:
    """The outcome when there is no driver, or nothing could query the GPUs; None when they were read."""
    if not facts.get("driver_present"):
        nvml_error, smi_error = facts.get("nvml_error") or "unavailable", facts.get("smi_error") or "unavailable"
        reason = (f"no NVIDIA driver on this host (NVML: {nvml_error}; nvidia-smi: {smi_error}; "
                  "/proc/driver/nvidia/version absent)")
        if expected:
            return combine([Finding(Status.FAIL, reason + f", but GPUs are expected ({why_expected})",
                                    "install the NVIDIA datacenter driver and check that `nvidia-smi` lists the "
                                    "GPUs")], "", metrics)
        return skip(reason + "; GPU health does not apply (set gpus_expected = true to make this a failure)",
                    **metrics)

    if not facts.get("source"):
        if facts.get("tool_timeout"):
            return error(f"could not query the GPUs: {facts['tool_timeout']} (NVML: {facts.get('nvml_error')})",
                         "run `nvidia-smi` by hand; a hang usually means a GPU needs a reset or the host a reboot",
                         **metrics)
        return combine([Finding(Status.FAIL, "the NVIDIA kernel module is loaded but neither NVML "
                                             f"({facts.get('nvml_error')}) nor nvidia-smi "
                                             f"({facts.get('smi_error')}) can query the GPUs",
                                "install nvidia-ml-py / the driver's utilities matching the kernel module "
                                "(cat /proc/driver/nvidia/version), or reboot after a driver upgrade")],
                       "", metrics)
    return None


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    expected, why_expected = gpus_expected(facts, bool(limits(thresholds, NAME)["gpus_expected"]))
    gpus = facts.get("gpus") or []
    metrics: Dict[str, Any] = {"gpu_count": len(gpus), "driver": facts.get("driver"), "source": facts.get("source")}

    unqueried = _unqueried(facts, expected, why_expected, metrics)
    if unqueried is not None:
        return unqueried

    findings: List[Finding] = []
    if not gpus:
        findings.append(Finding(Status.FAIL if expected else Status.WARN,
                                f"the NVIDIA driver {facts.get('driver')} is loaded but reports 0 GPUs",
                                "check `nvidia-smi -L`, `lspci | grep -i nvidia` and `dmesg | grep -i nvrm`"))
    failed_gpus: List[int] = []
    for gpu in gpus:
        own = _gpu_findings(gpu, thresholds)
        if any(f.status in (Status.FAIL, Status.ERROR) for f in own) and isinstance(gpu.get("index"), int):
            failed_gpus.append(gpu["index"])
        findings.extend(own)
    per_gpu = len(findings)

    if facts.get("kernel_log_error"):
        xid_note = (f"Xid scan skipped: kernel log not readable ({facts['kernel_log_error']}; run preflight as "
                    "root or set kernel.dmesg_restrict=0)")
    else:
        findings.extend(_xid_findings(facts, thresholds))
        xid_note = f"no Xid errors in {facts.get('kernel_log_source') or 'the kernel log'}"
    metrics["xid_lines_total"] = facts.get("xid_lines_total", 0)
    # Which GPUs failed, when the host's failures are theirs alone: the launch can go on without just those slots
    # (DeepSpeed's -e host:slot; preflight/launchable.py). An Xid or a host-wide finding keeps it unset.
    host_wide = [f for f in findings[per_gpu:] if f.status in (Status.FAIL, Status.ERROR)]
    if failed_gpus and not host_wide and gpus:
        metrics["failed_gpus"] = sorted(failed_gpus)

    names = sorted(set(g.get("name") or "?" for g in gpus))
    ok = (f"{len(gpus)} GPU(s) healthy ({', '.join(names)}, driver {facts.get('driver')} via "
          f"{facts.get('source')}); {xid_note}")
    if not findings:
        findings.append(Finding(Status.PASS, ok))
    if facts.get("kernel_log_error"):
        # Not a silent pass: without the kernel log a GPU that fell off the bus last hour looks healthy.
        findings.append(Finding(Status.WARN, xid_note, "run preflight as root, or allow reading the kernel log: "
                                                      "sudo sysctl -w kernel.dmesg_restrict=0"))
    return combine(findings, ok, metrics)


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="GPU health: ECC, row remapping, PCIe link, clock slowdowns, temperature, modes, memory in use, Xids",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
)
