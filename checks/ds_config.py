"""The job's DeepSpeed config checked against the real cluster: keys, batch math, precision, ZeRO memory, offload, ops.

Parses the config like DeepSpeed does (hjson: comments allowed; duplicate keys are an error), e.g.::

    {
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,   // x world size = train_batch_size
      "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    }
"""
from __future__ import annotations

import difflib
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .base import Finding, HostContext, Outcome, Status, combine, read_text

NAME = "ds_config"
DESCRIPTION = ("DeepSpeed config (--deepspeed-config): keys, deprecations, batch math, precision vs GPUs, "
               "ZeRO memory vs GPU/CPU, offload paths, required ops, DeepSpeed version")
SCOPE = "cluster"
DEFAULT = False

CLUSTER = "*"
GiB = 1 << 30

# Threshold defaults, used when [ds_config] is missing from the merged thresholds (documented in defaults.toml).
_DEFAULTS: Dict[str, Any] = {
    "gpu_mem_fail_fraction": 1.0,
    "gpu_mem_warn_fraction": 0.9,
    "stage3_comfort_fraction": 0.5,
    "cpu_mem_fail_fraction": 1.0,
    "pin_memory_min_memlock_gib": 1.0,
    "host_memory_timeout_s": 20.0,
}

# DeepSpeed's estimators use this buffer factor for CPU memory (additional_buffer_factor=1.5).
BUFFER_FACTOR = 1.5
COMMENT_PREFIXES = ("_", "#", "//")


# --- pure helpers (coordinator, before any host is contacted) ----------------------------------------------

def _plain(obj: Any) -> Any:
    """hjson's OrderedDicts -> plain dicts/lists (JSON-able facts)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _key_lines(text: str, key: str) -> List[int]:
    pat = re.compile(r"""(?:^|[\s{,])["']?%s["']?\s*:""" % re.escape(key))
    return [i + 1 for i, line in enumerate(text.splitlines()) if pat.search(line)]


def load_config(path: str) -> Tuple[Dict[str, Any], List[Finding]]:
    """Read and parse the config as DeepSpeed does: hjson.load(object_pairs_hook=raise on duplicate keys).

    Returns (config, findings): config is {} when it cannot be used; findings are FAILs with the reason
    (missing file, parse error with line and column, duplicate keys, not an object).
    """
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return {}, [Finding(Status.FAIL, "DeepSpeed config %s: no such file (expected the JSON/HJSON file the "
                                         "job passes to deepspeed.initialize)" % path,
                            "pass the job's config file: --deepspeed-config PATH")]
    except IsADirectoryError:
        return {}, [Finding(Status.FAIL, "DeepSpeed config %s is a directory (expected a JSON/HJSON file)" % path,
                            "pass the config file itself, e.g. --deepspeed-config %s"
                            % os.path.join(path, "ds_config.json"))]
    except UnicodeDecodeError as exc:
        return {}, [Finding(Status.FAIL, "DeepSpeed config %s is not UTF-8 text (byte %d): %s"
                            % (path, exc.start, exc.reason), "save the config as UTF-8 JSON")]
    except OSError as exc:
        return {}, [Finding(Status.FAIL, "DeepSpeed config %s cannot be read: %s" % (path, exc.strerror or exc),
                            "check the file's permissions")]
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

    try:
        import hjson
        decode_error: Any = hjson.HjsonDecodeError
        loads = hjson.loads
        parser = "hjson"
    except ImportError:  # DeepSpeed depends on hjson; without it fall back to strict JSON
        import json
        decode_error = json.JSONDecodeError
        loads = json.loads
        parser = "json (hjson not installed: comments are not accepted)"
    try:
        config = loads(text, object_pairs_hook=pairs_hook)
    except decode_error as exc:
        lineno, colno = getattr(exc, "lineno", None), getattr(exc, "colno", None)
        msg = getattr(exc, "msg", str(exc))
        lines = text.splitlines()
        snippet = lines[lineno - 1].strip() if lineno and 0 < lineno <= len(lines) else ""
        return {}, [Finding(Status.FAIL, "DeepSpeed config %s does not parse (%s) at line %s column %s: %s%s"
                            % (path, parser, lineno, colno, msg, (" near: %s" % snippet[:80]) if snippet else ""),
                            "fix the syntax at line %s of %s (DeepSpeed parses the config with hjson)"
                            % (lineno, path))]
    except RecursionError:
        return {}, [Finding(Status.FAIL, "DeepSpeed config %s is nested too deeply to parse" % path,
                            "simplify the config")]
    findings: List[Finding] = []
    for key in duplicates:
        where = _key_lines(text, key)
        findings.append(Finding(
            Status.FAIL, "DeepSpeed config %s: duplicate key %r%s (expected each key once; DeepSpeed refuses it: "
            "'Duplicate keys in DeepSpeed config')" % (path, key, (" on lines %s" % ", ".join(map(str, where)))
                                                         if where else ""),
            "keep one %r entry in that object and delete the other(s)" % key))
    if not isinstance(config, dict):
        findings.append(Finding(Status.FAIL, "DeepSpeed config %s is a %s at the top level (expected an object "
                                             "{...})" % (path, type(config).__name__),
                                "wrap the settings in { ... }"))
        return {}, findings
    return _plain(config), findings


def _section(config: Dict[str, Any], key: str) -> Dict[str, Any]:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _zero(config: Dict[str, Any]) -> Dict[str, Any]:
    return _section(config, "zero_optimization")


def _device(section: Any) -> str:
    """Offload device of an offload_param/offload_optimizer dict: 'none' | 'cpu' | 'nvme' | other text."""
    if not isinstance(section, dict):
        return "none"
    dev = section.get("device", "none")
    return str(dev).lower() if dev is not None else "none"


def offload_devices(config: Dict[str, Any]) -> Tuple[str, str]:
    """(optimizer device, param device), with the deprecated cpu_offload/cpu_offload_param booleans mapped."""
    zero = _zero(config)
    opt = _device(zero.get("offload_optimizer"))
    par = _device(zero.get("offload_param"))
    if opt == "none" and zero.get("cpu_offload") is True:
        opt = "cpu"
    if par == "none" and (zero.get("cpu_offload_param") is True or zero.get("cpu_offload_params") is True):
        par = "cpu"
    return opt, par


def nvme_paths(config: Dict[str, Any]) -> List[str]:
    """nvme_path of each offload section whose device is nvme (the coordinator gives them to the nvme check)."""
    out: List[str] = []
    zero = _zero(config)
    for name in ("offload_param", "offload_optimizer"):
        sec = zero.get(name)
        if _device(sec) == "nvme" and sec.get("nvme_path") not in (None, "", "auto"):
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


def _opt_params(config: Dict[str, Any]) -> Dict[str, Any]:
    opt = config.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    return params if isinstance(params, dict) else {}


def required_ops(config: Dict[str, Any]) -> List[str]:
    """DeepSpeed ops (ds_report names) the config needs, mirroring engine._configure_basic_optimizer.

    async_io: any NVMe offload; gds: aio.use_gds; Adam/AdamW: cpu_adam under optimizer offload (cpu or nvme),
    else fused_adam (unless params.torch_adam); Adagrad: cpu_adagrad under offload; Lion: cpu_lion / fused_lion;
    Lamb: fused_lamb; 1-bit optimizers with comm_backend_name "compressed": packbits.
    """
    ops: List[str] = []

    def add(op: str) -> None:
        if op not in ops:
            ops.append(op)

    opt_dev, par_dev = offload_devices(config)
    if "nvme" in (opt_dev, par_dev):
        add("async_io")
    aio = _section(config, "aio")
    if aio.get("use_gds") is True:
        add("gds")
    name = (optimizer_type(config) or "").lower()
    cpu_optimizer = opt_dev in ("cpu", "nvme")
    params = _opt_params(config)
    if name in ("adam", "adamw"):
        if params.get("torch_adam") is not True:
            add("cpu_adam" if cpu_optimizer else "fused_adam")
    elif name == "adagrad":
        if cpu_optimizer:
            add("cpu_adagrad")
    elif name == "lion":
        add("cpu_lion" if cpu_optimizer else "fused_lion")
    elif name == "lamb":
        add("fused_lamb")
    elif name in ("onebitadam", "zerooneadam", "onebitlamb"):
        if str(params.get("comm_backend_name", "nccl")).lower() == "compressed":
            add("packbits")
    return ops


def parse_version(text: Any) -> Optional[Tuple[int, int, int]]:
    """'0.19.8' / '0.14.5+cu121' / '0.9.3.dev0' -> (0, 19, 8); None when there is no x.y.z."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _vstr(v: Tuple[int, int, int]) -> str:
    return "%d.%d.%d" % v


def _gib(n: Optional[float]) -> str:
    if n is None:
        return "?"
    return "%.1f GiB" % (n / GiB)


def _params_text(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= div:
            return "%.4g%s" % (n / div, unit)
    return "%d" % n


# --- ZeRO memory estimators (DeepSpeed's formulas; bytes) ------------------------------------------------

def estimate_zero2(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                   additional_buffer_factor: float = BUFFER_FACTOR) -> Tuple[int, int]:
    """deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs -> (cpu_mem, gpu_mem)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 = params_16bit; 18 = 2 grads_16bit + 4 grads_32bit + 4 params_32bit + 8 optimizer states (Adam)
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                   num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                   zero_init: bool = True, additional_buffer_factor: float = BUFFER_FACTOR) -> Tuple[int, int, int]:
    """deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs -> (cpu_mem, gpu_mem, largest_layer)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


def _stage_label(stage: int, opt_dev: str, par_dev: str) -> str:
    parts = ["ZeRO-%d" % stage]
    if opt_dev in ("cpu", "nvme"):
        parts.append("optimizer offload to %s" % opt_dev)
    if par_dev in ("cpu", "nvme") and stage == 3:
        parts.append("param offload to %s" % par_dev)
    return " + ".join(parts)


def model_state_estimate(stage: int, opt_dev: str, par_dev: str, n_params: float, largest_layer: float,
                         world_size: int, mixed_precision: bool = True) -> Dict[str, Any]:
    """Per-GPU bytes of model states (params, grads, optimizer states) for a stage and offload choice.

    ZeRO-2 / ZeRO-3 use DeepSpeed's estimators above (ZeRO-3 with zero_init=True). DeepSpeed has no
    estimator for stages 0 and 1; they use its ZeRO-2 multipliers with nothing / only the 16 optimizer
    bytes (4 grads_32 + 4 params_32 + 8 Adam) partitioned: stage 0 = 20N (16N without fp16/bf16),
    stage 1 = 4N + 16N/G, stage 1 with optimizer offload = 4N (16-bit params + grads stay on the GPU).
    param offload without optimizer offload (stage 3) moves the 2N/G 16-bit partition off the GPU: L + 16N/G.
    """
    n, G = float(n_params), max(1, int(world_size))
    opt_off = opt_dev in ("cpu", "nvme")
    par_off = par_dev in ("cpu", "nvme") and stage == 3
    if stage >= 3:
        if opt_off or not par_off:
            _, gpu, _ = estimate_zero3(n, largest_layer, G, 1, cpu_offload=opt_off, cpu_offload_params=par_off)
            formula = ("DeepSpeed estimate_zero3_model_states_mem_needs: " +
                       ("4*L" if opt_off and par_off else "4*L + 2N/G" if opt_off else "4*L + 18N/G"))
        else:
            gpu = int(4 * largest_layer + 16 * n / G)
            formula = "4*L + 16N/G (ZeRO-3 multipliers with the 16-bit partition offloaded)"
    elif stage == 2:
        _, gpu = estimate_zero2(n, G, 1, cpu_offload=opt_off)
        formula = "DeepSpeed estimate_zero2_model_states_mem_needs: " + ("2N" if opt_off else "2N + 18N/G")
    elif stage == 1:
        gpu = int(4 * n) if opt_off else int(4 * n + 16 * n / G)
        formula = "4N (16-bit params + grads)" if opt_off else "4N + 16N/G (ZeRO-2 multipliers, grads unpartitioned)"
    else:
        gpu = int((20 if mixed_precision else 16) * n)
        formula = "20N (2+2 16-bit params/grads + 16 fp32/Adam bytes)" if mixed_precision else "16N (fp32 + Adam)"
    return {"gpu": int(gpu), "formula": formula, "label": _stage_label(stage, opt_dev, par_dev)}


def cpu_offload_estimate(stage: int, opt_dev: str, par_dev: str, n_params: float, largest_layer: float,
                         slots: int, num_nodes: int) -> Optional[Dict[str, Any]]:
    """CPU RAM one host needs for offloaded model states (DeepSpeed's estimators); None without CPU offload.

    ZeRO-1/2: estimate_zero2(..., num_gpus_per_node=slots, num_nodes=1, cpu_offload=True)[0], i.e. DeepSpeed's
    single-node figure N*max(4*slots, 16)*1.5 for this host. ZeRO-3: estimate_zero3(..., zero_init=True)[0]
    = N*18/nodes*1.5 (params and optimizer) or N*16/nodes*1.5 (optimizer only). NVMe offload is not CPU RAM.
    """
    n = float(n_params)
    if stage in (1, 2) and opt_dev == "cpu":
        cpu, _ = estimate_zero2(n, max(1, slots), 1, cpu_offload=True)
        return {"cpu": cpu, "formula": "N*max(4*%d GPUs, 16)*1.5 (estimate_zero2_model_states_mem_needs)"
                % max(1, slots)}
    if stage >= 3 and opt_dev == "cpu":
        cpu, _, _ = estimate_zero3(n, largest_layer, max(1, slots), max(1, num_nodes), cpu_offload=True,
                                   cpu_offload_params=(par_dev == "cpu"), zero_init=True)
        return {"cpu": cpu, "formula": "N*%d/%d nodes*1.5 (estimate_zero3_model_states_mem_needs, zero_init)"
                % (18 if par_dev == "cpu" else 16, max(1, num_nodes))}
    if stage >= 3 and par_dev == "cpu":  # params only: the 16-bit partitions, 2N/nodes with the same buffer
        return {"cpu": int(n * 2 / max(1, num_nodes) * BUFFER_FACTOR),
                "formula": "N*2/%d nodes*1.5 (16-bit param partitions)" % max(1, num_nodes)}
    return None


# Offload choices from least to most GPU-memory saving: what a FAIL suggests next.
LADDER = [(1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "none"),
          (3, "cpu", "cpu")]


# --- batch size math (DeepSpeedConfig._configure_train_batch_size) --------------------------------------

def resolve_batch(tb: Optional[float], mb: Optional[float], ga: Optional[float],
                  world_size: float) -> Tuple[Optional[Dict[str, float]], Optional[str]]:
    """Mirror _set_batch_related_parameters + _batch_assertion: (resolved values, None) or (values, error)."""
    ws = world_size
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = tb // mb
        ga //= ws
    elif tb is not None and ga is not None:
        mb = tb // ws
        mb //= ga
    elif mb is not None and ga is not None:
        tb = mb * ga
        tb *= ws
    elif tb is not None:
        ga = 1
        mb = tb // ws
    elif mb is not None:
        tb = mb * ws
        ga = 1
    else:
        return None, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
    values = {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga}
    if not tb > 0:
        return values, "Train batch size: %s has to be greater than 0" % _num(tb)
    if not mb > 0:
        return values, "Micro batch size per gpu: %s has to be greater than 0" % _num(mb)
    if not ga > 0:
        return values, "Gradient accumulation steps: %s has to be greater than 0" % _num(ga)
    if tb != mb * ga * ws:
        return values, ("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size "
                        "%s != %s * %s * %s" % (_num(tb), _num(mb), _num(ga), _num(ws)))
    return values, None


def _num(x: Any) -> str:
    if isinstance(x, float) and x.is_integer():
        return "%d" % x
    return str(x)


# --- DeepSpeed's own pydantic models, when DeepSpeed is importable on the coordinator ---------------------

def validate_with_deepspeed(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Validate the pydantic-backed sections with the installed DeepSpeed's models (extra="forbid").

    Returns None when DeepSpeed cannot be imported, else {"version", "sections": [checked],
    "errors": [{"section", "loc": [...], "type", "msg"}]}. Impure (imports DeepSpeed and torch); coordinator only.
    """
    import importlib
    try:
        import deepspeed
    except Exception:
        return None
    from .ds_config_keys import DS_MODELS
    checked: List[str] = []
    errors: List[Dict[str, Any]] = []
    for section, (modname, clsname) in DS_MODELS.items():
        value = config.get(section)
        if not isinstance(value, dict):
            continue
        try:
            model = getattr(importlib.import_module(modname), clsname)
        except Exception:
            continue  # this DeepSpeed has no such model (older release): our tables cover the section
        checked.append(section)
        try:
            model(**value)
        except Exception as exc:
            items = None
            errs = getattr(exc, "errors", None)
            if callable(errs):
                try:
                    items = errs()
                except Exception:
                    items = None
            if items:
                for e in items:
                    errors.append({"section": section, "loc": [str(x) for x in e.get("loc", ())],
                                   "type": str(e.get("type")), "msg": str(e.get("msg"))})
            else:
                errors.append({"section": section, "loc": [], "type": type(exc).__name__, "msg": str(exc)})
    return {"version": getattr(deepspeed, "__version__", None), "sections": checked, "errors": errors}


# --- host side ------------------------------------------------------------------------------------

def _meminfo_bytes(text: str, field: str) -> Optional[int]:
    m = re.search(r"^%s:\s+(\d+)\s*kB" % re.escape(field), text or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def host_memory(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
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


# --- coordinator ----------------------------------------------------------------------------------

def _t(thresholds: Dict[str, Any], key: str) -> Any:
    return (thresholds.get(NAME) or {}).get(key, _DEFAULTS[key])


def coordinate(cluster: Any) -> Dict[str, Any]:
    """Gather everything evaluate() needs into plain JSON-able facts (see the schema in evaluate)."""
    opts = getattr(cluster, "options", None) or {}
    path = opts.get("deepspeed_config")
    hosts = [{"name": h.name, "slots": int(getattr(h, "slots", 0) or 0)} for h in cluster.hosts]
    facts: Dict[str, Any] = {
        "config_path": path, "config": None, "load_findings": [],
        "world_size": int(cluster.world_size), "hosts": hosts,
        "model_params": opts.get("model_params"), "largest_layer_params": opts.get("largest_layer_params"),
        "host_facts": {}, "host_memory": {}, "deepspeed_models": None,
    }
    for h in hosts:
        per = (cluster.facts or {}).get(h["name"]) or {}
        facts["host_facts"][h["name"]] = {k: per.get(k) for k in ("gpu", "ds_report", "nvme", "python")}
    if not path:
        facts["load_findings"] = [Finding(Status.FAIL, "no DeepSpeed config given (ds_config runs with "
                                                       "--deepspeed-config PATH)",
                                          "pass --deepspeed-config PATH").to_dict()]
        return facts
    config, found = load_config(str(path))
    facts["load_findings"] = [f.to_dict() for f in found]
    if not config:
        return facts
    facts["config"] = config
    try:
        facts["deepspeed_models"] = validate_with_deepspeed(config)
    except Exception as exc:  # DeepSpeed importable but broken: fall back to our tables
        facts["deepspeed_models"] = None
        facts["deepspeed_models_error"] = "%s: %s" % (type(exc).__name__, exc)

    opt_dev, par_dev = offload_devices(config)
    if "cpu" in (opt_dev, par_dev) or "nvme" in (opt_dev, par_dev):
        thresholds = getattr(cluster, "thresholds", None) or {}
        timeout = float(_t(thresholds, "host_memory_timeout_s"))
        names = [h["name"] for h in hosts]
        results: Dict[str, Any] = {}
        call_all = getattr(cluster, "call_all", None)
        if callable(call_all):
            try:
                results = call_all("ds_config.host_memory", {n: {} for n in names}, timeout)
            except Exception as exc:
                results = {n: exc for n in names}
        else:
            for n in names:
                try:
                    results[n] = cluster.call(n, "ds_config.host_memory", {}, timeout)
                except Exception as exc:
                    results[n] = exc
        for n in names:
            r = results.get(n)
            if isinstance(r, BaseException) or not isinstance(r, dict):
                facts["host_memory"][n] = {"error": "host_memory failed: %s" % (
                    "%s: %s" % (type(r).__name__, r) if isinstance(r, BaseException) else "no result")}
            else:
                facts["host_memory"][n] = r
    return facts


# --- evaluation -----------------------------------------------------------------------------------

class _Report:
    """Findings for the cluster cell ("*") and per host."""

    def __init__(self) -> None:
        self.star: List[Finding] = []
        self.hosts: Dict[str, List[Finding]] = {}

    def add(self, status: Status, message: str, fix: str = "", hosts: Optional[Dict[str, str]] = None) -> None:
        """hosts: {host: that host's own message}; the "*" finding names them all."""
        self.star.append(Finding(status, message, fix))
        for h, msg in (hosts or {}).items():
            self.hosts.setdefault(h, []).append(Finding(status, msg, fix))


def _hosts_text(names: Sequence[str], limit: int = 8) -> str:
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return "%s and %d more" % (", ".join(names[:limit]), len(names) - limit)


def _host_versions(facts: Dict[str, Any]) -> Dict[str, Tuple[int, int, int]]:
    out: Dict[str, Tuple[int, int, int]] = {}
    for name, hf in (facts.get("host_facts") or {}).items():
        for src in ("ds_report", "python"):
            v = parse_version(((hf or {}).get(src) or {}).get("deepspeed"))
            if v:
                out[name] = v
                break
    return out


def _did_you_mean(key: str, choices: Sequence[str]) -> str:
    m = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    if not m:
        m = difflib.get_close_matches(key.lower(), [c.lower() for c in choices], n=1, cutoff=0.6)
        if m:
            m = [c for c in choices if c.lower() == m[0]]
    return m[0] if m else ""


def _known_elsewhere(key: str, here: str) -> List[str]:
    from .ds_config_keys import SECTIONS, TOP_LEVEL
    out = []
    if here != "" and key in TOP_LEVEL:
        out.append("the top level")
    for sec, keys in SECTIONS.items():
        if sec != here and key in keys and sec != "bfloat16":
            out.append(sec)
    return out


def _unknown_key_finding(report: _Report, path: str, key: str, section: str, choices: Sequence[str],
                         how: str) -> None:
    guess = _did_you_mean(key, choices)
    elsewhere = _known_elsewhere(key, section)
    hint = ""
    if guess:
        hint = "; did you mean %r?" % guess
    elif elsewhere:
        hint = "; %r is a key of %s" % (key, " / ".join(elsewhere))
    where = section or "top level"
    fix = ("rename %s to %s" % (path, (section + "." if section else "") + guess) if guess else
           "move %r into %s" % (key, elsewhere[0]) if elsewhere and elsewhere[0] != "the top level" else
           "move %r to the top level" % key if elsewhere else "remove %s (not a DeepSpeed setting)" % path)
    report.add(Status.FAIL, "%s: unknown %s key (%s)%s" % (path, where, how, hint), fix)


def _check_keys(config: Dict[str, Any], ds_models: Optional[Dict[str, Any]], report: _Report) -> None:
    from .ds_config_keys import SECTIONS, TOP_LEVEL
    for key in config:
        if key in TOP_LEVEL or key.startswith(COMMENT_PREFIXES):
            continue
        _unknown_key_finding(report, key, key, "", list(TOP_LEVEL),
                             "DeepSpeed silently ignores unknown top-level keys, so this setting has no effect")
    checked_by_ds = set((ds_models or {}).get("sections") or [])
    zero = config.get("zero_optimization")
    for sec_path, known in SECTIONS.items():
        top, _, sub = sec_path.partition(".")
        if top in checked_by_ds:
            continue  # DeepSpeed's own model validated it (errors below)
        value = config.get(top)
        if sub:
            value = value.get(sub) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            continue
        how = ("DeepSpeed's %s model forbids extra keys, so the job fails at deepspeed.initialize" % sec_path
               if top in ("zero_optimization", "fp16", "bf16", "tensorboard", "wandb", "csv_monitor", "comet",
                          "comms_logger")
               else "DeepSpeed ignores keys it does not read, so this setting has no effect")
        for key in value:
            if key in known or key.startswith(COMMENT_PREFIXES):
                continue
            if sec_path == "optimizer" and key in ("adam_w_mode", "torch_adam", "lr", "betas", "eps",
                                                    "weight_decay"):
                report.add(Status.FAIL, "optimizer.%s: not read there (DeepSpeed reads optimizer.type, "
                                        "optimizer.params and optimizer.legacy_fusion only)" % key,
                           "move %r into optimizer.params" % key)
                continue
            _unknown_key_finding(report, "%s.%s" % (sec_path, key), key, sec_path, list(known), how)
    for err in (ds_models or {}).get("errors") or []:
        loc = [err.get("section", "")] + list(err.get("loc") or [])
        path = ".".join(str(x) for x in loc if x != "")
        etype = str(err.get("type") or "")
        version = (ds_models or {}).get("version") or "?"
        if etype in ("extra_forbidden", "value_error.extra"):
            key = str(loc[-1])
            parent = ".".join(str(x) for x in loc[:-1])
            if key in SECTIONS.get(parent, {}):
                # A key some DeepSpeed release has, unknown only to the coordinator's: the version gates judge it
                # against the hosts' DeepSpeed instead.
                continue
            choices = list(SECTIONS.get(parent, {})) or list(SECTIONS.get(loc[0], {}))
            _unknown_key_finding(report, path, key, parent, choices,
                                 "DeepSpeed %s's pydantic model rejects it: %s" % (version, err.get("msg")))
        else:
            report.add(Status.FAIL, "%s: invalid value (DeepSpeed %s says: %s)" % (path, version, err.get("msg")),
                       "fix %s as DeepSpeed's message says" % path)
    if isinstance(zero, bool):
        report.add(Status.WARN, "zero_optimization: %s is the deprecated boolean form (DeepSpeed maps it to "
                                "stage %d with a warning)" % (str(zero).lower(), 1 if zero else 0),
                   'use "zero_optimization": {"stage": %d}' % (1 if zero else 0))


def _check_deprecated(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: _Report) -> None:
    from .ds_config_keys import DEPRECATED
    for section, old, new, note, renamed_in in DEPRECATED:
        container = config if section == "" else config.get(section)
        if not isinstance(container, dict) or old not in container:
            continue
        if section == "" and old == "bfloat16" and "bf16" in config:
            note = "ignored: bf16 is present and takes precedence"
        if renamed_in and versions:
            cut = parse_version(renamed_in)
            if all(v < cut for v in versions.values()):
                continue  # every host still reads the old name
        path = "%s.%s" % (section, old) if section else old
        report.add(Status.WARN, "%s is deprecated (%s); the modern key is %s" % (path, note, new),
                   "replace %s with %s" % (path, new))


def _gate_findings(label: str, info: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: _Report,
                   added_status: Status = Status.WARN) -> None:
    added, removed = info.get("added"), info.get("removed")
    if added:
        last_without = parse_version(added[0])
        old = {h: v for h, v in versions.items() if v <= last_without}
        if old:
            report.add(added_status,
                       "%s needs DeepSpeed >= %s (absent in %s); %s run%s DeepSpeed %s"
                       % (label, added[1], added[0], _hosts_text(sorted(old)), "s" if len(old) == 1 else "",
                          ", ".join(sorted({_vstr(v) for v in old.values()}))),
                       "upgrade DeepSpeed on those hosts (pip install -U 'deepspeed>=%s') or drop %s"
                       % (added[1], label),
                       {h: "%s needs DeepSpeed >= %s; this host runs %s" % (label, added[1], _vstr(v))
                        for h, v in old.items()})
    if removed:
        first_without = parse_version(removed[1])
        why = info.get("why") or "removed"
        new = {h: v for h, v in versions.items() if v >= first_without}
        if new:
            report.add(Status.FAIL,
                       "%s was removed in DeepSpeed %s (%s); %s run%s %s, which rejects the config"
                       % (label, removed[1], why, _hosts_text(sorted(new)), "s" if len(new) == 1 else "",
                          ", ".join(sorted({_vstr(v) for v in new.values()}))),
                       "remove %s from the config (see %s)" % (label, _removed_issue()),
                       {h: "%s was removed in DeepSpeed %s; this host runs %s" % (label, removed[1], _vstr(v))
                        for h, v in new.items()})
        elif not versions:
            report.add(Status.WARN, "%s was removed in DeepSpeed %s (%s); DeepSpeed >= %s rejects the config "
                                    "(host DeepSpeed version unknown)" % (label, removed[1], why, removed[1]),
                       "remove %s from the config" % label)


def _removed_issue() -> str:
    from .ds_config_keys import REMOVED_ISSUE
    return REMOVED_ISSUE


def _check_versions(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: _Report) -> None:
    from .ds_config_keys import SECTIONS, TOP_LEVEL
    for key in config:
        info = TOP_LEVEL.get(key)
        if info:
            _gate_findings(key, info, versions, report)
    for sec_path, known in SECTIONS.items():
        if sec_path == "bfloat16":
            continue
        top, _, sub = sec_path.partition(".")
        value = config.get(top)
        if sub:
            value = value.get(sub) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            continue
        for key in value:
            info = known.get(key)
            if info:
                _gate_findings("%s.%s" % (sec_path, key), info, versions, report)


# --- batch -----------------------------------------------------------------------------------------

def _batch_value(config: Dict[str, Any], key: str, report: _Report) -> Tuple[bool, Optional[float]]:
    """(ok, value): value None when absent or "auto"; ok False when the value is unusable (reported)."""
    if key not in config or config[key] is None:
        return True, None
    v = config[key]
    if isinstance(v, str) and v.strip().lower() == "auto":
        return True, None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        report.add(Status.FAIL, "%s = %r (expected a positive integer, or \"auto\" with the HF/Accelerate "
                                "integration)" % (key, v), "set %s to an integer" % key)
        return False, None
    return True, v


def _check_batch(config: Dict[str, Any], world_size: int, slots: Sequence[int], report: _Report) -> str:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    vals: Dict[str, Optional[float]] = {}
    for k in keys:
        ok, v = _batch_value(config, k, report)
        if not ok:
            return ""
        vals[k] = v
    auto = [k for k in keys if isinstance(config.get(k), str)]
    if _section(config, "elasticity").get("enabled") is True:
        return "batch set by elasticity"
    sp = config.get("sequence_parallel_size")
    dp: float = world_size
    dp_note = "world size %d" % world_size
    if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1:
        dp = world_size / sp  # DeepSpeedConfig: dist.get_world_size() / config["sequence_parallel_size"]
        dp_note = "world size %d / sequence_parallel_size %d" % (world_size, sp)
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]

    if auto:
        # The HF/Accelerate integration fills "auto" (micro batch and accumulation from its arguments,
        # train_batch_size = world_size * micro * accumulation); DeepSpeed then asserts the product.
        if tb is None:
            return "batch: %s filled by the HF integration" % ", ".join(auto)
        fixed = [v for v in (mb, ga) if v is not None]
        unit = dp
        for v in fixed:
            unit *= v
        if tb % unit != 0 or tb < unit:
            report.add(Status.FAIL,
                       "train_batch_size %s is not a multiple of %s: no value of %s can make train_batch_size "
                       "== micro_batch * grad_accum * world_size (%s)"
                       % (_num(tb), ("%s = %s" % (" x ".join([_num(v) for v in fixed] + [_num(dp)]), _num(unit))
                                     if fixed else "the world size %s" % _num(dp)),
                          " / ".join(auto), dp_note),
                       'set train_batch_size to "auto", or to a multiple of %s' % _num(unit))
            return ""
        return "batch %s = %s x %s" % (_num(tb), " x ".join(
            [_num(v) if v is not None else "auto" for v in (mb, ga)]), _num(dp))

    values, err = resolve_batch(tb, mb, ga, dp)
    if err is None:
        return "batch %s = %s x %s x %s (%s)" % (_num(values["train_batch_size"]),
                                                 _num(values["train_micro_batch_size_per_gpu"]),
                                                 _num(values["gradient_accumulation_steps"]), _num(dp), dp_note)
    if values is None:
        report.add(Status.FAIL, "no batch size given: %s (DeepSpeed asserts at start)" % err,
                   "set train_micro_batch_size_per_gpu (and gradient_accumulation_steps), or train_batch_size")
        return ""
    given = ", ".join("%s=%s" % (k, _num(vals[k])) for k in keys if vals[k] is not None)
    fixes = _batch_fixes(vals, dp)
    # With tensor parallelism (DeepSpeed gets an mpu) its world size is the data-parallel size. Tensor
    # parallelism lives inside a node: a degree that divides every host's slots, leaving a data-parallel size
    # of at least 2 (with 1 nearly any batch fits, which would excuse every mistake), makes this a WARN.
    per_node = [s for s in slots if s > 0]
    for k in range(2, (min(per_node) if per_node else 1) + 1):
        if all(s % k == 0 for s in per_node) and dp % k == 0 and dp / k >= 2 and \
                resolve_batch(tb, mb, ga, dp / k)[1] is None:
            report.add(Status.WARN,
                       "batch math fails with %s (%s): %s; it holds for a data-parallel size of %s, so it is right "
                       "only if the job uses tensor parallelism of degree %d" % (given, dp_note, err, _num(dp / k), k),
                       "if the job is purely data parallel: %s" % fixes)
            return ""
    report.add(Status.FAIL, "batch math fails with %s (%s): %s" % (given, dp_note, err), fixes)
    return ""


def _batch_fixes(vals: Dict[str, Optional[float]], dp: float) -> str:
    """Corrected values: keep the micro batch and accumulation (new train_batch_size), or keep train_batch_size."""
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    out = []
    m, g = mb or 1, ga or 1
    if mb is not None or ga is not None:
        out.append("train_batch_size = %s x %s x %s = %s" % (_num(m), _num(g), _num(dp), _num(m * g * dp)))
    if tb is not None:
        if mb is not None and tb % (mb * dp) == 0 and tb // (mb * dp) > 0:
            out.append("gradient_accumulation_steps = %s (keeping train_batch_size %s)" % (
                _num(tb // (mb * dp)), _num(tb)))
        if tb % (g * dp) == 0 and tb // (g * dp) > 0:
            out.append("train_micro_batch_size_per_gpu = %s (keeping train_batch_size %s)" % (
                _num(tb // (g * dp)), _num(tb)))
        if tb % dp != 0:
            out.append("a train_batch_size that is a multiple of %s" % _num(dp))
    return "set " + ", or ".join(out) if out else "set train_micro_batch_size_per_gpu and gradient_accumulation_steps"


# --- precision ------------------------------------------------------------------------------------

def _enabled(section: Any) -> Optional[bool]:
    """True / False / None ("auto": decided later by the HF integration)."""
    if not isinstance(section, dict):
        return False
    v = section.get("enabled", False)
    if isinstance(v, str) and v.lower() == "auto":
        return None
    return v is True


def _gpus(facts: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    out = {}
    for name, hf in (facts.get("host_facts") or {}).items():
        gpus = ((hf or {}).get("gpu") or {}).get("gpus") or []
        if gpus:
            out[name] = [g for g in gpus if isinstance(g, dict)]
    return out


def _check_precision(config: Dict[str, Any], gpus: Dict[str, List[Dict[str, Any]]], report: _Report) -> str:
    fp16 = _enabled(config.get("fp16"))
    bf16_sec = config.get("bf16") if "bf16" in config else config.get("bfloat16")
    bf16 = _enabled(bf16_sec)
    if fp16 and bf16:
        report.add(Status.FAIL, "fp16.enabled and bf16.enabled are both true (DeepSpeed asserts 'bfloat16 and fp16 "
                                "modes cannot be simultaneously enabled')",
                   "keep one: bf16 on Ampere (compute capability 8.0) or newer, fp16 otherwise")
    if bf16:
        old: Dict[str, str] = {}
        for host, lst in sorted(gpus.items()):
            bad = [g for g in lst if isinstance(g.get("cc"), (list, tuple)) and len(g["cc"]) >= 1
                   and (g["cc"][0], (g["cc"][1] if len(g["cc"]) > 1 else 0)) < (8, 0)]
            if bad:
                g = bad[0]
                old[host] = "%d GPU(s) of compute capability %s (%s): bf16 needs >= 8.0" % (
                    len(bad), ".".join(str(x) for x in g["cc"]), g.get("name") or "?")
        if old:
            report.add(Status.FAIL, "bf16 is enabled but %s ha%s GPUs without bf16 support (compute capability "
                                    "< 8.0; %s)" % (_hosts_text(sorted(old)), "s" if len(old) == 1 else "ve",
                                                    "; ".join("%s: %s" % (h, m) for h, m in sorted(old.items()))),
                       'use "fp16": {"enabled": true} with dynamic loss scaling on these GPUs, or exclude the hosts',
                       old)
    if fp16:
        sec = config.get("fp16") or {}
        ls = sec.get("loss_scale", 0)
        clip = config.get("gradient_clipping")
        clip_set = isinstance(clip, str) or (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0)
        if isinstance(ls, (int, float)) and not isinstance(ls, bool) and ls != 0 and not clip_set:
            report.add(Status.WARN, "fp16 uses a static loss_scale of %s without gradient_clipping (expected "
                                    "dynamic scaling, loss_scale 0, or clipping): overflows are not caught" % _num(ls),
                       'set "fp16": {"loss_scale": 0} (dynamic), add "gradient_clipping": 1.0, or use bf16 on '
                       "Ampere or newer")
    return "bf16" if bf16 else "fp16" if fp16 else "precision auto" if (bf16 is None or fp16 is None) else "fp32"


# --- optimizer, scheduler and ops ------------------------------------------------------------------

def _check_optimizer(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: _Report) -> None:
    from .ds_config_keys import (DS_OPTIMIZERS, DS_SCHEDULERS, TORCH_OPTIMIZERS, TORCH_SCHEDULERS,
                                       ZERO_SUPPORTED)
    name = optimizer_type(config)
    stage = zero_stage(config) or 0
    if name is not None and not (isinstance(config["optimizer"].get("type"), str)
                                 and name.lower() == "auto"):
        low = name.lower()
        if low in DS_OPTIMIZERS:
            _gate_findings("optimizer type %s" % name, DS_OPTIMIZERS[low], versions, report,
                           added_status=Status.FAIL)
            if low in ("onebitadam", "zerooneadam", "onebitlamb") and stage > 0:
                report.add(Status.FAIL, "optimizer %s with ZeRO stage %d (DeepSpeed asserts: not compatible with "
                                        "ZeRO)" % (name, stage), "use stage 0 with %s, or Adam/AdamW with ZeRO" % name)
        elif name in TORCH_OPTIMIZERS:
            if stage > 0 and config.get("zero_allow_untested_optimizer") is not True and low not in ZERO_SUPPORTED:
                report.add(Status.FAIL, "optimizer torch.optim.%s with ZeRO stage %d needs "
                                        "\"zero_allow_untested_optimizer\": true (DeepSpeed asserts 'You are using an "
                                        "untested ZeRO Optimizer')" % (name, stage),
                           'add "zero_allow_untested_optimizer": true, or use Adam/AdamW/Adagrad/Lion')
        else:
            known = sorted(set(k for k in DS_OPTIMIZERS) | set(TORCH_OPTIMIZERS))
            guess = _did_you_mean(name, [k for k in DS_OPTIMIZERS] + TORCH_OPTIMIZERS)
            report.add(Status.FAIL, "optimizer type %r is unknown to DeepSpeed (DeepSpeed names, any case: %s; "
                                    "else a torch.optim class, exact case: %s)%s"
                       % (name, ", ".join(sorted(DS_OPTIMIZERS)), ", ".join(TORCH_OPTIMIZERS),
                          "; did you mean %r?" % guess if guess else ""),
                       "set optimizer.type to %s" % (repr(guess) if guess else "one of %s" % ", ".join(known)))
        if stage > 0 and low in ("lamb", "muadam", "muadamw", "musgd") and \
                config.get("zero_allow_untested_optimizer") is not True:
            report.add(Status.FAIL, "optimizer %s with ZeRO stage %d needs \"zero_allow_untested_optimizer\": true "
                                    "(its class is not in DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS)" % (name, stage),
                       'add "zero_allow_untested_optimizer": true')
    params = _opt_params(config)
    if "max_grad_norm" in params:
        report.add(Status.FAIL, "optimizer.params.max_grad_norm = %r: DeepSpeed raises \"'max_grad_norm' is not "
                                "supported as an optimizer parameter\"" % params["max_grad_norm"],
                   'remove it and set "gradient_clipping": %s at the top level' % params["max_grad_norm"])

    sched = config.get("scheduler")
    sname = sched.get("type") if isinstance(sched, dict) else None
    if sname is not None and not (isinstance(sname, str) and sname.lower() == "auto"):
        if sname in DS_SCHEDULERS:
            _gate_findings("scheduler type %s" % sname, DS_SCHEDULERS[sname], versions, report,
                           added_status=Status.FAIL)
        elif sname not in TORCH_SCHEDULERS:
            choices = list(DS_SCHEDULERS) + TORCH_SCHEDULERS
            guess = _did_you_mean(str(sname), choices)
            report.add(Status.FAIL, "scheduler type %r is unknown (DeepSpeed's: %s; else a torch.optim.lr_scheduler "
                                    "class: %s; exact case)%s" % (sname, ", ".join(DS_SCHEDULERS),
                                                                   ", ".join(TORCH_SCHEDULERS),
                                                                   "; did you mean %r?" % guess if guess else ""),
                       "set scheduler.type to %s" % (guess or "one of %s" % ", ".join(DS_SCHEDULERS)))


_OP_FIX = {
    "async_io": "apt install libaio-dev (and a C compiler) on the host so DeepSpeed can build async_io; "
                "ds_report must show async_io [OKAY]",
    "gds": "install libaio-dev and the GPUDirect Storage (cufile) libraries, or set aio.use_gds false",
    "cpu_adam": "install a C++ compiler and ninja (JIT), or pre-build: DS_BUILD_CPU_ADAM=1 pip install deepspeed",
    "fused_adam": "install the CUDA toolkit (nvcc) matching torch and ninja, or DS_BUILD_FUSED_ADAM=1 pip install "
                  "deepspeed; or set optimizer.params.torch_adam true",
}


def _check_ops(config: Dict[str, Any], facts: Dict[str, Any], report: _Report) -> str:
    ops = required_ops(config)
    if not ops:
        return ""
    bad: Dict[str, Dict[str, str]] = {}
    unknown_hosts: List[str] = []
    for h in facts.get("hosts") or []:
        name = h["name"]
        dr = ((facts.get("host_facts") or {}).get(name) or {}).get("ds_report") or {}
        host_ops = dr.get("ops") or {}
        if not host_ops:
            unknown_hosts.append(name)
            continue
        for op in ops:
            e = host_ops.get(op)
            if not isinstance(e, dict):
                bad.setdefault(op, {})[name] = "%s is not in this DeepSpeed's op list (ds_report)" % op
            elif not (e.get("installed") or e.get("compatible")):
                note = e.get("note") or ""
                bad.setdefault(op, {})[name] = "%s is neither pre-built nor JIT-compatible (ds_report [NO] / [NO])%s" \
                    % (op, (": " + str(note)[:160]) if note else "")
    why = {"async_io": "NVMe offload", "gds": "aio.use_gds", "cpu_adam": "the optimizer runs on the CPU (offload)",
           "fused_adam": "Adam/AdamW on the GPU is DeepSpeed's FusedAdam", "cpu_adagrad": "Adagrad under offload",
           "cpu_lion": "Lion under offload", "fused_lion": "Lion on the GPU", "fused_lamb": "Lamb",
           "packbits": "the 'compressed' 1-bit comm backend"}
    for op, per in sorted(bad.items()):
        report.add(Status.FAIL, "the config needs op %s (%s) but it is not usable on %s: %s"
                   % (op, why.get(op, "required by the config"), _hosts_text(sorted(per)),
                      next(iter(per.values()))),
                   _OP_FIX.get(op, "fix the prerequisites ds_report lists for %s, or pre-build it with "
                                   "DS_BUILD_%s=1 pip install deepspeed" % (op, op.upper())),
                   {h: "config needs op %s (%s): %s" % (op, why.get(op, ""), m) for h, m in per.items()})
    if unknown_hosts:
        report.add(Status.SKIP, "ops %s not checked on %s: no ds_report facts (DeepSpeed missing or ds_report "
                                "not run)" % (", ".join(ops), _hosts_text(unknown_hosts)))
    return "ops %s" % ", ".join(ops)


# --- offload paths and pinned memory ------------------------------------------------------------------

def _norm(p: Any) -> str:
    return os.path.normpath(str(p)) if p not in (None, "") else ""


def _check_nvme(config: Dict[str, Any], facts: Dict[str, Any], report: _Report) -> None:
    zero = _zero(config)
    for sec in ("offload_param", "offload_optimizer"):
        s = zero.get(sec)
        if _device(s) == "nvme" and s.get("nvme_path") in (None, ""):
            report.add(Status.FAIL, "zero_optimization.%s.device is nvme but nvme_path is not set (expected the "
                                    "directory to swap to)" % sec,
                       'set zero_optimization.%s.nvme_path, e.g. "/local_nvme"' % sec)
    for path in nvme_paths(config):
        bad: Dict[str, str] = {}
        untested: List[str] = []
        for h in facts.get("hosts") or []:
            name = h["name"]
            nv = ((facts.get("host_facts") or {}).get(name) or {}).get("nvme") or {}
            entry = next((e for e in nv.get("paths") or []
                          if isinstance(e, dict) and _norm(e.get("path")) == _norm(path)), None)
            if entry is None:
                untested.append(name)
                continue
            err = entry.get("error")
            if not entry.get("exists"):
                bad[name] = "nvme_path %s does not exist on %s%s" % (path, name, " (%s)" % err if err else "")
            elif not entry.get("is_dir"):
                bad[name] = "nvme_path %s is not a directory on %s%s" % (path, name, " (%s)" % err if err else "")
            elif not entry.get("writable"):
                bad[name] = "nvme_path %s is not writable on %s%s" % (path, name, " (%s)" % err if err else "")
        if bad:
            report.add(Status.FAIL, "NVMe offload path %s is unusable on %s: %s" % (
                path, _hosts_text(sorted(bad)), "; ".join(bad[h] for h in sorted(bad)[:3])),
                "create it on every host as the job's user: mkdir -p %s && chown $USER %s (on the NVMe mount)"
                % (path, path), bad)
        if untested:
            report.add(Status.SKIP, "NVMe offload path %s not tested on %s (no nvme check result for it)"
                       % (path, _hosts_text(untested)))


def _check_offload_stage(config: Dict[str, Any], report: _Report) -> None:
    stage = zero_stage(config)
    if stage is None:
        return
    zero = _zero(config)
    opt_dev, par_dev = offload_devices(config)
    for dev, name in ((opt_dev, "offload_optimizer"), (par_dev, "offload_param")):
        if dev not in ("none", "cpu", "nvme"):
            report.add(Status.FAIL, "zero_optimization.%s.device = %r (expected none, cpu or nvme)"
                       % (name, (zero.get(name) or {}).get("device")), 'set device to "cpu" or "nvme"')
    if par_dev in ("cpu", "nvme") and stage != 3:
        report.add(Status.WARN, "zero_optimization.offload_param (device %s) has no effect at ZeRO stage %d "
                                "(parameter offload is ZeRO-3 only)" % (par_dev, stage),
                   "use stage 3 for parameter offload, or remove offload_param")
    if opt_dev in ("cpu", "nvme") and stage == 0:
        report.add(Status.WARN, "zero_optimization.offload_optimizer (device %s) at ZeRO stage 0: optimizer offload "
                                "needs ZeRO stage 1, 2 or 3" % opt_dev,
                   "set zero_optimization.stage to 1, 2 or 3, or remove offload_optimizer")
    if stage > 3 or stage < 0:
        report.add(Status.FAIL, "zero_optimization.stage = %d (expected 0, 1, 2 or 3; DeepSpeed: 'Maximum supported "
                                "ZeRO stage is 3')" % stage, "set zero_optimization.stage to 0-3")


PIN_MEMORY_DEFAULT_TRUE_SINCE = (0, 19, 5)  # offload_config.py: pin_memory default False up to 0.19.4, True from 0.19.5


def _pin_memory(config: Dict[str, Any], version: Optional[Tuple[int, int, int]] = None) -> Optional[str]:
    """Why offloaded tensors are pinned on a host running DeepSpeed `version` (None: they are not).

    An explicit pin_memory wins; without one DeepSpeed >= 0.19.5 pins by default (mlock'ed pages, counted
    against RLIMIT_MEMLOCK); an unknown version is taken as not pinning by default.
    """
    zero = _zero(config)
    reasons = []
    for sec in ("offload_param", "offload_optimizer"):
        s = zero.get(sec)
        if _device(s) not in ("cpu", "nvme"):
            continue
        pin = s.get("pin_memory")
        if pin is True:
            reasons.append("%s.pin_memory true" % sec)
        elif pin is None and version is not None and version >= PIN_MEMORY_DEFAULT_TRUE_SINCE:
            reasons.append("%s pins by default in DeepSpeed >= 0.19.5" % sec)
    if not reasons and zero.get("cpu_offload_use_pin_memory") is True and "cpu" in offload_devices(config):
        reasons.append("cpu_offload_use_pin_memory true")
    return ", ".join(reasons) or None


# --- memory -------------------------------------------------------------------------------------

def _check_memory(config: Dict[str, Any], facts: Dict[str, Any], gpus: Dict[str, List[Dict[str, Any]]],
                  thresholds: Dict[str, Any], report: _Report) -> str:
    n = facts.get("model_params")
    opt_dev, par_dev = offload_devices(config)
    stage = zero_stage(config)
    hosts = facts.get("hosts") or []
    mem = facts.get("host_memory") or {}
    cpu_frac = float(_t(thresholds, "cpu_mem_fail_fraction"))

    # pinned memory vs memlock (independent of --model-params)
    versions = _host_versions(facts)
    pinned = {h["name"]: _pin_memory(config, versions.get(h["name"])) for h in hosts}
    floor = float(_t(thresholds, "pin_memory_min_memlock_gib")) * GiB
    small: Dict[str, str] = {}
    for h in hosts:
        m = mem.get(h["name"]) or {}
        if not pinned[h["name"]] or "memlock_soft" not in m:
            continue  # nothing pinned, or host memory unknown
        soft = m.get("memlock_soft")  # None: unlimited
        if soft is not None and soft < floor:
            small[h["name"]] = "memlock soft limit %s (expected unlimited or >= %s) while offloaded tensors are " \
                               "pinned (%s)" % (_gib(soft) if soft >= GiB else "%d KiB" % (soft // 1024),
                                                _gib(floor), pinned[h["name"]])
    if small:
        report.add(Status.WARN, "pinned offload on hosts with a small locked-memory limit (DeepSpeed mlock()s pinned "
                                "offload buffers): %s" % "; ".join("%s: %s" % (h, small[h]) for h in sorted(small)[:4]),
                   "raise it: ulimit -l unlimited (/etc/security/limits.conf '* - memlock unlimited', docker "
                   "--ulimit memlock=-1), or set pin_memory false in the offload sections", small)

    if n in (None, 0):
        return "memory not checked (no --model-params)"
    if stage not in (0, 1, 2, 3):
        report.add(Status.SKIP, "ZeRO memory not estimated: zero_optimization.stage is %r"
                   % _zero(config).get("stage"))
        return ""
    n = float(n)
    L = facts.get("largest_layer_params")
    ll_known = L not in (None, 0)
    L = float(L) if ll_known else 0.0
    ws = int(facts.get("world_size") or sum(h.get("slots") or 0 for h in hosts) or 1)
    nodes = max(1, len(hosts))
    mixed = _enabled(config.get("fp16")) is not False or _enabled(
        config.get("bf16") if "bf16" in config else config.get("bfloat16")) is not False
    est = model_state_estimate(stage, opt_dev, par_dev, n, L, ws, mixed)
    ll_note = "" if stage < 3 or ll_known else " (largest layer unknown, counted as 0: a lower bound; pass " \
                                               "--largest-layer-params)"
    summary = "%s est. %s/GPU for %s params on %d GPUs" % (est["label"], _gib(est["gpu"]), _params_text(n), ws)

    # CPU RAM for CPU offload
    cpu_fail: Dict[str, str] = {}
    cpu_need: Dict[str, int] = {}
    for h in hosts:
        c = cpu_offload_estimate(stage, opt_dev, par_dev, n, L, h.get("slots") or 1, nodes)
        if c is None:
            break
        cpu_need[h["name"]] = c["cpu"]
        m = mem.get(h["name"]) or {}
        avail = m.get("mem_available")
        if avail is None:
            continue
        if c["cpu"] > avail * cpu_frac:
            cpu_fail[h["name"]] = "offloaded model states need %s of CPU RAM (%s), %s available (MemTotal %s)" % (
                _gib(c["cpu"]), c["formula"], _gib(avail), _gib(m.get("mem_total")))
    if cpu_fail:
        report.add(Status.FAIL, "%s: not enough CPU RAM on %s: %s" % (
            est["label"], _hosts_text(sorted(cpu_fail)), "; ".join("%s: %s" % (h, cpu_fail[h])
                                                                   for h in sorted(cpu_fail)[:3])),
            "free RAM on those hosts, offload to NVMe instead (device \"nvme\"), or use more nodes", cpu_fail)
    missing_mem = [h["name"] for h in hosts if cpu_need and (mem.get(h["name"]) or {}).get("mem_available") is None]
    if missing_mem:
        report.add(Status.SKIP, "CPU RAM for offload not compared on %s (host memory unknown: %s)" % (
            _hosts_text(missing_mem), (mem.get(missing_mem[0]) or {}).get("error") or "not collected"))
    if cpu_need:
        low: Dict[str, str] = {}
        for name, need in cpu_need.items():
            soft = (mem.get(name) or {}).get("memlock_soft")
            if pinned.get(name) and soft is not None and need > soft >= floor:
                low[name] = "memlock soft limit %s is below the %s of pinned offload buffers" % (_gib(soft), _gib(need))
        if low:
            report.add(Status.WARN, "pin_memory offload may exceed the locked-memory limit on %s: %s" % (
                _hosts_text(sorted(low)), "; ".join(low[h] for h in sorted(low)[:2])),
                "ulimit -l unlimited on those hosts, or set pin_memory false", low)

    # GPU memory
    if not gpus:
        report.add(Status.SKIP, "GPU memory not compared: no GPU facts (the gpu check did not run or found no "
                                "GPUs); %s%s" % (summary, ll_note))
        return summary
    free_by_host: Dict[str, Tuple[int, str]] = {}
    for host, lst in gpus.items():
        frees = [(g.get("memory_free"), g) for g in lst if isinstance(g.get("memory_free"), (int, float))]
        if frees:
            f, g = min(frees, key=lambda x: x[0])
            free_by_host[host] = (int(f), "GPU %s (%s)" % (g.get("index"), g.get("name") or "?"))
    if not free_by_host:
        report.add(Status.SKIP, "GPU memory not compared: the gpu facts have no free-memory figures; " + summary)
        return summary
    min_host = min(free_by_host, key=lambda h: free_by_host[h][0])
    min_free = free_by_host[min_host][0]
    fail_frac = float(_t(thresholds, "gpu_mem_fail_fraction"))
    warn_frac = float(_t(thresholds, "gpu_mem_warn_fraction"))
    summary += " (smallest free: %s on %s %s)" % (_gib(min_free), min_host, free_by_host[min_host][1])

    def fits(s: int, o: str, p: str, limit: float) -> Optional[Dict[str, Any]]:
        e = model_state_estimate(s, o, p, n, L, ws, mixed)
        if e["gpu"] > limit:
            return None
        for h in hosts:
            c = cpu_offload_estimate(s, o, p, n, L, h.get("slots") or 1, nodes)
            avail = (mem.get(h["name"]) or {}).get("mem_available")
            if c is not None and avail is not None and c["cpu"] > avail * cpu_frac:
                return None
        return e

    over = {h: v for h, v in free_by_host.items() if est["gpu"] > v[0] * fail_frac}
    if over:
        suggestion = None
        for limit in (min_free * warn_frac, min_free * fail_frac):
            for s, o, p in LADDER:
                if model_state_estimate(s, o, p, n, L, ws, mixed)["gpu"] >= est["gpu"]:
                    continue  # not a step forward from the configured stage/offload
                suggestion = fits(s, o, p, limit)
                if suggestion is not None:
                    break
            if suggestion is not None:
                break
        fix = ("use %s: est. %s/GPU (%s)" % (suggestion["label"], _gib(suggestion["gpu"]), suggestion["formula"])
               if suggestion else "no ZeRO stage/offload fits: use more GPUs, NVMe offload (ZeRO-Infinity), or a "
                                  "smaller model")
        report.add(Status.FAIL, "%s needs an estimated %s per GPU for model states (%s)%s, above the free GPU memory "
                                "on %s (smallest %s on %s)" % (
                                    est["label"], _gib(est["gpu"]), est["formula"], ll_note,
                                    _hosts_text(sorted(over)), _gib(min_free), min_host), fix,
                   {h: "%s needs an estimated %s per GPU; %s has %s free" % (
                       est["label"], _gib(est["gpu"]), v[1], _gib(v[0])) for h, v in over.items()})
        return summary
    tight = {h: v for h, v in free_by_host.items() if est["gpu"] > v[0] * warn_frac}
    if tight:
        report.add(Status.WARN, "%s needs an estimated %s per GPU for model states alone (%s)%s, over %.0f%% of the "
                                "free GPU memory on %s (smallest %s): little room for activations"
                   % (est["label"], _gib(est["gpu"]), est["formula"], ll_note, warn_frac * 100,
                      _hosts_text(sorted(tight)), _gib(min_free)),
                   "use a higher ZeRO stage or offload, or activation checkpointing with a smaller micro batch",
                   {h: "model states est. %s of %s free on %s" % (_gib(est["gpu"]), _gib(v[0]), v[1])
                    for h, v in tight.items()})
    if stage == 3:
        e2 = model_state_estimate(2, "none", "none", n, L, ws, mixed)
        comfort = float(_t(thresholds, "stage3_comfort_fraction"))
        if e2["gpu"] <= min_free * comfort:
            report.add(Status.WARN, "ZeRO-3 for a model that fits comfortably with ZeRO-2: ZeRO-2 needs an estimated "
                                    "%s per GPU (%s), under %.0f%% of the smallest free %s; ZeRO-3 adds parameter "
                                    "all-gathers (about 1.5x the communication) for no memory need"
                       % (_gib(e2["gpu"]), e2["formula"], comfort * 100, _gib(min_free)),
                       'use "zero_optimization": {"stage": 2} (without offload) for this model size')
    return summary


# --- evaluate ---------------------------------------------------------------------------------------

def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    """Pure: coordinate()'s facts -> {"*": cluster-wide outcome, host: that host's outcome (only hosts with findings)}.

    facts: {"config_path", "config": dict|None, "load_findings": [finding dicts], "world_size": int,
            "hosts": [{"name", "slots"}], "model_params", "largest_layer_params",
            "host_facts": {host: {"gpu", "ds_report", "nvme", "python"}},
            "host_memory": {host: {"mem_total", "mem_available", "memlock_soft", "memlock_hard", "error"}},
            "deepspeed_models": None | {"version", "sections", "errors": [...]}}
    """
    report = _Report()
    for f in facts.get("load_findings") or []:
        report.star.append(Finding(Status(f.get("status", "fail")), f.get("message", ""), f.get("fix", "")))
    config = facts.get("config")
    if not isinstance(config, dict):
        if not report.star:
            report.star.append(Finding(Status.ERROR, "no parsed DeepSpeed config in the facts"))
        return {CLUSTER: combine(report.star, "")}
    versions = _host_versions(facts)
    gpus = _gpus(facts)
    _check_keys(config, facts.get("deepspeed_models"), report)
    _check_deprecated(config, versions, report)
    _check_versions(config, versions, report)
    batch = _check_batch(config, int(facts.get("world_size") or 0) or 1,
                         [int(h.get("slots") or 0) for h in facts.get("hosts") or []], report)
    precision = _check_precision(config, gpus, report)
    _check_optimizer(config, versions, report)
    ops = _check_ops(config, facts, report)
    _check_offload_stage(config, report)
    _check_nvme(config, facts, report)
    memory = _check_memory(config, facts, gpus, thresholds, report)

    stage = zero_stage(config)
    opt_dev, par_dev = offload_devices(config)
    parts = [_stage_label(stage, opt_dev, par_dev) if stage is not None else "ZeRO stage ?", precision]
    if optimizer_type(config):
        parts.append("optimizer %s" % optimizer_type(config))
    parts += [p for p in (batch, ops, memory) if p]
    if versions:
        parts.append("DeepSpeed %s on the hosts" % ", ".join(sorted({_vstr(v) for v in versions.values()})))
    ok = "%s: %s" % (os.path.basename(str(facts.get("config_path") or "config")), "; ".join(parts))
    metrics = {"zero_stage": stage, "offload": {"optimizer": opt_dev, "param": par_dev},
               "required_ops": required_ops(config), "nvme_paths": nvme_paths(config),
               "deepspeed_models": (facts.get("deepspeed_models") or {}).get("version")}
    if not report.star:
        report.star.append(Finding(Status.PASS, ok))
    elif all(f.status == Status.SKIP for f in report.star):
        report.star.append(Finding(Status.PASS, ok))
    out = {CLUSTER: combine(report.star, ok, metrics)}
    for host, fs in sorted(report.hosts.items()):
        out[host] = combine(fs, "%s: ok" % NAME)
    return out
