"""Coordinator only: validate the config's sections with the installed DeepSpeed's own pydantic models.

E.g. ``"compile": {"enabeld": true}`` -> {"section": "compile", "loc": ["enabeld"], "type": "extra_forbidden"}.
Imports DeepSpeed (and torch), so it never runs on a host or in ``evaluate``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .keys import DS_MODELS


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


