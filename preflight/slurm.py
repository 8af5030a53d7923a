"""Hosts and slots of the current Slurm allocation, from the variables Slurm sets in a job's environment.

Sample of what this module parses:

    SLURM_JOB_ID=4242  SLURM_JOB_NODELIST=gpu[01-03],login1  SLURM_TASKS_PER_NODE=2(x3),1  SLURM_GPUS_ON_NODE=8
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from preflight.hostfile import HostfileError, HostSpec, expand_range

SCONTROL_TIMEOUT_S = 20.0
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_ONE_BRACKET_RE = re.compile(r"^([^\[\]]*)\[([0-9,\-]+)\]([^\[\]]*)$")


class AllocationError(Exception):
    """The allocation's variables are missing or malformed; the message names the variable."""


@dataclass
class Allocation:
    job_id: str
    hosts: List[HostSpec]
    source: str  # one line: where the hosts and the slots came from


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def split_nodelist(nodelist: str) -> List[str]:
    """Top-level items of a Slurm node list: commas inside brackets do not split ('a[1,3],b' -> 'a[1,3]', 'b')."""
    items, depth, cur = [], 0, ""
    for ch in nodelist:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


def expand_nodelist(nodelist: str, env: Optional[Mapping[str, str]] = None) -> Tuple[List[str], str]:
    """(host names, how): `scontrol show hostnames` when it works, else the hostfile's range library."""
    try:
        proc = subprocess.run(["scontrol", "show", "hostnames", "--", nodelist], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, stdin=subprocess.DEVNULL,
                              env=dict(env) if env is not None else None)
        if proc.returncode == 0 and proc.stdout.split():
            return proc.stdout.split(), "scontrol show hostnames"
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        names = [n for item in split_nodelist(nodelist) for n in _expand_in_order(item)]
    except HostfileError as exc:
        raise AllocationError(str(exc)) from None
    return names, "preflight's range expansion"


def _expand_in_order(item: str) -> List[str]:
    """One node-list item in Slurm's order: 'gpu[01-03,7]' -> gpu01 gpu02 gpu03 gpu7 (the range library sorts
    by width, and the first node is the job's master, so the order must be Slurm's)."""
    names = expand_range(item, "SLURM_JOB_NODELIST")  # validates and bounds the range
    m = _ONE_BRACKET_RE.match(item)
    if not m:
        return names
    ordered: List[str] = []
    for part in m[2].split(","):
        lo, _, hi = part.partition("-")
        width = len(lo) if lo.startswith("0") else 0
        ordered += [f"{m[1]}{i:0{width}d}{m[3]}" for i in range(int(lo), int(hi or lo) + 1)]
    return ordered if sorted(ordered) == sorted(names) else names


def tasks_per_node(value: str, count: int) -> List[int]:
    """SLURM_TASKS_PER_NODE ('2(x3),1') as one number per node."""
    out: List[int] = []
    for item in value.split(","):
        m = _TASKS_RE.match(item.strip())
        if not m:
            raise AllocationError(f"SLURM_TASKS_PER_NODE={value!r}: cannot read {item!r} (expected N or N(xM))")
        out += [int(m[1])] * int(m[2] or 1)
    if len(out) != count:
        raise AllocationError(f"SLURM_TASKS_PER_NODE={value!r} describes {len(out)} nodes, "
                              f"SLURM_JOB_NODELIST has {count}")
    return out


def allocation(env: Mapping[str, str], gpus_per_node: Optional[int] = None) -> Allocation:
    """The hosts of the job's allocation, with slots from --gpus-per-node, SLURM_GPUS_ON_NODE or the tasks."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        raise AllocationError("no SLURM_JOB_NODELIST in the environment: run inside an allocation "
                              "(salloc, sbatch) or pass --hostfile")
    names, how = expand_nodelist(nodelist, env)
    if gpus_per_node:
        slots, slot_source = [gpus_per_node] * len(names), f"--gpus-per-node {gpus_per_node}"
    elif (gpus := env.get("SLURM_GPUS_ON_NODE", "")).strip():
        if not gpus.strip().isdigit() or int(gpus) < 1:
            raise AllocationError(f"SLURM_GPUS_ON_NODE={gpus!r} is not a positive number")
        slots, slot_source = [int(gpus)] * len(names), f"SLURM_GPUS_ON_NODE={gpus}"
    elif tasks := env.get("SLURM_TASKS_PER_NODE", ""):
        slots, slot_source = tasks_per_node(tasks, len(names)), f"SLURM_TASKS_PER_NODE={tasks}"
    else:
        slots, slot_source = [1] * len(names), "1 per node (no SLURM_GPUS_ON_NODE or SLURM_TASKS_PER_NODE)"
    hosts = [HostSpec(name=n, slots=s, index=i, gpus=list(range(s)), line=0)
             for i, (n, s) in enumerate(zip(names, slots))]
    job = env.get("SLURM_JOB_ID", "")
    source = (f"hosts: Slurm job {job or '?'} SLURM_JOB_NODELIST={nodelist} ({len(names)} nodes, expanded by "
              f"{how}); slots: {slot_source}")
    return Allocation(job, hosts, source)
