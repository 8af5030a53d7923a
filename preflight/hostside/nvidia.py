"""NVIDIA facts shared by the GPU checks: an NVML session, and whether this host should have GPUs at all.

Standard library only (runs on the hosts); ``pynvml`` is imported inside ``nvml_session`` when present::

    gpu_evidence() -> ["/dev/nvidia0 exists", "the job's torch is a CUDA 12.4 build"]
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .proc import sh

class NVMLUnavailable(Exception):
    """NVML could not be opened; the message is the fact to record, ``module`` the nvidia-ml-py version if any."""

    def __init__(self, message: str, module: Optional[str] = None):
        super().__init__(message)
        self.module = module


@contextlib.contextmanager
def nvml_session() -> Iterator[Any]:
    """Import nvidia-ml-py and initialise NVML for the block, shutting it down afterwards.

    Raises NVMLUnavailable (import or nvmlInit failed: no driver, version mismatch) before the block runs.
    """
    try:
        import pynvml  # nvidia-ml-py
    except Exception as exc:  # noqa: BLE001 - a missing/broken module is a fact
        raise NVMLUnavailable(f"cannot import pynvml (nvidia-ml-py): {exc}") from None
    module = getattr(pynvml, "__version__", "unknown")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        raise NVMLUnavailable("nvmlInit: %s" % (str(exc) or type(exc).__name__), module) from None
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def as_str(value: Any) -> str:
    """NVML returns bytes from some nvidia-ml-py versions and str from others."""
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_evidence(torch_cuda: Optional[str] = None) -> List[str]:
    """Why this host should have working NVIDIA GPUs, whatever the driver says: the reasons found, or [].

    A missing or broken driver on such a host is a FAIL, not a "CPU host" SKIP. Evidence: device nodes
    (/dev/nvidia0), an NVIDIA display/3D controller on the PCI bus (lspci -mm -n: vendor 10de, class 03xx), or
    the job's torch being a CUDA build (torch.version.cuda, or a "+cu124"-style wheel version).
    """
    import glob
    import sys
    reasons: List[str] = []
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes:
        reasons.append(f"{nodes[0]} exists")
    lspci = sh(["lspci", "-mm", "-n"], timeout=5.0)
    if lspci.ok:
        for line in lspci.out.splitlines():
            parts = [x.strip('"') for x in line.split('"') if x.strip()]
            # slot "class" "vendor" "device" ...: class 0300 VGA, 0302 3D controller; vendor 10de NVIDIA
            if len(parts) >= 3 and parts[1].startswith("03") and parts[2].lower() == "10de":
                reasons.append(f"lspci shows an NVIDIA display/3D controller at {parts[0]}")
                break
    if torch_cuda is None:
        torch = sys.modules.get("torch")  # imported by the python/driver_cuda checks in this agent, if at all
        torch_cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    if torch_cuda:
        reasons.append(f"the job's torch is a CUDA {torch_cuda} build")
    return reasons


def gpus_expected(facts: Dict[str, Any], configured: bool) -> Tuple[bool, str]:
    """(expected, why) for the driver_cuda and gpu verdicts: the coordinator's per-host param, the [gpu]
    gpus_expected threshold, or the host's own evidence (``gpu_evidence``)."""
    if facts.get("gpus_expected") is not None:
        return bool(facts["gpus_expected"]), "the coordinator expects GPUs on this host"
    if configured:
        return True, "gpus_expected = true in [gpu]"
    evidence = facts.get("gpu_evidence") or []
    if evidence:
        return True, "GPUs are expected: " + "; ".join(str(e) for e in evidence)
    return False, "no sign of NVIDIA GPUs (no /dev/nvidia*, no NVIDIA PCI device, torch is not a CUDA build)"

