"""Locked-memory limit (ulimit -l) of the job's processes on each host: RDMA registration and pinned buffers need it.

Reads RLIMIT_MEMLOCK of the agent, which an SSH session starts like the job's ranks (pdsh/ssh launch), with
``resource.getrlimit`` (``ulimit -l`` prints the soft limit in KiB, e.g. ``8192`` or ``unlimited``), and lists
/sys/class/infiniband (RDMA devices, e.g. ``mlx5_0``). Facts, e.g.::

    {"soft_bytes": 8388608, "hard_bytes": 8388608, "rdma_devices": ["mlx5_0", "mlx5_1"]}
    {"soft_bytes": null, "hard_bytes": null, "rdma_devices": []}          (null = unlimited)

Thresholds: the ``[memlock]`` section of memlock.toml beside this module.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from ..hostside.seams import CheckSpec, HostContext
from ..hostside.outcome import Outcome, Status, limits

NAME = "memlock"

GiB = 1 << 30


def collect(ctx: HostContext) -> Dict[str, Any]:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        rdma = sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        rdma = []
    return {"soft_bytes": None if soft == resource.RLIM_INFINITY else int(soft),
            "hard_bytes": None if hard == resource.RLIM_INFINITY else int(hard), "rdma_devices": rdma}


def _text(value: Optional[int]) -> str:
    if value is None:
        return "unlimited"
    if value >= GiB:
        return f"{value / GiB:.1f} GiB"
    return f"{value // 1024} KiB"


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    lim = limits(thresholds, NAME)
    soft, hard = facts.get("soft_bytes"), facts.get("hard_bytes")
    rdma = list(facts.get("rdma_devices") or [])
    metrics = {"soft_bytes": soft, "hard_bytes": hard, "rdma_devices": rdma,
               "ulimit_l": "unlimited" if soft is None else str(int(soft) // 1024)}
    fix = ("raise it for the job's user: '* - memlock unlimited' in /etc/security/limits.conf (and "
           "LimitMEMLOCK=infinity for sshd/slurmd under systemd), then log in again; check with ulimit -l")
    where = f"the job's processes (over SSH) may lock {_text(soft)} (hard limit {_text(hard)})"
    devices = ", ".join(rdma[:4])
    if rdma and soft is not None and lim["rdma_requires_unlimited"]:
        return Outcome(Status.WARN, f"{where}, but this host has RDMA devices ({devices}): NCCL over InfiniBand/RoCE "
                       "registers its buffers with the NIC and fails or falls back to sockets when it cannot lock "
                       "them; expected unlimited", fix, metrics)
    min_gib = float(lim["min_gib"])
    if soft is not None and min_gib > 0 and soft < min_gib * GiB:
        return Outcome(Status.WARN, f"{where}, below {min_gib:.0f} GiB: pinned-memory buffers (DeepSpeed pin_memory, "
                       "offload) and RDMA registration need more", fix, metrics)
    return Outcome(Status.PASS, where + (f" (RDMA devices: {devices})" if rdma else ""), metrics=metrics)


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="locked-memory limit (ulimit -l) of the job's processes; must be unlimited where RDMA devices are",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
)
