"""Host side: the functions the coordinator calls on each host through the agent ("ds_config.host.probe").

``probe`` answers, in the job's interpreter, what the config needs of this host: the installed DeepSpeed's
version (package metadata, e.g. ``0.19.8``; torch is not imported), whether each offload ``nvme_path`` is a
writable directory (a test file is created and removed), ``memory``: /proc/meminfo
(``MemAvailable:   123456 kB``) and RLIMIT_MEMLOCK, the config file itself at the path every rank will open
(its sha256), and the layout of an existing DeepSpeed checkpoint to resume from, read from its file names only::

    CKPT/latest                                             -> "global_step1000"
    CKPT/global_step1000/mp_rank_00_model_states.pt         -> ZeRO stage 1 or 2 (one model file per MP rank)
    CKPT/global_step1000/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt   -> DP rank 3, MP rank 0
    CKPT/global_step1000/zero_pp_rank_3_mp_rank_00_model_states.pt        -> ZeRO stage 3 (one per DP rank)
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
from typing import Any, Dict, List, Optional

from ...hostside.seams import HostContext
from ...hostside.proc import read_text
from .ckpt_version import saved_version


def _meminfo_bytes(text: str, field: str) -> Optional[int]:
    m = re.search(rf"^{re.escape(field)}:\s+(\d+)\s*kB", text or "", re.M)
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
        entry["error"] = f"cannot create a file as uid {os.geteuid()}: {exc.strerror or exc}"
        return entry
    os.close(fd)
    try:
        os.unlink(test_file)
    except OSError as exc:
        entry["error"] = f"created a test file but could not remove it: {exc.strerror or exc}"
    entry["writable"] = True
    return entry


CONFIG_MAX_BYTES = 64 << 20  # a DeepSpeed config is kilobytes; hashing stops here (the CLI's own limit is lower)


def file_digest(path: str) -> Dict[str, Any]:
    """{"path", "exists", "sha256", "size", "error"} of the file every rank opens (--deepspeed_config PATH)."""
    entry: Dict[str, Any] = {"path": path, "exists": False, "sha256": None, "size": None, "error": None}
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_MAX_BYTES + 1)
    except FileNotFoundError:
        entry["error"] = "does not exist"
        return entry
    except OSError as exc:
        entry["exists"] = os.path.exists(path)
        entry["error"] = f"cannot read it as uid {os.geteuid()}: {exc.strerror or exc}"
        return entry
    entry.update(exists=True, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    return entry


# DeepSpeed 0.19.8's checkpoint file names (deepspeed/runtime/engine.py): _get_ckpt_name :4336-4359 (model states:
# "zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt" when ZeRO-3 partitions the weights, else
# "mp_rank_{mp:02d}_model_states.pt"), _get_rank_zero_ckpt_name :4322-4329 and _get_zero_ckpt_prefix :4319-4320
# (optimizer partitions: "[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"; :4793-4797 also reads the
# old "..._mp_rank_{mp:02d}optim_states.pt").
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")


def checkpoint_layout(names: List[str]) -> Dict[str, Any]:
    """The layout of one checkpoint tag directory from its file names: {"zero_stage": "3" | "1 or 2" | "0" | None,
    "dp_size", "mp_size", "model_files", "optim_files", "bf16"}. Stages 1 and 2 save the same files, and so does
    stage 0 under bf16 (its BF16_Optimizer saves partitions too); None: no DeepSpeed model states at all."""
    zero3 = [m for m in (_ZERO3_MODEL.match(n) for n in names) if m]
    model = [m for m in (_MODEL.match(n) for n in names) if m]
    optim = [m for m in (_OPTIM.match(n) for n in names) if m]
    out: Dict[str, Any] = {"model_files": len(zero3) + len(model), "optim_files": len(optim),
                           "bf16": any(n.startswith("bf16_zero_pp_rank_") for n in names)}
    mp = {int(m.group(2)) for m in zero3 + optim} | {int(m.group(1)) for m in model}
    dp = {int(m.group(1)) for m in optim} or {int(m.group(1)) for m in zero3}
    out["mp_size"] = len(mp) or None
    out["dp_size"] = len(dp) or None
    if zero3:
        out["zero_stage"] = "3"
    elif model and optim:
        out["zero_stage"] = "1 or 2"
    elif model:
        out["zero_stage"] = "0"
    else:
        out["zero_stage"] = None
    return out


def read_checkpoint(directory: str, latest_name: str = "latest") -> Dict[str, Any]:
    """What DeepSpeed's load_checkpoint(directory) would open (engine.py:4427-4441): the tag in ``latest_name``, its
    directory's layout (file names only; nothing is loaded), or why there is nothing to resume."""
    out: Dict[str, Any] = {"dir": directory, "latest_name": latest_name, "latest": None, "tag_dir": None,
                           "exists": os.path.isdir(directory), "layout": None, "error": None,
                           "latest_universal": os.path.isfile(os.path.join(directory, "latest_universal"))}
    latest = os.path.join(directory, latest_name)
    if not os.path.isfile(latest):
        return out  # nothing to resume: DeepSpeed warns and starts from scratch
    try:
        with open(latest) as f:
            out["latest"] = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        out["error"] = f"cannot read {latest}: {getattr(exc, 'strerror', None) or exc}"
        return out
    tag_dir = os.path.join(directory, out["latest"])
    out["tag_dir"] = tag_dir
    try:
        names = sorted(os.listdir(tag_dir))
    except OSError as exc:
        out["error"] = f"{latest} names tag {out['latest']!r}, but {tag_dir} cannot be listed: {exc.strerror or exc}"
        return out
    out["layout"] = checkpoint_layout(names)
    # The DeepSpeed version it was saved with, from its first model states file (ckpt_version.py; never unpickled).
    model = next((n for n in names if n.endswith("model_states.pt")), None)
    out["ds_version"] = saved_version(os.path.join(tag_dir, model)) if model else None
    return out


def probe(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """params: {"memory": bool, "nvme_paths": [dir, ...], "config_path": path, "checkpoint_dir": dir,
    "checkpoint_latest": "latest" | "latest_universal"} -> {"deepspeed", "deepspeed_found", "paths", "memory",
    "config_file", "checkpoint"}."""
    out: Dict[str, Any] = deepspeed_version()
    paths: List[str] = [str(p) for p in params.get("nvme_paths") or []]
    out["paths"] = [path_state(p) for p in paths]
    out["memory"] = memory(params, ctx) if params.get("memory") else None
    out["config_file"] = file_digest(str(params["config_path"])) if params.get("config_path") else None
    out["checkpoint"] = (read_checkpoint(str(params["checkpoint_dir"]), str(params.get("checkpoint_latest")
                                                                            or "latest"))
                         if params.get("checkpoint_dir") else None)
    return out
