"""Host side: the functions the coordinator calls on each host through the agent ("ds_config.host.memory").

``memory`` reads /proc/meminfo (``MemAvailable:   123456 kB``) and RLIMIT_MEMLOCK.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional

from ..base import HostContext, read_text


def _meminfo_bytes(text: str, field: str) -> Optional[int]:
    m = re.search(r"^%s:\s+(\d+)\s*kB" % re.escape(field), text or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def memory(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Host-side: MemTotal/MemAvailable (bytes, /proc/meminfo) and RLIMIT_MEMLOCK (bytes; None = unlimited)."""
    import resource
    text = read_text("/proc/meminfo") or ""
    out: Dict[str, Any] = {"mem_total": _meminfo_bytes(text, "MemTotal"),
                           "mem_available": _meminfo_bytes(text, "MemAvailable"),
                           "memlock_soft": None, "memlock_hard": None, "error": None}
    if out["mem_available"] is None and text:
        free = _meminfo_bytes(text, "MemFree")
        cached = _meminfo_bytes(text, "Cached") or 0
        out["mem_available"] = free + cached if free is not None else None  # kernels before 3.14
    if not text:
        out["error"] = "/proc/meminfo is not readable"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    out["memlock_soft"] = None if soft == resource.RLIM_INFINITY else int(soft)
    out["memlock_hard"] = None if hard == resource.RLIM_INFINITY else int(hard)
    return out
