"""The NCCL/Gloo network variables a job should use, from the hosts' interfaces and a measured network.

Pure, standard library only (Python 3.9). Inputs: each host's interfaces facts as ``netinfo.trusted_interfaces``
gives them, and the network measurement (iperf3's facts), e.g.::

    {"chosen": {"network": "10.1.0.0/24", "devices": ["eth1", "eth1"], "hosts": ["n1", "n2"],
                "median_gbps": 9.4, "addresses": {"n1": "10.1.0.1", "n2": "10.1.0.2"}},
     "networks": [{"network": "10.0.0.0/24", "median_gbps": 0.9}, ...], "hosts": ["n1", "n2"]}

Each function appends its decisions to ``steps`` in order: an ``EnvVar`` per variable, a str per note. Sources:
NCCL's env.rst (NCCL_SOCKET_IFNAME prefix list, '=' exact, '^' exclude, applying to the whole list; NCCL_IB_HCA '='
exact; NCCL_IB_GID_INDEX dynamic since 2.21), PyTorch's distributed docs (GLOO_SOCKET_IFNAME: a comma list of
exact interface names, each of which must exist on every process); see shared/reference/facts.md of the design
notes. iperf3's ``SPEC.recommend`` uses them.
"""
from __future__ import annotations

import ipaddress
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from . import validate
from .netinfo import EXCLUDED_KINDS
from .seams import EnvVar

Steps = List[Union[EnvVar, str]]
NcclVersion = Optional[Tuple[int, int]]

# NCCL picks the RoCE GID index dynamically from this version on (NCCL_IB_GID_INDEX default -1).
DYNAMIC_GID_NCCL = (2, 21)
IPV4_MAPPED_GID = "0000:0000:0000:0000:0000:ffff:"


def socket_ifname(names: Sequence[str]) -> str:
    """One NCCL_SOCKET_IFNAME value matching the chosen interface on every host.

    '=' makes the whole list exact (without it, eth1 would also match eth10..eth19). Different names across
    hosts: '=a,b' still matches exactly one interface on each host, provided no host also has the other name.
    """
    return "=" + ",".join(sorted(set(names)))


def allowed(name: Optional[str], itf_facts: Optional[Dict[str, Any]]) -> bool:
    """Never lo, docker* or bridges, whatever the measurements say; never a name outside validate's rules (it
    came from a host and would end up in every node's environment)."""
    if not validate.ifname(name) or name == "lo" or str(name).startswith("docker"):
        return False
    for itf in (itf_facts or {}).get("interfaces") or []:
        if itf.get("name") == name and (itf.get("kind") in EXCLUDED_KINDS or itf.get("bridge_master")):
            return False
    return True


def route_dev(itf_facts: Dict[str, Any]) -> Optional[str]:
    """The interface a host reaches the master over; on the master itself (route via lo) the interface that
    holds the master's address."""
    route = itf_facts.get("route_to_master") or {}
    if route.get("dev") and route["dev"] != "lo":
        return route["dev"]
    for addr in (route.get("ip"), route.get("src")):
        for i in itf_facts.get("interfaces") or []:
            if addr and i.get("name") != "lo" and any(a.split("/")[0] == addr for a in i.get("ipv4") or []):
                return i["name"]
    return route.get("dev")


def _is_network(text: Any) -> bool:
    try:
        ipaddress.ip_network(str(text))
        return True
    except ValueError:
        return False


def nccl_version(text: Any) -> NcclVersion:
    """(major, minor) of an NCCL version such as '2.28.9'; None if it is not one."""
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None


def roce_gid_index(ports: Sequence[Dict[str, Any]]) -> Tuple[Optional[int], str]:
    """The GID index of a RoCE v2 IPv4 GID common to every given RoCE port, or (None, why not)."""
    common: Optional[Set[Any]] = None
    for p in ports:
        idx = {g.get("index") for g in p.get("gids") or [] if validate.port_number(g.get("index"))
               if "v2" in (g.get("type") or "").lower() and str(g.get("gid", "")).startswith(IPV4_MAPPED_GID)}
        if not idx:
            return None, f"{p.get('device')}:{p.get('port')} has no RoCE v2 GID of an IPv4 address"
        common = idx if common is None else common & idx
    if not common:
        return None, "the RoCE v2 IPv4 GID sits at different indexes on different ports"
    return min(common), ""


def _gloo_step(steps: Steps, unique: List[str], named: List[Tuple[Any, Optional[str]]],
               chosen: Optional[Dict[str, Any]]) -> None:
    """GLOO_SOCKET_IFNAME when one interface name fits all hosts, else how to set it per host."""
    if len(unique) == 1:
        steps.append(EnvVar("GLOO_SOCKET_IFNAME", unique[0],
                            "same interface as NCCL, for torch.distributed's gloo (CPU collectives, and the object "
                            "collectives DeepSpeed uses); gloo takes exact names, not NCCL's '='/'^' syntax"))
    else:
        net = chosen["network"] if chosen and _is_network(chosen.get("network")) else None
        how = (f"GLOO_SOCKET_IFNAME=$(ip -o -4 addr show to {net} | awk '{{print $2}}')" if net else
               "GLOO_SOCKET_IFNAME=<that host's interface>")
        per_host = ", ".join(f"{h} {d}" for h, d in named)
        steps.append("GLOO_SOCKET_IFNAME is not recommended: gloo takes a comma list of exact interface names and "
                     f"fails on a host that lacks any of them, and the names differ ({per_host}); set it per host in "
                     f"the launch script, e.g. export {how}")


def _master_addr_step(steps: Steps, hosts: Sequence[str], chosen: Dict[str, Any],
                      master_address: Optional[str]) -> None:
    """--master_addr on the measured network when the hostfile's names resolve to another."""
    master = hosts[0] if hosts else None
    addr = chosen.get("addresses", {}).get(master)
    try:
        on_chosen = ipaddress.ip_address(str(master_address)) in ipaddress.ip_network(chosen["network"])
    except (ValueError, TypeError, KeyError):
        on_chosen = None  # a name, not an address: unknown
    if addr and on_chosen is False and validate.ip_address(addr):
        steps.append(f"the hostfile names resolve to another network ({master} is {master_address}) than the "
                     f"fastest one: launch with deepspeed --master_addr={addr} so that the rendezvous uses "
                     f"{chosen['network']} too")


def socket_env(steps: Steps, hosts: Sequence[str], iface: Dict[str, Dict[str, Any]], measured: Dict[str, Any],
               master_address: Optional[str]) -> None:
    """NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME when one name fits all) on the measured network, else on the
    interface each host routes to the master over; notes where neither is safe. measured: the network
    measurement's facts ({} when it did not run)."""
    chosen = measured.get("chosen")
    if chosen:
        devices: List[str] = list(chosen["devices"])
        named: List[Tuple[Any, Optional[str]]] = list(zip(chosen.get("hosts") or measured.get("hosts") or hosts,
                                                          devices))
        why = (f"network {chosen['network']} reaches all hosts with the best measured bandwidth "
               f"({chosen['median_gbps']:.3g} Gbit/s median iperf3)")
        others = [n for n in measured.get("networks") or [] if n.get("network") != chosen["network"]]
        if others:
            why += "; also measured: " + ", ".join(f"{n['network']} {n.get('median_gbps') or 0:.3g} Gbit/s"
                                                   for n in others)
    elif measured and not measured.get("skipped"):
        steps.append("iperf3 found no network that reaches all hosts: NCCL_SOCKET_IFNAME is not recommended "
                     "until that is fixed (see the iperf3 results)")
        return
    elif iface and len(iface) == len(hosts) and len(hosts) > 1:
        named = [(h, route_dev(iface[h])) for h in hosts]
        devices = [d or "" for _, d in named]  # None never survives the `bad` check below
        why = ("the interface each host routes to the master over (no bandwidth measured: run the iperf3 check "
               "to pick the fastest network)")
    else:
        return
    bad = [(h, d) for h, d in named if not allowed(d, iface.get(h))]
    if bad:
        shown = ", ".join(f"{d if validate.ifname(d) else validate.quote(d)} on {h}" for h, d in bad)
        steps.append(f"not recommending NCCL_SOCKET_IFNAME: {shown} is loopback, docker or a bridge (or unknown); "
                     "NCCL must use the hosts' real NICs")
        return
    value = socket_ifname(devices)
    unique = sorted(set(devices))
    if len(unique) > 1:
        per_host = ", ".join(f"{h} {d}" for h, d in named)
        why += f"; the interface names differ across hosts ({per_host}), so the exact list matches one on each"
        clash = [(h, d, o) for h, d in named for o in unique
                 if o != d and any(i.get("name") == o for i in (iface.get(h) or {}).get("interfaces") or [])]
        if clash:
            also = ", ".join(f"{o} on {h} (chosen: {d})" for h, d, o in clash)
            steps.append(f"NCCL_SOCKET_IFNAME={value} also matches {also}: NCCL would use that interface too; rename "
                         "the interfaces to one name, or set NCCL_SOCKET_IFNAME per host")
    steps.append(EnvVar("NCCL_SOCKET_IFNAME", value, why))
    _gloo_step(steps, unique, named, chosen)
    if chosen:
        _master_addr_step(steps, hosts, chosen, master_address)


def ib_env(steps: Steps, hosts: Sequence[str], iface: Dict[str, Dict[str, Any]],
           nccl_versions: Callable[[], Dict[str, NcclVersion]]) -> None:
    """NCCL_IB_DISABLE, or NCCL_IB_HCA on the active IB/RoCE ports with NCCL_IB_GID_INDEX (RoCE, NCCL < 2.21) and
    NCCL_NET_GDR_LEVEL (nvidia_peermem everywhere). nccl_versions: {host: (major, minor) or None}, asked only
    when a RoCE port needs it."""
    if not iface or len(iface) < len(hosts):
        if hosts:
            missing = ", ".join(h for h in hosts if h not in iface)
            steps.append(f"no interfaces facts for {missing}: run the interfaces check for the IB/RoCE recommendation")
        return
    active = {h: [p for p in iface[h].get("ib") or [] if p.get("active")] for h in hosts}
    if not any(active.values()):
        steps.append(EnvVar("NCCL_IB_DISABLE", "1", "no host has an active InfiniBand/RoCE port: NCCL must use TCP "
                                                    "sockets (without it NCCL probes for IB devices at every start)"))
        return
    without = [h for h in hosts if not active[h]]
    if without:
        verb = "has" if len(without) == 1 else "have"
        steps.append(f"{', '.join(without)} {verb} no active IB/RoCE port while the others do: NCCL cannot mix IB "
                     "and sockets in one job; fix the port, leave the host out, or set NCCL_IB_DISABLE=1 (sockets "
                     "only, much slower)")
    ports = [p for h in hosts for p in active[h]]
    # Host-reported names go into NCCL_IB_HCA only when they pass validate's rules (interfaces FAILs the others).
    odd = [p for p in ports if not (validate.hca_name(p.get("device")) and validate.port_number(p.get("port")))]
    if odd:
        shown = ", ".join(f"{validate.quote(p.get('device'))}:{validate.quote(p.get('port'))}" for p in odd[:8])
        steps.append(f"not using IB ports with invalid names in NCCL_IB_HCA: {shown} (see the interfaces results)")
        ports = [p for p in ports if p not in odd]
        if not ports:
            return
    hcas = sorted({f"{p['device']}:{p['port']}" for p in ports})
    steps.append(EnvVar("NCCL_IB_HCA", "=" + ",".join(hcas), "the active IB/RoCE ports; '=' makes NCCL match exact "
                                                             "names (without it mlx5_1 also matches mlx5_10..)"))
    roce = [p for p in ports if (p.get("link_layer") or "").lower() == "ethernet"]
    if roce:
        versions = nccl_versions()
        if versions and all(v is not None and v >= DYNAMIC_GID_NCCL for v in versions.values()):
            steps.append("RoCE: NCCL >= 2.21 on every host picks the GID index itself; NCCL_IB_GID_INDEX not needed")
        else:
            idx, why_not = roce_gid_index(roce)
            if idx is None:
                steps.append(f"RoCE: cannot recommend NCCL_IB_GID_INDEX ({why_not}); NCCL < 2.21 defaults to index 0 "
                             "(RoCE v1/link-local), which usually fails across subnets")
            else:
                steps.append(EnvVar("NCCL_IB_GID_INDEX", str(idx),
                                    f"RoCE ports: index {idx} holds the RoCE v2 GID of an IPv4 address on every "
                                    "active RoCE port; NCCL < 2.21 uses index 0 unless told (newer NCCL finds the "
                                    "same index itself)"))
    if all(iface[h].get("peermem") for h in hosts) and not without:
        steps.append(EnvVar("NCCL_NET_GDR_LEVEL", "PHB", "nvidia_peermem is loaded on every host: allow GPUDirect "
                                                         "RDMA when the GPU and NIC share a CPU socket"))
