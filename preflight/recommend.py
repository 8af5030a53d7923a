"""Recommend the NCCL/Gloo environment for the job from the facts of this run, each with its reason.

Inputs: ``cluster.facts["*"]["iperf3"]["chosen"]`` (the network that reaches all hosts with the best measured
bandwidth), ``cluster.facts[host]["interfaces"]`` (NICs, IB/RoCE ports and GIDs, nvidia_peermem) and, when
present, the NCCL version from the python/driver_cuda facts. Sources: NCCL's env.rst (NCCL_SOCKET_IFNAME prefix
list, '=' exact, '^' exclude, applying to the whole list; NCCL_IB_HCA '=' exact; NCCL_IB_GID_INDEX dynamic since
2.21), PyTorch's distributed docs (GLOO_SOCKET_IFNAME: a comma list of exact interface names, each of which must
exist on every process) and TORCH_NCCL_ASYNC_ERROR_HANDLING; see shared/reference/facts.md of the design notes.
"""
from __future__ import annotations

import ipaddress
import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple

from preflight.checks import interfaces
from preflight.hostside import validate
from preflight.hostside.outcome import Status

Env = Dict[str, str]

# Folklore that must never be recommended, with what to say instead.
NEVER = {
    "NCCL_TIMEOUT": "NCCL_TIMEOUT does not exist: set the collective timeout with "
                    "torch.distributed.init_process_group(timeout=datetime.timedelta(minutes=N)) "
                    "(DeepSpeed: deepspeed.init_distributed(timeout=...)); the default is 10 minutes",
    # NCCL's env docs: NCCL_MIN_NRINGS (until 2.4) became NCCL_MIN_NCHANNELS; NCCL_MIN_CTAS is a separate knob.
    "NCCL_MIN_NRINGS": "NCCL_MIN_NRINGS is the pre-2.5 name of NCCL_MIN_NCHANNELS (still read as an alias, ignored "
                       "when NCCL_MIN_NCHANNELS is set); NCCL tunes channels itself",
    "NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING is PyTorch's legacy name: use "
                                 "TORCH_NCCL_ASYNC_ERROR_HANDLING (recommended above)",
}
# The only variables preflight ever writes to the --env-file (DeepSpeed's .deepspeed_env): a key outside this set is
# a bug, never something a host could add.
OWNED_KEYS = frozenset({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA",
                        "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
# NCCL picks the RoCE GID index dynamically from this version on (NCCL_IB_GID_INDEX default -1).
DYNAMIC_GID_NCCL = (2, 21)
IPV4_MAPPED_GID = "0000:0000:0000:0000:0000:ffff:"
EXCLUDED_KINDS = ("loopback", "docker", "bridge")


def _host_facts(cluster: Any, check: str) -> Dict[str, Dict[str, Any]]:
    facts = getattr(cluster, "facts", {}) or {}
    return {h.name: facts[h.name][check] for h in cluster.hosts
            if isinstance(facts.get(h.name), dict) and facts[h.name].get(check) is not None}


def _interfaces_view(cluster: Any) -> Dict[str, Dict[str, Any]]:
    """Each host's interfaces facts as the interfaces check judged them: names outside validate's rules and
    fields of the wrong type left out (the host reported them; they are data, never part of an env value)."""
    return {h: interfaces.trusted_view(f)[0] for h, f in _host_facts(cluster, "interfaces").items()
            if isinstance(f, dict)}


def socket_ifname(names: Sequence[str]) -> str:
    """One NCCL_SOCKET_IFNAME value matching the chosen interface on every host.

    '=' makes the whole list exact (without it, eth1 would also match eth10..eth19). Different names across
    hosts: '=a,b' still matches exactly one interface on each host, provided no host also has the other name.
    """
    return "=" + ",".join(sorted(set(names)))


def _allowed(name: Optional[str], itf_facts: Optional[Dict[str, Any]]) -> bool:
    """Never lo, docker* or bridges, whatever the measurements say; never a name outside validate's rules (it
    came from a host and would end up in every node's environment)."""
    if not validate.ifname(name) or name == "lo" or str(name).startswith("docker"):
        return False
    for itf in (itf_facts or {}).get("interfaces") or []:
        if itf.get("name") == name and (itf.get("kind") in EXCLUDED_KINDS or itf.get("bridge_master")):
            return False
    return True


def _route_dev(itf_facts: Dict[str, Any]) -> Optional[str]:
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


def _is_address(text: Any) -> bool:
    try:
        ipaddress.ip_address(str(text))
        return True
    except ValueError:
        return False


def _version(text: Any) -> Optional[Tuple[int, int]]:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, TypeError):
        return None


def _nccl_versions(cluster: Any) -> Dict[str, Optional[Tuple[int, int]]]:
    facts = getattr(cluster, "facts", {}) or {}
    out = {}
    for h in cluster.hosts:
        hf = facts.get(h.name) or {}
        raw = (hf.get("python") or {}).get("nccl") or (hf.get("driver_cuda") or {}).get("nccl")
        out[h.name] = _version(raw) if raw else None
    return out


def roce_gid_index(ports: Sequence[Dict[str, Any]]) -> Tuple[Optional[int], str]:
    """The GID index of a RoCE v2 IPv4 GID common to every given RoCE port, or (None, why not)."""
    common: Optional[set] = None
    for p in ports:
        idx = {g.get("index") for g in p.get("gids") or [] if validate.port_number(g.get("index"))
               if "v2" in (g.get("type") or "").lower() and str(g.get("gid", "")).startswith(IPV4_MAPPED_GID)}
        if not idx:
            return None, "%s:%s has no RoCE v2 GID of an IPv4 address" % (p.get("device"), p.get("port"))
        common = idx if common is None else common & idx
    if not common:
        return None, "the RoCE v2 IPv4 GID sits at different indexes on different ports"
    return min(common), ""


def _socket_env(cluster: Any, put: Any, notes: List[str], iface: Dict[str, Dict[str, Any]]) -> None:
    hosts = [h.name for h in cluster.hosts]
    iperf3 = (getattr(cluster, "facts", {}) or {}).get("*", {}).get("iperf3") or {}
    chosen = iperf3.get("chosen")
    if chosen:
        devices: List[str] = list(chosen["devices"])
        named: List[Tuple[Any, Optional[str]]] = list(zip(chosen.get("hosts") or iperf3.get("hosts") or hosts,
                                                          devices))
        why = ("network %s reaches all hosts with the best measured bandwidth (%.3g Gbit/s median iperf3)"
               % (chosen["network"], chosen["median_gbps"]))
        others = [n for n in iperf3.get("networks") or [] if n.get("network") != chosen["network"]]
        if others:
            why += "; also measured: " + ", ".join("%s %.3g Gbit/s" % (n["network"], n.get("median_gbps") or 0)
                                                   for n in others)
    elif iperf3 and not iperf3.get("skipped"):
        notes.append("iperf3 found no network that reaches all hosts: NCCL_SOCKET_IFNAME is not recommended "
                     "until that is fixed (see the iperf3 results)")
        return
    elif iface and len(iface) == len(hosts) and len(hosts) > 1:
        named = [(h, _route_dev(iface[h])) for h in hosts]
        devices = [d or "" for _, d in named]  # None never survives the `bad` check below
        why = ("the interface each host routes to the master over (no bandwidth measured: run the iperf3 check "
               "to pick the fastest network)")
    else:
        return
    bad = [(h, d) for h, d in named if not _allowed(d, iface.get(h))]
    if bad:
        notes.append("not recommending NCCL_SOCKET_IFNAME: %s is loopback, docker or a bridge (or unknown); NCCL "
                     "must use the hosts' real NICs" % ", ".join(
                         "%s on %s" % (d if validate.ifname(d) else validate.quote(d), h) for h, d in bad))
        return
    value = socket_ifname(devices)
    unique = sorted(set(devices))
    if len(unique) > 1:
        why += "; the interface names differ across hosts (%s), so the exact list matches one on each" % ", ".join(
            "%s %s" % (h, d) for h, d in named)
        clash = [(h, d, o) for h, d in named for o in unique
                 if o != d and any(i.get("name") == o for i in (iface.get(h) or {}).get("interfaces") or [])]
        if clash:
            notes.append("NCCL_SOCKET_IFNAME=%s also matches %s: NCCL would use that interface too; rename the "
                         "interfaces to one name, or set NCCL_SOCKET_IFNAME per host"
                         % (value, ", ".join("%s on %s (chosen: %s)" % (o, h, d) for h, d, o in clash)))
    put("NCCL_SOCKET_IFNAME", value, why)
    if len(unique) == 1:
        put("GLOO_SOCKET_IFNAME", unique[0],
            "same interface as NCCL, for torch.distributed's gloo (CPU collectives, and the object collectives "
            "DeepSpeed uses); gloo takes exact names, not NCCL's '='/'^' syntax")
    else:
        net = chosen["network"] if chosen and _is_network(chosen.get("network")) else None
        how = ("GLOO_SOCKET_IFNAME=$(ip -o -4 addr show to %s | awk '{print $2}')" % net) if net else \
            "GLOO_SOCKET_IFNAME=<that host's interface>"
        notes.append("GLOO_SOCKET_IFNAME is not recommended: gloo takes a comma list of exact interface names and "
                     "fails on a host that lacks any of them, and the names differ (%s); set it per host in the "
                     "launch script, e.g. export %s" % (", ".join("%s %s" % (h, d) for h, d in named), how))
    if chosen:
        master = hosts[0] if hosts else None
        addr = chosen.get("addresses", {}).get(master)
        ssh_addr = None
        try:
            ssh_addr = cluster.address(master) if master and hasattr(cluster, "address") else None
            on_chosen = ipaddress.ip_address(str(ssh_addr)) in ipaddress.ip_network(chosen["network"])
        except (ValueError, TypeError, KeyError):
            on_chosen = None  # a name, not an address: unknown
        if addr and on_chosen is False and _is_address(addr):
            notes.append("the hostfile names resolve to another network (%s is %s) than the fastest one: launch with "
                         "deepspeed --master_addr=%s so that the rendezvous uses %s too"
                         % (master, ssh_addr, addr, chosen["network"]))


def _ib_env(cluster: Any, put: Any, notes: List[str], iface: Dict[str, Dict[str, Any]]) -> None:
    hosts = [h.name for h in cluster.hosts]
    if not iface or len(iface) < len(hosts):
        if hosts:
            notes.append("no interfaces facts for %s: run the interfaces check for the IB/RoCE recommendation"
                         % ", ".join(h for h in hosts if h not in iface))
        return
    active = {h: [p for p in iface[h].get("ib") or [] if p.get("active")] for h in hosts}
    if not any(active.values()):
        put("NCCL_IB_DISABLE", "1", "no host has an active InfiniBand/RoCE port: NCCL must use TCP sockets (without "
                                    "it NCCL probes for IB devices at every start)")
        return
    without = [h for h in hosts if not active[h]]
    if without:
        notes.append("%s %s no active IB/RoCE port while the others do: NCCL cannot mix IB and sockets in one job; "
                     "fix the port, leave the host out, or set NCCL_IB_DISABLE=1 (sockets only, much slower)"
                     % (", ".join(without), "has" if len(without) == 1 else "have"))
    ports = [p for h in hosts for p in active[h]]
    # Host-reported names go into NCCL_IB_HCA only when they pass validate's rules (interfaces FAILs the others).
    odd = [p for p in ports if not (validate.hca_name(p.get("device")) and validate.port_number(p.get("port")))]
    if odd:
        notes.append("not using IB ports with invalid names in NCCL_IB_HCA: %s (see the interfaces results)"
                     % ", ".join("%s:%s" % (validate.quote(p.get("device")), validate.quote(p.get("port")))
                                 for p in odd[:8]))
        ports = [p for p in ports if p not in odd]
        if not ports:
            return
    hcas = sorted({"%s:%s" % (p["device"], p["port"]) for p in ports})
    put("NCCL_IB_HCA", "=" + ",".join(hcas),
        "the active IB/RoCE ports; '=' makes NCCL match exact names (without it mlx5_1 also matches mlx5_10..)")
    roce = [p for p in ports if (p.get("link_layer") or "").lower() == "ethernet"]
    if roce:
        versions = _nccl_versions(cluster)
        if versions and all(v is not None and v >= DYNAMIC_GID_NCCL for v in versions.values()):
            notes.append("RoCE: NCCL >= 2.21 on every host picks the GID index itself; NCCL_IB_GID_INDEX not needed")
        else:
            idx, why_not = roce_gid_index(roce)
            if idx is None:
                notes.append("RoCE: cannot recommend NCCL_IB_GID_INDEX (%s); NCCL < 2.21 defaults to index 0 (RoCE "
                             "v1/link-local), which usually fails across subnets" % why_not)
            else:
                put("NCCL_IB_GID_INDEX", str(idx),
                    "RoCE ports: index %d holds the RoCE v2 GID of an IPv4 address on every active RoCE port; NCCL "
                    "< 2.21 uses index 0 unless told (newer NCCL finds the same index itself)" % idx)
    if all(iface[h].get("peermem") for h in hosts) and not without:
        put("NCCL_NET_GDR_LEVEL", "PHB",
            "nvidia_peermem is loaded on every host: allow GPUDirect RDMA when the GPU and NIC share a CPU socket")


def recommend(cluster: Any, results: List[Any]) -> Tuple[Env, Dict[str, str], List[str]]:
    """(env, {var: reason}, notes) for the job; the runner prints them and writes the --env-file."""
    env: Env = {}
    reasons: Dict[str, str] = {}
    notes: List[str] = []

    def put(name: str, value: str, why: str) -> None:
        if name in NEVER or name not in OWNED_KEYS:  # guards against regressions, not against hosts
            raise ValueError("refusing to recommend %s" % name)
        if not validate.env_key(name) or not validate.env_value(value):
            # The last gate before the printed exports and the --env-file: whatever a host reported, nothing a
            # shell or DeepSpeed's `export K="V"` would interpret gets through.
            notes.append("not recommending %s: its value %s holds characters a shell would interpret"
                         % (validate.quote(name), validate.quote(value)))
            return
        env[name] = value
        reasons[name] = why

    iface = _interfaces_view(cluster)
    try:
        _socket_env(cluster, put, notes, iface)
        _ib_env(cluster, put, notes, iface)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        # Facts of a shape no check produces (a broken or lying host): no network variables, never a crash.
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA",
                     "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL"):
            env.pop(name, None)
            reasons.pop(name, None)
        notes.append("no network recommendation: the hosts' interface facts are malformed (%s: %s)"
                     % (type(exc).__name__, validate.quote(str(exc))))
    put("NCCL_DEBUG", "WARN", "NCCL prints the reason of a failure instead of failing silently; INFO for more")
    put("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
        "a failed or timed-out collective aborts the job instead of hanging it (the legacy "
        "NCCL_ASYNC_ERROR_HANDLING is deprecated)")
    notes.extend(NEVER.values())
    failing = [r for r in results if r.check in ("interfaces", "iperf3") and r.status == Status.FAIL]
    if failing:
        notes.append("network checks failed (%s): fix them before trusting the interface recommendation"
                     % ", ".join(sorted({r.host for r in failing})))
    return env, reasons, notes


def safe_env(env: Env) -> Env:
    """The variables that may be written or printed: owned keys whose values a shell would not interpret."""
    return {k: v for k, v in env.items() if k in OWNED_KEYS and validate.env_value(v)}


def env_file_text(env: Env) -> str:
    """DeepSpeed's .deepspeed_env: one KEY=VALUE line per variable and nothing else (a blank line crashes its
    launcher). Its pdsh runner turns each line into `export K=V` (quoted as "V" when V has other characters than
    [\\w@%+=:,./-]) in a shell on every node, so each value is checked again here: no $, `, ", \\ or newline."""
    return "".join("%s=%s\n" % (k, v) for k, v in safe_env(env).items())


def export_lines(env: Env) -> List[str]:
    """The same variables as env_file_text, as shell lines to paste (shlex-quoted, so the same text)."""
    return ["export %s=%s" % (k, shlex.quote(v)) for k, v in safe_env(env).items()]
