"""Network interfaces, IB/RoCE ports, GPUDirect RDMA module and the interface that routes to the master host.

Reads /sys/class/net/IF/{operstate,speed,mtu,type,flags}, ``ip -j addr`` / ``ip -j -d link`` (fallback:
/proc/net/dev, /proc/net/if_inet6, ioctl), /sys/class/infiniband/DEV/ports/P/* and ``ip -j route get IP``, e.g.::

    /sys/class/infiniband/mlx5_0/ports/1/state       4: ACTIVE
    /sys/class/infiniband/mlx5_0/ports/1/phys_state  5: LinkUp
    /sys/class/infiniband/mlx5_0/ports/1/rate        400 Gb/sec (4X NDR)
    ip -j route get 192.0.2.1  ->  [{"dst":"192.0.2.1","dev":"eth0","prefsrc":"192.0.2.2","flags":[],...}]
    /proc/net/route            ->  eth0  000200C0  00000000  0001 ... 00FFFFFF ...
    /proc/modules              ->  nvidia_peermem 16384 0 - Live 0x0000000000000000 (O)
    /proc/driver/nvidia/version -> NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  ...

GPUDirect RDMA: on a GPU host (the nvidia kernel module loaded) with an active IB/RoCE port, NCCL uses GPUDirect RDMA
only when a peer-memory module is loaded (NCCL's src/transport/net_ib/gdr.cc tests /sys/module/nvidia_peermem/version
and /sys/kernel/mm/memory_peers/nv_mem{,_nc}/version) or through DMA-BUF (NCCL >= 2.13, NVIDIA's open kernel module, a
kernel >= 5.12). Neither is a WARN: every inter-node transfer is staged through host memory. The fix is NCCL's own
(docs/userguide/source/troubleshooting/gpu_troubleshooting.rst, "GPU-to-NIC communication": the module "must be
loaded on each node boot with: sudo modprobe nvidia-peermem").

Thresholds: [interfaces] in interfaces.toml beside this module.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import socket
import struct
import threading
from typing import Any, Dict, List, Optional, Tuple

from ..hostside import validate
from ..hostside.netinfo import DMABUF_KERNEL, gdr_path, trusted_interfaces
from ..hostside.outcome import Finding, Outcome, Status, combine, limits
from ..hostside.seams import CheckSpec, HostContext
from ..hostside.proc import read_text, sh

NAME = "interfaces"

SYS_NET = "/sys/class/net"
SYS_IB = "/sys/class/infiniband"
MAX_GIDS = 256
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IFF_LOOPBACK = 0x8
ARPHRD_LOOPBACK = 772
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
# The files NCCL itself tests for a loaded peer-memory module (src/transport/net_ib/gdr.cc, ibGdrSupportInitOnce).
PEERMEM_PATHS = ("/sys/module/nvidia_peermem/version", "/sys/kernel/mm/memory_peers/nv_mem/version",
                 "/sys/kernel/mm/memory_peers/nv_mem_nc/version")
NVIDIA_VERSION = "/proc/driver/nvidia/version"
# Loads the module now and at every boot (systemd-modules-load reads /etc/modules-load.d/*.conf).
PEERMEM_FIX = ("sudo modprobe nvidia_peermem && echo nvidia_peermem | sudo tee /etc/modules-load.d/nvidia-peermem.conf"
               "  # nvidia_peermem ships with the NVIDIA driver (R470+); MLNX_OFED/DOCA-OFED must be installed first")


# --- pure parsers ----------------------------------------------------------------------------

def parse_ib_state(text: Optional[str]) -> Optional[str]:
    """'4: ACTIVE' -> 'ACTIVE'; '5: LinkUp' -> 'LinkUp'."""
    if text is None:
        return None
    text = text.strip()
    return text.split(":", 1)[1].strip() if ":" in text else (text or None)


def parse_ib_rate(text: Optional[str]) -> Optional[float]:
    """'400 Gb/sec (4X NDR)' -> 400.0; '2.5 Gb/sec (1X SDR)' -> 2.5."""
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def parse_modules(text: str) -> List[str]:
    """Module names of /proc/modules (first field)."""
    return [ln.split()[0] for ln in (text or "").splitlines() if ln.strip()]


def parse_open_module(text: Optional[str]) -> Optional[bool]:
    """/proc/driver/nvidia/version -> True for NVIDIA's open kernel module ('NVIDIA UNIX Open Kernel Module for
    x86_64 580.159.04'), False for the proprietary one ('NVIDIA UNIX x86_64 Kernel Module 535.183.01'), None without
    the file."""
    if text is None:
        return None
    first = (text.strip().splitlines() or [""])[0]
    return "Open Kernel Module" in first


def parse_proc_net_dev(text: str) -> List[str]:
    """Interface names of /proc/net/dev."""
    names = []
    for line in (text or "").splitlines()[2:]:
        if ":" in line:
            names.append(line.split(":", 1)[0].strip())
    return names


def parse_if_inet6(text: str) -> Dict[str, List[str]]:
    """/proc/net/if_inet6 -> {ifname: ["fd00::2/64", ...]} (prefix length is hex there)."""
    out: Dict[str, List[str]] = {}
    for line in (text or "").splitlines():
        f = line.split()
        if len(f) < 6 or len(f[0]) != 32:
            continue
        addr = ipaddress.IPv6Address(bytes.fromhex(f[0]))
        out.setdefault(f[5], []).append(f"{addr}/{int(f[2], 16)}")
    return out


def parse_ip_addr_json(text: str) -> Dict[str, Dict[str, Any]]:
    """``ip -j addr`` -> {ifname: {"ipv4": [...], "ipv6": [...], "operstate", "mtu", "link_type", "flags"}}."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return {}
    out: Dict[str, Dict[str, Any]] = {}
    for item in data if isinstance(data, list) else []:
        name = item.get("ifname")
        if not name:
            continue
        v4: List[str] = []
        v6: List[str] = []
        for a in item.get("addr_info") or []:
            local, plen = a.get("local"), a.get("prefixlen")
            if local is None or plen is None:
                continue
            (v4 if a.get("family") == "inet" else v6 if a.get("family") == "inet6" else []).append(
                f"{local}/{plen}")
        out[name] = {"ipv4": v4, "ipv6": v6, "operstate": item.get("operstate"), "mtu": item.get("mtu"),
                     "link_type": item.get("link_type"), "flags": item.get("flags") or []}
    return out


def parse_ip_link_kinds(text: str) -> Dict[str, Optional[str]]:
    """``ip -j -d link`` -> {ifname: linkinfo.info_kind or None} (veth, bridge, bond, vlan, ifb, ...)."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return {}
    out: Dict[str, Optional[str]] = {}
    for item in data if isinstance(data, list) else []:
        if item.get("ifname"):
            out[item["ifname"]] = (item.get("linkinfo") or {}).get("info_kind")
    return out


def parse_ip_route_get(text: str) -> Optional[Dict[str, Any]]:
    """``ip -j route get IP`` -> {"dev", "src", "gateway"}."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return None
    if not isinstance(data, list) or not data:
        return None
    r = data[0]
    if not r.get("dev"):
        return None
    return {"dev": r.get("dev"), "src": r.get("prefsrc"), "gateway": r.get("gateway")}


def _hex_le_ip(h: str) -> int:
    return struct.unpack("<I", bytes.fromhex(h))[0]


def route_lookup_proc(text: str, ip: str) -> Optional[Dict[str, Any]]:
    """IPv4 longest-prefix match in /proc/net/route -> {"dev", "gateway"} (lowest metric on ties)."""
    try:
        target = int(ipaddress.IPv4Address(ip))
    except ValueError:
        return None
    best = None
    for line in (text or "").splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        try:
            dest = int(ipaddress.IPv4Address(_hex_le_ip(f[1])))
            gw = ipaddress.IPv4Address(_hex_le_ip(f[2]))
            flags = int(f[3], 16)
            metric = int(f[6])
            mask = int(ipaddress.IPv4Address(_hex_le_ip(f[7])))
        except (ValueError, struct.error):
            continue
        if not flags & 0x1:  # RTF_UP
            continue
        if target & mask != dest & mask:
            continue
        plen = bin(mask).count("1")
        key = (plen, -metric)
        if best is None or key > best[0]:
            best = (key, {"dev": f[0], "gateway": str(gw) if flags & 0x2 else None})
    return best[1] if best else None


def classify(name: str, sysinfo: Dict[str, Any], info_kind: Optional[str]) -> str:
    """physical | veth | bridge | loopback | docker | other."""
    flags = sysinfo.get("flags") or 0
    if name == "lo" or sysinfo.get("type") == ARPHRD_LOOPBACK or flags & IFF_LOOPBACK:
        return "loopback"
    if name.startswith("docker"):
        return "docker"
    if info_kind == "veth" or name.startswith("veth"):
        return "veth"
    if sysinfo.get("bridge") or info_kind == "bridge":
        return "bridge"
    if sysinfo.get("sys_virtual") is False:
        return "physical"
    return "other"


def build_interfaces(sysnet: Dict[str, Dict[str, Any]], addrs: Dict[str, Dict[str, Any]],
                     kinds: Dict[str, Optional[str]], names: List[str]) -> List[Dict[str, Any]]:
    """Merge sysfs, ``ip`` and fallback data into the shared interface schema."""
    out = []
    for name in names:
        s = sysnet.get(name, {})
        a = addrs.get(name, {})
        kind = classify(name, s, kinds.get(name))
        mtu = s.get("mtu") if s.get("mtu") is not None else a.get("mtu")
        oper = s.get("operstate") or (a.get("operstate") or "").lower() or None
        virtual = bool(s.get("sys_virtual")) or kind in ("loopback", "docker", "veth", "bridge")
        out.append({"name": name, "ipv4": list(a.get("ipv4", [])), "ipv6": list(a.get("ipv6", [])),
                    "operstate": oper, "speed_mbps": s.get("speed_mbps"), "mtu": mtu, "virtual": virtual,
                    "kind": kind, "info_kind": kinds.get(name), "bridge_master": s.get("bridge_master"),
                    "arp_type": s.get("type")})
    return out


# --- host side -------------------------------------------------------------------------------

def _int(text: Optional[str], base: int = 10) -> Optional[int]:
    try:
        return int((text or "").strip(), base)
    except ValueError:
        return None


def read_sys_net(root: str = SYS_NET) -> Dict[str, Dict[str, Any]]:
    """Per interface: operstate, speed_mbps (None when -1/unreadable), mtu, type, flags, virtual, bridge."""
    out: Dict[str, Dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        d = os.path.join(root, name)
        speed = _int(read_text(os.path.join(d, "speed")))
        master = None
        if os.path.isdir(os.path.join(d, "brport")):
            master = os.path.basename(os.path.realpath(os.path.join(d, "master")))
        out[name] = {
            "operstate": (read_text(os.path.join(d, "operstate")) or "").strip() or None,
            "speed_mbps": speed if speed is not None and speed >= 0 else None,
            "mtu": _int(read_text(os.path.join(d, "mtu"))),
            "type": _int(read_text(os.path.join(d, "type"))),
            "flags": _int(read_text(os.path.join(d, "flags")), 16),
            "sys_virtual": "/devices/virtual/" in os.path.realpath(d) + "/",
            "bridge": os.path.isdir(os.path.join(d, "bridge")),
            "bridge_master": master,
        }
    return out


def read_infiniband(root: str = SYS_IB) -> List[Dict[str, Any]]:
    """One entry per (device, port) of /sys/class/infiniband."""
    out: List[Dict[str, Any]] = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return out
    for dev in devices:
        ports_dir = os.path.join(root, dev, "ports")
        try:
            ports = sorted(os.listdir(ports_dir), key=lambda p: _int(p) or 0)
        except OSError:
            continue
        try:
            netdevs = sorted(os.listdir(os.path.join(root, dev, "device", "net")))
        except OSError:
            netdevs = []
        for port in ports:
            pd = os.path.join(ports_dir, port)
            state_raw = (read_text(os.path.join(pd, "state")) or "").strip()
            phys_raw = (read_text(os.path.join(pd, "phys_state")) or "").strip()
            rate_raw = (read_text(os.path.join(pd, "rate")) or "").strip()
            state, phys = parse_ib_state(state_raw), parse_ib_state(phys_raw)
            gids = []
            try:
                idx = sorted((i for i in os.listdir(os.path.join(pd, "gids")) if i.isdigit()), key=int)[:MAX_GIDS]
            except OSError:
                idx = []
            for i in idx:
                gid = (read_text(os.path.join(pd, "gids", i)) or "").strip()
                if not gid or gid == ZERO_GID:
                    continue
                gids.append({"index": int(i), "gid": gid,
                             "type": (read_text(os.path.join(pd, "gid_attrs", "types", i)) or "").strip() or None,
                             "ndev": (read_text(os.path.join(pd, "gid_attrs", "ndevs", i)) or "").strip() or None})
            out.append({"device": dev, "port": _int(port), "state": state, "phys_state": phys,
                        "rate_gbps": parse_ib_rate(rate_raw), "rate": rate_raw or None,
                        "link_layer": (read_text(os.path.join(pd, "link_layer")) or "").strip() or None,
                        "active": state == "ACTIVE" and phys == "LinkUp", "gids": gids, "netdevs": netdevs})
    return out


def _ioctl_ipv4(names: List[str]) -> Dict[str, List[str]]:
    import fcntl
    out: Dict[str, List[str]] = {}
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return out
    try:
        for name in names:
            ifr = struct.pack("256s", name.encode()[:15])
            try:
                addr = fcntl.ioctl(s.fileno(), 0x8915, ifr)[20:24]   # SIOCGIFADDR
                mask = fcntl.ioctl(s.fileno(), 0x891B, ifr)[20:24]   # SIOCGIFNETMASK
            except OSError:
                continue
            plen = bin(struct.unpack("!I", mask)[0]).count("1")
            out[name] = [f"{socket.inet_ntoa(addr)}/{plen}"]
    finally:
        s.close()
    return out


def _resolve(host: str, timeout: float) -> Dict[str, Any]:
    try:
        ipaddress.ip_address(host)
        return {"given": host, "ip": host, "addresses": [host], "error": None}
    except ValueError:
        pass
    result: Dict[str, Any] = {"given": host, "ip": None, "addresses": [], "error": None}

    def work() -> None:
        try:
            infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
            seen: List[str] = []
            for info in infos:
                addr = str(info[4][0])
                if addr not in seen:
                    seen.append(addr)
            result["addresses"] = seen
            result["ip"] = seen[0] if seen else None
        except (socket.gaierror, OSError, UnicodeError) as exc:
            result["error"] = f"does not resolve: {exc}"

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        result["error"] = f"name resolution timed out after {timeout:.0f} s"
    elif result["ip"] is None and not result["error"]:
        result["error"] = "does not resolve: no addresses"
    return result


def _route(ip: str, ctx: HostContext, interfaces: List[Dict[str, Any]]) -> Dict[str, Any]:
    # `to`: iproute2 takes the next word as the address whatever it starts with (it has no `--`).
    res = sh(["ip", "-j", "route", "get", "to", ip], timeout=ctx.remaining(5))
    if res.ok:
        r = parse_ip_route_get(res.out)
        if r:
            r["via"] = "ip route get"
            return {"route": r, "error": None}
    if not res.ok and res.rc not in (124, 127) and ("RTNETLINK" in res.err or "unreachable" in res.err.lower()):
        last = (res.err.strip().splitlines() or [f"rc {res.rc}"])[-1]
        return {"route": None, "error": f"ip route get {ip}: {last}"}
    # Fallback without iproute2 (or without -j): let the kernel pick the source, then map it to an interface.
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.connect((ip, 9))
            src = s.getsockname()[0]
        finally:
            s.close()
    except OSError as exc:
        return {"route": None, "error": f"no route to {ip}: {exc.strerror or exc}"}
    dev = None
    for itf in interfaces:
        if any(a.split("/")[0] == src for a in itf["ipv4"] + itf["ipv6"]):
            dev = itf["name"]
    proc = route_lookup_proc(read_text("/proc/net/route") or "", ip) if family == socket.AF_INET else None
    if dev is None and proc:
        dev = proc["dev"]
    return {"route": {"dev": dev, "src": src, "gateway": proc["gateway"] if proc else None, "via": "socket"},
            "error": None if dev else f"route source {src} matches no interface"}


def collect(ctx: HostContext) -> Dict[str, Any]:
    params = ctx.params or {}
    facts: Dict[str, Any] = {"interfaces": [], "ib": [], "peermem": False, "peermem_module": None,
                             "gpu_driver_loaded": False, "nvidia_open_module": None, "kernel": os.uname().release,
                             "route_to_master": None, "master": None, "route_error": None, "sources": [],
                             "errors": []}
    sysnet = read_sys_net()
    names = sorted(sysnet) or parse_proc_net_dev(read_text("/proc/net/dev") or "")
    addrs: Dict[str, Dict[str, Any]] = {}
    kinds: Dict[str, Optional[str]] = {}
    res = sh(["ip", "-j", "addr", "show"], timeout=ctx.remaining(5))
    if res.ok:
        addrs = parse_ip_addr_json(res.out)
    if addrs:
        facts["sources"].append("ip -j addr")
        link = sh(["ip", "-j", "-d", "link", "show"], timeout=ctx.remaining(5))
        if link.ok:
            kinds = parse_ip_link_kinds(link.out)
    else:
        facts["errors"].append(f"ip -j addr: rc {res.rc} {res.err.strip()[:200]}")
        facts["sources"].append("ioctl + /proc/net/if_inet6")
        v4 = _ioctl_ipv4(names)
        v6 = parse_if_inet6(read_text("/proc/net/if_inet6") or "")
        addrs = {n: {"ipv4": v4.get(n, []), "ipv6": v6.get(n, [])} for n in names}
    for n in addrs:
        if n not in names:
            names.append(n)
    facts["interfaces"] = build_interfaces(sysnet, addrs, kinds, names)
    facts["ib"] = read_infiniband()

    mods = parse_modules(read_text("/proc/modules") or "")
    for m in PEERMEM_MODULES:
        if m in mods or os.path.isdir(os.path.join("/sys/module", m)):
            facts["peermem"], facts["peermem_module"] = True, m
            break
    else:
        found = next((p for p in PEERMEM_PATHS if os.path.exists(p)), None)
        if found:  # MLNX_OFED's nv_peer_mem registers there (nv_mem), under another module name
            facts["peermem"] = True
            facts["peermem_module"] = "nvidia_peermem" if "nvidia_peermem" in found else "nv_peer_mem"
    nvidia_version = read_text(NVIDIA_VERSION)
    facts["gpu_driver_loaded"] = "nvidia" in mods or nvidia_version is not None
    facts["nvidia_open_module"] = parse_open_module(nvidia_version)

    master = params.get("master")
    if master:
        info = _resolve(str(master), ctx.remaining(10))
        facts["master"] = info
        if info["ip"]:
            r = _route(info["ip"], ctx, facts["interfaces"])
            facts["route_to_master"], facts["route_error"] = r["route"], r["error"]
            if facts["route_to_master"] is not None:
                facts["route_to_master"]["ip"] = info["ip"]
        else:
            facts["route_error"] = f"master {master} {info['error']}"
    return facts


# --- evaluation ------------------------------------------------------------------------------

def _port(p: Dict[str, Any]) -> str:
    return f"{p.get('device')}:{p.get('port')}"


def trusted_view(facts: Any) -> Tuple[Dict[str, Any], List[Finding]]:
    """The facts with every name that breaks validate's rules left out (and every field of the wrong type
    dropped), and one FAIL listing those names.

    The facts come from the host: a name like '$(touch x)' or one holding a newline must never reach a message
    unquoted, a fix, or the recommended environment (hostside.netinfo.trusted_interfaces, which this uses).
    """
    facts = facts if isinstance(facts, dict) else {}
    bad = validate.bad_interface_names(facts)
    findings: List[Finding] = []
    if bad:
        plural = "" if len(bad) == 1 else "s"
        shown = ", ".join(f"{what} {validate.quote(v)}" for what, v in bad[:8]) + (", ..." if len(bad) > 8 else "")
        findings.append(Finding(
            Status.FAIL, f"this host reports {len(bad)} name{plural} outside Linux's rules (expected 1-15 bytes of "
            f"[A-Za-z0-9_.:@-], not starting with '-'): {shown}; preflight leaves them out of every command and of "
            "the recommended environment",
            "ip -br link; rename with: ip link set dev OLD name NEW (or find out what on this host reports them)"))
    return trusted_interfaces(facts), findings


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    frac = float(limits(thresholds, NAME)["min_rate_fraction"])
    if not isinstance(facts, dict):
        return Outcome(Status.ERROR, f"the host reported interfaces facts of the wrong shape "
                       f"({type(facts).__name__}, expected an object)",
                       "rerun with -v; look at what runs as --python on the host")
    raw = facts
    facts, findings = trusted_view(facts)
    ifaces = facts.get("interfaces") or []
    ib = facts.get("ib") or []
    active = [p for p in ib if p.get("active")]
    findings.extend(_ib_port_findings(ib, active, frac))
    master = facts.get("master")
    route = facts.get("route_to_master")
    if master is not None:
        findings.extend(_route_findings(master, route, facts.get("route_error"), ifaces))

    phys = [i for i in ifaces if not i.get("virtual")]
    physical = ", ".join(_iface_summary(i) for i in phys) or "none"
    parts = [f"{len(ifaces)} interfaces ({physical} physical)"]
    if ib:
        ports = ", ".join(f"{_port(p)} {p.get('link_layer')} {p.get('rate_gbps') or 0:g} Gb/s" for p in active)
        parts.append(f"{len(active)}/{len(ib)} IB/RoCE ports active ({ports})")
    else:
        parts.append("no IB/RoCE devices")
    parts.append(f"{facts.get('peermem_module')} loaded" if facts.get("peermem")
                 else "nvidia_peermem not loaded")
    gdr = gdr_path(raw)
    findings.extend(_gdr_findings(gdr, raw, active))
    if gdr == "dmabuf":
        parts.append(f"GPUDirect RDMA through DMA-BUF (open kernel module, kernel {_shown_kernel(raw.get('kernel'))}; "
                     f"needs NCCL >= 2.13, see the versions check)")
    if route:
        to_ip = route.get("ip") or (master or {}).get("ip")
        parts.append(f"route to master {to_ip} via {route.get('dev')} (src {route.get('src')})")
    metrics = {k: raw.get(k) for k in ("interfaces", "ib", "peermem", "peermem_module", "route_to_master",
                                        "master")}
    metrics["gdr"] = gdr
    return combine(findings, "; ".join(parts), metrics)


def _iface_summary(i: Dict[str, Any]) -> str:
    """One physical interface as the PASS message shows it: name, IPv4 addresses, speed, MTU."""
    ipv4 = ",".join(i.get("ipv4") or []) or "no IPv4"
    speed = f" {int(i['speed_mbps'])} Mb/s" if i.get("speed_mbps") else ""  # whole Mb/s, a float truncated
    return f"{i['name']} {ipv4}{speed} MTU {i.get('mtu')}"


def _shown_kernel(release: Any) -> str:
    """The host-reported kernel release as a message may show it (quoted when it is not a plain release string)."""
    text = str(release)
    return text if re.fullmatch(r"[A-Za-z0-9_.+~-]{1,64}", text) else validate.quote(release)


def _gdr_findings(gdr: Optional[str], facts: Dict[str, Any], active: List[Dict[str, Any]]) -> List[Finding]:
    """A WARN on a GPU host with an active IB/RoCE port and no way to GPUDirect RDMA: no peer-memory module, and
    DMA-BUF ruled out (proprietary kernel module, or a kernel older than 5.12)."""
    if gdr != "none":
        return []
    kernel = _shown_kernel(facts.get("kernel"))
    if facts.get("nvidia_open_module") is True:
        why = f"kernel {kernel} is older than {'.'.join(map(str, DMABUF_KERNEL))}"
    elif facts.get("nvidia_open_module") is False:
        why = "the NVIDIA driver is the proprietary kernel module"
    else:
        why = "/proc/driver/nvidia/version is unreadable, so the open kernel module is not known to be loaded"
    ports = ", ".join(_port(p) for p in active)
    return [Finding(Status.WARN, f"GPU host with {len(active)} active IB/RoCE port{'s'[:len(active) != 1]} ({ports}) "
                                 f"but neither nvidia_peermem nor nv_peer_mem is loaded (expected one loaded): NCCL "
                                 f"cannot use GPUDirect RDMA and stages every inter-node transfer through host "
                                 f"memory; DMA-BUF is no alternative here ({why})", PEERMEM_FIX)]


def _ib_port_findings(ib: List[Dict[str, Any]], active: List[Dict[str, Any]], frac: float) -> List[Finding]:
    """FAIL for a port that is not ACTIVE / LinkUp; WARN for an active port slower than frac of the fastest of its
    link layer on this host, and for a RoCE port with no GID."""
    findings: List[Finding] = []
    hca_list = ",".join(_port(p) for p in active)
    for p in ib:
        if p.get("active"):
            continue
        fix = f"ibstat {p.get('device')}"
        if (p.get("link_layer") or "").lower() == "ethernet" and p.get("netdevs"):
            fix = f"ip link set {p['netdevs'][0]} up; ethtool {p['netdevs'][0]}"
        if active:
            fix += f"; export NCCL_IB_HCA=={hca_list}"
        else:
            fix += "; export NCCL_IB_DISABLE=1"
        hint = "; Polling = no link partner: check the cable and the switch port" if p.get("phys_state") == "Polling" \
            else ""
        meanwhile = (f"; until fixed, NCCL_IB_HCA=={hca_list} keeps NCCL on the active ports" if active
                     else "; until fixed, NCCL_IB_DISABLE=1 falls back to (slow) sockets")
        states = f"{p.get('state') or '?'} / {p.get('phys_state') or '?'}"
        findings.append(Finding(Status.FAIL, f"IB port {_port(p)} ({p.get('link_layer') or '?'}) is {states} "
                                             f"(expected ACTIVE / LinkUp){hint}{meanwhile}", fix))

    by_layer: Dict[str, List[Dict[str, Any]]] = {}
    for p in active:
        if p.get("rate_gbps") is not None:
            by_layer.setdefault(p.get("link_layer") or "?", []).append(p)
    for layer, ports in sorted(by_layer.items()):
        fastest = max(p["rate_gbps"] for p in ports)
        fast = [_port(p) for p in ports if p["rate_gbps"] == fastest]
        for p in ports:
            if p["rate_gbps"] < frac * fastest:
                findings.append(Finding(
                    Status.WARN, f"IB port {_port(p)} runs at {p['rate_gbps']:g} Gb/s ({p.get('rate') or ''}), below "
                    f"the {fastest:g} Gb/s of {', '.join(fast)} on this host ({layer}); check the negotiated "
                    "width/speed, the cable and the switch port",
                    f"ibstat {p.get('device')}"))

    for p in active:
        if (p.get("link_layer") or "").lower() == "ethernet" and not p.get("gids"):
            nd = (p.get("netdevs") or ["<netdev>"])[0]
            findings.append(Finding(Status.WARN, f"RoCE port {_port(p)} has an empty GID table (expected a RoCE v2 "
                                                 f"GID from an IP address on {nd}; NCCL_IB_GID_INDEX needs one)",
                                    f"ip addr add <IP>/<PREFIX> dev {nd} && cat /sys/class/infiniband/"
                                    f"{p.get('device')}/ports/{p.get('port')}/gids/*"))
    return findings


def _route_findings(master: Dict[str, Any], route: Optional[Dict[str, Any]], route_error: Optional[str],
                    ifaces: List[Dict[str, Any]]) -> List[Finding]:
    """Whether this host reaches the master: its name resolves, a route exists, and the route's interface is up."""
    if route is None:
        err = route_error or "unknown error"
        if master.get("error"):
            given = master.get("given")
            line = shlex.quote(f"<MASTER_IP> {given}")
            return [Finding(Status.FAIL, f"master {given}: {master.get('error') or err} (expected an address this "
                                         "host can reach)",
                            f"getent hosts {shlex.quote(str(given))} || echo {line} >> /etc/hosts")]
        if "unreachable" in err.lower() or "no route" in err.lower():
            return [Finding(Status.FAIL, f"no route from this host to master {master.get('given')} "
                                         f"({master.get('ip')}): {err} (expected a route on the cluster interface)",
                            "ip route show; ip -br addr")]
        return [Finding(Status.ERROR, f"could not find the route to master {master.get('given')}: {err}",
                        f"ip route get {shlex.quote(str(master.get('ip')))}")]
    dev = next((i for i in ifaces if i.get("name") == route.get("dev")), None)
    if dev and (dev.get("operstate") or "").lower() in ("down", "lowerlayerdown", "notpresent"):
        to_ip = shlex.quote(str(master.get("ip")))
        return [Finding(Status.FAIL, f"the route to master {master.get('given')} goes via {dev['name']}, which is "
                                     f"{dev.get('operstate')} (expected up)",
                        f"ip link set {dev['name']} up; ip route get {to_ip}")]
    return []


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="NICs (addresses, speed, MTU, virtual or not), IB/RoCE port state and rate, peermem, route to master",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
)
