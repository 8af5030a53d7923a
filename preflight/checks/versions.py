"""Same software on every host: torch, CUDA runtime, NCCL, DeepSpeed, Python major.minor, driver branch.

Runs nothing on the hosts: ``coordinate`` reads the facts the host checks already recorded, e.g.

    cluster.facts["node1"]["python"]      = {"python": "3.11.7", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
                                             "nccl": "2.28.9", "deepspeed": "0.19.8", "nvidia_ml_py": ...}
    cluster.facts["node1"]["driver_cuda"] = {"driver": "580.159.04", "torch": ..., "torch_cuda": ..., "nccl": ...}
    cluster.facts["node1"]["ds_report"]   = {"deepspeed": "0.19.8", "torch": ...}

and returns ``{"hosts": {name: {"torch": ..., "cuda": ..., "nccl": ..., "deepspeed": ..., "python": "3.11",
"driver": "580"}}}``. A field is left out for a host whose source checks recorded nothing (errored, not run):
unknown is not compared; None means "known to be absent" (e.g. DeepSpeed not installed) and is compared.

Thresholds: [versions] ignore (fields not to compare).

Thresholds: [versions] in versions.toml beside this module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..hostside.outcome import Finding, Outcome, Status, combine, limits
from ..hostside.seams import CheckSpec, ClusterView

NAME = "versions"

# field -> (label, [(check, key), ...] in order of preference)
FIELDS: Dict[str, Tuple[str, List[Tuple[str, str]]]] = {
    "torch": ("torch", [("python", "torch"), ("driver_cuda", "torch"), ("ds_report", "torch")]),
    "cuda": ("CUDA runtime (torch.version.cuda)", [("python", "torch_cuda"), ("driver_cuda", "torch_cuda"),
                                                   ("ds_report", "torch_cuda")]),
    "nccl": ("NCCL", [("python", "nccl"), ("driver_cuda", "nccl")]),
    "deepspeed": ("DeepSpeed", [("python", "deepspeed"), ("ds_report", "deepspeed")]),
    "python": ("Python", [("python", "python")]),
    "driver": ("NVIDIA driver branch", [("driver_cuda", "driver"), ("gpu", "driver")]),
}

_FIXES = {
    "torch": "install torch==%s on %s from the same index as the other hosts (e.g. pip install torch==%s "
             "--index-url https://download.pytorch.org/whl/cuXYZ), or use one container image everywhere",
    "cuda": "install the torch build for CUDA %s on %s (the CUDA runtime comes with the torch wheel); "
            "one container image everywhere avoids this",
    "nccl": "install NCCL %s on %s (it ships with torch: the same torch build, or pip install "
            "nvidia-nccl-cuXX==%s)",
    "deepspeed": "pip install deepspeed==%s on %s",
    "python": "use Python %s on %s (the same venv/conda env or container image as the other hosts)",
    "driver": "install NVIDIA driver branch %s on %s (mixed branches give different CUDA support and NCCL "
              "behaviour)",
}


def _normalize(field: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    text = str(value).strip()
    if not text:
        return None
    if field == "python":
        return ".".join(text.split()[0].split(".")[:2])
    if field == "driver":
        return text.split(".")[0]
    return text


def host_versions(checks: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """One host's recorded facts ({check name: facts dict}) -> {field: value}; unknown fields are left out."""
    result: Dict[str, Optional[str]] = {}
    for field, (_label, sources) in FIELDS.items():
        for check, key in sources:
            facts = checks.get(check)
            if isinstance(facts, dict) and key in facts:
                result[field] = _normalize(field, facts[key])
                if result[field] is not None:
                    break
    return result


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    hosts: Dict[str, Dict[str, Optional[str]]] = {}
    all_facts = getattr(cluster, "facts", None) or {}
    for host in cluster.hosts:
        name = getattr(host, "name", str(host))
        hosts[name] = host_versions(all_facts.get(name) or {})
    return {"hosts": hosts}


def _show(value: Optional[str]) -> str:
    return "not installed" if value is None else value


def _hosts(names: Sequence[str], limit: int = 8) -> str:
    names = sorted(names)
    if len(names) <= limit:
        return ", ".join(names)
    return "%s and %d more" % (", ".join(names[:limit]), len(names) - limit)


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    ignore = set(limits(thresholds, NAME)["ignore"])
    hosts: Dict[str, Dict[str, Any]] = facts.get("hosts") or {}
    findings: List[Finding] = []
    odd_hosts: Dict[str, List[str]] = {}
    summary: Dict[str, Any] = {}
    for field, (label, _sources) in FIELDS.items():
        if field in ignore:
            continue
        groups: Dict[Optional[str], List[str]] = {}
        unknown = []
        for name, values in hosts.items():
            if field in values:
                groups.setdefault(values[field], []).append(name)
            else:
                unknown.append(name)
        summary[field] = {_show(v): sorted(n) for v, n in groups.items()}
        if unknown:
            summary[field]["unknown"] = sorted(unknown)
        if len(groups) <= 1:
            continue
        ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), _show(kv[0])))
        top_value, top_hosts = ranked[0]
        if len(ranked[1][1]) == len(top_hosts):
            parts = "; ".join("%s on %s" % (_show(v), _hosts(n)) for v, n in ranked)
            findings.append(Finding(Status.FAIL, "%s differs between hosts with no majority: %s" % (label, parts),
                                    _FIXES[field] % ((_show(top_value), "every host") +
                                                     ((_show(top_value),) if field in ("torch", "nccl") else ()))))
            for _v, names in ranked:
                for n in names:
                    odd_hosts.setdefault(n, []).append(field)
            continue
        odd = [(v, n) for v, n in ranked[1:]]
        odd_names = [n for _v, names in odd for n in names]
        parts = "; ".join("%s has %s" % (_hosts(n), _show(v)) for v, n in odd)
        findings.append(Finding(
            Status.FAIL,
            "%s differs: %s, expected %s like the other %d host(s) (%s)" % (
                label, parts, _show(top_value), len(top_hosts), _hosts(top_hosts, 3)),
            _FIXES[field] % ((_show(top_value), _hosts(odd_names)) +
                             ((_show(top_value),) if field in ("torch", "nccl") else ()))))
        for n in odd_names:
            odd_hosts.setdefault(n, []).append(field)

    metrics = {"hosts": len(hosts), "versions": summary, "odd_hosts": odd_hosts}
    if len(hosts) < 2:
        ok = "%d host: nothing to compare" % len(hosts)
    else:
        same = ["%s %s" % (FIELDS[f][0].split(" (")[0], ", ".join(summary[f].keys() - {"unknown"}))
                for f in FIELDS if f in summary and len(summary[f].keys() - {"unknown"}) == 1]
        ok = "all %d hosts agree: %s" % (len(hosts), "; ".join(same) or "no versions recorded")
    return {"*": combine(findings, ok, metrics)}


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="torch, CUDA, NCCL, DeepSpeed, Python major.minor and driver branch are the same on every host",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    reads=tuple(dict.fromkeys(check for _, sources in FIELDS.values() for check, _ in sources)),
    # Measures nothing and loads no host: runs together with its QUIET neighbours in ORDER (runner.py).
    quiet=True,
)
