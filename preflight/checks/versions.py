"""Same software and GPUs on every host (torch, CUDA runtime, NCCL, DeepSpeed, Python, driver branch; GPU model,
memory, count, compute capability), and an NCCL new enough for the GPUDirect RDMA path each host relies on.

Runs nothing on the hosts: ``coordinate`` reads the facts the host checks already recorded, e.g.

    cluster.facts["node1"]["python"]      = {"python": "3.11.7", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
                                             "nccl": "2.28.9", "deepspeed": "0.19.8", "nvidia_ml_py": ...}
    cluster.facts["node1"]["driver_cuda"] = {"driver": "580.159.04", "torch": ..., "torch_cuda": ..., "nccl": ...}
    cluster.facts["node1"]["ds_report"]   = {"deepspeed": "0.19.8", "torch": ...}
    cluster.facts["node1"]["gpu"]         = {"source": "nvml", "gpus": [{"name": "NVIDIA H100 80GB HBM3",
                                             "memory_total": 85520809984, "cc": [9, 0], ...}, ...], ...}
    cluster.facts["node1"]["interfaces"]  = {"peermem": false, "gpu_driver_loaded": true, "ib": [...], ...}

and returns ``{"hosts": {name: {"torch": ..., "cuda": ..., "nccl": ..., "deepspeed": ..., "python": "3.11",
"driver": "580", "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory": "80 GiB", "gpu_count": "8", "gpu_cc": "9.0"}},
"gdr": {name: "peermem" | "dmabuf"}}`` (gdr only where a host relies on GPUDirect RDMA). A field is left out for
a host whose source checks recorded nothing (errored, not run): unknown is not compared; None means "known to be
absent" (e.g. DeepSpeed not installed, no GPU) and is compared.

Severities. Different software is a FAIL (a mixed cluster fails at NCCL init or silently diverges). Different GPUs
are a WARN by default ([versions] hardware_status): DeepSpeed runs on them, but synchronous data parallel steps at
the slowest GPU's pace, ZeRO gives every rank the same share so the smallest GPU memory sets what fits, the hostfile
must give each host its own slot count, and ops built for one compute capability may not run on another
(TORCH_CUDA_ARCH_LIST). A host that relies on GPUDirect RDMA (interfaces: an active IB/RoCE port on a GPU host) with
an NCCL older than that path needs is a WARN (the job runs, staging through host memory); NCCL's env.rst:
NCCL_DMABUF_ENABLE "(since 2.13)" (the 2.13.4-1 release added DMA-BUF registration, NET API v6), NCCL_NET_GDR_LEVEL
"(since 2.3.4. In 2.4.0, NCCL_IB_GDR_LEVEL was renamed to NCCL_NET_GDR_LEVEL)".

Thresholds: [versions] in versions.toml beside this module (ignore, hardware_status).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..hostside.ncclenv import nccl_version
from ..hostside.netinfo import gdr_path
from ..hostside.fixes import PREBUILD_OPTIONS, pip_install, pip_install_torch, python_word
from ..hostside.outcome import Finding, Outcome, Status, combine, limits
from ..hostside.seams import CheckSpec, ClusterView

NAME = "versions"

# Software: field -> (label, [(check, key), ...] in order of preference)
SOFTWARE: Dict[str, Tuple[str, List[Tuple[str, str]]]] = {
    "torch": ("torch", [("python", "torch"), ("driver_cuda", "torch"), ("ds_report", "torch")]),
    "cuda": ("CUDA runtime (torch.version.cuda)", [("python", "torch_cuda"), ("driver_cuda", "torch_cuda"),
                                                   ("ds_report", "torch_cuda")]),
    "nccl": ("NCCL", [("python", "nccl"), ("driver_cuda", "nccl")]),
    "deepspeed": ("DeepSpeed", [("python", "deepspeed"), ("ds_report", "deepspeed")]),
    "python": ("Python", [("python", "python")]),
    "driver": ("NVIDIA driver branch", [("driver_cuda", "driver"), ("gpu", "driver")]),
}

# Templates filled in later with str.format: {value} = the majority's, {hosts} = the hosts to fix.
_FIXES = {
    "torch": "install torch=={value} on {hosts} from the same index as the other hosts, with the job's interpreter "
             "there, or use one container image everywhere",
    "cuda": "install the torch build for CUDA {value} on {hosts} (the CUDA runtime comes with the torch wheel); "
            "one container image everywhere avoids this",
    "nccl": "install NCCL {value} on {hosts}: it ships with torch, so install the same torch build as the other "
            "hosts (the torch line above), or the nvidia-nccl wheel of torch's CUDA major version",
    "deepspeed": "install deepspeed=={value} on {hosts}, with the job's interpreter there",
    "python": "use Python {value} on {hosts} (the same venv/conda env or container image as the other hosts)",
    "driver": "install NVIDIA driver branch {value} on {hosts} (mixed branches give different CUDA support and "
              "NCCL behaviour)",
}

# GPUs, from the gpu check's facts (driver_cuda's gpu_count where the gpu check recorded nothing):
# field -> (label, why a difference matters, fix: a str.format template filled in later with {value} = the
# majority's, {hosts} = the odd hosts, {own} = each odd host's own hostfile line, "node02 slots=4").
HARDWARE: Dict[str, Tuple[str, str, str]] = {
    "gpu_model": ("GPU model", "mixed GPU models in one job: synchronous data-parallel steps go at the slowest GPU's "
                  "pace", "run the job on hosts with {value} only (leave {hosts} out of the hostfile), or accept the "
                  "slowest GPU's pace"),
    "gpu_memory": ("GPU memory", "ZeRO and data parallel give every rank the same share: the smallest GPU memory "
                   "sets the micro-batch that fits (a batch tuned on the larger GPUs runs out of memory on the "
                   "smaller)", "leave {hosts} out of the hostfile, or size train_micro_batch_size_per_gpu for the "
                   "smallest GPU memory in the job"),
    "gpu_count": ("GPU count", "each host's hostfile line must give its own count (slots=N), and layouts that "
                  "assume the same GPUs per node (pipeline or tensor parallel groups) break",
                  "write each host's own count in the hostfile ({own}), or restore the missing "
                  "GPUs there (nvidia-smi -L; the gpu check's result says which GPU is gone)"),
    "gpu_cc": ("GPU compute capability", "kernels built for one compute capability (TORCH_CUDA_ARCH_LIST, DeepSpeed's "
               "pre-built ops) may not run on another, and bf16 needs 8.0 or higher",
               "use one GPU generation per job, or build ops for every one: TORCH_CUDA_ARCH_LIST='<each cc>' "
               "DS_BUILD_OPS=1 and `-m pip install " + " ".join(PREBUILD_OPTIONS) + " deepspeed==<its version>` run "
               "by the job's interpreter (on {hosts} too)"),
}
# Every compared field (the choices of [versions] ignore): the software, then the GPUs with the facts they come from.
FIELDS: Dict[str, Tuple[str, List[Tuple[str, str]]]] = dict(
    SOFTWARE, **{f: (label, [("gpu", "gpus"), ("driver_cuda", "gpu_count")] if f == "gpu_count" else [("gpu", "gpus")])
                 for f, (label, _why, _fix) in HARDWARE.items()})
GIB = 1 << 30

# The oldest NCCL for each way a host does GPUDirect RDMA (netinfo.gdr_path), with why (NCCL's env.rst).
GDR_MIN_NCCL: Dict[str, Tuple[Tuple[int, int], str, str]] = {
    "dmabuf": ((2, 13), "GPUDirect RDMA through DMA-BUF (no nvidia_peermem; NVIDIA's open kernel module)",
               "NCCL registers GPU memory through DMA-BUF from 2.13 on (NCCL_DMABUF_ENABLE, 'since 2.13'); an older "
               "NCCL stages every inter-node transfer through host memory"),
    "peermem": ((2, 4), "GPUDirect RDMA through nvidia_peermem",
                "NCCL_NET_GDR_LEVEL, the variable that steers GPUDirect RDMA (preflight recommends it), was "
                "NCCL_IB_GDR_LEVEL before 2.4.0, which ignores it"),
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
    for field, (_label, sources) in SOFTWARE.items():
        for check, key in sources:
            facts = checks.get(check)
            if isinstance(facts, dict) and key in facts:
                result[field] = _normalize(field, facts[key])
                if result[field] is not None:
                    break
    return result


def _joined(values: Any) -> Optional[str]:
    """The distinct values of one host's GPUs, as one comparable text ('A + B' for a host that mixes them)."""
    distinct = sorted(set(values))
    return " + ".join(distinct) if distinct else None


def host_hardware(checks: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """One host's GPUs from the gpu check's facts -> {gpu_model, gpu_memory, gpu_count, gpu_cc}; a host without an
    NVIDIA driver has 0 GPUs (and None for the rest); fields the facts do not give are left out (unknown)."""
    gpu = checks.get("gpu")
    result: Dict[str, Optional[str]] = {}
    if isinstance(gpu, dict) and isinstance(gpu.get("gpus"), list) and (gpu.get("source")
                                                                        or gpu.get("driver_present") is False):
        gpus = [g for g in gpu["gpus"] if isinstance(g, dict)]
        result["gpu_count"] = str(len(gpus))
        names = [g["name"].strip() for g in gpus if isinstance(g.get("name"), str) and g["name"].strip()]
        if len(names) == len(gpus):
            result["gpu_model"] = _joined(names)
        totals = [g["memory_total"] for g in gpus
                  if isinstance(g.get("memory_total"), int) and not isinstance(g.get("memory_total"), bool)]
        if len(totals) == len(gpus):
            # Whole GiB: an 80 GB H100 reports 85520809984 bytes (79.6 GiB) whatever its driver reserves.
            result["gpu_memory"] = _joined(f"{round(t / GIB)} GiB" for t in totals)
        ccs = [g["cc"] for g in gpus if isinstance(g.get("cc"), list) and len(g["cc"]) >= 2
               and all(isinstance(x, int) and not isinstance(x, bool) for x in g["cc"][:2])]
        if len(ccs) == len(gpus):
            result["gpu_cc"] = _joined(f"{cc[0]}.{cc[1]}" for cc in ccs)
        return result
    driver = checks.get("driver_cuda")
    count = driver.get("gpu_count") if isinstance(driver, dict) else None
    if isinstance(count, int) and not isinstance(count, bool):
        result["gpu_count"] = str(count)
    return result


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    hosts: Dict[str, Dict[str, Optional[str]]] = {}
    gdr: Dict[str, str] = {}
    all_facts = getattr(cluster, "facts", None) or {}
    for host in cluster.hosts:
        name = getattr(host, "name", str(host))
        checks = all_facts.get(name) or {}
        hosts[name] = host_versions(checks)
        hosts[name].update(host_hardware(checks))
        path = gdr_path(checks.get("interfaces"))
        if path in GDR_MIN_NCCL:
            gdr[name] = str(path)
    # Only where a host relies on GPUDirect RDMA, so that a cluster without IB records what it always did.
    out: Dict[str, Any] = {"hosts": hosts, **({"gdr": gdr} if gdr else {})}
    # The job's interpreter on each host (its python check's sys.executable): a fix's pip runs in it.
    executables = {h: py.get("executable") if isinstance(py := (all_facts.get(h) or {}).get("python"), dict) else None
                   for h in hosts}
    if any(executables.values()):
        out["executables"] = executables
    return out


def _show(value: Optional[str], field: str = "") -> str:
    if value is None:
        return "no GPU" if field in HARDWARE else "not installed"
    return value


def _hosts(names: Sequence[str], limit: int = 8) -> str:
    names = sorted(names)
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def _differs(field: str, label: str, groups: Dict[Optional[str], List[str]], status: Status,
             odd_hosts: Dict[str, List[str]], executables: Optional[Dict[str, Any]] = None,
             cuda: Optional[str] = None) -> Finding:
    """The finding for one field whose value differs between hosts: the odd hosts against the majority, or every
    group where there is none; records each odd host's field in odd_hosts."""
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), _show(kv[0], field)))
    top_value, top_hosts = ranked[0]
    if len(ranked[1][1]) == len(top_hosts):
        parts = "; ".join(f"{_show(v, field)} on {_hosts(n)}" for v, n in ranked)
        message = f"{label} differs between hosts with no majority: {parts}"
        odd = ranked
        odd_names = [n for _v, names in ranked for n in names]
        named_for_fix = "every host"
    else:
        odd = ranked[1:]
        odd_names = [n for _v, names in odd for n in names]
        parts = "; ".join(f"{_hosts(n)} has {_show(v, field)}" for v, n in odd)
        message = (f"{label} differs: {parts}, expected {_show(top_value, field)} like the other "
                   f"{len(top_hosts)} host(s) ({_hosts(top_hosts, 3)})")
        named_for_fix = _hosts(odd_names)
    for n in odd_names:
        odd_hosts.setdefault(n, []).append(field)
    if field in HARDWARE:
        _label, why, fix = HARDWARE[field]
        lines = [f"{n} slots={v}" for v, names in odd if v is not None and str(v).isdigit() for n in sorted(names)]
        own = ", ".join(lines[:8]) + (f" and {len(lines) - 8} more" if len(lines) > 8 else "")
        own = own or f"slots= the GPUs each of {named_for_fix} has"
        return Finding(status, f"{message}: {why}", fix.format(value=_show(top_value, field), hosts=named_for_fix,
                                                               own=own))
    fix = _FIXES[field].format(value=_show(top_value), hosts=named_for_fix)
    return Finding(status, message, fix + _pip_lines(field, top_value, odd_names, executables or {}, cuda))


# The package each field comes from, as `<python> -m pip install` takes it (nccl: NVIDIA's wheel, per CUDA major).
def _pip_lines(field: str, value: Optional[str], hosts: Sequence[str], executables: Dict[str, Any],
               cuda: Optional[str]) -> str:
    """':' and one command line per interpreter of the hosts to fix: the job's own interpreter on each host (as its
    python check reported it) runs pip, for the majority's version; '' when there is nothing to install."""
    if value is None or field not in ("torch", "deepspeed", "nccl"):
        return ""
    if field == "nccl":
        major = (cuda or "").split(".")[0]
        if not major.isdigit():
            return ""
        spec: Tuple[str, ...] = (f"nvidia-nccl-cu{major}=={value}",)
    else:
        spec = (f"{field}=={value}",)
    by_python: Dict[str, List[str]] = {}
    for h in sorted(hosts):
        exe = executables.get(h)
        if python_word(exe) is None:
            continue  # no path to name: the prose above says what to install
        line = pip_install_torch(exe, value) if field == "torch" else pip_install(exe, *spec)
        by_python.setdefault(line, []).append(h)
    if not by_python:
        return ""
    if len(by_python) == 1:
        return ":\n  " + next(iter(by_python))
    # Different interpreters: each line says where it runs (a comment, so the line still pastes as it is).
    return ":\n" + "\n".join(f"  {line}  # on {_hosts(names)}" for line, names in by_python.items())


def _gdr_findings(gdr: Dict[str, str], hosts: Dict[str, Dict[str, Any]]) -> Tuple[List[Finding], Dict[str, Any]]:
    """A WARN per (GDR path, NCCL version) whose NCCL is older than that path needs, naming the hosts; and the
    metrics: each GDR host's path and NCCL (None where its NCCL is unknown: then nothing is judged)."""
    groups: Dict[Tuple[str, str], List[str]] = {}
    metrics: Dict[str, Any] = {}
    for name, path in sorted(gdr.items()):
        nccl = (hosts.get(name) or {}).get("nccl")
        metrics[name] = {"path": path, "nccl": nccl}
        version = nccl_version(nccl) if nccl else None
        if version is not None and path in GDR_MIN_NCCL and version < GDR_MIN_NCCL[path][0]:
            groups.setdefault((path, str(nccl)), []).append(name)
    findings = []
    for (path, nccl), names in sorted(groups.items()):
        minimum, what, why = GDR_MIN_NCCL[path]
        floor = ".".join(map(str, minimum))
        check = "python -c 'import torch; print(torch.cuda.nccl.version())'"
        if path == "dmabuf":
            fix = (f"on {_hosts(names)}: sudo modprobe nvidia_peermem (GPUDirect RDMA with the NCCL there), or "
                   f"install a torch build whose NCCL is >= {floor} ({check} shows it)")
        else:
            fix = (f"on {_hosts(names)}: install a torch build whose NCCL is >= {floor} ({check} shows it), or "
                   f"export NCCL_IB_GDR_LEVEL (the old name) instead of NCCL_NET_GDR_LEVEL")
        findings.append(Finding(Status.WARN, f"{_hosts(names)} rel{'ies' if len(names) == 1 else 'y'} on {what} "
                                             f"but run{'s' if len(names) == 1 else ''} NCCL {nccl} (expected >= "
                                             f"{floor}): {why}", fix))
    return findings, metrics


def _majority(hosts: Dict[str, Dict[str, Any]], field: str) -> Optional[str]:
    """The value of field on most hosts (None when no host has one)."""
    counts: Dict[str, int] = {}
    for values in hosts.values():
        if values.get(field) is not None:
            counts[str(values[field])] = counts.get(str(values[field]), 0) + 1
    return max(sorted(counts), key=lambda v: counts[v]) if counts else None


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    t = limits(thresholds, NAME)
    ignore = set(t["ignore"])
    hardware_status = Status.FAIL if str(t.get("hardware_status", "warn")).lower() == "fail" else Status.WARN
    hosts: Dict[str, Dict[str, Any]] = facts.get("hosts") or {}
    findings: List[Finding] = []
    odd_hosts: Dict[str, List[str]] = {}
    summary: Dict[str, Any] = {}
    labels = [(f, label) for f, (label, _sources) in FIELDS.items()]
    for field, label in labels:
        if field in ignore:
            continue
        groups: Dict[Optional[str], List[str]] = {}
        unknown = []
        for name, values in hosts.items():
            if field in values:
                groups.setdefault(values[field], []).append(name)
            else:
                unknown.append(name)
        if not groups and field in HARDWARE:
            continue  # recorded without the gpu check: nothing to say, not even "unknown"
        summary[field] = {_show(v, field): sorted(n) for v, n in groups.items()}
        if unknown:
            summary[field]["unknown"] = sorted(unknown)
        if len(groups) > 1:
            findings.append(_differs(field, label, groups, hardware_status if field in HARDWARE else Status.FAIL,
                                     odd_hosts, facts.get("executables"), _majority(hosts, "cuda")))
    gdr_findings, gdr_metrics = _gdr_findings(facts.get("gdr") or {}, hosts)
    findings.extend(gdr_findings)

    metrics = {"hosts": len(hosts), "versions": summary, "odd_hosts": odd_hosts}
    if gdr_metrics:
        metrics["gdr"] = gdr_metrics
    if len(hosts) < 2:
        ok = f"{len(hosts)} host: nothing to compare"
    else:
        same = [f"{FIELDS[f][0].split(' (')[0]} {', '.join(summary[f].keys() - {'unknown'})}"
                for f in FIELDS if f in summary and len(summary[f].keys() - {"unknown"}) == 1]
        ok = f"all {len(hosts)} hosts agree: {'; '.join(same) or 'no versions recorded'}"
    return {"*": combine(findings, ok, metrics)}


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="torch, CUDA, NCCL, DeepSpeed, Python major.minor, driver branch and the GPUs (model, memory, count, "
                "compute capability) are the same on every host; NCCL new enough for the host's GPUDirect RDMA",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    reads=tuple(dict.fromkeys([check for _, sources in FIELDS.values() for check, _ in sources] + ["interfaces"])),
    # Measures nothing and loads no host: it reads the host checks' facts (runner.Schedule runs it beside anything).
    quiet=True,
    loads=(),
)
