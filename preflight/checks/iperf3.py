"""TCP bandwidth between hosts over every shared IPv4 network, measured with real iperf3; finds stragglers.

Parses ``iperf3 -c ADDR -p PORT -J -t 2`` (iperf3 >= 3.1) on the sending host, e.g.::

    {"start": {"connected": [{"local_host": "198.18.1.1", "remote_host": "198.18.1.2", ...}], ...},
     "end": {"sum_sent": {"bits_per_second": 199733114.2, "retransmits": 0, ...},
             "sum_received": {"seconds": 2.04, "bytes": 49414728, "bits_per_second": 193624470.1, ...}}}
    {"start": {"connected": []}, "intervals": [], "end": {},
     "error": "unable to connect to server: Connection refused"}

and ``/proc/net/tcp{,6}`` (state 0A = LISTEN) to know when the server listens, without connecting to it::

      sl  local_address rem_address   st tx_queue rx_queue ...
       0: 00000000:1451 00000000:0000 0A 00000000:00000000 ...

Host-side functions (run through the agent): ``serve`` (an ``iperf3 -s`` for the whole check), ``client``
(one test) and ``interfaces`` (the interfaces check's facts, when that check did not run). The coordinator
side (``coordinate``) tests disjoint pairs in rounds on each candidate network; ``evaluate`` is pure.

Stragglers: each host's median link against the median of the links without it, tested against the other hosts
by the moderated t prediction test of ``hostside/stats.py`` in Holm's step-down order (``mesh.find_stragglers``).
Floors: besides that comparison and the optional absolute ``min_gbps`` (FAIL), a host's median below
``link_rate_fraction`` of what its network's links report (/sys/class/net/IF/speed, the negotiated rate ethtool shows;
the slowest host's, capped at ``streams`` x ``stream_cap_gbps`` since one TCP stream is CPU-bound) is a WARN: a
healthy NIC gives iperf3 most of its line rate, so half of it means a duplex or speed mismatch, errors, or a leftover
rate limit. The default floor by link type (``link_type_min_gbps``: Ethernet 1 Gbit/s, InfiniBand 10 Gbit/s, times
the same fraction) applies with no configuration, also where a NIC reports no usable rate (virtio -1, IPoIB's IB
rate); a virtual NIC (veth) gets it only with ``virtual_link_type``.

Thresholds: [iperf3] in iperf3.toml beside this module.
"""
from __future__ import annotations

import ipaddress
import json
import math
import shlex
import socket
import statistics
import subprocess
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..hostside import validate
from ..hostside.outcome import BlockedBy, Finding, Outcome, Status, combine, limits, skip
from ..hostside.display import STATUS_COLOURS, absent, badge, esc
from ..hostside.seams import (CheckSpec, ClusterView, EnvVar, HostContext, HtmlSection, PromSample, Recommendation,
                              RecommendInput)
from ..hostside.proc import read_text, sh, spawn, stop
from ..hostside.fmt import rate
from ..hostside.stats import TEST_NAME
from ..hostside.stats import p_text as stats_p_text
from ..hostside.mesh import blame_failures, blocked_hosts, find_stragglers, short_list, sole_culprits
from ..hostside import ncclenv
from ..hostside.netinfo import host_subnets, trusted_interfaces

NAME = "iperf3"

CLUSTER = "*"
LISTEN = "0A"
SERVER_READY_S = 15.0     # iperf3 -s listens within milliseconds; the margin covers a loaded host
AGENT_MARGIN_S = 20.0     # SSH channel + interpreter start + shipping the checks zip, per call
ARPHRD_INFINIBAND = 32    # /sys/class/net/IF/type of an IPoIB interface (linux/if_arp.h)


# --- pure helpers (coordinator and host) ---------------------------------------------------------------

def parse_client_json(text: str) -> Dict[str, Any]:
    """``iperf3 -c ... -J`` stdout -> {"gbps", "sent_gbps", "retransmits", "seconds", "bytes", "error", ...}.

    ``gbps`` is what the receiver got (end.sum_received): the sender's count includes bytes still in its
    socket buffer when the test ends, which overstates a shaped or lossy link.
    """
    out: Dict[str, Any] = {"gbps": None, "sent_gbps": None, "retransmits": None, "seconds": None, "bytes": None,
                           "error": None, "local": None, "remote": None, "version": None}
    try:
        data = json.loads(text or "")
    except ValueError:
        tail = (text or "").strip().splitlines()[-1:] or ["no output"]
        out["error"] = f"iperf3 printed no JSON: {tail[0][:200]}"
        return out
    if not isinstance(data, dict):
        out["error"] = "iperf3 printed unexpected JSON"
        return out
    start = data.get("start") or {}
    out["version"] = start.get("version")
    conn = (start.get("connected") or [{}])[0]
    out["local"], out["remote"] = conn.get("local_host"), conn.get("remote_host")
    if data.get("error"):
        out["error"] = str(data["error"])
        return out
    end = data.get("end") or {}
    recv, sent = end.get("sum_received") or {}, end.get("sum_sent") or {}
    if recv.get("bits_per_second") is None:
        out["error"] = "iperf3 JSON has no end.sum_received (the test did not finish)"
        return out
    out["gbps"] = round(float(recv["bits_per_second"]) / 1e9, 6)
    out["seconds"] = recv.get("seconds")
    out["bytes"] = recv.get("bytes")
    if sent.get("bits_per_second") is not None:
        out["sent_gbps"] = round(float(sent["bits_per_second"]) / 1e9, 6)
    out["retransmits"] = sent.get("retransmits")  # absent on non-Linux senders
    # Per-interval rates (-i): repeated measurements of the one link, for the straggler detector's noise estimate.
    # The first interval holds TCP's slow start, and a last one shorter than the others is a remainder: both go.
    rates = []
    for iv in data.get("intervals") or []:
        summ = iv.get("sum") if isinstance(iv, dict) else None
        if isinstance(summ, dict) and isinstance(summ.get("bits_per_second"), (int, float)):
            rates.append((float(summ.get("seconds") or 0.0), float(summ["bits_per_second"]) / 1e9))
    if len(rates) > 2:
        full = max(sec for sec, _ in rates)
        out["samples_gbps"] = [round(g, 6) for sec, g in rates[1:] if sec >= 0.9 * full]
    return out


def listening_ports(texts: Sequence[str]) -> List[int]:
    """Local ports in LISTEN state in /proc/net/tcp and /proc/net/tcp6 contents."""
    ports = set()
    for text in texts:
        for line in (text or "").splitlines()[1:]:
            f = line.split()
            if len(f) > 3 and f[3] == LISTEN and ":" in f[1]:
                try:
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
                except ValueError:
                    continue
    return sorted(ports)


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


def _below_floor(links: Sequence[Dict[str, Any]], hosts: Sequence[str], floor: Optional[float]) -> List[str]:
    """The hosts whose median over their successful links is below the floor."""
    if floor is None:
        return []
    out = []
    for h in hosts:
        med = _median([ln["gbps"] for ln in links if h in (ln["src"], ln["dst"]) and not ln.get("error")
                       and ln.get("gbps") is not None])
        if med is not None and med < floor:
            out.append(h)
    return out


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def ok_links(network: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [ln for ln in network.get("links") or [] if not ln.get("error") and ln.get("gbps") is not None]


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


# --- host side -------------------------------------------------------------------------------------------

def _help_text() -> Optional[str]:
    """iperf3's usage text (to use newer flags only where supported), or None when iperf3 is not installed."""
    res = sh(["iperf3", "--help"], timeout=5)
    return None if res.rc in (126, 127) else res.out + res.err


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def _listening(port: int) -> bool:
    return port in listening_ports([read_text("/proc/net/tcp", "") or "", read_text("/proc/net/tcp6", "") or ""])


def _drain(stream: Any, tail: List[bytes]) -> None:
    """Keep the last few KB of the server's stderr (an undrained pipe would block iperf3 after 64 KB)."""
    try:
        for chunk in iter(lambda: stream.read(4096), b""):
            tail.append(chunk)
            while sum(len(c) for c in tail) > 4096 and len(tail) > 1:
                tail.pop(0)
    except (OSError, ValueError):
        pass


def serve(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Run ``iperf3 -s`` on every address of this host until the coordinator says stop (or the deadline).

    params: {"port": 0 (any free port) or N, "bind": this host's address on the network under test}. Reports
    {"port": p} through ctx.ready once it listens.
    """
    wanted = int(params.get("port") or 0)
    help_text = _help_text()
    if help_text is None:
        raise RuntimeError("iperf3 is not installed on this host (iperf3: command not found)")
    proc = None
    tail: List[bytes] = []
    started = time.monotonic()
    try:
        for _ in range(1 if wanted else 3):  # a free port can be taken between probing and binding: retry
            port = wanted or _free_port()
            argv = ["iperf3", "-s", "-p", str(port)]
            if params.get("bind") and validate.ip_address(params["bind"]):
                # Only the address of the network under test, not every address of the host (issue 16).
                argv += ["-B", str(params["bind"])]
            if "--idle-timeout" in help_text:
                # Lets a server wedged by a vanished client accept the next test (iperf3 >= 3.8 only).
                argv += ["--idle-timeout", str(int(params.get("idle_timeout_s", 30)))]
            proc = spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            tail = []
            threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True).start()
            deadline = time.monotonic() + min(SERVER_READY_S, max(1.0, ctx.deadline - time.monotonic() - 1))
            while time.monotonic() < deadline and proc.poll() is None and not _listening(port):
                time.sleep(0.02)
            if proc.poll() is None and _listening(port):
                break
            stop(proc, grace=0.5)
            proc = None
        if proc is None:
            err = b"".join(tail).decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"iperf3 -s did not start listening: {err[0][:300]}")
        ctx.ready({"port": port, "pid": proc.pid})
        # Stop a little before the agent's own deadline so that the finally below, not SIGALRM, cleans up.
        ctx.wait_stop(max(0.5, ctx.deadline - time.monotonic() - 2.0))
        exited = proc.poll()
        return {"port": port, "served_s": round(time.monotonic() - started, 3),
                "exited": exited, "stderr": b"".join(tail).decode(errors="replace")[-1000:]}
    finally:
        if proc is not None:
            stop(proc, grace=1.0)


def client(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """One test from this host to params["addr"]:params["port"]; a failure is a result, never an exception.

    params: {"addr", "port", "duration_s", "bind" (this host's address on the network), "connect_timeout_s",
             "streams"}
    """
    duration = max(1, int(round(float(params.get("duration_s", 2)))))
    connect_timeout = float(params.get("connect_timeout_s", 3.0))
    for key in ("addr", "bind"):  # host-reported addresses: only a real IP address reaches iperf3's argv
        if key in params and params[key] and not validate.ip_address(params[key]):
            return dict(parse_client_json(""), error=f"{key} {validate.quote(params[key])} is not an IP address")
    argv = ["iperf3", "-c", str(params["addr"]), "-p", str(int(params["port"])), "-J", "-t", str(duration)]
    if params.get("interval_s"):
        argv += ["-i", f"{float(params['interval_s']):g}"]
    if params.get("bind"):
        argv += ["-B", str(params["bind"])]  # keep the test on the network under test whatever the routes say
    if int(params.get("streams", 1)) > 1:
        argv += ["-P", str(int(params["streams"]))]
    help_text = _help_text()
    if help_text is None:
        return dict(parse_client_json(""), error="iperf3 is not installed on this host", missing=True)
    if "--connect-timeout" in help_text:  # iperf3 >= 3.5; older ones fall back on the sh() deadline below
        argv += ["--connect-timeout", str(int(connect_timeout * 1000))]
    budget = ctx.remaining(duration + connect_timeout + 10.0)
    res = sh(argv, timeout=budget)
    out = parse_client_json(res.out)
    if res.rc == 124:
        out["error"] = f"iperf3 -c {params['addr']}:{params['port']} timed out after {budget:.0f}s"
    elif out["error"] and "no JSON" in out["error"] and res.err.strip():
        out["error"] = f"iperf3 failed (rc {res.rc}): {res.err.strip().splitlines()[-1][:300]}"
    out["argv"] = argv
    out["wall_s"] = round(res.duration, 3)
    return out


def interfaces(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """The interfaces check's facts (a declared read), for runs where that check was not selected."""
    from ..hostside.depends import collect_facts
    return collect_facts("interfaces", ctx)


# --- coordinator side ------------------------------------------------------------------------------------

def _err(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 400 else text[:400] + "..."


def _parallel(fn: Any, items: Sequence[Any], timeout: float) -> List[Any]:
    from ..hostside.proc import parallel_map
    return parallel_map(fn, list(items), max(1, len(items)), timeout)


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    from ..hostside.schedule import pair_rounds

    t = limits(cluster.thresholds, NAME)
    hosts = [h.name for h in cluster.hosts]
    duration = float(t["duration_s"])
    connect_timeout = float(t["connect_timeout_s"])
    facts: Dict[str, Any] = {"hosts": hosts, "networks": [], "chosen": None, "errors": {}, "subnets": {},
                             "unreachable": [h.name for h in getattr(cluster, "all_hosts", cluster.hosts)
                                             if h.name not in hosts],
                             "duration_s": duration, "rounds": 0}
    if len(hosts) < 2:
        reachable = ", ".join(hosts) or "none"
        facts["skipped"] = f"needs at least 2 reachable hosts to measure between them (reachable: {reachable})"
        return facts

    iface = _host_interfaces(cluster, hosts, facts["errors"])
    usable = [h for h in hosts if iface.get(h)]
    networks, facts["subnets"] = shared_networks({h: v for h, v in iface.items() if v}, usable,
                                                   int(t["max_networks"]))
    if len(usable) < 2 or not networks:
        return facts

    rounds = pair_rounds(len(usable), int(t["extra_rounds"]), 0)
    facts["rounds"] = len(rounds)
    per_call = duration + connect_timeout + AGENT_MARGIN_S
    # The servers stay up through the rounds and, where a host is in doubt, through `confirm` repeats of them.
    serve_budget = (1 + int(t["confirm"])) * len(rounds) * (per_call + 5) + SERVER_READY_S + 60
    progress = getattr(cluster, "progress", None)
    _announce_phase(progress, networks, rounds)
    for net in networks:
        _measure_network(cluster, net, usable, rounds, facts, t, per_call, serve_budget, progress)
    facts["chosen"] = choose(facts["networks"], usable)
    ports_facts = (cluster.facts.get("*") or {}).get("ports")
    for net in facts["networks"]:
        net["blocked"] = _blocked_by_ports(ports_facts, net.get("addresses") or {})
    return facts


def _host_interfaces(cluster: ClusterView, hosts: Sequence[str], errors: Dict[str, str]) -> Dict[str, Any]:
    """Each host's interfaces, as the interfaces check read them, else listed here (the networks to measure on
    come from them); a host whose listing fails is noted in `errors` and left without."""
    iface = {h: (cluster.facts.get(h) or {}).get("interfaces") for h in hosts}
    missing = [h for h in hosts if not iface[h]]
    if missing:  # the interfaces check did not run (or failed): list them ourselves
        got = cluster.call_all(NAME + ".interfaces", {h: {} for h in missing}, timeout=30)
        for h, value in got.items():
            if isinstance(value, BaseException):
                errors[h] = f"could not list the interfaces: {_err(value)}"
            else:
                iface[h] = value
    return iface


def _announce_phase(progress: Any, networks: Sequence[Any], rounds: Sequence[Any]) -> None:
    """Tell the progress display (where there is one) how many steps follow: one per network and round."""
    if progress is not None:
        # +1: the runner advances once more when the check ends.
        nets_s, rounds_s = "s"[:len(networks) != 1], "s"[:len(rounds) != 1]
        progress.phase(f"iperf3 ({len(networks)} network{nets_s} x {len(rounds)} round{rounds_s})",
                       len(networks) * len(rounds) + 1)


def _measure_network(cluster: ClusterView, net: Dict[str, Any], usable: Sequence[str], rounds: Sequence[Any],
                     facts: Dict[str, Any], t: Dict[str, Any], per_call: float, serve_budget: float,
                     progress: Any) -> None:
    """Measure one network: servers up on it, the rounds run (and repeated to confirm a suspect), the network with
    its links added to facts["networks"]; every server that was started is stopped whatever happens."""
    # The servers of one network listen on that network's addresses only, and only while it is measured.
    services: Dict[str, Any] = {}
    ports: Dict[str, int] = {}
    try:
        _start_servers(cluster, net, usable, t, serve_budget, services, ports, facts["errors"])

        def measure() -> List[Dict[str, Any]]:
            return _run_rounds(cluster, rounds, usable, net, ports, facts["errors"], t, per_call, progress)

        net["links"] = _measure_confirmed(measure, usable, net, t, progress)
        net["median_gbps"] = _median([ln["gbps"] for ln in ok_links(net)])
        facts["networks"].append(net)
    finally:
        _stop_servers(services, ports, facts)


def _start_servers(cluster: ClusterView, net: Dict[str, Any], usable: Sequence[str], t: Dict[str, Any],
                   serve_budget: float, services: Dict[str, Any], ports: Dict[str, int],
                   errors: Dict[str, str]) -> None:
    """Start an iperf3 server on each host, bound to its address on `net`, all in parallel: `services` gets every
    server started (for the caller to stop), `ports` the port of each that listens, `errors` why the others do not."""
    def start(h: str) -> int:
        services[h] = cluster.start(h, NAME + ".serve", {"port": int(t["port"]),
                                                         "bind": net["addresses"][h]}, serve_budget)
        return int(services[h].wait_ready(SERVER_READY_S + AGENT_MARGIN_S)["port"])

    for h, res in zip(usable, _parallel(start, usable, SERVER_READY_S + AGENT_MARGIN_S + 10)):
        if isinstance(res, BaseException):
            errors[h] = f"iperf3 server did not start: {_err(res)}"
        else:
            ports[h] = res


def _measure_confirmed(measure: Callable[[], List[Dict[str, Any]]], usable: Sequence[str], net: Dict[str, Any],
                       t: Dict[str, Any], progress: Any) -> List[Dict[str, Any]]:
    """The links of one network: the rounds once, then again while a host is named, in doubt or below the floor,
    up to `confirm` times, each pair keeping its best rate."""
    links = measure()
    # While a host is named or in doubt (below the straggler fraction, but the other hosts' links disagree
    # too much to tell), measure every pair again, up to `confirm` times, and let each pair keep its best
    # rate, as compute keeps each device's best: a slow host is slow every time, while a moment of
    # contention on a loaded host (another process starving its iperf3) passes. Doubt is met by measuring
    # more, not by failing; a healthy cluster costs nothing.
    # A host below the link-rate floor is confirmed the same way before it is named.
    floor = link_floor(net, t)[0]
    for _ in range(int(t["confirm"])):
        doubt: Dict[str, Dict[str, Any]] = {}
        named = find_stragglers(links, usable, float(t["straggler_warn_fraction"]), t, doubt)
        slow = _below_floor(links, usable, floor)
        if not named and not doubt and not slow:
            break
        if progress is not None:
            suspects = ", ".join(sorted(set(named) | set(doubt) | set(slow)))
            progress.note(f"iperf3: measuring {net['network']} again to confirm {suspects}")
        net["remeasured"] = int(net.get("remeasured") or 0) + 1
        links = best_links(links + measure())
    return links


def _stop_servers(services: Dict[str, Any], ports: Dict[str, int], facts: Dict[str, Any]) -> None:
    """Stop every server started, in parallel, killing one whose stop fails; a failed stop of a server that
    listened is noted in facts["stop_errors"]."""
    def halt(h: str) -> Any:
        try:
            return services[h].stop(15)
        except BaseException:
            services[h].kill()  # its agent sees EOF and kills iperf3 (and the runner reaps after all)
            raise
    done = _parallel(halt, list(services), 30)
    for h, res in zip(list(services), done):
        if isinstance(res, BaseException) and h in ports:
            facts.setdefault("stop_errors", {})[h] = _err(res)


def _blocked_by_ports(ports_facts: Any, addresses: Dict[str, str]) -> List[str]:
    """Hosts whose TCP the ports check proved blocked on these addresses: the evidence that says which end of a
    failed test to blame when the tests alone cannot (3 hosts measure each pair once)."""
    if not isinstance(ports_facts, dict) or not addresses:
        return []
    try:
        return sorted(blocked_hosts(ports_facts, addresses))
    except Exception:  # another check's facts: a schema change there must not break this check
        return []


def best_links(links: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per measured (src, dst) pair, its best rate over the repeats (``tests``: how many); every failed
    test is kept as its own record, since a failure is evidence whatever a repeat did."""
    best: Dict[Tuple[str, str], Dict[str, Any]] = {}
    tests: Dict[Tuple[str, str], int] = {}
    failed = []
    for ln in links:
        pair = (ln["src"], ln["dst"])
        tests[pair] = tests.get(pair, 0) + 1
        if ln.get("error") or ln.get("gbps") is None:
            failed.append(ln)
        elif pair not in best or ln["gbps"] > best[pair]["gbps"]:
            best[pair] = ln
    return [dict(ln, tests=tests[pair]) for pair, ln in best.items()] + failed


def _run_rounds(cluster: ClusterView, rounds: Sequence[Any], usable: Sequence[str], net: Dict[str, Any],
                ports: Dict[str, int], errors: Dict[str, str], t: Dict[str, Any], per_call: float,
                progress: Any) -> List[Dict[str, Any]]:
    """One iperf3 test per pair of each round (the pairs of a round at once), as link records."""
    links: List[Dict[str, Any]] = []
    for rnd in rounds:
        params: Dict[str, Dict[str, Any]] = {}
        for a, b in rnd:
            src, dst = usable[a], usable[b]
            if dst not in ports:
                links.append({"src": src, "dst": dst, "gbps": None, "retransmits": None, "blame": dst,
                              "error": f"no iperf3 server on {dst} ({errors.get(dst)})"})
                continue
            params[src] = {"addr": net["addresses"][dst], "port": ports[dst], "dst": dst,
                           "bind": net["addresses"][src], "duration_s": float(t["duration_s"]),
                           "connect_timeout_s": float(t["connect_timeout_s"]), "streams": int(t["streams"]),
                           "interval_s": float(t["interval_s"])}
        got = cluster.call_all(NAME + ".client", params, per_call) if params else {}
        for src, value in got.items():
            link = {"src": src, "dst": params[src]["dst"], "gbps": None, "retransmits": None, "error": None}
            if isinstance(value, BaseException):
                link["error"] = f"the client on {src} did not report: {_err(value)}"
                link["agent_failed"] = True  # preflight's machinery, not evidence about the network
            else:
                link.update(gbps=value.get("gbps"), retransmits=value.get("retransmits"),
                            error=value.get("error"), sent_gbps=value.get("sent_gbps"))
                if value.get("samples_gbps"):
                    link["samples_gbps"] = value["samples_gbps"]
                if value.get("missing"):
                    link["blame"] = src
            links.append(link)
        if progress is not None:
            progress.advance(net["network"], f"round of {len(rnd)} pair{'s'[:len(rnd) != 1]}")
    return links


# --- evaluation ------------------------------------------------------------------------------------------

def _confidence(s: Dict[str, Any], max_p: float) -> str:
    """``t -8.6, 10 df; adjusted p = 3e-05 over 6 hosts (moderated t prediction test, Holm-adjusted)``"""
    if "t" not in s:
        return "n/a"
    family = int(s.get("family") or 1)
    return (f"t {s['t']:.1f}, {s['df']:.0f} df; adjusted {stats_p_text(float(s.get('p_adj', 1.0)), max_p)} over "
            f"{family} host{'' if family == 1 else 's'} ({TEST_NAME})")


def _fix_slow(host: str, dev: Optional[str]) -> str:
    d = shlex.quote(str(dev)) if validate.ifname(dev) else "<nic>"
    return (f"on {host}: ethtool {d} (negotiated speed/duplex), ip -s link show {d} (errors/drops), tc qdisc show "
            f"dev {d} (a leftover rate limit), and CPU load during the test; then swap the cable/switch port, or "
            "leave the host out of the hostfile")


def _network_line(net: Dict[str, Any]) -> str:
    devs = sorted(set(net["devices"].values()))
    good = ok_links(net)
    failed = len(net.get("links") or []) - len(good)
    failed_note = f", {failed} failed" if failed else ""
    return (f"{net['network']} ({','.join(devs)}): median {rate(net.get('median_gbps'))} over {len(good)} "
            f"links{failed_note}")


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    t = limits(thresholds, NAME)
    hosts: List[str] = list(facts.get("hosts") or [])
    errors: Dict[str, str] = facts.get("errors") or {}
    out: Dict[str, Outcome] = {}
    for h in facts.get("unreachable") or []:
        out[h] = Outcome(Status.ERROR, "not run: the host is unreachable (see its ssh result)")
    if facts.get("skipped"):
        out[CLUSTER] = skip(facts["skipped"])
        return out
    for h, msg in errors.items():
        installed = "not installed" not in msg and "command not found" not in msg
        out[h] = Outcome(Status.ERROR, msg, "rerun with -v for the host-side error" if installed
                         else f"install iperf3 on {h} (apt-get install iperf3 / dnf install iperf3)")
    networks: List[Dict[str, Any]] = facts.get("networks") or []
    unlisted = [h for h in hosts if h in errors and h not in (facts.get("subnets") or {})]
    if not networks and unlisted and len(facts.get("subnets") or {}) < 2:
        # Not a finding about the subnets: fewer than 2 hosts' interfaces are known, those hosts' errors say why.
        out[CLUSTER] = Outcome(Status.ERROR, f"no network compared: the interfaces of {short_list(unlisted)} could "
                                             "not be listed (see their iperf3 results)", "see those hosts' results",
                               blocked_by=BlockedBy(unlisted[0], NAME))
        return out
    if not networks:
        listing = "; ".join(f"{h}: {', '.join(s) or 'none'}" for h, s in (facts.get("subnets") or {}).items())
        out[CLUSTER] = Outcome(Status.FAIL, "no IPv4 network is shared by all hosts (usable subnets per host: "
                                            f"{listing or 'unknown'})",
                               "put every host on one common subnet on a non-virtual NIC (NCCL needs direct "
                               "TCP between all hosts); see each host's interfaces result")
        return out
    measured = [h for h in hosts if h not in errors or any(h in n["devices"] for n in networks)]
    chosen = facts.get("chosen")
    net = next((n for n in networks if chosen and n["network"] == chosen["network"]), None)
    # Without a network that reaches everyone, judge hosts on the one with the most successful tests.
    judged = net or max(networks, key=lambda n: (len(ok_links(n)), n.get("median_gbps") or 0))
    links = judged.get("links") or []
    doubt: Dict[str, Dict[str, Any]] = {}
    stragglers = find_stragglers(links, measured, float(t["straggler_warn_fraction"]), t, doubt)
    blamed = blame_failures(links, judged.get("blocked") or ())
    for h in measured:
        if h not in out:
            out[h] = _host_outcome(h, judged, networks, stragglers, doubt, blamed, t)
    culprit = _culprit(judged, hosts, measured, blamed, out)
    out[CLUSTER] = _cluster_outcome(chosen, networks, judged, stragglers, len(measured), facts, t, culprit)
    return out


def _culprit(judged: Dict[str, Any], hosts: List[str], measured: List[str], blamed: Dict[str, List[Dict[str, Any]]],
             out: Dict[str, Outcome]) -> Optional[BlockedBy]:
    """The host whose own fault explains every failed test of the judged network (each test blamed on it alone, and
    every host no test reached among them), whose own row says so (FAIL/ERROR): the cluster row's failed tests, or
    its "no network reaches all hosts", are then that host's, blocked by its ports result when the ports check proved
    its TCP blocked, else by its iperf3 result. None when the failures point at no one host."""
    found = sole_culprits(judged.get("links") or [], blamed)
    if not found or any(out.get(h) is None or out[h].status not in (Status.FAIL, Status.ERROR) for h in found):
        return None
    good = ok_links(judged)
    if any(h not in found and not any(h in (ln["src"], ln["dst"]) for ln in good) for h in measured):
        return None  # a host that no test reached, and no failure blamed on it: not explained
    order = {h: i for i, h in enumerate(hosts)}
    first = min(found, key=lambda h: order.get(h, len(order)))
    return BlockedBy(first, "ports" if first in (judged.get("blocked") or ()) else NAME)


def _host_outcome(h: str, judged: Dict[str, Any], networks: List[Dict[str, Any]],
                  stragglers: Dict[str, Dict[str, Any]], doubt: Dict[str, Dict[str, Any]],
                  blamed: Dict[str, List[Dict[str, Any]]], t: Dict[str, Any]) -> Outcome:
    """One host's row: its links on the judged network, whether it is a straggler (or below the fraction on weak
    evidence: said, not named), below the minimum, or the common end of failed tests."""
    min_gbps = float(t["min_gbps"])
    max_p = float(t["max_p"])
    where = str(judged["network"])
    links = judged.get("links") or []
    dev = judged["devices"].get(h)
    mine = [ln for ln in links if h in (ln["src"], ln["dst"])]
    mine_ok = [ln["gbps"] for ln in mine if not ln.get("error") and ln.get("gbps") is not None]
    med = _median(mine_ok)
    findings: List[Finding] = []
    if h in stragglers:
        findings.append(_straggler_finding(h, stragglers[h], judged, dev, t))
    if min_gbps > 0 and med is not None and med < min_gbps:
        findings.append(Finding(Status.FAIL, f"{h}: median {rate(med)} over {len(mine_ok)} links on {where}, below "
                                             f"the minimum {rate(min_gbps)}", _fix_slow(h, dev)))
    floor, floor_basis = link_floor(judged, t)
    if floor is not None and med is not None and med < floor and not (min_gbps > 0 and med < min_gbps):
        findings.append(Finding(Status.WARN, f"{h}: median {rate(med)} over {len(mine_ok)} links on {where}, below "
                                             f"the {floor_basis} (expected a healthy NIC to give iperf3 at least "
                                             f"that)", _fix_slow(h, dev)))
    if h in blamed:
        bad = blamed[h]
        shown = "; ".join(f"{ln['src']}->{ln['dst']}: {ln['error']}" for ln in bad[:3])
        what = (f"every iperf3 test to and from {h} failed" if not mine_ok
                else f"{len(bad)} of {len(mine)} iperf3 tests with {h} failed")
        findings.append(Finding(Status.FAIL, f"{what} on {where} ({shown})",
                                f"check the firewall on {h}: NCCL and torch.distributed need TCP on arbitrary "
                                "ports between all hosts (nft list ruleset / iptables -S); is iperf3 "
                                f"installed and the address {judged['addresses'].get(h)} up?"))
    peers = ", ".join(f"-> {ln['dst']} {rate(ln['gbps'])}" if ln["src"] == h else f"<- {ln['src']} {rate(ln['gbps'])}"
                      for ln in mine if not ln.get("error"))
    ok_msg = (f"median {rate(med)} over {len(mine_ok)} links on {where} via {dev} ({peers or 'none'}); cluster "
              f"median {rate(judged.get('median_gbps'))}")
    proven = h in blamed and len(findings) == 1 and h in (judged.get("blocked") or ())
    if h in doubt:
        # Below the straggler fraction, but the other hosts' links disagree too much for that to be evidence
        # (measured again first: coordinate's confirm rounds): said, not named.
        d = doubt[h]
        ok_msg += (f"; not named, the evidence is weak (adjusted p >= {max_p:g}): {100 * d['ratio']:.0f}% of the "
                   f"median of the other hosts {rate(d['reference_gbps'])} (confidence: {_confidence(d, max_p)})")
    metrics = {"network": judged["network"], "device": dev, "address": judged["addresses"].get(h),
               "median_gbps": med, "cluster_median_gbps": judged.get("median_gbps"), "floor_gbps": floor,
               "link_mbps": (judged.get("link_mbps") or {}).get(h),
               "links": [dict({k: ln.get(k) for k in ("src", "dst", "gbps", "retransmits", "error")},
                              **({"tests": ln["tests"]} if "tests" in ln else {})) for ln in mine],
               "by_network": {n["network"]: _median([ln["gbps"] for ln in ok_links(n)
                                                     if h in (ln["src"], ln["dst"])]) for n in networks}}
    if h in stragglers:
        metrics.update(reference_gbps=stragglers[h]["reference_gbps"], ratio=round(stragglers[h]["ratio"], 3),
                       t=round(stragglers[h].get("t", 0.0), 2), p_adj=stragglers[h].get("p_adj"),
                       detected_by=stragglers[h]["by"])
    elif h in doubt:
        metrics.update(reference_gbps=doubt[h]["reference_gbps"], ratio=round(doubt[h]["ratio"], 3),
                       t=round(doubt[h].get("t", 0.0), 2), p_adj=doubt[h].get("p_adj"), detected_by=None,
                       unsure=True)
    out = combine(findings, ok_msg, metrics)
    if proven:  # its failed tests are what the ports check proved of its TCP: that result is the cause
        out.blocked_by = BlockedBy(h, "ports")
    return out


def _straggler_finding(h: str, s: Dict[str, Any], judged: Dict[str, Any], dev: Any, t: Dict[str, Any]) -> Finding:
    """WARN for a straggler, FAIL below straggler_fail_fraction; says by which rule it was found, how sure, and
    whether every pair was measured again."""
    warn_frac, fail_frac = float(t["straggler_warn_fraction"]), float(t["straggler_fail_fraction"])
    again = (f"; every pair measured {1 + int(judged['remeasured'])} times, each judged by its best"
             if judged.get("remeasured") else "")
    status = Status.FAIL if s["ratio"] < fail_frac else Status.WARN
    why = (f"below {warn_frac * 100:.0f}%" if s["by"] == "fraction" else
           f"below {fail_frac * 100:.0f}%" if status == Status.FAIL else
           f"at least {100 * float(t['min_deficit']):.0f}% slower")
    # "median of the other hosts": of the links without this host (the reference it is judged by), not
    # the cluster median of every link that the PASS lines and the cluster row print.
    return Finding(status, f"{h}: median {rate(s['median_gbps'])} over {s['links']} links vs median of the other "
                           f"hosts {rate(s['reference_gbps'])} ({s['ratio'] * 100:.0f}%) on {judged['network']} via "
                           f"{dev} (straggler: {why}; confidence: {_confidence(s, float(t['max_p']))}){again}",
                   _fix_slow(h, dev))


def _cluster_outcome(chosen: Optional[Dict[str, Any]], networks: List[Dict[str, Any]], judged: Dict[str, Any],
                     stragglers: Dict[str, Dict[str, Any]], measured: int, facts: Dict[str, Any],
                     t: Dict[str, Any], culprit: Optional[BlockedBy] = None) -> Outcome:
    """The cluster row: the chosen network and its median, the stragglers, and whether the best network is fast
    enough and its tests all passed; FAIL when no network reaches every host. Blocked by ``culprit`` when that
    host's fault is all it reports (failed tests, no network reaching all hosts)."""
    min_gbps = float(t["min_gbps"])
    links = judged.get("links") or []
    good = ok_links(judged)
    summary = "; ".join(_network_line(n) for n in networks)
    metrics = {"networks": [{"network": n["network"], "devices": n["devices"], "median_gbps": n.get("median_gbps"),
                             "links": len(n.get("links") or []), "ok": len(ok_links(n))} for n in networks],
               "chosen": chosen, "stragglers": {h: round(s["ratio"], 3) for h, s in stragglers.items()},
               "by_network": {n["network"]: n.get("median_gbps") for n in networks}, "rounds": facts.get("rounds"),
               "duration_s": facts.get("duration_s"),
               "remeasured": {n["network"]: n["remeasured"] for n in networks if n.get("remeasured")}}
    floor, floor_basis = link_floor(judged, t)
    metrics.update(floor_gbps=floor, floor=floor_basis)
    if not chosen:
        return Outcome(Status.FAIL, f"no network reaches all hosts with iperf3 ({summary})",
                       "see the hosts' iperf3 results: a firewall or a down interface blocks the tests", metrics,
                       blocked_by=culprit)
    devs = sorted(set(chosen["devices"]))
    message = (f"chosen {chosen['network']} via {','.join(devs)}: cluster median {rate(chosen['median_gbps'])} "
               f"({len(good)} of {len(links)} tests ok); measured {summary}")
    if stragglers:
        message += "; stragglers: " + ", ".join(f"{h} ({s['ratio'] * 100:.0f}%)" for h, s in stragglers.items())
    elif measured == 2:
        message += " (2 hosts: a slow link cannot be attributed to either of them)"
    message += "; " + floor_basis
    status, problems, fixes = Status.PASS, [], []
    if floor is not None and chosen["median_gbps"] < floor and not (min_gbps > 0 and chosen["median_gbps"] < min_gbps):
        status = Status.WARN
        problems.append(f"the best network's median {rate(chosen['median_gbps'])} is below its link-rate "
                        f"{floor_basis}")
        fixes.append("on every host: ethtool <nic> (negotiated speed/duplex), ip -s link show <nic> (errors), tc qdisc "
                     "show dev <nic> (a leftover rate limit); with streams = 1, raise [iperf3] streams on links above "
                     "~20 Gbit/s")
    if min_gbps > 0 and chosen["median_gbps"] < min_gbps:
        status = Status.FAIL
        problems.append(f"the best network's median {rate(chosen['median_gbps'])} is below the minimum "
                        f"{rate(min_gbps)}")
        fixes.append("check the NICs and switch ports (ethtool); a faster network may lack IPv4 addresses on "
                     "some hosts")
    if len(good) < len(links):
        status = Status.FAIL if status == Status.FAIL else Status.WARN
        problems.append(f"{len(links) - len(good)} of {len(links)} tests on the chosen network failed (see the "
                        "hosts' results)")
        fixes.append("see the failing hosts' iperf3 results")
    only_failed = len(problems) == 1 and len(good) < len(links)  # the failed tests are all it reports
    return Outcome(status, "; ".join(problems + [message]), "; ".join(fixes), metrics,
                   blocked_by=culprit if only_failed else None)


# --- the HTML report's section (SPEC.html): a heat map of the measured links ------------------------------------

# Colour scale, as link rate / the median of the unflagged hosts (reference_median). At or below SLOW_RATIO a link is
# fully red: the default straggler_fail_fraction ("a node at 50% must never pass"). At or above FAST_RATIO fully
# green: at least the median is what a healthy link of this cluster does. Hues in between run through amber.
SLOW_RATIO, FAST_RATIO = 0.5, 1.0
SLOW_HUE, FAST_HUE = 0, 130
UNMEASURED_FILL, SELF_FILL, GRID_LINE = "#f1f3f5", "#cfd4da", "#ffffff"
# Geometry (px). The grid is at most HEATMAP_MAX_PX wide (fits a laptop screen beside the labels); cells shrink
# with hosts down to CELL_MIN_PX (64 hosts: 10 px), and values are written inside cells only when a cell is wide
# enough for "1234" at the value font (VALUE_TEXT_MIN_PX); the <title> tooltip has them always.
HEATMAP_MAX_PX, CELL_MAX_PX, CELL_MIN_PX, VALUE_TEXT_MIN_PX = 640, 64, 8, 34
SLANT_MIN_PX = 20  # column labels at -45 degrees from this cell width up (label spacing cell*sin45 > font)
CHAR_PX = 0.62  # average glyph width / font size of the sans-serif font: sizes the label margins
FLAGGED = ("fail", "warn")  # the statuses whose host is outlined in the map and listed beside it


def measured_links(results: Sequence[Mapping[str, Any]]) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Every measured (src, dst) link from the hosts' results (each link is listed at both of its ends)."""
    links: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for r in results:
        if r["host"] != CLUSTER:
            for ln in (r.get("metrics") or {}).get("links") or []:
                if ln.get("src") and ln.get("dst"):
                    links[(ln["src"], ln["dst"])] = ln
    return links


def reference_median(ok: List[Dict[str, Any]], flagged: Iterable[str]) -> Optional[float]:
    """The median that colours the heat map: of the links between hosts the check did not flag (the cluster
    median when it flagged none; the report's text calls each number by its own name, issue 26).

    With 4 hosts a straggler takes part in half the links, so the plain median would be its rate and its links
    would look normal; evaluate compares a host with the links that do not involve it, as here.
    """
    flagged = set(flagged)
    healthy = [ln["gbps"] for ln in ok if ln["src"] not in flagged and ln["dst"] not in flagged]
    rates = healthy or [ln["gbps"] for ln in ok]
    return statistics.median(rates) if rates else None


def _ratio_colour(ratio: float) -> str:
    t = min(1.0, max(0.0, (ratio - SLOW_RATIO) / (FAST_RATIO - SLOW_RATIO)))
    return f"hsl({SLOW_HUE + t * (FAST_HUE - SLOW_HUE):.0f}, 70%, 62%)"


def _short_rate(gbps: float, mbit: bool) -> str:
    value = gbps * 1000 if mbit else gbps
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def html_section(results: Sequence[Mapping[str, Any]], host_names: Sequence[str]) -> str:
    """The heat map (``<svg id="heatmap">``) of this check's results, the flagged hosts beside it; or why none."""
    per_host = {r["host"]: r for r in results if r["host"] != CLUSTER}
    cluster = next((r for r in results if r["host"] == CLUSTER), None)
    if cluster is None and not per_host:
        return absent("iperf3 did not run (add iperf3 to --checks)")
    links = measured_links(results)
    ok = [ln for ln in links.values() if not ln.get("error") and ln.get("gbps") is not None]
    if not links:
        why = cluster["message"] if cluster is not None else "no link was measured"
        return absent("no heat map: " + why)
    named = {n for pair in links for n in pair}
    hosts = [h for h in host_names if h in per_host or h in named]
    hosts += sorted(named - set(hosts))  # a link to a host the report does not list still gets its row
    marked = {h: r for h, r in per_host.items() if r["status"] in FLAGGED}
    median = reference_median(ok, marked)
    network = next((r["metrics"]["network"] for r in per_host.values() if (r.get("metrics") or {}).get("network")),
                   None)
    svg, values = _heatmap_svg(hosts, links, median, marked, {h: r["status"] for h, r in per_host.items()})
    n = len(hosts)
    caption = (f'iperf3 TCP rate{" on " + esc(network) if network else ""}: rows send (src), columns receive '
               f'(dst). Colour: rate relative to the median of the unflagged hosts ({esc(rate(median))}, their '
               f'links with each other; the cluster median when no host is flagged). '
               f'{len(links)} of {n * (n - 1)} ordered pairs measured: pairs are sampled in rounds of disjoint '
               f'pairs, not all-to-all. {esc(values)}')
    legend = (f'<div class="legend"><span><span class="ramp" style="background: linear-gradient(to right, '
              f'{_ratio_colour(SLOW_RATIO)}, {_ratio_colour((SLOW_RATIO + FAST_RATIO) / 2)}, '
              f'{_ratio_colour(FAST_RATIO)})"></span> &le;{SLOW_RATIO:.0%} &hellip; &ge;{FAST_RATIO:.0%} of '
              f'median</span><span><span class="swatch" style="background:{UNMEASURED_FILL}"></span>not measured'
              f'</span><span><span class="swatch" style="background:{SELF_FILL}"></span>same host</span>'
              f'<span><span class="swatch st-fail"></span>failed test (&times;)</span>'
              f'<span><span class="swatch" style="border:2px solid {STATUS_COLOURS[Status.FAIL][0]}"></span>'
              f'flagged host (row and column)</span></div>')
    flagged = "".join(f'<li data-host="{esc(h)}">{badge(r["status"])} '
                      f'{"" if r["message"].startswith(h) else "<b>" + esc(h) + "</b>: "}{esc(r["message"])}</li>'
                      for h, r in marked.items())
    flagged_html = (f'<h3>flagged hosts (iperf3 FAIL/WARN)</h3><ul id="stragglers">{flagged}</ul>' if flagged else
                    '<p class="caption" id="stragglers">no straggler: every host\'s links are within the '
                    'iperf3 thresholds.</p>')
    return (f'<p class="caption">{caption}</p>{legend}'
            f'<div class="maprow"><div class="scroll">{svg}</div><div class="flagged">{flagged_html}</div></div>')


def _heatmap_svg(hosts: List[str], links: Dict[Tuple[str, str], Dict[str, Any]], median: Optional[float],
                 marked: Mapping[str, Mapping[str, Any]], statuses: Dict[str, str]) -> Tuple[str, str]:
    """The SVG, and one line saying where the values are (in the cells, or only in the tooltips)."""
    n = len(hosts)
    cell = max(CELL_MIN_PX, min(CELL_MAX_PX, HEATMAP_MAX_PX // n))
    font = max(8, min(13, cell - 2))
    label_w = int(max(len(h) for h in hosts) * font * CHAR_PX) + 18  # + the flagged marker dot
    # Slanted column labels read better but need cells wider than the font, else they overlap: then upright.
    angle = 45 if cell >= SLANT_MIN_PX else 90
    rise, run = math.sin(math.radians(angle)), math.cos(math.radians(angle))
    left, top = label_w + 20, int(label_w * rise) + 20
    width, height = left + n * cell + int(label_w * run) + font + 8, top + n * cell + 8
    index = {h: i for i, h in enumerate(hosts)}
    mbit = median is not None and median < 1.0
    show_values = cell >= VALUE_TEXT_MIN_PX
    grid = "".join(f"M{left},{top + k * cell}h{n * cell}M{left + k * cell},{top}v{n * cell}"
                   for k in range(1, n))
    out = [f'<svg id="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="{font}" data-hosts="{n}" role="img" '
           f'aria-label="iperf3 bandwidth heat map">',
           f'<rect x="{left}" y="{top}" width="{n * cell}" height="{n * cell}" fill="{UNMEASURED_FILL}"/>',
           # Grid lines instead of one element per unmeasured cell: the page stays small at 64+ hosts.
           f'<path d="{grid}" stroke="{GRID_LINE}" stroke-width="1" pointer-events="none"/>',
           f'<text x="{left - 6}" y="{top - 6}" text-anchor="end" fill="#6b7280">src \\ dst</text>']
    out += _heatmap_labels(hosts, marked, statuses, left, top, cell, angle)
    out += _heatmap_cells(links, index, median, left, top, cell, mbit, show_values)
    out += _heatmap_bands(marked, index, left, top, cell, n)
    out.append("</svg>")
    unit = "Mbit/s" if mbit else "Gbit/s"
    values = (f"Values in {unit}." if show_values else
              f"{n} hosts: the values are in each cell's tooltip (hover), not written in the cells.")
    return "".join(out), values


def _heatmap_labels(hosts: List[str], marked: Mapping[str, Mapping[str, Any]], statuses: Dict[str, str],
                    left: int, top: int, cell: int, angle: int) -> List[str]:
    """Each host's row and column label (a flagged host's in bold, with a dot, in its status colour) and its
    diagonal self cell."""
    def label_colour(h: str) -> str:
        st = statuses.get(h)
        return STATUS_COLOURS[Status(st)][0] if st in ("fail", "warn", "error") else "#1f2937"

    out = []
    for i, h in enumerate(hosts):
        y = top + i * cell + cell / 2
        x = left + i * cell + cell / 2
        weight = ' font-weight="700"' if h in marked else ""
        dot = (f'<circle cx="{left - 10}" cy="{y:.1f}" r="4" fill="{label_colour(h)}"/>' if h in marked else "")
        out.append(f'{dot}<text class="row-label" x="{left - 18}" y="{y:.1f}" dy="0.35em" text-anchor="end" '
                   f'fill="{label_colour(h)}"{weight}>{esc(h)}</text>')
        out.append(f'<text class="col-label" transform="translate({x:.1f},{top - 8}) rotate(-{angle})" '
                   f'dy="0.35em" fill="{label_colour(h)}"{weight}>{esc(h)}</text>')
        out.append(f'<rect class="self" x="{left + i * cell}" y="{top + i * cell}" width="{cell}" '
                   f'height="{cell}" fill="{SELF_FILL}"><title>{esc(h)}</title></rect>')
    return out


def _heatmap_cells(links: Dict[Tuple[str, str], Dict[str, Any]], index: Dict[str, int], median: Optional[float],
                   left: int, top: int, cell: int, mbit: bool, show_values: bool) -> List[str]:
    """One cell per measured link between two of the hosts: a crossed-out cell for a failed test, else coloured by
    its rate's ratio to the median, with the rate as its tooltip (and written in it when the cells are big enough)."""
    value_font = min(12, cell // 3)
    failed_fill, failed_mark = STATUS_COLOURS[Status.FAIL]
    out = []
    for (src, dst), ln in links.items():
        if src not in index or dst not in index or src == dst:
            continue
        x, y = left + index[dst] * cell, top + index[src] * cell
        geometry = f'x="{x}" y="{y}" width="{cell}" height="{cell}"'
        data = f'data-src="{esc(src)}" data-dst="{esc(dst)}"'
        if ln.get("error") or ln.get("gbps") is None:
            tip = f"{src} \u2192 {dst}: failed: {ln.get('error') or 'no result'}"
            pad = cell * 0.28
            out.append(f'<rect class="cell failed" {data} {geometry} fill="{failed_fill}" '
                       f'stroke="{GRID_LINE}"><title>{esc(tip)}</title></rect>'
                       f'<path d="M{x + pad:.1f},{y + pad:.1f}L{x + cell - pad:.1f},{y + cell - pad:.1f}'
                       f'M{x + cell - pad:.1f},{y + pad:.1f}L{x + pad:.1f},{y + cell - pad:.1f}" '
                       f'stroke="{failed_mark}" stroke-width="2" pointer-events="none"/>')
            continue
        gbps = float(ln["gbps"])
        ratio = gbps / median if median else 1.0
        retrans = ln.get("retransmits")
        tip = (f"{src} \u2192 {dst}: {rate(gbps)} ({ratio:.0%} of median)"
               + (f", {retrans} retransmits" if retrans is not None else ""))
        out.append(f'<rect class="cell" {data} data-gbps="{gbps:.6g}" {geometry} fill="{_ratio_colour(ratio)}" '
                   f'stroke="{GRID_LINE}"><title>{esc(tip)}</title></rect>')
        if show_values:
            out.append(f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2:.1f}" dy="0.35em" text-anchor="middle" '
                       f'font-size="{value_font}" fill="#111827" pointer-events="none">'
                       f'{_short_rate(gbps, mbit)}</text>')
    return out


def _heatmap_bands(marked: Mapping[str, Mapping[str, Any]], index: Dict[str, int], left: int, top: int, cell: int,
                   n: int) -> List[str]:
    """Flagged hosts: outline their whole row and column so that a straggler's band stands out."""
    band_w = max(1.5, min(3.0, cell / 8))  # the flagged band's outline: thin enough not to hide small cells
    out = []
    for h, r in marked.items():
        i = index[h]
        colour = STATUS_COLOURS[Status(r["status"])][0]
        band = f'fill="none" stroke="{colour}" stroke-width="{band_w}" pointer-events="none"'
        d = band_w / 2  # the outline sits just outside the row's and column's cells
        out.append(f'<rect class="flagged-row" data-host="{esc(h)}" x="{left - d}" y="{top + i * cell - d:.1f}" '
                   f'width="{n * cell + 2 * d}" height="{cell + 2 * d}" {band}/>'
                   f'<rect class="flagged-col" data-host="{esc(h)}" x="{left + i * cell - d}" y="{top - d:.1f}" '
                   f'width="{cell + 2 * d}" height="{n * cell + 2 * d}" {band}/>')
    return out


# --- the recommended environment (SPEC.recommend) ---------------------------------------------------------------

def _nccl_versions(given: RecommendInput) -> Dict[str, Optional[Tuple[int, int]]]:
    """NCCL's version on each host, as the python check (else driver_cuda) read it from torch."""
    out = {}
    for h in given.hosts:
        hf = given.facts.get(h) or {}
        raw = (hf.get("python") or {}).get("nccl") or (hf.get("driver_cuda") or {}).get("nccl")
        out[h] = ncclenv.nccl_version(raw) if raw else None
    return out


def recommend(given: RecommendInput) -> Recommendation:
    """NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME on the network this check measured fastest (without a measurement,
    the interface each host routes to the master over) and the IB/RoCE variables, from the interfaces facts; the
    rules are hostside.ncclenv's. Pure: the facts of this check and its reads in, its part of the environment out."""
    iface = {}
    for h in given.hosts:
        facts = (given.facts.get(h) or {}).get("interfaces")
        if isinstance(facts, dict):
            iface[h] = trusted_interfaces(facts)  # host-reported names outside validate's rules left out
    measured = (given.facts.get(CLUSTER) or {}).get(NAME) or {}
    steps: List[Union[EnvVar, str]] = []
    try:
        ncclenv.socket_env(steps, given.hosts, iface, measured, given.master_address)
        ncclenv.ib_env(steps, given.hosts, iface, lambda: _nccl_versions(given))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        # Facts of a shape no check produces (a broken or lying host): no network variables, never a crash.
        steps = [s for s in steps if isinstance(s, str)]
        steps.append("no network recommendation: the hosts' interface facts are malformed "
                     f"({type(exc).__name__}: {validate.quote(str(exc))})")
    failing = sorted(set(given.failed.get("interfaces", [])) | set(given.failed.get(NAME, [])))
    caveats = (f"network checks failed ({', '.join(failing)}): fix them before trusting the interface "
               "recommendation",) if failing else ()
    return Recommendation(tuple(steps), caveats)


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: every measured link's TCP rate (bits per second), by sender and receiver."""
    return [PromSample("preflight_iperf3_bits_per_second", "iperf3 TCP rate of the link from src to dst", "gauge",
                       {"src": src, "dst": dst}, float(ln["gbps"]) * 1e9)
            for (src, dst), ln in measured_links(results).items()
            if not ln.get("error") and isinstance(ln.get("gbps"), (int, float))]


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="TCP bandwidth between host pairs on every shared network (iperf3); names stragglers, picks the NIC",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    # Compared with the host's own past runs (preflight/history.py): its median link rate, and the network's.
    baseline={"median_gbps": "higher", "networks[*].median_gbps": "higher"},
    html=HtmlSection("Host-to-host bandwidth (iperf3)", html_section),
    # interfaces: the candidate networks (and their facts, listed here when that check did not run); python and
    # driver_cuda: NCCL's version, for the recommended environment.
    reads=("python", "driver_cuda", "interfaces", "ports"),
    recommend=recommend,
    prom_metrics=prom_metrics,
)
