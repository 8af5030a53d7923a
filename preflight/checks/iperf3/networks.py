"""Pure: the candidate networks every host shares, the floor a network's rates are held to, and the network chosen.

Reads the interfaces check's facts per host, e.g.::

    {"interfaces": [{"name": "eth0", "speed_mbps": 10000, "virtual": False, "arp_type": 1,
                     "ipv4": ["198.18.1.1/24"], ...}, ...]}
"""
from __future__ import annotations

import ipaddress
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .common import median, ok_links
from ...hostside.fmt import rate
from ...hostside.netinfo import host_subnets

ARPHRD_INFINIBAND = 32    # /sys/class/net/IF/type of an IPoIB interface (linux/if_arp.h)


def shared_networks(facts_by_host: Dict[str, Dict[str, Any]], hosts: Sequence[str],
                    limit: int) -> Tuple[List[Dict[str, Any]], Dict[str, List[str]]]:
    """Candidate networks: every IPv4 subnet on a usable interface of every host.

    Returns (networks as {"network", "devices": {host: dev}, "addresses": {host: ip}}, {host: [subnet (dev)]}).
    At most ``limit`` networks, the fastest reported link speed first (a NIC without a speed, e.g. a veth,
    counts as unknown, not slow), then by address for a stable order.
    """
    per_host = {h: host_subnets(facts_by_host.get(h) or {}) for h in hosts}
    subnets = {h: [f"{net} ({dev})" for net, dev, _, _ in entries] for h, entries in per_host.items()}
    if not hosts:
        return [], subnets
    common = set(net for net, _, _, _ in per_host[hosts[0]])
    for h in hosts[1:]:
        common &= set(net for net, _, _, _ in per_host[h])
    networks: List[Dict[str, Any]] = []
    for net in common:
        devices: Dict[str, str] = {}
        addresses: Dict[str, str] = {}
        speeds: List[float] = []
        link_mbps: Dict[str, Optional[int]] = {}
        link_types: Dict[str, str] = {}
        for h in hosts:
            # Two NICs of one host on the same subnet: the first (by name) is measured; routing picks one too.
            net_dev, ip, speed = sorted((d, a, s) for n, d, a, s in per_host[h] if n == net)[0]
            devices[h], addresses[h] = net_dev, ip
            speeds.append(speed or 0)
            link_mbps[h] = link_rate_mbps(facts_by_host.get(h) or {}, net_dev)
            link_types[h] = link_type(facts_by_host.get(h) or {}, net_dev)
        networks.append({"network": net, "devices": devices, "addresses": addresses,
                         "min_speed_mbps": min(speeds) or None, "link_mbps": link_mbps, "link_types": link_types})
    networks.sort(key=lambda n: (-float(n["min_speed_mbps"] or 0), ipaddress.ip_network(str(n["network"]))))
    return networks[:max(1, limit)], subnets


def link_rate_mbps(iface_facts: Dict[str, Any], dev: str) -> Optional[int]:
    """The rate a physical NIC reports (sysfs speed, Mb/s), or None: unknown (-1), a virtual device (veth reports a
    fixed 10000 whatever carries its traffic), or IPoIB (the IB port's rate, far above what TCP over it reaches)."""
    for itf in iface_facts.get("interfaces") or []:
        if isinstance(itf, dict) and itf.get("name") == dev:
            speed = itf.get("speed_mbps")
            if itf.get("virtual") is not False or itf.get("arp_type") == ARPHRD_INFINIBAND:
                return None
            return speed if isinstance(speed, int) and not isinstance(speed, bool) and speed > 0 else None
    return None


def link_type(iface_facts: Dict[str, Any], dev: str) -> str:
    """"infiniband" (IPoIB: ARPHRD_INFINIBAND), "virtual" (veth, bridge, ...: no /sys/class/net/IF/device),
    "ethernet" (every other NIC: RoCE's netdev is Ethernet too), or "unknown" (the interfaces facts lack it)."""
    for itf in iface_facts.get("interfaces") or []:
        if isinstance(itf, dict) and itf.get("name") == dev:
            if itf.get("arp_type") == ARPHRD_INFINIBAND:
                return "infiniband"
            return "virtual" if itf.get("virtual") is not False else "ethernet"
    return "unknown"


def link_floor(net: Dict[str, Any], t: Mapping[str, Any]) -> Tuple[Optional[float], str]:
    """(floor in Gbit/s, how it was set) for a network's medians: the larger of the floor from its reported link
    rates (``_rate_floor``) and the default floor of its link type (``type_floor``), or (None, why there is none)."""
    by_rate, why_rate = _rate_floor(net, t)
    by_type, why_type = type_floor(net, t)
    if by_type is not None and (by_rate is None or by_type > by_rate):
        return by_type, why_type + ("" if by_rate is None else f" (above the {why_rate})")
    return by_rate, why_rate


def type_floor(net: Dict[str, Any], t: Mapping[str, Any]) -> Tuple[Optional[float], str]:
    """The default floor by link type, with no min_gbps configured: link_rate_fraction of the slowest rate the
    network's link type comes in (``[iperf3] link_type_min_gbps``: Ethernet 1 Gbit/s, InfiniBand 10 Gbit/s); the
    lowest over the hosts' types. A virtual NIC counts as ``virtual_link_type`` ("" = no type floor)."""
    fraction = float(t.get("link_rate_fraction", 0) or 0)
    table = t.get("link_type_min_gbps") or {}
    types = net.get("link_types")
    if fraction <= 0 or not isinstance(types, dict) or not types or not isinstance(table, Mapping):
        return None, ""
    virtual_as = str(t.get("virtual_link_type") or "")
    rates: Dict[str, float] = {}
    for h, kind in types.items():
        kind = virtual_as if kind == "virtual" else kind
        if kind not in table:
            return None, ""  # one host of unknown type: no default floor for the network
        rates[h] = float(table[kind])
    slowest = min(rates, key=lambda h: (rates[h], h))
    kind = virtual_as if types[slowest] == "virtual" else types[slowest]
    if rates[slowest] <= 0:
        return None, ""
    floor = fraction * rates[slowest]
    label = {"ethernet": "Ethernet", "infiniband": "InfiniBand (IPoIB)"}.get(kind, kind)
    return floor, (f"floor {rate(floor)}: {fraction:.0%} of {rate(rates[slowest])}, the slowest {label} link "
                   f"(the default floor by link type)")


def _rate_floor(net: Dict[str, Any], t: Mapping[str, Any]) -> Tuple[Optional[float], str]:
    """(floor in Gbit/s, how it was set) for a network's medians from its reported link rates, or (None, why there
    is none). The slowest host's link bounds every pair; `streams` x stream_cap_gbps bounds what iperf3's TCP streams
    carry whatever the NIC."""
    fraction = float(t.get("link_rate_fraction", 0) or 0)
    if fraction <= 0:
        return None, "no link-rate floor (link_rate_fraction = 0)"
    rates = net.get("link_mbps")
    if not isinstance(rates, dict) or not rates:
        return None, "no link-rate floor: the link rates were not recorded"
    unknown = sorted(h for h, r in rates.items() if not isinstance(r, int) or r <= 0)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        return None, (f"no link-rate floor: link rate unknown on {shown} (a virtual NIC, IPoIB, or speed -1), so "
                      f"only the hosts are compared with each other")
    slowest = min(rates, key=lambda h: (rates[h], h))
    link_gbps = rates[slowest] / 1000.0
    cap = int(t.get("streams", 1)) * float(t.get("stream_cap_gbps", 0) or 0)
    if 0 < cap < link_gbps:
        basis = (f"{int(t.get('streams', 1))} TCP stream(s) x {rate(float(t['stream_cap_gbps']))} (below the "
                 f"{rate(link_gbps)} link of {slowest})")
        return fraction * cap, f"floor {rate(fraction * cap)}: {fraction:.0%} of {basis}"
    dev = (net.get("devices") or {}).get(slowest)
    return fraction * link_gbps, (f"floor {rate(fraction * link_gbps)}: {fraction:.0%} of the {rate(link_gbps)} link "
                                  f"rate {slowest} {dev} reports")


def below_floor(links: Sequence[Dict[str, Any]], hosts: Sequence[str], floor: Optional[float]) -> List[str]:
    """The hosts whose median over their successful links is below the floor."""
    if floor is None:
        return []
    out = []
    for h in hosts:
        med = median([ln["gbps"] for ln in links if h in (ln["src"], ln["dst"]) and not ln.get("error")
                       and ln.get("gbps") is not None])
        if med is not None and med < floor:
            out.append(h)
    return out




def reaches_all(network: Dict[str, Any], hosts: Sequence[str]) -> bool:
    """Every host sent or received at least one successful test on this network."""
    good = ok_links(network)
    return all(any(h in (ln["src"], ln["dst"]) for ln in good) for h in hosts)


def choose(networks: List[Dict[str, Any]], hosts: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The network that reaches all hosts with the best measured median; one without failed tests first."""
    def failed(n: Dict[str, Any]) -> int:
        return sum(1 for ln in n.get("links") or [] if ln.get("error"))

    candidates = [n for n in networks if n.get("median_gbps") is not None and reaches_all(n, hosts)]
    if not candidates:
        return None
    best = min(candidates, key=lambda n: (failed(n) > 0, -n["median_gbps"], n["network"]))
    return {"network": best["network"], "devices": [best["devices"][h] for h in hosts],
            "addresses": dict(best["addresses"]), "median_gbps": best["median_gbps"], "hosts": list(hosts)}
