"""The interfaces check's facts as the checks that read them use them: usable interfaces, IPv4 subnets, trusted view.

Pure, standard library only (Python 3.9). Input: one host's interfaces facts, e.g.::

    {"interfaces": [{"name": "eth0", "kind": "physical", "operstate": "up", "ipv4": ["10.0.0.2/24"],
                     "speed_mbps": 100000, "bridge_master": null}, ...],
     "ib": [{"device": "mlx5_0", "port": 1, "active": true, "link_layer": "Ethernet", "gids": [...]}],
     "route_to_master": {"dev": "eth0", "src": "10.0.0.2", ...}, "peermem": true,
     "gpu_driver_loaded": true, "nvidia_open_module": true, "kernel": "6.8.0-52-generic"}

Shared by the interfaces check (its judgement), ports and iperf3 (the candidate networks between hosts),
iperf3's contribution to the recommended environment, and versions (``gdr_path``: how GPUDirect RDMA would work on a
host, for the NCCL version it needs); none of them imports another check for it.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any, Dict, List, Optional, Tuple

from . import validate

# Interfaces NCCL must never use for inter-host traffic: NCCL's own default also avoids lo and docker*.
# A veth is NOT excluded: in containers (and in network namespaces) the veth is the host's only NIC.
EXCLUDED_KINDS = ("loopback", "docker", "bridge")
EXCLUDED_PREFIXES = ("lo", "docker", "virbr", "br-", "cni", "flannel", "cilium", "kube-ipvs")


def usable_interface(itf: Dict[str, Any]) -> bool:
    """May NCCL use this interface between hosts? Not loopback, docker, bridges (or their ports), down links."""
    name = itf.get("name") or ""
    if itf.get("kind") in EXCLUDED_KINDS or itf.get("bridge_master"):
        return False
    if name == "lo" or any(name.startswith(p) for p in EXCLUDED_PREFIXES if p != "lo"):
        return False
    return (itf.get("operstate") or "").lower() not in ("down", "lowerlayerdown", "notpresent", "dormant")


def host_subnets(iface_facts: Dict[str, Any]) -> List[Tuple[str, str, str, Optional[int]]]:
    """(network, device, address, speed_mbps) for each usable IPv4 address of one host."""
    out = []
    for itf in (iface_facts or {}).get("interfaces") or []:
        if not usable_interface(itf):
            continue
        for cidr in itf.get("ipv4") or []:
            try:
                iface = ipaddress.ip_interface(cidr)
            except ValueError:
                continue
            if iface.ip.is_loopback or iface.ip.is_link_local or iface.network.prefixlen >= 32:
                continue
            out.append((str(iface.network), itf["name"], str(iface.ip), itf.get("speed_mbps")))
    return out


def _strs(value: Any) -> List[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _opt_str(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


def trusted_interfaces(facts: Any) -> Dict[str, Any]:
    """The facts with every name that breaks validate's rules left out and every field of the wrong type dropped.

    The facts come from the host: a name like '$(touch x)' or one holding a newline must never reach a message
    unquoted, a fix, or the recommended environment. (The interfaces check FAILs the host for such names.)
    """
    facts = facts if isinstance(facts, dict) else {}
    view = dict(facts)
    view["interfaces"] = [
        dict(i, ipv4=_strs(i.get("ipv4")), ipv6=_strs(i.get("ipv6")), kind=_opt_str(i.get("kind")),
             operstate=_opt_str(i.get("operstate")))
        for i in facts.get("interfaces") or [] if isinstance(i, dict) and validate.ifname(i.get("name"))
        and (i.get("bridge_master") is None or validate.ifname(i.get("bridge_master")))]
    ib = []
    for p in facts.get("ib") if isinstance(facts.get("ib"), list) else []:
        if isinstance(p, dict) and validate.hca_name(p.get("device")) and (
                p.get("port") is None or validate.port_number(p.get("port"))):
            rate = p.get("rate_gbps")
            p = dict(p, netdevs=[n for n in _strs(p.get("netdevs")) if validate.ifname(n)],
                     gids=[g for g in p.get("gids") or [] if isinstance(g, dict)] if isinstance(p.get("gids"), list)
                     else [], active=p.get("active") is True, link_layer=_opt_str(p.get("link_layer")),
                     state=_opt_str(p.get("state")), phys_state=_opt_str(p.get("phys_state")),
                     rate_gbps=rate if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None)
            ib.append(p)
    view["ib"] = ib
    route = facts.get("route_to_master")
    if not isinstance(route, dict):
        view["route_to_master"] = None
    else:
        view["route_to_master"] = {k: _opt_str(route.get(k)) for k in ("dev", "src", "gateway", "ip", "via")}
        if view["route_to_master"]["dev"] is not None and not validate.ifname(route.get("dev")):
            view["route_to_master"]["dev"] = None
    view["peermem"] = facts.get("peermem") is True
    if not isinstance(facts.get("master"), dict):
        view["master"] = None
    return view


# Linux gained RDMA memory registration from a dma-buf (ib_umem_dmabuf, ibv_reg_dmabuf_mr) in 5.12; NCCL's DMA-BUF
# path for GPUDirect RDMA (NCCL >= 2.13) needs it, with NVIDIA's open kernel module (NCCL's gpu_troubleshooting.rst:
# "GDRDMA can also be enabled by using the DMA-BUF feature of recent Linux kernels combined with the open source
# Nvidia GPU driver ... the nvidia-peermem module will not be necessary").
DMABUF_KERNEL = (5, 12)


def kernel_version(release: Any) -> Optional[Tuple[int, int]]:
    """(major, minor) of a kernel release such as '6.8.0-52-generic'; None if it is not one."""
    m = re.match(r"^(\d+)\.(\d+)", str(release or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def gdr_path(facts: Any) -> Optional[str]:
    """How NCCL would do GPUDirect RDMA on one host, from its interfaces facts: "peermem" (nvidia_peermem or
    nv_peer_mem loaded, NCCL's net_ib/gdr.cc test), "dmabuf" (no peer-memory module, but NVIDIA's open kernel module
    on a kernel >= 5.12), "none" (neither: NCCL stages every inter-node transfer through host memory), or None where
    it does not apply (no NVIDIA driver loaded, no active IB/RoCE port) or the facts do not say (recorded before
    preflight collected gpu_driver_loaded)."""
    facts = facts if isinstance(facts, dict) else {}
    if facts.get("gpu_driver_loaded") is not True:
        return None
    ib = facts.get("ib") if isinstance(facts.get("ib"), list) else []
    if not any(isinstance(p, dict) and p.get("active") is True for p in ib):
        return None
    if facts.get("peermem") is True:
        return "peermem"
    kernel = kernel_version(facts.get("kernel"))
    if facts.get("nvidia_open_module") is True and kernel is not None and kernel >= DMABUF_KERNEL:
        return "dmabuf"
    return "none"
