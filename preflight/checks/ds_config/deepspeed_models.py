"""The config checked by an installed DeepSpeed's own code, section by section: on the coordinator, or on a host.

E.g. ``"compile": {"enabeld": true}`` -> {"section": "compile", "loc": ["enabeld"], "type": "extra_forbidden"}, and
``"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas2": 0.9}}`` -> FusedAdam takes no ``betas2``.
Which sections DeepSpeed validates with a pydantic model is asked of DeepSpeed itself (a probe key in each
section), not kept in a list here. Imports DeepSpeed (and torch), so it never runs in ``evaluate``; where the
coordinator has no DeepSpeed, ``validate`` runs it on a host through the agent, in the job's interpreter.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ...hostside.seams import HostContext
from .parse import offload_devices, optimizer_params

# A key no DeepSpeed release has: a section whose parser rejects it is validated by a model that forbids extras.
PROBE = "__preflight_probe__"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed logs deprecation notes while parsing; they would interleave with preflight's progress."""
    log = logging.getLogger("DeepSpeed")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _errors(section: str, exc: BaseException) -> List[Dict[str, Any]]:
    items = None
    errs = getattr(exc, "errors", None)
    if callable(errs):
        try:
            items = errs()
        except Exception:
            items = None
    if items:
        return [{"section": section, "loc": [str(x) for x in e.get("loc", ())], "type": str(e.get("type")),
                 "msg": str(e.get("msg"))} for e in items]
    return [{"section": section, "loc": [], "type": type(exc).__name__, "msg": str(exc)[:300]}]


def validate_with_deepspeed(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Each top-level key parsed alone by DeepSpeedConfig._initialize_params, as deepspeed.initialize parses it.

    Returns None when DeepSpeed cannot be imported, else {"version", "sections": [the config's sections that
    DeepSpeed validates with a model forbidding unknown keys], "errors": [{"section", "loc", "type", "msg"}],
    "param_errors": [...] (see optimizer_param_errors)}.
    """
    return validate_or_why(config)[0]


def validate_or_why(config: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """(validate_with_deepspeed's result, why it is None: '' when it is not)."""
    try:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
    except Exception as exc:
        return None, f"import deepspeed: {type(exc).__name__}: {str(exc)[:200]}"
    parser = DeepSpeedConfig.__new__(DeepSpeedConfig)  # the parsing half only: no world size, no batch asserts
    checked: List[str] = []
    errors: List[Dict[str, Any]] = []
    with _quiet():
        try:
            # A DeepSpeed whose parser cannot run on its own (a private API that changed) must not turn every
            # key into a finding: an empty config has to parse, else fall back to our own tables.
            parser._initialize_params({})
        except Exception as exc:
            return None, (f"DeepSpeed {getattr(deepspeed, '__version__', '?')}'s config parser does not run on its "
                          f"own: {type(exc).__name__}: {str(exc)[:200]}")
        for key, value in config.items():
            if isinstance(value, dict):
                try:
                    parser._initialize_params({key: {PROBE: 1}})
                except Exception as exc:
                    if any(e["type"] in ("extra_forbidden", "value_error.extra") and e["loc"][-1:] == [PROBE]
                           for e in _errors(key, exc)):
                        checked.append(key)
            try:
                parser._initialize_params({key: copy.deepcopy(value)})
            except Exception as exc:
                errors.extend(_errors(key, exc))
    return {"version": getattr(deepspeed, "__version__", None), "sections": checked, "errors": errors,
            "param_errors": optimizer_param_errors(config)}, ""


def validate(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Host side ("ds_config.deepspeed_models.validate"), in the job's interpreter when the coordinator has no
    DeepSpeed: params {"config": the config as checked} -> validate_with_deepspeed's result, or {"unavailable": why}
    where DeepSpeed cannot be imported there either."""
    config = params.get("config")
    if not isinstance(config, dict):
        return {"unavailable": "no config in the request"}
    res, why = validate_or_why(config)
    return res if res is not None else {"unavailable": why}


_TEXT_MAX = 300
_ITEMS_MAX = 200


def _text(value: Any, limit: int = _TEXT_MAX) -> str:
    """A host's string as data: printable characters only, bounded."""
    return "".join(c if c.isprintable() else "?" for c in str(value))[:limit]


def clean_models(res: Any) -> Optional[Dict[str, Any]]:
    """A host's validate result, checked and bounded before evaluate reads it (hosts are not trusted): the same
    shape as validate_with_deepspeed's, every value a bounded printable string; None when it is not that shape."""
    if not isinstance(res, dict) or not isinstance(res.get("errors"), list) or \
            not isinstance(res.get("param_errors"), list) or not isinstance(res.get("sections"), list):
        return None
    errors = [{"section": _text(e.get("section")), "loc": [_text(x, 100) for x in (e.get("loc") or [])[:16]],
               "type": _text(e.get("type"), 60), "msg": _text(e.get("msg"))}
              for e in res["errors"][:_ITEMS_MAX] if isinstance(e, dict) and isinstance(e.get("loc") or [], list)]
    params = [{"path": _text(e.get("path"), 60), "key": _text(e.get("key"), 100), "class": _text(e.get("class"), 120),
               "accepted": [_text(a, 60) for a in (e.get("accepted") or [])[:64]], "why": _text(e.get("why"))}
              for e in res["param_errors"][:_ITEMS_MAX]
              if isinstance(e, dict) and isinstance(e.get("accepted") or [], list)]
    version = res.get("version")
    return {"version": _text(version, 40) if version is not None else None,
            "sections": [_text(x, 100) for x in res["sections"][:_ITEMS_MAX]], "errors": errors,
            "param_errors": params}


def _optimizer_class(config: Dict[str, Any]) -> Tuple[Optional[Any], Dict[str, Any], List[str]]:
    """The class engine._configure_basic_optimizer builds for this config, the keyword arguments it adds
    itself, and the params keys it pops first; (None, ...) when it cannot be told here."""
    import torch

    opt = config.get("optimizer")
    name = str(opt.get("type")) if isinstance(opt, dict) and opt.get("type") is not None else ""
    low = name.lower()
    params = optimizer_params(config)
    cpu = offload_devices(config)[0] in ("cpu", "nvme")  # zero_use_cpu_optimizer
    if low in ("adam", "adamw"):
        popped = ["adam_w_mode", "torch_adam", "fp32_optimizer_states"]
        if params.get("torch_adam") is True:
            return (torch.optim.AdamW if low == "adamw" else torch.optim.Adam), {"foreach": None}, popped + ["foreach"]
        if cpu:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            return DeepSpeedCPUAdam, {"adamw_mode": True, "fp32_optimizer_states": True}, popped
        from deepspeed.ops.adam import FusedAdam
        return FusedAdam, {"adam_w_mode": True}, popped
    if low == "adagrad":
        if cpu:
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
            return DeepSpeedCPUAdagrad, {}, []
        return torch.optim.Adagrad, {}, []
    if low == "lamb":
        from deepspeed.ops.lamb import FusedLamb
        return FusedLamb, {}, []
    if low == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        return (DeepSpeedCPULion if cpu else FusedLion), {}, []
    if low in ("muadam", "muadamw", "musgd", "muon", "onebitadam", "zerooneadam", "onebitlamb", "auto", ""):
        return None, {}, []  # mup's classes, Muon's param groups, removed optimizers, HF's "auto": not judged
    cls = getattr(torch.optim, name, None)
    return (cls if inspect.isclass(cls) else None), {}, []


def _scheduler_class(config: Dict[str, Any]) -> Optional[Any]:
    import torch
    from deepspeed.runtime import lr_schedules

    sched = config.get("scheduler")
    name = sched.get("type") if isinstance(sched, dict) else None
    if not isinstance(name, str) or name.lower() == "auto":
        return None
    cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
    return cls if inspect.isclass(cls) else None


def _accepted(cls: Any, skip: int) -> Tuple[Optional[List[str]], bool]:
    """(keyword names of cls.__init__ after `skip` positional ones, takes **kwargs)."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None, True
    names: List[str] = []
    kwargs = False
    for p in list(sig.parameters.values())[1 + skip:]:
        if p.kind == p.VAR_KEYWORD:
            kwargs = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.append(p.name)
    return names, kwargs


def optimizer_param_errors(config: Dict[str, Any]) -> List[Dict[str, Any]]:
    """optimizer.params / scheduler.params keys the constructor DeepSpeed calls would refuse (a TypeError at
    deepspeed.initialize): [{"path", "key", "class", "accepted": [...], "why"}]."""
    out: List[Dict[str, Any]] = []
    checks: List[Tuple[str, Any, Dict[str, Any], List[str], Dict[str, Any]]] = []
    try:
        cls, added, popped = _optimizer_class(config)
        if cls is not None:
            checks.append(("optimizer.params", cls, added, popped, optimizer_params(config)))
        scls = _scheduler_class(config)
        sched = config.get("scheduler")
        sparams = sched.get("params") if isinstance(sched, dict) else None
        if scls is not None and isinstance(sparams, dict):
            checks.append(("scheduler.params", scls, {}, [], sparams))
    except Exception:  # an op package that fails to import here: the hosts' ds_report judges the ops
        return out
    for path, cls, added, popped, params in checks:
        names, kwargs = _accepted(cls, 1)  # the first argument is the parameters / the optimizer
        if names is None:
            continue
        label = f"{cls.__module__}.{cls.__qualname__}"
        for key in params:
            if key in popped:
                continue
            if key in added:
                out.append({"path": path, "key": key, "class": label, "accepted": names,
                            "why": f"DeepSpeed passes {key} itself: 'got multiple values for keyword argument'"})
            elif key not in names and not kwargs:
                out.append({"path": path, "key": key, "class": label, "accepted": names,
                            "why": f"{cls.__name__}() got an unexpected keyword argument {key!r}"})
    return out
