"""Collecting findings for the cluster cell and per host, the facts accessors and the number formats of the messages.

E.g. ``report.add(Status.FAIL, "... on node01", fix, {"node01": "that host's own message"})``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...hostside.outcome import Finding, Status
from .parse import parse_version

GiB = 1 << 30


def vstr(v: Tuple[int, int, int]) -> str:
    major, minor, patch = v
    return f"{major}.{minor}.{patch}"


def gib(n: Optional[float]) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.1f} GiB"


def params_text(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return f"{int(n)}"


def num(x: Any) -> str:
    if isinstance(x, float) and x.is_integer():
        return f"{int(x)}"
    return str(x)


class Report:
    """Findings for the cluster cell ("*") and per host."""

    def __init__(self) -> None:
        self.star: List[Finding] = []
        self.hosts: Dict[str, List[Finding]] = {}

    def add(self, status: Status, message: str, fix: str = "", hosts: Optional[Dict[str, str]] = None) -> None:
        """hosts: {host: that host's own message}; the "*" finding names them all."""
        self.star.append(Finding(status, message, fix))
        for h, msg in (hosts or {}).items():
            self.hosts.setdefault(h, []).append(Finding(status, msg, fix))


def hosts_text(names: Sequence[str], limit: int = 8) -> str:
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more"


def host_versions(facts: Dict[str, Any]) -> Dict[str, Tuple[int, int, int]]:
    """{host: DeepSpeed version} from the ds_report or python check's facts, else ds_config's own host probe."""
    out: Dict[str, Tuple[int, int, int]] = {}
    for name, hf in (facts.get("host_facts") or {}).items():
        for src in ("ds_report", "python"):
            v = parse_version(((hf or {}).get(src) or {}).get("deepspeed"))
            if v:
                out[name] = v
                break
    for name, probe in (facts.get("host_probe") or {}).items():
        v = parse_version((probe or {}).get("deepspeed"))
        if v and name not in out:
            out[name] = v
    return out


def gpus_by_host(facts: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    out = {}
    for name, hf in (facts.get("host_facts") or {}).items():
        gpus = ((hf or {}).get("gpu") or {}).get("gpus") or []
        if gpus:
            out[name] = [g for g in gpus if isinstance(g, dict)]
    return out
