"""Verdict on CPUs per rank: each host's CPUs (the compute check's facts, declared in SPEC.reads) over its hostfile
slots, against ``[ds_config] min_cpus_per_slot``. Pure.

E.g. compute's ``{"cpu": {"model": "AMD EPYC 9654", "threads": 8}}`` on ``node01 slots=8``: 1 CPU per rank, under
2: every rank's process and its DataLoader workers time-share one CPU -> a WARN naming node01.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ...hostside.outcome import Status
from .findings import Report


def host_cpus(facts: Dict[str, Any], host: str) -> Optional[int]:
    """The CPUs a rank on ``host`` may run on: compute's ``cpu.threads``, sched_getaffinity of the agent, the same
    cpuset and cgroup the launcher's ranks inherit over SSH; None when unknown (the compute check did not run)."""
    compute = ((facts.get("host_facts") or {}).get(host) or {}).get("compute")
    cpu = compute.get("cpu") if isinstance(compute, dict) else None
    value = cpu.get("threads") if isinstance(cpu, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def check_cpus_per_slot(facts: Dict[str, Any], min_per_slot: float, report: Report) -> str:
    """A WARN per host whose CPUs / slots is under min_per_slot. torch's DataLoader compares one loader's
    num_workers with the whole machine's CPUs (torch/utils/data/dataloader.py:613-620 in torch 2.13), blind to
    the other ranks of the host, each with its own workers: the check that it does not make."""
    low: Dict[str, str] = {}
    per_rank: Dict[str, int] = {}
    ratios: List[float] = []
    for h in facts.get("hosts") or []:
        name, slots = str(h.get("name")), int(h.get("slots") or 0)
        cpus = host_cpus(facts, name)
        if cpus is None or slots <= 0:
            continue
        ratio = cpus / slots
        ratios.append(ratio)
        if ratio < min_per_slot:
            low[name] = f"{cpus} CPUs for {slots} ranks ({ratio:.2g} per rank)"
            per_rank[name] = cpus // slots
    if low:
        names = sorted(low)
        # One CPU for the rank's own process, the rest for its workers.
        workers = max(0, per_rank[names[0]] - 1)
        more = f" and {len(names) - 8} more hosts" if len(names) > 8 else ""
        listed = "; ".join(f"{h}: {low[h]}" for h in names[:8])
        report.add(Status.WARN, f"{listed}{more}, under "
                   f"{min_per_slot:g} per rank ([ds_config] min_cpus_per_slot): each rank's own process and its "
                   f"DataLoader workers time-share the CPUs, so the GPUs wait for data",
                   f"give the job more CPUs on {names[0]} (Slurm --cpus-per-task, docker --cpus, the cgroup's "
                   f"cpuset), or run fewer ranks there (hostfile: {names[0]} slots=N), or keep each rank's "
                   f"DataLoader(num_workers=...) at {workers} or fewer",
                   {h: f"{low[h]}, under {min_per_slot:g} per rank ([ds_config] min_cpus_per_slot)" for h in names})
    if not ratios:
        return ""
    return f"{min(ratios):.3g}+ CPUs per rank"
