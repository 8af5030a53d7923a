"""Inbound TCP between hosts on sampled high ports, and the master port: free on the master, reachable by all at
the job's master address (--master-addr, else the one DeepSpeed's launcher picks: the first of ``hostname -I`` on the
first host, deepspeed/launcher/runner.py:495-510).

Host side: ``listen`` binds random ports of ip_local_port_range (and the master port on the master), ``probe``
connects to (address, port) lists. The master-port holder is found in /proc/net/tcp{,6}, e.g.::

    sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
     0: 00000000:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 48213 1 ...
    (LISTEN = 0A on 0.0.0.0:29500, socket inode 48213 -> /proc/PID/fd/N -> socket:[48213] -> PID's cmdline)

DeepSpeed's master address: without ``--master_addr`` its launcher runs ``ssh FIRST_HOST hostname -I`` and takes
the first word (deepspeed/launcher/runner.py:495-515), e.g. ``172.17.0.1 10.0.0.11`` -> 172.17.0.1 (docker0):
the master listens on the master port (ours does), every other host connects to that address.

Thresholds: [ports] in ports.toml beside this module.
"""
from __future__ import annotations

import errno
import ipaddress
import math
import os
import random
import selectors
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..hostside import validate
from ..hostside.fixes import FIREWALL_CALL, firewall_fix
from ..hostside.outcome import Finding, Outcome, Status, combine, error, limits
from ..hostside.seams import CheckSpec, ClusterView, HostContext
from ..hostside.proc import read_text, sh
from ..hostside.mesh import REASONS, egress_blocked, short_list
from ..hostside.netinfo import host_subnets

NAME = "ports"

LISTEN_STATE = "0A"  # TCP_LISTEN in include/net/tcp_states.h, as /proc/net/tcp prints it
DEFAULT_EPHEMERAL = (32768, 60999)  # the kernel's default net.ipv4.ip_local_port_range
READY_TIMEOUT_S = 30.0
PRIMARY = "ssh"  # label of the network the coordinator reached the hosts on
DS_MASTER = "deepspeed master address"  # label of the probes to the address DeepSpeed's launcher gives the ranks


# --- pure parsers ----------------------------------------------------------------------------

def _hex_ip(text: str) -> str:
    """/proc/net/tcp's address: each 32-bit word in host (little-endian) order. '0100007F' -> 127.0.0.1."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket's IPv4 peer: print it as such
    return f"::ffff:{mapped}" if mapped else str(ip)


def parse_proc_net_tcp(text: str) -> List[Dict[str, Any]]:
    """Sockets of /proc/net/tcp or tcp6: [{"address", "port", "state", "uid", "inode"}] (header skipped)."""
    out = []
    for line in (text or "").splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or ":" not in fields[1]:
            continue
        addr, _, port = fields[1].rpartition(":")
        try:
            out.append({"address": _hex_ip(addr), "port": int(port, 16), "state": fields[3],
                        "uid": int(fields[7]), "inode": int(fields[9])})
        except ValueError:
            continue
    return out


def parse_port_range(text: Optional[str]) -> Tuple[int, int]:
    """net.ipv4.ip_local_port_range '32768\\t60999' -> (32768, 60999); the kernel default when unreadable."""
    try:
        lo, hi = (int(x) for x in (text or "").split()[:2])
    except ValueError:
        return DEFAULT_EPHEMERAL
    return (lo, hi) if 1024 <= lo < hi <= 65535 else DEFAULT_EPHEMERAL


def shared_subnets(iface_facts: Dict[str, Any], primary: Dict[str, str], limit: int) -> List[Dict[str, Any]]:
    """IPv4 subnets every host has an address on (besides the SSH network), at most ``limit``.

    iface_facts: {host: facts of the interfaces check}. Loopback, docker, bridges, down links, link-local and
    subnets where two hosts share one address (every host's docker0 is 172.17.0.1) are left out: NCCL skips
    them, or they are not cross-host networks. Returns [{"cidr": "198.18.1.0/24", "addresses": {host: "198.18.1.3"}}].
    """
    hosts = list(primary)
    if len(hosts) < 2 or any(not isinstance(iface_facts.get(h), dict) for h in hosts):
        return []
    per_host: Dict[str, Dict[str, str]] = {}
    for h in hosts:
        # The same candidate networks as iperf3 measures and NCCL may use: one definition for both checks.
        nets: Dict[str, str] = {}
        for network, _dev, address, _speed in host_subnets(iface_facts[h]):
            nets.setdefault(network, address)
        per_host[h] = nets
    common = set.intersection(*(set(n) for n in per_host.values()))
    out: List[Dict[str, Any]] = []
    for cidr in sorted(common, key=lambda c: ipaddress.ip_network(c)):
        addrs = {h: per_host[h][cidr] for h in hosts}
        if len(set(addrs.values())) < len(hosts):
            continue
        if all(addrs[h] == primary[h] for h in hosts):
            out.insert(0, {"cidr": cidr, "addresses": addrs, "primary": True})  # the SSH network's own subnet
            continue
        out.append({"cidr": cidr, "addresses": addrs})
    primary_net = [n for n in out if n.get("primary")]
    return primary_net + [n for n in out if not n.get("primary")][:max(0, int(limit))]


# --- host side -------------------------------------------------------------------------------

def _bind_on(port: int, addresses: Sequence[str]) -> List[socket.socket]:
    """Listen on port at each of addresses, or on every address when none are given; all or nothing.

    Binding the addresses the check probes (not the wildcard) keeps the test listeners off every other network of
    the host while they are open (issue 16: listeners bound to wildcard addresses)."""
    if not addresses:
        return [_bind(port)]
    socks: List[socket.socket] = []
    try:
        for addr in addresses:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            socks.append(socket.create_server((addr, port), family=family, backlog=128))
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def _bind(port: int) -> socket.socket:
    """Listen on every address, IPv4 and IPv6, with SO_REUSEADDR like torch's TCPStore (TIME_WAIT is no conflict)."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise
            # IPv6 disabled on the host: fall through to IPv4 only.
    return socket.create_server(("0.0.0.0", port), family=socket.AF_INET, backlog=128)


def _listening(port: int) -> List[Dict[str, Any]]:
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        found += [s for s in parse_proc_net_tcp(read_text(path, "") or "")
                  if s["port"] == port and s["state"] == LISTEN_STATE]
    return found


def _owners(inodes: Iterable[int], budget_s: float = 2.0) -> List[Dict[str, Any]]:
    """Processes holding these socket inodes (/proc/PID/fd), within a time budget; others' fds need root."""
    wanted = {f"socket:[{i}]" for i in inodes if i}
    found: List[Dict[str, Any]] = []
    if not wanted:
        return found
    end = time.monotonic() + budget_s
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if time.monotonic() > end:
            break
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in wanted:
                cmd = (read_text(f"/proc/{pid}/cmdline", "") or "").replace("\0", " ").strip()
                found.append({"pid": int(pid), "cmdline": cmd[:200]})
                break
    return found


def _claim_master_port(port: int, socks: List[socket.socket], addresses: Sequence[str] = ()) -> Dict[str, Any]:
    """Is the port free? A LISTEN entry in /proc (on any address) or a failing bind means torch's rendezvous cannot
    bind it."""
    info: Dict[str, Any] = {"port": port, "free": True, "listening": [], "holders": [], "error": None}
    held = _listening(port)
    if held:
        info["listening"] = [f"{s['address']}:{s['port']}" for s in held]
    try:
        mine = _bind_on(port, addresses)
    except OSError as exc:
        info["free"] = False
        info["error"] = f"bind: {exc.strerror or exc}"
        held = held or _listening(port)
    else:
        if held:
            for sock in mine:
                sock.close()
            info["free"] = False
        else:
            socks.extend(mine)
    if not info["free"]:
        info["holders"] = _owners(s["inode"] for s in held)
    return info


def _accept_pending(sock: socket.socket, accepted: Dict[int, int]) -> None:
    """Accept (and close) every connection waiting on a non-blocking listener."""
    port = sock.getsockname()[1]
    while True:
        try:
            conn, _ = sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        accepted[port] = accepted.get(port, 0) + 1
        conn.close()  # a completed handshake is all a probe needs


def _accept_loop(socks: Sequence[socket.socket], stop: threading.Event, accepted: Dict[int, int]) -> None:
    sel = selectors.DefaultSelector()
    try:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        while not stop.is_set():
            for key, _ in sel.select(0.2):
                _accept_pending(key.fileobj, accepted)  # type: ignore[arg-type]  # we registered sockets
        # Probes whose handshake completed in the kernel's backlog before the stop count too (and get closed).
        for s in socks:
            _accept_pending(s, accepted)
    except (OSError, ValueError):
        pass  # the sockets were closed under us: the main thread is cleaning up
    finally:
        sel.close()


def deepspeed_master_addr() -> Dict[str, Any]:
    """The master address DeepSpeed's launcher would pick for this (first) host: the first word of `hostname -I`
    (runner.py:495-510 runs `ssh FIRST_HOST hostname -I` and takes ``.split()[0]``); {"address", "all", "error"}."""
    res = sh(["hostname", "-I"], timeout=5)
    words = res.out.split() if res.ok else []
    error = None
    if not res.ok:
        said = (res.err or res.out).strip()[:200] or "no output"
        error = f"`hostname -I` failed (rc={res.rc}): {said}"
    elif not words:
        error = "`hostname -I` printed no address"
    return {"address": words[0] if words else None, "all": words[:16], "error": error}


def _bind_random(count: int, lo: int, hi: int, master_port: Any, addresses: List[str],
                 socks: List[socket.socket]) -> List[int]:
    """Up to ``count`` random free ports of lo..hi bound on addresses (their sockets added to socks), sorted."""
    ports: List[int] = []
    rng = random.SystemRandom()
    for _ in range(count * 20):
        if len(ports) >= count:
            break
        port = rng.randint(lo, hi)
        if port in ports or port == master_port:
            continue
        try:
            socks.extend(_bind_on(port, addresses))
        except OSError:
            continue  # taken: try another
        ports.append(port)
    ports.sort()
    return ports


def listen(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Listen on ``count`` random free ports of ip_local_port_range (NCCL binds port 0, so the kernel picks its
    ports from there) and on ``master_port`` if given; accept-and-close until stopped; always close them."""
    count = int(params.get("count", 3))
    master_port = params.get("master_port")
    lo, hi = parse_port_range(read_text("/proc/sys/net/ipv4/ip_local_port_range"))
    # Only the addresses the coordinator will probe; the wildcard when it gave none or one is not on this host
    # (e.g. an address behind NAT), so that a probe never fails for the listener's sake.
    # A name (ssh_config's HostName may be one) resolves where the prober is: bind everything then.
    wanted = list(params.get("addresses") or [])
    hostname_i = deepspeed_master_addr() if params.get("hostname_i") else None
    if hostname_i and hostname_i["address"]:
        wanted.append(hostname_i["address"])  # the other hosts probe it on the master port
    addresses = sorted({str(a) for a in wanted}) if all(validate.ip_address(a) for a in wanted) else []
    if addresses:
        try:
            for s in _bind_on(0, addresses):
                s.close()
        except OSError:
            addresses = []
    info: Dict[str, Any] = {"ports": [], "range": [lo, hi], "master_port": None, "accepted": {},
                            "bound": addresses or ["*"], "hostname_i": hostname_i}
    socks: List[socket.socket] = []
    stop = threading.Event()
    thread = None
    try:
        if master_port:
            info["master_port"] = _claim_master_port(int(master_port), socks, addresses)
        info["ports"] = _bind_random(count, lo, hi, master_port, addresses, socks)
        accepted: Dict[int, int] = {}
        thread = threading.Thread(target=_accept_loop, args=(socks, stop, accepted), daemon=True)
        thread.start()
        ctx.ready({"ports": info["ports"], "master_port": info["master_port"], "range": info["range"],
                   "hostname_i": hostname_i})
        stopped = ctx.wait_stop(max(0.5, ctx.deadline - time.monotonic() - 1.0))
        info["stopped_by"] = "coordinator" if stopped else "deadline"
        stop.set()
        thread.join(2.0)
        info["accepted"] = {str(k): v for k, v in accepted.items()}
        return info
    finally:
        stop.set()
        if thread is not None:
            thread.join(1.0)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass


def _connect(address: str, port: int, timeout: float) -> Dict[str, Any]:
    start = time.monotonic()

    def done(result: str, err: str = "") -> Dict[str, Any]:
        return {"result": result, "ms": round((time.monotonic() - start) * 1000, 2), "error": err}

    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return done("unresolved", str(exc.strerror or exc))
    family, stype, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, stype, proto)
    sock.settimeout(timeout)
    try:
        sock.connect(sockaddr)
        return done("ok")
    except socket.timeout:
        return done("timeout", f"no answer within {timeout:.1f}s")
    except ConnectionRefusedError:
        return done("refused", "connection refused")
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return done("unreachable", exc.strerror or str(exc))
        if exc.errno == errno.ETIMEDOUT:
            return done("timeout", exc.strerror or str(exc))
        return done("error", exc.strerror or str(exc))
    finally:
        sock.close()


def probe(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Connect to every [address, port] of ``targets`` with ``threads`` threads; one result per target, in order."""
    targets = [(str(a), int(p)) for a, p in params.get("targets", [])]
    timeout = float(params.get("connect_timeout", 3.0))
    end = min(ctx.deadline - 1.0, time.monotonic() + float(params.get("budget_s", 60.0)))
    results: List[Optional[Dict[str, Any]]] = [None] * len(targets)
    lock = threading.Lock()
    cursor = [0]

    def worker() -> None:
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(targets):
                return
            left = end - time.monotonic()
            if left < min(timeout, 0.5):
                results[i] = {"result": "skipped", "ms": 0.0, "error": "probe time budget used up"}
                continue
            results[i] = _connect(targets[i][0], targets[i][1], min(timeout, left))

    # Daemon threads: one stuck in getaddrinfo must not keep the agent alive past its deadline.
    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(max(1, min(int(params.get("threads", 64)), len(targets))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end + timeout - time.monotonic()))
    return {"results": [r or {"result": "error", "ms": 0.0, "error": "no answer from the probe thread"}
                        for r in results]}


# --- coordinator -----------------------------------------------------------------------------

def _parallel(fn: Callable[[Any], Any], items: Sequence[Any], limit: int, timeout: float) -> List[Any]:
    from ..hostside.proc import parallel_map
    return parallel_map(fn, list(items), limit, timeout)


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    from ..hostside.schedule import probe_targets

    lim = limits(cluster.thresholds, NAME)
    hosts = [h.name for h in cluster.hosts]
    master = cluster.master.name
    master_port = cluster.options.master_port
    addresses = {h: cluster.address(h) for h in hosts}
    facts: Dict[str, Any] = {
        "master": master, "master_port": master_port, "hosts": hosts, "addresses": addresses,
        "unreachable": [h.name for h in cluster.all_hosts if h.name not in addresses],
        "networks": [{"name": PRIMARY, "addresses": addresses}],
        "listeners": {}, "listener_errors": {}, "probes": [], "probe_errors": {}, "limits": lim,
    }
    iface = {h: (cluster.facts.get(h) or {}).get("interfaces") for h in hosts}
    _add_shared_subnets(facts, iface, addresses, int(lim["max_extra_subnets"]))

    given = cluster.options.master_addr
    facts["ds_master"] = {"address": given, "source": "--master-addr" if given else "hostname -I", "all": [],
                          "error": None, "probes": []}
    timeout_c = float(lim["connect_timeout_s"])
    max_probe = float(lim["max_probe_s"])
    # parallel_map runs `parallel` calls at a time: an overall deadline must grow with the number of batches.
    batches = math.ceil(len(hosts) / max(1, cluster.parallel))
    start_budget = 15.0 + 5.0 * batches
    services: Dict[str, Any] = {}
    try:
        service_timeout = start_budget + READY_TIMEOUT_S + max_probe + timeout_c + 60 * batches
        _start_listeners(cluster, facts, lim, services, start_budget, service_timeout)
        plan = _plan(facts, probe_targets(len(hosts), int(lim["mesh_limit"])))
        _plan_ds_master(facts, plan)
        if plan:
            _run_probes(cluster, facts, plan, int(lim["probe_threads"]), timeout_c, max_probe)
            _read_firewalls(cluster, facts, batches)
    finally:
        # Every listener is stopped whatever happened above; one that does not stop in time is killed.
        _stop_listeners(cluster, services, facts, batches)
    return facts


def _add_shared_subnets(facts: Dict[str, Any], iface: Dict[str, Any], addresses: Dict[str, str],
                        max_extra: int) -> None:
    """Name the primary network's subnet, and add each other subnet that the hosts share (up to `max_extra`) to
    facts["networks"], so that the listeners listen and the probes connect on those addresses too."""
    for net in shared_subnets(iface, addresses, max_extra):
        if net.get("primary"):
            facts["networks"][0]["cidr"] = net["cidr"]
        else:
            facts["networks"].append({"name": net["cidr"], "cidr": net["cidr"], "addresses": net["addresses"]})


def _start_listeners(cluster: ClusterView, facts: Dict[str, Any], lim: Dict[str, Any], services: Dict[str, Any],
                     start_budget: float, service_timeout: float) -> None:
    """Start a listener on every host (on each of its network addresses; the master's also on the master port and
    the job's master address), then wait for all of them: `services` gets every one started (for the caller to
    stop), facts["listeners"] what each ready one listens on, facts["listener_errors"] why the others are not."""
    hosts, master, master_port = facts["hosts"], facts["master"], facts["master_port"]
    given = facts["ds_master"]["address"]  # --master-addr, else None

    def start(h: str) -> None:
        addresses = {n["addresses"][h] for n in facts["networks"] if n["addresses"].get(h)}
        params: Dict[str, Any] = {"count": int(lim["sample_ports"]),
                                  "master_port": master_port if h == master else None}
        if h == master and len(hosts) > 1:
            # The job's master address: --master-addr, else the one DeepSpeed's launcher picks there.
            if given:
                addresses.add(given)
            else:
                params["hostname_i"] = True
        params["addresses"] = sorted(addresses)
        services[h] = cluster.start(h, NAME + ".listen", params, service_timeout)

    # Start every listener first, then wait for all of them against one deadline: they come up in parallel.
    started = _parallel(start, hosts, cluster.parallel, start_budget)
    ready_by = time.monotonic() + READY_TIMEOUT_S
    for h, res in zip(hosts, started):
        try:
            if isinstance(res, BaseException):
                raise res
            facts["listeners"][h] = services[h].wait_ready(max(0.1, ready_by - time.monotonic()))
        except Exception as exc:  # this host is no destination; the others still are
            facts["listener_errors"][h] = str(exc) or type(exc).__name__


def _run_probes(cluster: ClusterView, facts: Dict[str, Any], plan: Dict[str, List[Dict[str, Any]]], threads: int,
                timeout_c: float, max_probe: float) -> None:
    """Every source host connects to its planned targets at once (`threads` at a time there), within one budget:
    the results go to facts["probes"] (the master address's to facts["ds_master"]), a failed call to
    facts["probe_errors"]."""
    longest = max(len(t) for t in plan.values())
    budget = min(max_probe, math.ceil(longest / threads) * (timeout_c + 0.5) + 2.0)
    call_timeout = budget + timeout_c + 10

    def run(src: str) -> Any:
        return cluster.call(src, NAME + ".probe",
                            {"targets": [[t["address"], t["port"]] for t in plan[src]],
                             "connect_timeout": timeout_c, "threads": threads, "budget_s": budget},
                            call_timeout)

    sources = list(plan)
    answers = _parallel(run, sources, cluster.parallel,
                        (call_timeout + 15) * math.ceil(len(sources) / max(1, cluster.parallel)))
    for src, ans in zip(sources, answers):
        if not isinstance(ans, dict):
            facts["probe_errors"][src] = str(ans) or type(ans).__name__
            continue
        for t, r in zip(plan[src], ans.get("results", [])):
            # The master address probes are the ds_master verdict's alone (not a network's).
            (facts["ds_master"]["probes"] if t["network"] == DS_MASTER else facts["probes"]).append(
                dict(t, src=src, **r))


def _read_firewalls(cluster: ClusterView, facts: Dict[str, Any], batches: int) -> None:
    """facts["firewalls"][host]: the firewall of each host that some probes could not reach (its fix's commands
    come from it), or {"error": why} when it could not be read."""
    blocked: Dict[str, set] = {}
    for p in facts["probes"] + facts["ds_master"]["probes"]:
        if p["result"] not in ("ok", "skipped"):
            blocked.setdefault(p["dst"], set()).add(p["address"])
    if not blocked:
        return
    names = sorted(blocked)
    # What filters inbound TCP there (firewalld, ufw, the nft chains on the input hook that drop, iptables): read
    # only on a host some probes could not reach, so that its fix names the tool and chain it really runs.
    answers = _parallel(lambda h: cluster.call(h, FIREWALL_CALL, {"addresses": sorted(blocked[h])}, 30.0),
                        names, cluster.parallel, 40.0 * batches + 10)
    facts["firewalls"] = {h: ans if isinstance(ans, dict) else {"error": str(ans) or type(ans).__name__}
                          for h, ans in zip(names, answers)}


def _stop_listeners(cluster: ClusterView, services: Dict[str, Any], facts: Dict[str, Any], batches: int) -> None:
    """Stop every listener started, in parallel, and record the connections each accepted (the evidence of which
    probes arrived); one that does not stop in time is killed."""
    names = list(services)
    stopped = _parallel(lambda h: services[h].stop(10.0), names, cluster.parallel, 15.0 * batches + 10)
    for h, res in zip(names, stopped):
        if isinstance(res, dict):
            if h in facts["listeners"]:
                facts["listeners"][h]["accepted"] = res.get("accepted", {})
        else:
            services[h].kill()


def _plan_ds_master(facts: Dict[str, Any], plan: Dict[str, List[Dict[str, Any]]]) -> None:
    """Every other host connects to the job's master address on the master port, as its ranks will (TCPStore):
    DeepSpeed's own pick (the master's `hostname -I`, read by its listener) or --master-addr. Nothing to add
    when it is the master's SSH address (probed already) or the master port is not ours to listen on."""
    ds, master, hosts = facts["ds_master"], facts["master"], facts["hosts"]
    info = facts["listeners"].get(master) or {}
    picked = info.get("hostname_i") or {}
    if picked:
        ds.update(address=picked.get("address"), all=picked.get("all") or [], error=picked.get("error"))
    mp = info.get("master_port") or {}
    if len(hosts) < 2 or not ds["address"] or not mp.get("free"):
        return
    ds["ssh_address"] = facts["addresses"].get(master)
    if ds["address"] == ds["ssh_address"]:
        return
    for src in hosts:
        if src != master:
            plan.setdefault(src, []).append({"dst": master, "address": ds["address"], "port": mp["port"],
                                             "network": DS_MASTER})


def _plan(facts: Dict[str, Any], pairs: Sequence[Tuple[int, int]]) -> Dict[str, List[Dict[str, Any]]]:
    """{source: [{"dst", "address", "port", "network"}]}: every sampled port (and a free master port) on the
    SSH network; on each extra shared subnet the first sampled port (and the master port) keeps it bounded."""
    hosts, listeners, master = facts["hosts"], facts["listeners"], facts["master"]
    plan: Dict[str, List[Dict[str, Any]]] = {}
    for a, b in pairs:
        src, dst = hosts[a], hosts[b]
        info = listeners.get(dst)
        if not info:
            continue
        ports = list(info.get("ports") or [])
        mp = info.get("master_port") or {}
        extra = [mp["port"]] if dst == master and mp.get("free") else []
        for net in facts["networks"]:
            address = net["addresses"].get(dst)
            if not address:
                continue
            chosen = ports + extra if net["name"] == PRIMARY else ports[:1] + extra
            plan.setdefault(src, []).extend({"dst": dst, "address": address, "port": p, "network": net["name"]}
                                            for p in chosen)
    return plan


# --- evaluation ------------------------------------------------------------------------------

def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    hosts: List[str] = facts.get("hosts", [])
    egress = egress_blocked(facts.get("probes", []))
    out: Dict[str, Outcome] = {}
    for h in facts.get("unreachable", []):
        out[h] = error("not run: the host is unreachable (see its ssh result)")
    for h in hosts:
        out[h] = _host_outcome(h, facts, thresholds, egress)
    # Each host pair's round trip from the same handshakes (hostside/latency.py), a WARN above rtt_warn_ms.
    from ..hostside import latency
    rtt, warn_ms = latency.pair_rtt(facts.get("probes", []), PRIMARY), float(limits(thresholds, NAME)["rtt_warn_ms"])
    for h in hosts:
        out[h] = latency.annotate(out[h], *latency.judge(h, rtt, warn_ms, facts.get("addresses")))
    return out


def _host_outcome(h: str, facts: Dict[str, Any], thresholds: Dict[str, Any],
                  egress: Dict[str, List[str]]) -> Outcome:
    """One host's row: its listener and master port, its probes out (egress) and the probes to it (inbound)."""
    hosts: List[str] = facts.get("hosts", [])
    master = facts.get("master")
    probes: List[Dict[str, Any]] = facts.get("probes", [])
    findings: List[Finding] = []
    info = facts.get("listeners", {}).get(h) or {}
    metrics: Dict[str, Any] = {"listen_ports": info.get("ports", [])}
    if h in facts.get("listener_errors", {}):
        findings.append(Finding(Status.ERROR, f"could not start the test listener on {h}: "
                                f"{facts['listener_errors'][h]}", "rerun with -v; check the host"))
    elif len(info.get("ports") or []) < int((facts.get("limits") or limits(thresholds, NAME))["sample_ports"]):
        bound = len(info.get("ports") or [])
        findings.append(Finding(Status.ERROR, f"could bind only {bound} test ports on {h} in {info.get('range')}",
                                "check net.ipv4.ip_local_port_range and ports in use (ss -ltn)"))
    mp = info.get("master_port")
    if h == master and mp:
        metrics["master_port"] = mp["port"]
        metrics["master_port_free"] = bool(mp.get("free"))
        if not mp.get("free"):
            findings.append(_master_port_taken(h, mp))
    if h == master and len(hosts) > 1 and facts.get("ds_master"):
        metrics["deepspeed_master_addr"] = facts["ds_master"].get("address")
        findings.extend(_ds_master_findings(h, facts))
    if h in facts.get("probe_errors", {}):
        findings.append(Finding(Status.ERROR, f"could not run the probes from {h}: {facts['probe_errors'][h]}",
                                "rerun with -v; check the host"))
    if h in egress:
        findings.append(Finding(
            Status.FAIL, f"outbound TCP from {h} to high ports blocked: none of {short_list(egress[h])} reachable "
            "from it, though other hosts reach them; NCCL will hang at init",
            f"check the OUTPUT chain / egress policy on {h} (nft list ruleset; iptables -S OUTPUT)"))
    inbound = [p for p in probes if p["dst"] == h and p["src"] not in egress and p["result"] != "skipped"]
    findings.extend(_inbound_findings(h, inbound, facts))
    ok = [p for p in inbound if p["result"] == "ok"]
    outbound = [p for p in probes if p["src"] == h]
    ms = sorted(p["ms"] for p in ok)
    metrics.update({"probes_in": len(inbound), "probes_in_ok": len(ok),
                    "probes_out": len(outbound), "probes_out_ok": sum(p["result"] == "ok" for p in outbound),
                    "sources": sorted({p["src"] for p in inbound}),
                    "networks": sorted({p["network"] for p in inbound}),
                    "connect_ms_max": ms[-1] if ms else None,
                    "connect_ms_median": ms[len(ms) // 2] if ms else None})
    skipped = sum(p["result"] == "skipped" for p in probes if p["dst"] == h)
    if skipped:
        findings.append(Finding(Status.ERROR, f"{skipped} probes to {h} were not run within the time budget",
                                "raise [ports] max_probe_s or probe_threads"))
    if len(hosts) == 1:
        ok_msg = "single host: no cross-host traffic to test"
    else:
        listening = ", ".join(map(str, info.get("ports", [])))
        slowest = ms[-1] if ms else 0.0
        ok_msg = (f"inbound TCP open on ports {listening} from {len(metrics['sources'])} hosts "
                  f"({len(ok)}/{len(inbound)} connects ok, max {slowest:.1f} ms)")
    if h == master and mp and mp.get("free"):
        ok_msg = f"master port {mp['port']} free; {ok_msg}"
    return combine(findings, ok_msg, metrics)


def _working_master_address(facts: Dict[str, Any]) -> Optional[str]:
    """An address of the master every other host reached on the master port: its SSH address first."""
    master, port = facts.get("master"), facts.get("master_port")
    others = {h for h in facts.get("hosts", []) if h != master}
    by_addr: Dict[str, set] = {}
    for p in facts.get("probes", []):
        if p["dst"] == master and p["port"] == port and p["result"] == "ok":
            by_addr.setdefault(p["address"], set()).add(p["src"])
    ssh = (facts.get("addresses") or {}).get(master)
    for addr in [ssh] + sorted(a for a in by_addr if a != ssh):
        if addr and others and by_addr.get(addr, set()) >= others:
            return addr
    return None


def _ds_master_findings(h: str, facts: Dict[str, Any]) -> List[Finding]:
    """FAIL when the ranks could not reach the job's master address on the master port: the address DeepSpeed's
    launcher picks (first of `hostname -I` on the first host) or --master-addr."""
    ds = facts["ds_master"]
    port = facts.get("master_port")
    works = _working_master_address(facts)
    use = (f"deepspeed --master_addr {works} (an address of {h} every host reached on port {port}), and preflight "
           f"run --master-addr {works} to check it" if works else
           f"deepspeed --master_addr ADDR with an address of {h} that every host reaches on port {port} (preflight "
           "run --master-addr ADDR checks it)")
    if ds.get("error") and ds.get("source") == "hostname -I":
        return [Finding(Status.FAIL, f"DeepSpeed's launcher cannot pick a master address on {h}: {ds['error']} (it "
                        f"runs `ssh {h} hostname -I` when --master_addr is not given, runner.py:495-510)", use)]
    failed = [p for p in ds.get("probes") or [] if p["result"] not in ("ok", "skipped")]
    if not failed:
        return []
    srcs = sorted({p["src"] for p in failed})
    result = sorted({p["result"] for p in failed})[0]
    if ds.get("source") == "hostname -I":
        printed = " ".join(ds.get("all") or []) or ds["address"]
        origin = (f"DeepSpeed's launcher gives the ranks {ds['address']} as the master address: the first of "
                  f"`hostname -I` on {h} ({printed}; deepspeed/launcher/runner.py:495-510, without --master_addr)")
    else:
        origin = f"the job's master address is {ds['address']} (--master-addr)"
    why = REASONS.get(result, result)
    return [Finding(Status.FAIL, f"{origin}, but {short_list(srcs)} cannot reach {ds['address']}:{port} ({why}): "
                    "their ranks never get through init_process_group (they retry torch.distributed's TCPStore on "
                    "rank 0 until its timeout)", use)]


def _master_port_taken(h: str, mp: Dict[str, Any]) -> Finding:
    holders = mp.get("holders", [])
    who = "; ".join(f"pid {o['pid']} ({o['cmdline'] or '?'})" for o in holders)
    where = ", ".join(mp.get("listening") or []) or mp.get("error") or "bind failed"
    held_by = ", held by " + who if who else ""
    stop = (", ".join(f"pid {o['pid']}" for o in holders)
            or f"the process listening on it (find it with: ss -ltnp sport = :{mp['port']})")
    return Finding(
        Status.FAIL,
        f"master port {mp['port']} is already in use on {h} ({where}){held_by}: torch.distributed's TCPStore on "
        "rank 0 cannot bind it and the job fails at init",
        f"pick another port: deepspeed --master_port PORT (and preflight run --master-port PORT), or stop {stop}")


def _inbound_findings(h: str, inbound: List[Dict[str, Any]], facts: Dict[str, Any]) -> List[Finding]:
    """One finding per (network, address, result, sources) of the failed probes to h, naming its ports: FAIL on the
    SSH network, WARN on an extra one; the fix opens the firewall to those sources."""
    master, mport = facts.get("master"), facts.get("master_port")
    nets = {n["name"]: n for n in facts.get("networks", [])}
    groups: Dict[Tuple[str, str, str, Tuple[str, ...]], List[int]] = {}
    failed_by_key: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
    for p in inbound:
        if p["result"] != "ok":
            failed_by_key.setdefault((p["network"], p["address"], p["port"]), []).append(p)
    for (net, addr, port), fails in failed_by_key.items():
        result = sorted({f["result"] for f in fails})[0]
        key = (net, addr, result, tuple(sorted({f["src"] for f in fails})))
        groups.setdefault(key, []).append(port)
    findings: List[Finding] = []
    for (net, addr, result, srcs), ports in sorted(groups.items()):
        ports = sorted(set(ports))
        label = ", ".join((f"{p} (master port)" if h == master and p == mport else str(p)) for p in ports)
        where = "" if net == PRIMARY else f" on network {net}"
        primary = net == PRIMARY
        consequence = ("torch.distributed rendezvous will hang" if ports == [mport] and h == master
                       else "NCCL will hang at init" if primary
                       else "NCCL hangs if it picks this network")
        cidr = (nets.get(net) or {}).get("cidr")
        src_addrs = [(nets.get(net) or {}).get("addresses", {}).get(s) for s in srcs]
        src_spec = [cidr] if cidr else [a for a in src_addrs if a] if all(src_addrs) else []
        # NCCL's ports are ephemeral: open the whole unprivileged range, not just the ports we sampled. The
        # commands are for the firewall the host runs, in the chain that drops (hostside/fixes.py).
        fix = firewall_fix(h, (facts.get("firewalls") or {}).get(h), src_spec,
                           str(mport) if ports == [mport] else "1024-65535")
        if not primary:
            prose, sep, commands = fix.partition("\n")  # the alternative goes in the prose: never on a command line
            fix = prose.rstrip(":") + " (or pin NCCL to the network that works: NCCL_SOCKET_IFNAME set to the SSH " \
                "network's interface)" + (":" + sep + commands if sep else "")
        findings.append(Finding(
            Status.FAIL if primary else Status.WARN,
            f"inbound TCP to {h}:{label} ({addr}){where} blocked from {short_list(srcs)} "
            f"({REASONS.get(result, result)}): {consequence}", fix))
    return findings


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="master port free on the master and reachable, also at the master address DeepSpeed's launcher "
                "picks (hostname -I); inbound TCP on sampled high ports between hosts",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    reads=("interfaces",),  # the subnets every host shares, probed besides the SSH network
    # Reachability, not speed: quiet. Its load is a listener and a few short connections per host (the full mesh up
    # to mesh_limit hosts, O(1) probes per host above it: hostside/schedule.probe_targets), a few ms of one core and
    # no bandwidth: it loads nothing a measuring check would see, so compute measures beside it (runner.Schedule).
    quiet=True,
    loads=(),
)
