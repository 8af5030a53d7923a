"""Recommend the NCCL/Gloo environment for the job from the facts of this run, each with its reason.

Sources: NCCL's env.rst (NCCL_SOCKET_IFNAME syntax, NCCL_IB_HCA '=' exact form, NCCL_IB_DISABLE) and
PyTorch's TORCH_NCCL_ASYNC_ERROR_HANDLING; see ../shared/reference/facts.md in the design notes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from checks.base import Status

Env = Dict[str, str]


def _common_fact(cluster: Any, check: str) -> Dict[str, Dict[str, Any]]:
    return {h.name: cluster.facts.get(h.name, {}).get(check) for h in cluster.hosts
            if cluster.facts.get(h.name, {}).get(check) is not None}


def socket_ifname(names: List[str]) -> str:
    """One NCCL_SOCKET_IFNAME value matching the chosen interface on every host.

    Same name everywhere: the '=' exact form (so eth1 does not also match eth10). Different names: their
    longest common prefix when it still excludes nothing else we know of; else a comma list of exact names.
    """
    unique = sorted(set(names))
    if len(unique) == 1:
        return "=" + unique[0]
    return ",".join(unique)


def recommend(cluster: Any, results: List[Any]) -> Tuple[Env, Dict[str, str], List[str]]:
    env: Env = {}
    reasons: Dict[str, str] = {}
    notes: List[str] = []

    def put(name: str, value: str, why: str) -> None:
        env[name] = value
        reasons[name] = why

    chosen = cluster.facts.get("*", {}).get("iperf3", {}).get("chosen") if hasattr(cluster, "facts") else None
    iface_facts = _common_fact(cluster, "interfaces")
    if chosen:
        put("NCCL_SOCKET_IFNAME", socket_ifname(chosen["devices"]),
            f"network {chosen['network']} reaches all hosts with the best measured bandwidth "
            f"({chosen['median_gbps']:.2f} Gbit/s median iperf3)")
        put("GLOO_SOCKET_IFNAME", env["NCCL_SOCKET_IFNAME"].lstrip("="),
            "same network as NCCL, for torch.distributed's gloo bootstrap and CPU collectives")
    elif iface_facts and len(iface_facts) == len(cluster.hosts):
        devs = [(f.get("route_to_master") or {}).get("dev") for f in iface_facts.values()]
        if all(devs) and not any(d == "lo" for d in devs) and len(cluster.hosts) > 1:
            put("NCCL_SOCKET_IFNAME", socket_ifname(devs),
                "the interface each host routes to the master over (no bandwidth measured: run the iperf3 check "
                "to pick the fastest network)")
            put("GLOO_SOCKET_IFNAME", env["NCCL_SOCKET_IFNAME"].lstrip("="), "same network as NCCL")
    if iface_facts and len(iface_facts) == len(cluster.hosts):
        active = {h: [p for p in f.get("ib", []) if p.get("active")] for h, f in iface_facts.items()}
        if not any(active.values()):
            put("NCCL_IB_DISABLE", "1", "no host has an active InfiniBand/RoCE port: NCCL must use sockets")
        else:
            hcas = sorted({f"{p['device']}:{p['port']}" for ports in active.values() for p in ports})
            put("NCCL_IB_HCA", "=" + ",".join(hcas),
                "the active IB/RoCE ports found; '=' makes NCCL match exact names (mlx5_1 would also match mlx5_10)")
            if any(p.get("link_layer") == "Ethernet" for ports in active.values() for p in ports):
                notes.append("RoCE ports found: NCCL >= 2.21 picks NCCL_IB_GID_INDEX dynamically; set it (usually 3 "
                             "for RoCEv2 over IPv4) only if your NCCL is older")
        if all(f.get("peermem") for f in iface_facts.values()) and any(active.values()):
            put("NCCL_NET_GDR_LEVEL", "PHB", "nvidia_peermem is loaded on every host: GPUDirect RDMA is available")
    put("NCCL_DEBUG", "WARN", "NCCL prints the reason of a failure instead of hanging silently")
    put("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
        "a failed collective aborts the job instead of hanging until the timeout (the legacy NCCL_ASYNC_ERROR_HANDLING "
        "is deprecated)")
    notes.append("NCCL_TIMEOUT does not exist: set the collective timeout with "
                 "torch.distributed.init_process_group(timeout=datetime.timedelta(minutes=N)) "
                 "(DeepSpeed: deepspeed.init_distributed(timeout=...))")
    failing = [r for r in results if r.check in ("interfaces", "iperf3") and r.status == Status.FAIL]
    if failing:
        notes.append("network checks failed: fix them before trusting the interface recommendation")
    return env, reasons, notes
