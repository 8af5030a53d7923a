"""NVIDIA driver vs PyTorch's CUDA: can this driver run torch's CUDA, does nvcc match, are there enough GPUs.

Parses, among others (NVML first; these are the fallbacks):

    /proc/driver/nvidia/version:
        NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)
    nvidia-smi (header and GPU rows):
        | NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |
        |   0  NVIDIA H100 80GB HBM3          On  |   00000000:00:06.0 Off |                    0 |
    nvcc --version:
        Cuda compilation tools, release 13.0, V13.0.88

Thresholds ([driver_cuda] in driver_cuda.toml beside this module): ``minor_compat_status`` ("warn" or "fail").
Whether GPUs are expected (a missing driver FAILs instead of SKIPping) comes from ``nvidia.gpus_expected``: the
coordinator's param, ``[gpu] gpus_expected``, or the host's own evidence (/dev/nvidia*, an NVIDIA PCI device, a CUDA
build of torch).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..hostside.fixes import pip_fix, pip_install, prebuild_phrase
from ..hostside.outcome import Finding, Outcome, Status, combine, error, limits, skip
from ..hostside.seams import CheckSpec, HostContext
from ..hostside.nvidia import NVMLUnavailable, as_str, gpu_evidence, gpus_expected, nvml_session
from ..hostside.proc import read_text, sh
from ..hostside.torchview import format_nccl_version

NAME = "driver_cuda"

# CUDA release notes, Table 3 ("CUDA Toolkit and Corresponding Driver Versions"), Linux, GA release of each
# toolkit: the oldest driver with full support of that toolkit (see /work/shared/reference/facts.md).
# 11.0 GA shipped with 450.51.05 (450.36.06 was the 11.0 RC driver); 13.3 GA with 610.43.02
# (cuda_13.3.0_610.43.02_linux.run). 13.4 is left out until its GA Linux driver is in NVIDIA's release notes.
TOOLKIT_MIN_DRIVER: Dict[Tuple[int, int], str] = {
    (13, 3): "610.43.02", (13, 2): "595.45.04", (13, 1): "590.44.01", (13, 0): "580.65.06",
    (12, 9): "575.51.03", (12, 8): "570.26", (12, 6): "560.28.03", (12, 5): "555.42.02",
    (12, 4): "550.54.14", (12, 3): "545.23.06", (12, 2): "535.54.03", (12, 1): "530.30.02",
    (12, 0): "525.60.13",
    (11, 8): "520.61.05", (11, 7): "515.43.04", (11, 6): "510.39.01", (11, 5): "495.29.05",
    (11, 4): "470.42.01", (11, 3): "465.19.01", (11, 2): "460.27.03", (11, 1): "455.23",
    (11, 0): "450.51.05",
}
# What max_cuda_for_driver says for a driver of a newer branch than the table's newest row: it may support a
# newer CUDA than the table knows, so capping it at that row would be a guess.
NEWER_THAN_TABLE = "unknown, newer than the table"

# CUDA compatibility guide, Table 2 (minor-version compatibility): a driver of this branch or newer runs any
# toolkit of the same major with a limited feature set (no PTX JIT of newer PTX, some APIs missing).
MINOR_COMPAT_MIN_DRIVER: Dict[int, str] = {13: "580", 12: "525.60.13", 11: "450.80.02"}

# DeepSpeed op_builder/builder.py ``cuda_minor_mismatch_ok``: nvcc/torch minor mismatches it accepts.
DS_CUDA_MINOR_MISMATCH_OK: Dict[int, List[str]] = {
    10: ["10.0", "10.1", "10.2"],
    11: ["11.0", "11.1", "11.2", "11.3", "11.4", "11.5", "11.6", "11.7", "11.8"],
    12: ["12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.8", "12.9"],
}


# --- pure parsers ----------------------------------------------------------------------------

def parse_proc_driver_version(text: Optional[str]) -> Optional[str]:
    """'NVRM version: NVIDIA UNIX ... Kernel Module ...  580.159.04  ...' -> '580.159.04'."""
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            m = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)*)\s", line + " ")
            if m:
                return m.group(1)
    return None


def parse_nvidia_smi_header(text: Optional[str]) -> Dict[str, Any]:
    """Plain ``nvidia-smi``: driver version, max CUDA version, and the number of GPU rows in the table."""
    result: Dict[str, Any] = {"driver": None, "cuda": None, "gpu_count": None}
    if not text:
        return result
    m = re.search(r"Driver Version:\s*(\d+(?:\.\d+)+)", text)
    if m:
        result["driver"] = m.group(1)
    m = re.search(r"CUDA Version:\s*(\d+\.\d+)", text)
    if m:
        result["cuda"] = m.group(1)
    # GPU rows: "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:00:06.0 Off |"; the bus id identifies them.
    rows = re.findall(r"^\|\s+(\d+)\s+.*\|\s+[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d\s", text, re.M)
    if result["driver"] is not None:
        result["gpu_count"] = len(rows)
    return result


def parse_nvcc_version(text: Optional[str]) -> Optional[str]:
    """'Cuda compilation tools, release 13.0, V13.0.88' -> '13.0' (what DeepSpeed compares)."""
    if not text:
        return None
    m = re.search(r"release (\d+)\.(\d+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def cuda_version_from_int(value: Optional[int]) -> Optional[str]:
    """NVML's 13000 -> '13.0' (major = v // 1000, minor = (v % 1000) // 10)."""
    if value is None:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


def version_tuple(version: Optional[str]) -> Tuple[int, ...]:
    """'580.159.04' -> (580, 159, 4); '12.8' -> (12, 8); junk -> ()."""
    if not version:
        return ()
    parts = []
    for piece in str(version).split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group(0)))
    return tuple(parts)


def max_cuda_for_driver(driver: Optional[str]) -> Optional[str]:
    """Highest toolkit in TOOLKIT_MIN_DRIVER whose GA driver is <= this driver (when NVML gave no number);
    NEWER_THAN_TABLE for a driver branch newer than the newest row's."""
    drv = version_tuple(driver)
    if not drv:
        return None
    newest = max(TOOLKIT_MIN_DRIVER)
    if drv[0] > version_tuple(TOOLKIT_MIN_DRIVER[newest])[0]:
        return NEWER_THAN_TABLE
    best = None
    for toolkit, minimum in TOOLKIT_MIN_DRIVER.items():
        if drv >= version_tuple(minimum) and (best is None or toolkit > best):
            best = toolkit
    return f"{best[0]}.{best[1]}" if best else None


def count_visible(cuda_visible_devices: Optional[str], total: int, uuids: Sequence[str]) -> int:
    """GPUs CUDA exposes under CUDA_VISIBLE_DEVICES: unset -> all; parsing stops at the first invalid entry."""
    if cuda_visible_devices is None:
        return total
    seen: List[int] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        index = None
        if re.fullmatch(r"\d+", entry):
            index = int(entry) if int(entry) < total else None
        elif entry.startswith("GPU-") or entry.startswith("MIG-"):
            matches = [i for i, u in enumerate(uuids) if u and u.startswith(entry)]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in seen:
            break
        seen.append(index)
    return len(seen)


# --- host side -------------------------------------------------------------------------------

def _nvml_facts() -> Dict[str, Any]:
    out: Dict[str, Any] = {"driver": None, "cuda_driver": None, "gpu_count": None, "gpu_uuids": [],
                           "error": None, "module": None}
    try:
        with nvml_session() as pynvml:
            out["module"] = getattr(pynvml, "__version__", "unknown")
            try:
                out["driver"] = as_str(pynvml.nvmlSystemGetDriverVersion())
                try:
                    out["cuda_driver"] = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
                except Exception:  # noqa: BLE001
                    out["cuda_driver"] = int(pynvml.nvmlSystemGetCudaDriverVersion())
                count = int(pynvml.nvmlDeviceGetCount())
                out["gpu_count"] = count
                for i in range(count):
                    try:
                        out["gpu_uuids"].append(as_str(pynvml.nvmlDeviceGetUUID(
                            pynvml.nvmlDeviceGetHandleByIndex(i))))
                    except Exception:  # noqa: BLE001
                        out["gpu_uuids"].append("")
            except Exception as exc:  # noqa: BLE001
                out["error"] = f"NVML query: {str(exc) or type(exc).__name__}"
    except NVMLUnavailable as exc:
        out["error"], out["module"] = str(exc), exc.module
    return out


def _torch_facts() -> Dict[str, Any]:
    out: Dict[str, Any] = {"torch": None, "torch_cuda": None, "torch_hip": None, "cuda_available": None,
                           "torch_gpu_count": None, "nccl": None, "torch_error": None, "torch_cuda_warning": None}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
        return out
    import warnings
    out["torch"] = str(torch.__version__)
    out["torch_cuda"] = getattr(torch.version, "cuda", None)
    out["torch_hip"] = getattr(torch.version, "hip", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["cuda_available"] = bool(torch.cuda.is_available())
            out["torch_gpu_count"] = int(torch.cuda.device_count())
        except Exception as exc:  # noqa: BLE001
            out["torch_cuda_warning"] = f"{type(exc).__name__}: {exc}"
    if caught and out["torch_cuda_warning"] is None:
        out["torch_cuda_warning"] = str(caught[0].message).strip()[:500]
    if out["cuda_available"]:
        try:
            out["nccl"] = format_nccl_version(torch.cuda.nccl.version())
        except Exception as exc:  # noqa: BLE001
            out["nccl"] = None
            out["torch_error"] = f"torch.cuda.nccl.version(): {exc}"
    return out


def _find_nvcc() -> Optional[str]:
    """Where torch.utils.cpp_extension (hence DeepSpeed) looks: CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return None


def _deepspeed_version() -> Optional[str]:
    """The installed DeepSpeed's version from its metadata (no import: importing it imports torch)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("deepspeed")
    except Exception:  # not installed, or broken metadata: the fix then names deepspeed unpinned
        return None


def collect(ctx: HostContext) -> Dict[str, Any]:
    facts: Dict[str, Any] = {
        "driver": None, "driver_source": None, "cuda_driver": None, "gpu_count": None, "gpu_uuids": [],
        "nvml_error": None, "smi_error": None, "proc_driver_version": None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nvcc": None, "nvcc_path": None, "nvcc_error": None, "tool_timeout": None,
        "slots": ctx.params.get("slots"), "gpus_expected": ctx.params.get("gpus_expected"),
        "python": sys.executable,  # the job's interpreter: a fix's pip runs in it
        "deepspeed": _deepspeed_version(),  # what a pre-build fix reinstalls (pinned, so pip builds that one)
    }
    proc_text = read_text("/proc/driver/nvidia/version")
    facts["proc_driver_version"] = parse_proc_driver_version(proc_text)

    nvml = _nvml_facts()
    facts["nvml_error"] = nvml["error"]
    facts["nvml_module"] = nvml["module"]
    if nvml["driver"]:
        facts.update(driver=nvml["driver"], driver_source="nvml", cuda_driver=nvml["cuda_driver"],
                     gpu_count=nvml["gpu_count"], gpu_uuids=nvml["gpu_uuids"])
    else:
        smi = sh(["nvidia-smi"], timeout=ctx.remaining(30))
        if smi.rc == 124:
            facts["tool_timeout"] = f"nvidia-smi timed out after {smi.duration:.0f}s"
        if smi.ok:
            head = parse_nvidia_smi_header(smi.out)
            if head["driver"]:
                cuda = version_tuple(head["cuda"])
                facts.update(driver=head["driver"], driver_source="nvidia-smi", gpu_count=head["gpu_count"],
                             cuda_driver=(cuda[0] * 1000 + cuda[1] * 10) if len(cuda) >= 2 else None)
        else:
            facts["smi_error"] = f"rc={smi.rc}: {(smi.err or smi.out).strip()}"[:500]
        if facts["driver"] is None and facts["proc_driver_version"]:
            facts.update(driver=facts["proc_driver_version"], driver_source="proc")

    facts.update(_torch_facts())
    facts["gpu_evidence"] = gpu_evidence(facts.get("torch_cuda"))

    nvcc_path = _find_nvcc()
    facts["nvcc_path"] = nvcc_path
    if nvcc_path:
        res = sh([nvcc_path, "--version"], timeout=ctx.remaining(20))
        if res.ok:
            facts["nvcc"] = parse_nvcc_version(res.out)
        else:
            facts["nvcc_error"] = f"rc={res.rc}: {(res.err or res.out).strip()}"[:300]
    return facts


# --- evaluation ------------------------------------------------------------------------------

def _gpus_expected(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Tuple[bool, str]:
    return gpus_expected(facts, bool(limits(thresholds, "gpu")["gpus_expected"]))


# CUDA variants PyTorch publishes wheels for at https://download.pytorch.org/whl/<tag> (recent releases).
TORCH_WHEEL_CUDA = ["11.8", "12.1", "12.4", "12.6", "12.8", "12.9", "13.0"]


def _torch_wheel(cuda: Optional[str]) -> Optional[str]:
    """The newest published torch CUDA wheel index this driver CUDA can run fully, e.g. '12.4' -> 'cu124'."""
    have = version_tuple(cuda)[:2]
    fits = [v for v in TORCH_WHEEL_CUDA if have and version_tuple(v) <= have]
    return "cu" + fits[-1].replace(".", "") if fits else None


def _torch_install_hint(cuda: Optional[str], python: Any) -> str:
    """The job's interpreter's pip (python: its sys.executable on the host), installing the torch CUDA build
    that this driver's CUDA runs; "" when no published build fits."""
    tag = _torch_wheel(cuda)
    if not tag:
        return ""
    return pip_install(python, "--force-reinstall", "torch", "--index-url", f"https://download.pytorch.org/whl/{tag}")


def _pasteable(command: str) -> bool:
    """A pip line that names the interpreter (not the prose pip_install gives for a path it cannot name)."""
    return " -m pip install " in command and not command.startswith("install ")


def _driver_for(cuda: str) -> Optional[str]:
    return TOOLKIT_MIN_DRIVER.get(tuple(version_tuple(cuda)[:2]))  # type: ignore[arg-type]


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    expected, why_expected = _gpus_expected(facts, thresholds)
    metrics = {k: facts.get(k) for k in ("driver", "cuda_driver", "torch", "torch_cuda", "nccl", "gpu_count",
                                         "nvcc", "slots")}
    unusable = _unusable_driver(facts, metrics, expected, why_expected)
    if unusable is not None:
        return unusable
    driver = facts["driver"]
    cuda_driver = facts.get("cuda_driver")
    driver_cuda = cuda_version_from_int(cuda_driver) if cuda_driver else max_cuda_for_driver(driver)
    torch_cuda = facts.get("torch_cuda")
    notes: List[str] = []

    # 1. can the driver run torch's CUDA?
    findings = _torch_findings(facts, driver, driver_cuda, thresholds)
    # 2. nvcc vs torch's CUDA (DeepSpeed JIT builds)
    nvcc = facts.get("nvcc")
    if nvcc and torch_cuda:
        findings.extend(_nvcc_findings(nvcc, facts.get("nvcc_path"), torch_cuda, facts.get("python"),
                                       facts.get("deepspeed")))
    elif not nvcc:
        notes.append("no nvcc found (DeepSpeed JIT op builds need a CUDA toolkit)")
    # 3. enough GPUs for the hostfile's slots
    visible = metrics["visible_gpus"] = _visible_gpus(facts)
    findings.extend(_slot_findings(facts, driver, visible, expected))
    # 4. torch cannot initialise CUDA although driver and build look fine
    if (torch_cuda and facts.get("cuda_available") is False and visible and
            not any(f.status == Status.FAIL for f in findings)):
        findings.append(Finding(
            Status.FAIL,
            f"torch {facts.get('torch')} cannot initialise CUDA (torch.cuda.is_available() is False) although "
            f"driver {driver} supports CUDA {driver_cuda}: {facts.get('torch_cuda_warning') or 'no reason given'}",
            "run `python -c 'import torch; torch.cuda.init()'` on the host to see the error; check "
            "/dev/nvidia* permissions and that no MIG or compute-mode setting hides the GPUs"))

    metrics["driver_max_cuda"] = driver_cuda
    if facts.get("torch") is None:
        ok = f"driver {driver} (CUDA <= {driver_cuda}); torch not importable, compatibility not checked"
    else:
        ok = f"driver {driver} (CUDA <= {driver_cuda}) runs torch {facts.get('torch')} (CUDA {torch_cuda})"
    slots = facts.get("slots")
    for_slots = "" if slots is None else f" for slots={slots}"
    ok += f"; {visible} GPU(s) visible{for_slots}"
    if notes:
        ok += "; " + "; ".join(notes)
    if not any(f.status != Status.SKIP for f in findings):
        findings.append(Finding(Status.PASS, ok))
    return combine(findings, ok, metrics)


def _unusable_driver(facts: Dict[str, Any], metrics: Dict[str, Any], expected: bool,
                     why_expected: str) -> Optional[Outcome]:
    """The outcome when there is no usable driver at all (a kernel module/library mismatch, no driver, a hung
    tool); None when the driver's version was read."""
    nvml_error = facts.get("nvml_error") or ""
    if "mismatch" in nvml_error.lower() or "mismatch" in (facts.get("smi_error") or "").lower():
        return combine([Finding(
            Status.FAIL,
            f"NVIDIA driver/library version mismatch ({nvml_error or facts.get('smi_error')}): the loaded kernel "
            f"module ({facts.get('proc_driver_version') or 'unknown'}) differs from the user-space NVML library; "
            "CUDA cannot start",
            "reboot the host (or unload and reload the nvidia kernel modules) after the driver upgrade")],
            "", metrics)
    if facts.get("driver"):
        return None
    if facts.get("tool_timeout"):
        return error(f"could not read the NVIDIA driver version: {facts['tool_timeout']}",
                     "run `nvidia-smi` on the host by hand; a hang there usually means a GPU needs a reset",
                     **metrics)
    reason = (f"no NVIDIA driver on this host (NVML: {nvml_error or 'unavailable'}; "
              f"nvidia-smi: {facts.get('smi_error') or 'unavailable'}; /proc/driver/nvidia/version absent)")
    if expected:
        branch = _driver_for(facts.get("torch_cuda") or "") or "the branch for torch's CUDA"
        cuda = facts.get("torch_cuda") or "of your torch build"
        return combine([Finding(Status.FAIL, reason + f", but GPUs are expected ({why_expected})",
                                f"install the NVIDIA datacenter driver (>= {branch} for CUDA {cuda}) and check that "
                                "`nvidia-smi` lists the GPUs")], "", metrics)
    return skip(reason + "; GPU checks do not apply (set gpus_expected = true to make this a failure)",
                **metrics)


def _torch_findings(facts: Dict[str, Any], driver: str, driver_cuda: Optional[str],
                    thresholds: Dict[str, Any]) -> List[Finding]:
    """Whether the driver runs torch's CUDA: SKIP without torch or for a ROCm build, FAIL for a CPU-only build."""
    torch_cuda = facts.get("torch_cuda")
    if facts.get("torch") is None:
        why = facts.get("torch_error") or "not installed"
        return [Finding(Status.SKIP, f"torch is not importable ({why}): driver/CUDA compatibility not checked")]
    if torch_cuda:
        return _compat_findings(driver, driver_cuda, torch_cuda, facts, thresholds)
    if facts.get("torch_hip"):
        return [Finding(Status.SKIP, f"torch {facts['torch']} is a ROCm build: NVIDIA driver compatibility does "
                                     "not apply")]
    return [Finding(
        Status.FAIL,
        f"torch {facts['torch']} is a CPU-only build (torch.version.cuda is None) on a host with NVIDIA driver "
        f"{driver} and {facts.get('gpu_count')} GPU(s): DeepSpeed cannot use the GPUs",
        (pip_fix(f"install a CUDA build of torch that driver {driver} supports", facts.get("python"),
                 "--force-reinstall", "torch", "--index-url", f"https://download.pytorch.org/whl/{tag}")
         if (tag := _torch_wheel(driver_cuda)) else f"install a CUDA build of torch that driver {driver} supports"))]


def _nvcc_findings(nvcc: str, nvcc_path: Optional[str], torch_cuda: str, python: Any = None,
                   deepspeed: Any = None) -> List[Finding]:
    """A WARN when the toolkit's nvcc differs from torch's CUDA (DeepSpeed's JIT op builds compile with it)."""
    torch_mm = ".".join(str(v) for v in version_tuple(torch_cuda)[:2])
    if nvcc == torch_mm:
        return []
    major = version_tuple(nvcc)[0]
    ok_list = DS_CUDA_MINOR_MISMATCH_OK.get(major, [])
    match = (f"install CUDA toolkit {torch_mm} and export CUDA_HOME=/usr/local/cuda-{torch_mm} (or install the torch "
             f"build for CUDA {nvcc})")
    if nvcc in ok_list and torch_mm in ok_list:
        consequence = (f"DeepSpeed accepts this minor mismatch but JIT-built ops are compiled with CUDA {nvcc} "
                       f"against torch's {torch_mm}")
        fix = match + f"; pre-building the ops ({prebuild_phrase(python, ['DS_BUILD_OPS'], deepspeed)}) also avoids JIT"
    else:
        # assert_no_cuda_mismatch (op_builder/builder.py:107-129) runs when ops are pre-built (CUDAOpBuilder.builder,
        # :804) and, before DeepSpeed 0.12.3, at every JIT build; DS_SKIP_CUDA_CHECK=1 (:119) lets it through.
        consequence = (f"DeepSpeed raises CUDAMismatchException (\"Installed CUDA version {nvcc} does not match the "
                       f"version torch was compiled with {torch_cuda}\") when it pre-builds ops, and before 0.12.3 at "
                       "every JIT build")
        fix = (match + "; pre-building does not avoid it: "
               f"{prebuild_phrase(python, ['DS_BUILD_OPS'], deepspeed)} stops with the same "
               "CUDAMismatchException on this host; DS_SKIP_CUDA_CHECK=1 is DeepSpeed's override (\"it may result "
               "in unexpected behavior\")")
    return [Finding(
        Status.WARN,
        f"nvcc {nvcc} ({nvcc_path}) differs from torch's CUDA {torch_mm}: {consequence}", fix)]


def _visible_gpus(facts: Dict[str, Any]) -> Optional[int]:
    """The GPUs a rank can use: torch's count where it initialised CUDA, else NVML's narrowed by
    CUDA_VISIBLE_DEVICES; None when neither is known."""
    total = facts.get("gpu_count")
    if facts.get("cuda_available") and facts.get("torch_gpu_count") is not None:
        return int(facts["torch_gpu_count"])
    if total is not None:
        return count_visible(facts.get("cuda_visible_devices"), int(total), facts.get("gpu_uuids") or [])
    return None


def _slot_findings(facts: Dict[str, Any], driver: str, visible: Optional[int], expected: bool) -> List[Finding]:
    """A FAIL when the hostfile's slots exceed the visible GPUs; a WARN (FAIL if GPUs are expected) for none."""
    total = facts.get("gpu_count")
    slots = facts.get("slots")
    cvd = facts.get("cuda_visible_devices")
    if slots is not None and visible is not None and int(slots) > visible:
        shown = "" if cvd is None else f" with CUDA_VISIBLE_DEVICES={cvd!r}"
        widen = "; unset or widen CUDA_VISIBLE_DEVICES" if cvd is not None else ""
        return [Finding(
            Status.FAIL,
            f"only {visible} GPU(s) visible{shown} (NVML sees {total}) but the hostfile gives slots={int(slots)}: "
            f"ranks beyond {visible} fail with \"invalid device ordinal\"",
            f"set slots={visible} for this host in the hostfile, or restore the missing GPUs (check `nvidia-smi -L`"
            f"{widen})")]
    if visible == 0 and total == 0:
        status = Status.FAIL if expected else Status.WARN
        return [Finding(status, f"the NVIDIA driver {driver} is loaded but no GPU is visible",
                        "check `nvidia-smi -L` and `dmesg | grep -i nvrm`; reseat or reset the GPUs")]
    return []


def _compat_findings(driver: str, driver_cuda: Optional[str], torch_cuda: str, facts: Dict[str, Any],
                     thresholds: Dict[str, Any]) -> List[Finding]:
    want = version_tuple(torch_cuda)[:2]
    have = version_tuple(driver_cuda)[:2] if driver_cuda else ()
    full_min = _driver_for(torch_cuda)
    if have and have >= want:
        return []
    if not have and full_min and version_tuple(driver) >= version_tuple(full_min):
        return []
    need = full_min or f"the branch released with CUDA {torch_cuda}"
    minor_min = MINOR_COMPAT_MIN_DRIVER.get(want[0]) if want else None
    same_major = bool(have) and have[0] == want[0]
    if minor_min and version_tuple(driver) >= version_tuple(minor_min) and (same_major or not have):
        status = Status.FAIL if str(limits(thresholds, NAME)["minor_compat_status"]).lower() == "fail" else Status.WARN
        hint = _torch_install_hint(driver_cuda, facts.get("python"))
        older = (f", or use a torch build for CUDA <= {driver_cuda}" + (f":\n  {hint}" if _pasteable(hint) else
                                                                       f" ({hint})")) if hint else ""
        return [Finding(
            status,
            f"driver {driver} supports CUDA {driver_cuda or 'unknown'}, older than torch's CUDA {torch_cuda}: it "
            "runs only through CUDA minor-version compatibility (limited feature set: no JIT of newer PTX, newer "
            f"APIs fail with cudaErrorCallRequiresNewerDriver); full support needs driver >= {need}",
            f"upgrade the NVIDIA driver to >= {need}{older}")]
    hint = _torch_install_hint(driver_cuda, facts.get("python"))
    minor = f"; minor-version compatibility needs >= {minor_min}" if minor_min else ""
    other_torch = (f" or use a torch build for CUDA <= {driver_cuda}" + (f":\n  {hint}" if _pasteable(hint) else
                                                                        f" ({hint})")) if hint else ""
    return [Finding(
        Status.FAIL,
        f"driver {driver} supports CUDA up to {driver_cuda or 'unknown'} but torch {facts.get('torch')} needs "
        f"CUDA {torch_cuda} (driver >= {need}{minor}): CUDA initialisation fails "
        "(\"The NVIDIA driver on your system is too old\")",
        f"upgrade the NVIDIA driver to >= {need}{other_torch}")]


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="NVIDIA driver can run torch's CUDA (incl. minor-version compat), nvcc matches, GPUs >= slots",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
)
