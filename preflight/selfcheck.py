"""The coordinator checks itself: before it connects, this machine's limits against what the run will hold; after
the connects, a failure whose cause is this machine's (not the hosts') is named once, with how many hosts it hit.

Three limits of this machine are compared with the run: the kernel's neighbour table (``gc_thresh3``, the most
entries it holds; one per on-link host and one per gateway), the open files of this process (RLIMIT_NOFILE, about
three descriptors per host) and the ephemeral ports (``ip_local_port_range``: how many connections may go to one
address and port at once). What it reads, as samples::

    /proc/sys/net/ipv4/neigh/default/gc_thresh3     1024
    /proc/sys/net/ipv4/ip_local_port_range          32768	60999
    /proc/net/stat/arp_cache                        entries  ... table_fulls      (hex, one row per CPU)
                                                    00000011 ... 00000000
    ip -j -force -batch - ("route get ADDRESS" per host)
        [{"dst":"198.18.0.1","dev":"br0","prefsrc":"198.18.0.254","flags":[],"uid":0,"cache":[]}]
        [{"dst":"10.1.2.3","gateway":"192.0.2.1","dev":"eth0",...}]

A finding is a WARN of the report's ``coordinator`` row (host ``*``), printed before the first connect::

    this machine's neighbour table holds at most 1024 entries (net.ipv4.neigh.default.gc_thresh3) and this run
    needs 1001 (1000 hosts on-link, 1 gateway): ...; fix: sudo sysctl -w net.ipv4.neigh.default.gc_thresh3=2048

The neighbour table is the kernel's, shared by every network namespace of the machine; inside a container's
namespace its settings cannot be read, and that part of the check is left out, never guessed.
"""
from __future__ import annotations

import errno
import ipaddress
import json
import os
import resource
import shutil
import socket
import subprocess
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from preflight.hostside.proc import parallel_map
from preflight.transport import SSHTransport, Transport, TransportError

# The report's name for the results about this machine itself (not a check of the registry: nothing to select).
COORDINATOR = "coordinator"
# Descriptors the coordinator holds per host while connected (measured: a direct SSH host holds its socket and
# the agent channel's wake-up pipe, 3; through a jump host or a ProxyCommand, one or two more), and on top of them
# for the run itself (its files, threads' pipes, a ProxyCommand's spare).
FDS_DIRECT = 3
FDS_INDIRECT = 5
FDS_SPARE = 32
# When the limit is below the run's and connects are admitted one share at a time (Admission): what the run keeps
# back for itself once the hosts are connected (its reports, the history file, a cluster check's extra channel).
FDS_RESERVE = 8
# Resolving the hosts' names before the connects: at most this long in all, so a slow DNS costs the check, not the
# run (a name not resolved by then is left out of the neighbour and port counts).
RESOLVE_S = 5.0
RESOLVE_PARALLEL = 32
# The neighbour table also holds the gateways' and the other programs' entries: a run that needs more than all but
# this share of it is warned about.
NEIGH_RESERVE = 1 / 16
# The kernel's default ephemeral range (28,232 ports), suggested when it suffices.
DEFAULT_PORTS = (32768, 60999)
FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}


def _sysctl(family: int) -> str:
    return f"net.ipv{family}.neigh.default.gc_thresh3"


@dataclass
class Finding:
    """One limit of this machine that the run would exceed: ``kind`` is "neighbours", "files" or "ports"."""

    kind: str
    message: str
    fix: str
    metrics: Dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.message}; fix: {self.fix}"


@dataclass
class LocalCause:
    """A cause of failed connects that is this machine's: every host it hit gets its message and fix."""

    kind: str
    hosts: List[str]
    message: str
    fix: str


class Kernel:
    """This machine as the self-check reads it. Each reader returns None where it cannot tell (a container's network
    namespace shows no neighbour table settings nor statistics), and that part is left out."""

    proc = Path("/proc")

    def _read(self, path: str) -> Optional[str]:
        try:
            return (self.proc / path).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def gc_thresh3(self, family: int) -> Optional[int]:
        text = self._read(f"sys/net/ipv{family}/neigh/default/gc_thresh3")
        try:
            return int(text.strip()) if text else None
        except ValueError:
            return None

    def table_fulls(self, family: int) -> Optional[int]:
        """How often the kernel refused a new neighbour entry because its table was full (since boot)."""
        text = self._read("net/stat/arp_cache" if family == 4 else "net/stat/ndisc_cache")
        lines = (text or "").split("\n")
        header = lines[0].split()
        if "table_fulls" not in header:
            return None
        column = header.index("table_fulls")
        total = 0
        for line in lines[1:]:  # one row per CPU
            cells = line.split()
            if len(cells) > column:
                try:
                    total += int(cells[column], 16)
                except ValueError:
                    return None
        return total

    def port_range(self) -> Optional[Tuple[int, int]]:
        text = self._read("sys/net/ipv4/ip_local_port_range")
        try:
            low, high = (int(v) for v in (text or "").split())
        except ValueError:
            return None
        return low, high

    def nofile(self) -> Tuple[int, int]:
        """(soft, hard) RLIMIT_NOFILE of this process; unlimited reads as a very large number."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        big = 2**31
        return (big if soft == resource.RLIM_INFINITY else soft), (big if hard == resource.RLIM_INFINITY else hard)

    def open_files(self) -> int:
        try:
            return len(os.listdir(self.proc / "self" / "fd"))
        except OSError:
            return 16

    def routes(self, addresses: Sequence[str]) -> Optional[Dict[str, Dict[str, Any]]]:
        """{address: the kernel's route to it (``ip -j route get``)}, all in one ``ip -batch``; None without ip."""
        ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None)
        if not addresses:
            return {}
        if ip is None:
            return None
        commands = "".join(f"route get {a}\n" for a in addresses)
        try:
            proc = subprocess.run([ip, "-j", "-force", "-batch", "-"], input=commands, capture_output=True,
                                  text=True, timeout=RESOLVE_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        found: Dict[str, Dict[str, Any]] = {}
        text, at, decoder = proc.stdout, 0, json.JSONDecoder()
        while at < len(text):  # one JSON array per command, one after the other
            while at < len(text) and text[at].isspace():
                at += 1
            if at >= len(text):
                break
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                break
            for route in value if isinstance(value, list) else []:
                if isinstance(route, dict) and isinstance(route.get("dst"), str):
                    found[route["dst"]] = route
        return found


@dataclass
class _Peer:
    """The TCP connection this machine opens for a host: to its first hop (itself, or its first jump host)."""

    host: str
    name: str  # the first hop's HostName
    port: int
    key: Tuple[Any, ...]  # hosts behind one jump host share its connection
    direct: bool
    proxy: bool  # a ProxyCommand makes the connection (its address is not ours to see)
    address: Optional[str] = None
    family: int = 4


def _fds(peer: _Peer) -> int:
    """The descriptors one host's connection holds: FDS_DIRECT, or FDS_INDIRECT through a jump host or a
    ProxyCommand (their own socket or pipes)."""
    return FDS_DIRECT if peer.direct and not peer.proxy else FDS_INDIRECT


class SelfCheck:
    """The run's connections, as this machine will hold them, against its limits (``before``), and the local causes
    of failed connects (``after_connect``)."""

    def __init__(self, transports: Sequence[Transport], kernel: Optional[Kernel] = None):
        self.kernel = kernel or Kernel()
        self.total = len(transports)
        self.ssh = [t for t in transports if isinstance(t, SSHTransport)]
        self.peers: List[_Peer] = []
        self.on_link: Dict[int, Set[str]] = {4: set(), 6: set()}
        self.gateways: Dict[int, Set[str]] = {4: set(), 6: set()}
        self.routes_known = False
        self._fulls: Dict[int, Optional[int]] = {}

    # ------------------------------------------------------------------------------------------ before
    def before(self) -> List[Finding]:
        """The limits this run would exceed, each with its fix; reads the table overflow counters for after_connect."""
        if not self.ssh:
            return []
        self._plan()
        self._fulls = {family: self.kernel.table_fulls(family) for family in (4, 6)}
        return [f for f in (self._neighbours(4), self._neighbours(6), self._files(), self._ports()) if f]

    def _plan(self) -> None:
        peers: List[_Peer] = []
        for t in self.ssh:
            try:
                hops = t.route()
            except TransportError:
                continue  # the connect says what is wrong with the config
            first = hops[0]
            jumped = len(hops) > 1
            key = ("jump", tuple(h.address for h in hops[:-1])) if jumped else ("host", t.name)
            peers.append(_Peer(t.name, first.hostname, first.port, key, not jumped, first.command is not None))
        self.peers = peers
        names = sorted({p.name for p in peers if not p.proxy})
        literal = [n for n in names if _is_address(n)]
        lookups = [n for n in names if not _is_address(n)]  # a thread each only for names DNS must answer
        resolved: Dict[str, Any] = {n: _resolve(n) for n in literal}
        resolved.update(zip(lookups, parallel_map(_resolve, lookups, RESOLVE_PARALLEL, RESOLVE_S)))
        for p in peers:
            got = resolved.get(p.name)
            if isinstance(got, tuple):
                p.address, p.family = got
        addresses = sorted({p.address for p in peers if p.address})
        routes = self.kernel.routes(addresses)
        if routes is None:
            return
        self.routes_known = True
        for p in peers:
            route = routes.get(p.address or "")
            if route is None:
                continue
            if route.get("type") in ("local", "unreachable", "blackhole", "prohibit", "throw"):
                continue  # this machine itself, or no route: no neighbour entry
            if route.get("gateway"):
                self.gateways[p.family].add(str(route["gateway"]))
            else:
                self.on_link[p.family].add(str(p.address))

    def needed(self, family: int) -> int:
        return len(self.on_link[family]) + len(self.gateways[family])

    def _neighbours(self, family: int) -> Optional[Finding]:
        limit = self.kernel.gc_thresh3(family)
        needed = self.needed(family)
        if limit is None or not self.routes_known or needed <= limit * (1 - NEIGH_RESERVE):
            return None
        hosts, gateways = len(self.on_link[family]), len(self.gateways[family])
        return Finding(
            "neighbours",
            f"this machine's neighbour table holds at most {limit} entries ({_sysctl(family)}) and this run needs "
            f"{needed} ({hosts} host{'s' if hosts != 1 else ''} on-link, {gateways} gateway"
            f"{'s' if gateways != 1 else ''}) besides the machine's own: past it the kernel drops new connections' "
            "packets (\"neighbour table overflow\") and those hosts look unreachable",
            self.neighbour_fix(family), {"gc_thresh3": limit, "needed": needed, "family": family})

    def neighbour_fix(self, family: int) -> str:
        return f"sudo sysctl -w {_sysctl(family)}={_table_size(self.needed(family))}"

    def admission(self) -> Optional["Admission"]:
        """Connects admitted by descriptors when this process's open-file limit is below what the run holds; None
        (every connect at once) when it is not."""
        if not self.ssh:
            return None
        soft, _ = self.kernel.nofile()
        open_now = self.kernel.open_files()
        if self.fds_needed(open_now) <= soft:
            return None
        cost = {p.host: _fds(p) for p in self.peers}
        return Admission(soft, soft - open_now - FDS_RESERVE, lambda host: cost.get(host, FDS_DIRECT))

    def fds_needed(self, open_now: Optional[int] = None) -> int:
        """The descriptors the run holds once every host is connected: those open now, each host's, a spare."""
        open_now = self.kernel.open_files() if open_now is None else open_now
        per_host = sum(_fds(p) for p in self.peers)
        per_host += (len(self.ssh) - len(self.peers)) * FDS_DIRECT  # hosts whose route did not resolve
        return open_now + per_host + FDS_SPARE

    def _files(self) -> Optional[Finding]:
        soft, hard = self.kernel.nofile()
        needed = self.fds_needed()
        if needed <= soft:
            return None
        return Finding(
            "files",
            f"this process may open {soft} files (RLIMIT_NOFILE; hard limit {hard}) and a run over {len(self.ssh)} "
            f"hosts holds about {needed} (about {FDS_DIRECT} per host): past it connects fail with \"Too many open "
            "files\"", self.files_fix(), {"nofile": soft, "nofile_hard": hard, "needed": needed})

    def files_fix(self) -> str:
        soft, hard = self.kernel.nofile()
        want = _round_up(max(self.fds_needed(), soft + 1), 1024)
        above = f" (above the hard limit {hard}: as root, or a nofile line in /etc/security/limits.conf)" \
            if want > hard else ""
        return f"ulimit -n {want} in the shell that runs preflight{above}"

    def connections_per_peer(self) -> Counter:
        """{(address, port): connections this machine opens to it at once}: ports are taken per destination."""
        seen = {p.key: p for p in self.peers if p.address and not p.proxy}
        return Counter((p.address, p.port) for p in seen.values())

    def _ports(self) -> Optional[Finding]:
        ports = self.kernel.port_range()
        counts = self.connections_per_peer()
        if ports is None or not counts:
            return None
        (address, port), most = counts.most_common(1)[0]
        size = ports[1] - ports[0] + 1
        if most <= size:
            return None
        where = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        return Finding(
            "ports",
            f"this machine's ephemeral ports (net.ipv4.ip_local_port_range {ports[0]}-{ports[1]}) allow {size} "
            f"connections to one address and port at once, and this run opens {most} to {where} (hosts that are one "
            "address): past it connects fail with \"Cannot assign requested address\"",
            self.ports_fix(most), {"port_range": list(ports), "most_per_destination": most})

    def ports_fix(self, most: Optional[int] = None) -> str:
        most = most if most is not None else max(self.connections_per_peer().values(), default=1)
        low, high = DEFAULT_PORTS if most * 2 <= DEFAULT_PORTS[1] - DEFAULT_PORTS[0] + 1 else (1024, 65535)
        return f'sudo sysctl -w net.ipv4.ip_local_port_range="{low} {high}"'

    # ------------------------------------------------------------------------------------------ after
    def after_connect(self, failed: Dict[str, str]) -> List[LocalCause]:
        """The local causes among failed connects ({host: its error}): each names how many hosts it hit, and takes
        the hosts whose error it explains; the others keep their own."""
        if not failed:
            return []
        grew = {}
        for family, before in self._fulls.items():
            after = self.kernel.table_fulls(family) if before is not None else None
            grew[family] = (after - before) if after is not None and before is not None else 0
        peers = {p.host: p for p in self.peers}
        by_kind: Dict[str, List[str]] = {}
        for host, error in failed.items():
            kind = local_kind(error)
            peer = peers.get(host)
            if kind is None and peer is not None and grew.get(peer.family, 0) > 0 and _network_failure(error) \
                    and (peer.address in self.on_link[peer.family] or not self.routes_known):
                kind = "neighbours"  # the kernel refused neighbour entries while these connects went unanswered
            if kind is not None:
                by_kind.setdefault(kind, []).append(host)
        out = []
        for kind, hosts in by_kind.items():
            hit = f"{len(hosts)} of {self.total} hosts could not be connected"
            if kind == "files":
                soft, _ = self.kernel.nofile()
                out.append(LocalCause(kind, hosts, f"this machine ran out of open files (RLIMIT_NOFILE {soft}, \"Too "
                                      f"many open files\"): {hit}; the hosts may be fine", self.files_fix()))
            elif kind == "ports":
                ports = self.kernel.port_range()
                within = f" (net.ipv4.ip_local_port_range {ports[0]}-{ports[1]})" if ports else ""
                out.append(LocalCause(kind, hosts, f"this machine had no free local port{within} for the connection "
                                      f"(\"Cannot assign requested address\"): {hit}; the hosts may be fine",
                                      self.ports_fix()))
            else:
                family = peers[hosts[0]].family if hosts[0] in peers else 4
                limit = self.kernel.gc_thresh3(family)
                size = (f" ({_sysctl(family)} = {limit}; this run needs {self.needed(family)} entries)"
                        if limit is not None else "")
                refused = f", and the kernel refused {grew[family]} new entries" if grew.get(family) else ""
                out.append(LocalCause(kind, hosts, f"this machine's neighbour table overflowed{size}{refused}: {hit}; "
                                      "the hosts may be fine", self.neighbour_fix(family)))
        return out


class Admission:
    """Connects admitted while this process's descriptors last. At the open-file limit, connects that all start at
    once starve each other: each holds its socket while its handshake waits, and the files and pipes the handshakes
    need next are gone (measured: behind slow sshds, 20 of 20 hosts failed at RLIMIT_NOFILE 40, where 8 fit one by
    one). A host whose share is not free waits for a connect in flight; a failed one gives its share back. Once
    none is in flight, the hosts still waiting are not connected, with EMFILE's words, so that after_connect names
    them under this machine's one cause."""

    def __init__(self, soft: int, descriptors: int, cost: Callable[[str], int]):
        self.soft = soft
        self.free = descriptors
        self.cost = cost
        self.in_flight = 0
        self._cond = threading.Condition()

    def take(self, host: str, timeout: float) -> bool:
        """Whether `host` may connect now (call done() after it); False once its share cannot be had."""
        need = self.cost(host)
        with self._cond:
            self._cond.wait_for(lambda: self.free >= need or self.in_flight == 0, timeout)
            if self.free < need:
                return False
            self.free -= need
            self.in_flight += 1
            return True

    def done(self, host: str, kept: bool) -> None:
        """The connect of a host that take() admitted has ended; `kept`: it holds its connection for the run."""
        with self._cond:
            self.in_flight -= 1
            if not kept:
                self.free += self.cost(host)
            self._cond.notify_all()

    def hosts_at_once(self) -> int:
        """How many hosts connect at once at most (those of the cheapest kind, while none has failed)."""
        return max(1, self.free // FDS_DIRECT)

    def refusal(self) -> str:
        return (f"not connected: the other hosts' connections held this process's open files (RLIMIT_NOFILE "
                f"{self.soft}): {os.strerror(errno.EMFILE)}")


def local_kind(error: str) -> Optional[str]:
    """The limit of this machine that an error names: "files" (EMFILE, ENFILE), "ports" (EADDRNOTAVAIL),
    "neighbours" (ENOBUFS: the kernel had no room for the packet's neighbour entry); None when it names none."""
    for kind, codes in (("files", (errno.EMFILE, errno.ENFILE)), ("ports", (errno.EADDRNOTAVAIL,)),
                        ("neighbours", (errno.ENOBUFS,))):
        if any(os.strerror(code) in error or f"[Errno {code}]" in error for code in codes):
            return kind
    return None


def _network_failure(error: str) -> bool:
    """A connect that went unanswered (what a dropped packet looks like), not a refusal or an SSH-level answer."""
    text = error.lower()
    return any(w in text for w in ("timed out", "no route to host", "network is unreachable", "no ssh banner",
                                   "host is unreachable"))


def _resolve(name: str) -> Tuple[str, int]:
    """(address, family) the connect will use: the first getaddrinfo answer, as tcp_connect takes it."""
    try:
        literal = ipaddress.ip_address(name)
        return str(literal), literal.version
    except ValueError:
        pass
    infos = socket.getaddrinfo(name, 22, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    return str(sockaddr[0]), 6 if family == socket.AF_INET6 else 4


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _table_size(needed: int) -> int:
    """A gc_thresh3 with room: twice what the run needs, a power of two, never below the kernel's default 1024."""
    size = 1024
    while size < 2 * needed:
        size *= 2
    return size


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step

