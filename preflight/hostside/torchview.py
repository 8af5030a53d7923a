"""torch, CUDA, the GPUs and NCCL as a rank on this host sees them; NCCL's version as text.

Standard library only at import (Python 3.9); ``torch_view`` imports torch when called, e.g.::

    {"torch": "2.11.0+cu130", "error": null, "cuda": true, "device_count": 8, "gpu_names": ["NVIDIA H200", ...],
     "nccl": "2.28.9", "python": "3.11.7"}

The python check records it in its facts (``rank_view``), which the all-reduce reads instead of importing torch
again on every host; the all-reduce's own probe and driver_cuda use the same functions.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional


def format_nccl_version(value: Any) -> Optional[str]:
    """torch.cuda.nccl.version(): (2, 28, 9) on new torch, 22809 (or 2708 before NCCL 2.9) on old."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return ".".join(str(int(v)) for v in value)
    value = int(value)
    if value >= 10000:
        return f"{value // 10000}.{value // 100 % 100}.{value % 100}"
    return f"{value // 1000}.{value // 100 % 10}.{value % 100}"


def torch_view() -> Dict[str, Any]:
    """torch, CUDA, GPUs and NCCL as a rank on this host will see them. Imports torch: the python check calls it
    in the worker where it imports torch anyway, so the all-reduce needs no import of its own to probe."""
    out: Dict[str, Any] = {"torch": None, "error": None, "cuda": False, "device_count": 0, "gpu_names": [],
                           "nccl": None, "python": sys.version.split()[0]}
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return out
    out["torch"] = torch.__version__
    try:
        out["cuda"] = bool(torch.cuda.is_available())
        if out["cuda"]:
            out["device_count"] = torch.cuda.device_count()
            out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["device_count"])]
            out["nccl"] = format_nccl_version(torch.cuda.nccl.version())  # a tuple; an int such as 2708 on old torch
    except Exception as exc:  # a driver problem: the gpu check says more; here it only means "no NCCL run"
        out["cuda_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["cuda"] = False
    return out
