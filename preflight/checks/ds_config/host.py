"""Host side: the functions the coordinator calls on each host through the agent ("ds_config.host.probe").

``probe`` answers, in the job's interpreter, what the config needs of this host: the installed DeepSpeed's
version (package metadata, e.g. ``0.19.8``; torch is not imported), whether each offload ``nvme_path`` is a
writable directory (a test file is created and removed), and ``memory``: /proc/meminfo
(``MemAvailable:   123456 kB``) and RLIMIT_MEMLOCK.
"""
from __future__ import annotations

import os
import re
import secrets
from typing import Any, Dict, List, Optional

from ...hostside.seams import HostContext
from ...hostside.proc import read_text


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


def deepspeed_version() -> Dict[str, Any]:
    """{"deepspeed": version or None, "deepspeed_found": importable at all} without importing it (seconds, torch)."""
    import importlib.metadata
    import importlib.util

    try:
        return {"deepspeed": importlib.metadata.version("deepspeed"), "deepspeed_found": True}
    except importlib.metadata.PackageNotFoundError:
        pass
    except Exception:  # a broken dist-info: fall through to the module itself
        pass
    try:
        found = importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        found = False
    return {"deepspeed": None, "deepspeed_found": found}


def path_state(path: str) -> Dict[str, Any]:
    """Whether DeepSpeed can swap to ``path``: exists, is a directory, and a file can be created there."""
    entry: Dict[str, Any] = {"path": path, "exists": False, "is_dir": False, "writable": False, "error": None}
    if not os.path.exists(path):
        entry["error"] = "does not exist"
        return entry
    entry["exists"] = True
    if not os.path.isdir(path):
        entry["error"] = "is not a directory"
        return entry
    entry["is_dir"] = True
    test_file = os.path.join(path, ".preflight-ds-" + secrets.token_hex(6))
    try:
        fd = os.open(test_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        entry["error"] = "cannot create a file as uid %d: %s" % (os.geteuid(), exc.strerror or exc)
        return entry
    os.close(fd)
    try:
        os.unlink(test_file)
    except OSError as exc:
        entry["error"] = "created a test file but could not remove it: %s" % (exc.strerror or exc)
    entry["writable"] = True
    return entry


def probe(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """params: {"memory": bool, "nvme_paths": [dir, ...]} -> {"deepspeed", "deepspeed_found", "paths", "memory"}."""
    out: Dict[str, Any] = deepspeed_version()
    paths: List[str] = [str(p) for p in params.get("nvme_paths") or []]
    out["paths"] = [path_state(p) for p in paths]
    out["memory"] = memory(params, ctx) if params.get("memory") else None
    return out
