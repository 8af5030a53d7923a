"""Reading a DeepSpeed config as DeepSpeed does (hjson, duplicate keys refused) and the accessors every verdict uses.

Pure, on the coordinator before any host is contacted; e.g. ``{"zero_optimization": {"stage": 3,
"offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}}`` -> stage 3, offload ("nvme", "none").
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...hostside.outcome import Finding, Status


def _plain(obj: Any) -> Any:
    """hjson's OrderedDicts -> plain dicts/lists (JSON-able facts)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _key_lines(text: str, key: str) -> List[int]:
    pat = re.compile(rf"""(?:^|[\s{{,])["']?{re.escape(key)}["']?\s*:""")
    return [i + 1 for i, line in enumerate(text.splitlines()) if pat.search(line)]


def load_config(path: str) -> Tuple[Dict[str, Any], List[Finding]]:
    """Read and parse the config as DeepSpeed does: hjson.load(object_pairs_hook=raise on duplicate keys).

    Returns (config, findings): config is {} when it cannot be used; findings are FAILs with the reason
    (missing file, parse error with line and column, duplicate keys, not an object).
    """
    config, findings, _ = _load(path)
    return config, findings


def usage_error(path: str) -> Optional[str]:
    """One line for a config that cannot be used at all (``file:line:col: ...`` for a syntax error), else None.

    The CLI stops on it before contacting any host (exit 2): DeepSpeed would refuse the file at start.
    """
    config, findings, where = _load(path)
    if config or not findings:
        return None
    message = findings[0].message.replace(f"DeepSpeed config {path} ", "DeepSpeed config ", 1)
    return f"{where or path}: {message}"


def _parser() -> Tuple[Callable[..., Any], Any, str]:
    """(loads, its decode error, the parser's name as the findings say it): hjson, as DeepSpeed parses."""
    try:
        import hjson
        return hjson.loads, hjson.HjsonDecodeError, "hjson"
    except ImportError:  # DeepSpeed depends on hjson; without it fall back to strict JSON
        import json
        return json.loads, json.JSONDecodeError, "json (hjson not installed: comments are not accepted)"


def _read_text(path: str) -> Tuple[Optional[str], List[Finding]]:
    """(the config file's text, []), or (None, [why it cannot be read])."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return fh.read(), []
    except FileNotFoundError:
        return None, [Finding(Status.FAIL, f"DeepSpeed config {path}: no such file (expected the JSON/HJSON file the "
                                           "job passes to deepspeed.initialize)",
                              "pass the job's config file: --deepspeed-config PATH")]
    except IsADirectoryError:
        return None, [Finding(Status.FAIL, f"DeepSpeed config {path} is a directory (expected a JSON/HJSON file)",
                              "pass the config file itself, e.g. --deepspeed-config "
                              f"{os.path.join(path, 'ds_config.json')}")]
    except UnicodeDecodeError as exc:
        return None, [Finding(Status.FAIL, f"DeepSpeed config {path} is not UTF-8 text (byte {exc.start}): "
                                           f"{exc.reason}",
                              "save the config as UTF-8 JSON")]
    except OSError as exc:
        return None, [Finding(Status.FAIL, f"DeepSpeed config {path} cannot be read: {exc.strerror or exc}",
                              "check the file's permissions")]


def _load(path: str) -> Tuple[Dict[str, Any], List[Finding], Optional[str]]:
    text, unreadable = _read_text(path)
    if text is None:
        return {}, unreadable, None
    if text.startswith("\ufeff"):
        text = text[1:]

    duplicates: List[str] = []

    def pairs_hook(pairs: Sequence[Tuple[str, Any]]) -> Dict[str, Any]:
        seen: Dict[str, int] = {}
        for k, _ in pairs:
            seen[k] = seen.get(k, 0) + 1
        for k, n in seen.items():
            if n > 1 and k not in duplicates:
                duplicates.append(k)
        return dict(pairs)

    loads, decode_error, parser = _parser()
    try:
        config = loads(text, object_pairs_hook=pairs_hook)
    except decode_error as exc:
        lineno, colno = getattr(exc, "lineno", None), getattr(exc, "colno", None)
        msg = getattr(exc, "msg", str(exc))
        lines = text.splitlines()
        snippet = lines[lineno - 1].strip() if lineno and 0 < lineno <= len(lines) else ""
        near = f" near: {snippet[:80]}" if snippet else ""
        finding = Finding(Status.FAIL, f"DeepSpeed config {path} does not parse ({parser}) at line {lineno} column "
                                       f"{colno}: {msg}{near}",
                          f"fix the syntax at line {lineno} of {path} (DeepSpeed parses the config with hjson)")
        return {}, [finding], f"{path}:{lineno}:{colno}"
    except RecursionError:
        return {}, [Finding(Status.FAIL, f"DeepSpeed config {path} is nested too deeply to parse",
                            "simplify the config")], None
    findings: List[Finding] = []
    for key in duplicates:
        where = _key_lines(text, key)
        on_lines = f" on lines {', '.join(map(str, where))}" if where else ""
        findings.append(Finding(
            Status.FAIL, f"DeepSpeed config {path}: duplicate key {key!r}{on_lines} (expected each key once; DeepSpeed "
                         "refuses it: 'Duplicate keys in DeepSpeed config')",
            f"keep one {key!r} entry in that object and delete the other(s)"))
    if not isinstance(config, dict):
        findings.append(Finding(Status.FAIL, f"DeepSpeed config {path} is a {type(config).__name__} at the top level "
                                             "(expected an object {...})",
                                "wrap the settings in { ... }"))
        return {}, findings, f"{path}:1:1"
    return _plain(config), findings, None


def config_section(config: Dict[str, Any], key: str) -> Dict[str, Any]:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def zero_section(config: Dict[str, Any]) -> Dict[str, Any]:
    return config_section(config, "zero_optimization")


def offload_device(section: Any) -> str:
    """Offload device of an offload_param/offload_optimizer dict: 'none' | 'cpu' | 'nvme' | other text."""
    if not isinstance(section, dict):
        return "none"
    dev = section.get("device", "none")
    return str(dev).lower() if dev is not None else "none"


def offload_devices(config: Dict[str, Any]) -> Tuple[str, str]:
    """(optimizer device, param device), with the deprecated cpu_offload/cpu_offload_param booleans mapped."""
    zero = zero_section(config)
    opt = offload_device(zero.get("offload_optimizer"))
    par = offload_device(zero.get("offload_param"))
    if opt == "none" and zero.get("cpu_offload") is True:
        opt = "cpu"
    if par == "none" and (zero.get("cpu_offload_param") is True or zero.get("cpu_offload_params") is True):
        par = "cpu"
    return opt, par


def nvme_paths(config: Dict[str, Any]) -> List[str]:
    """nvme_path of each offload section whose device is nvme (the coordinator gives them to the nvme check)."""
    out: List[str] = []
    zero = zero_section(config)
    for name in ("offload_param", "offload_optimizer"):
        sec = zero.get(name)
        if isinstance(sec, dict) and offload_device(sec) == "nvme" and sec.get("nvme_path") not in (None, "", "auto"):
            p = str(sec["nvme_path"])
            if p not in out:
                out.append(p)
    return out


def zero_stage(config: Dict[str, Any]) -> Optional[int]:
    """The ZeRO stage as DeepSpeed reads it (absent: 0; the deprecated boolean form: 1); None if not a number."""
    z = config.get("zero_optimization")
    if z is None:
        return 0
    if isinstance(z, bool):
        return 1 if z else 0
    if not isinstance(z, dict):
        return None
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, (int, float)) or int(stage) != stage:
        return None
    return int(stage)


def optimizer_type(config: Dict[str, Any]) -> Optional[str]:
    opt = config.get("optimizer")
    if isinstance(opt, dict) and opt.get("type") is not None:
        return str(opt["type"])
    return None


def optimizer_params(config: Dict[str, Any]) -> Dict[str, Any]:
    opt = config.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    return params if isinstance(params, dict) else {}


def parse_version(text: Any) -> Optional[Tuple[int, int, int]]:
    """'0.19.8' / '0.14.5+cu121' / '0.9.3.dev0' -> (0, 19, 8); None when there is no x.y.z."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def enabled(section: Any) -> Optional[bool]:
    """True / False / None ("auto": decided later by the HF integration)."""
    if not isinstance(section, dict):
        return False
    v = section.get("enabled", False)
    if isinstance(v, str) and v.lower() == "auto":
        return None
    return v is True
