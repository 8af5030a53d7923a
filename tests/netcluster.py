"""Throwaway multi-host cluster (network namespaces + real OpenSSH servers) for end-to-end tests."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence, Union

__all__ = ["NetCluster", "NetClusterError", "Host"]

SSH_PORT = 22
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
ROOT_OCTET = 254  # the coordinator's (root namespace's) address on every network
SUBNETS = 512  # /24s in the benchmarking range 198.18.0.0/15
MAX_NETWORKS = 16  # keeps veth names within IFNAMSIZ (15 chars)
MAX_NAMESPACES = 253  # host octets .1 .. .253 on each /24

# Hosts mount a private tmpfs on /tmp, which would hide cluster state kept under
# /tmp from their sshd.  /run is a root-only tmpfs that, like namespaces, is
# emptied at boot, so state can never outlive the kernel objects it describes.
STATE_ROOT = Path("/run")
NETNS_DIR = Path("/run/netns")  # where `ip netns` pins named namespaces
SYS_NET = Path("/sys/class/net")

_PREFIX = "pf"
_ID_HEX = 6
# Every kernel object is named pf<id><kind><index>, kind h=namespace b=bridge v=veth.
_OBJECT_RE = re.compile(rf"^{_PREFIX}([0-9a-f]{{{_ID_HEX}}})([hbv])\d")
# The state dir name carries its owner (pid and start time, against pid reuse),
# so ownership is claimed atomically by mkdir, before any kernel object exists.
_STATE_RE = re.compile(rf"^pfnc-([0-9a-f]{{{_ID_HEX}}})-(\d+)-(\d+)$")
_HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_PORTS_RE = re.compile(r"^\d{1,5}(-\d{1,5})?$")

SetupCommand = Union[str, Sequence[str]]
Ports = Union[int, str, Iterable[Union[int, str]]]

_SILENT_LISTENER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])), backlog=256)
held = []  # accepted sockets stay open: clients must see a live but mute peer
while True:
    held.append(server.accept()[0])
"""

_BLACKHOLE_RULES = """
table inet pf_blackhole {
    chain input {
        type filter hook input priority 0; policy drop;
    }
}
"""

_FIREWALL_TABLE = "pf_firewall"


class NetClusterError(RuntimeError):
    """Building, driving or tearing down a NetCluster failed."""


@dataclass
class Host:
    """One namespace-backed machine of the cluster."""

    name: str
    ns: str
    addresses: list[str]  # index k = address on network k
    pid: int = 0  # sshd (or silent listener) pid; 0 for a blackhole
    host_key_line: str = ""  # "ssh-ed25519 AAAA..." (empty for fault hosts)
    veths: list[str] = field(default_factory=list, repr=False)  # root-side peer per network
    proc: subprocess.Popen | None = field(default=None, repr=False)
    port: int = SSH_PORT  # the port its sshd listens on (the cluster's ssh_port)
    # What the host's /etc/machine-id (and /var/lib/dbus/machine-id) and boot id read: its own, as a machine's.
    machine_id: str = ""
    boot_id: str = ""

    @property
    def known_hosts_line(self) -> str:
        names = [self.name, *self.addresses]
        if self.port != SSH_PORT:  # OpenSSH's name for a host off port 22
            names = [f"[{name}]:{self.port}" for name in names]
        return f"{','.join(names)} {self.host_key_line}"


# ---------------------------------------------------------------- processes


@contextlib.contextmanager
def code_in_run(coordinator: bool = False) -> Iterator[Path]:
    """A copy of the code under /run for a namespace host to import (put it on PYTHONPATH): the host-side
    packages (preflight.checks, preflight.hostside) and, with coordinator=True, the whole preflight package. A host mounts a private /tmp, so
    a checkout under /tmp (as in `git clone . /tmp/fresh`) is invisible inside it; /run is shared."""
    root = Path(__file__).resolve().parent.parent
    code = Path(tempfile.mkdtemp(prefix="pf-code-", dir="/run"))
    try:
        if coordinator:
            shutil.copytree(root / "preflight", code / "preflight",
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (code / "preflight").mkdir()
            (code / "preflight" / "__init__.py").write_text("")
            for pkg in ("checks", "hostside"):
                shutil.copytree(root / "preflight" / pkg, code / "preflight" / pkg,
                                ignore=shutil.ignore_patterns("__pycache__"))
        yield code
    finally:
        shutil.rmtree(code, ignore_errors=True)


def _under_tmp(paths: Iterable[Path]) -> list[Path]:
    """The paths under /tmp, outermost only (a .venv inside a checkout comes with it)."""
    tmp = Path("/tmp")
    found = sorted({p for p in paths if tmp in p.parents})
    return [p for p in found if not any(q in p.parents for q in found)]


def _search_path() -> str:
    # Non-login root shells often lack the sbin dirs that ip/sshd live in.
    return os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])


@functools.lru_cache(maxsize=None)
def _which(tool: str) -> str | None:
    return shutil.which(tool, path=_search_path())


def _argv(argv: Sequence[str]) -> list[str]:
    tool = argv[0]
    return [_which(tool) or tool, *argv[1:]]


def _run(argv: Sequence[str], *, input: str | None = None, timeout: float = 30,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(_argv(argv), input=input, capture_output=True, text=True,
                          timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
    if check and proc.returncode:
        raise NetClusterError(f"{shlex.join(argv)} failed ({proc.returncode}): "
                              f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _run_all(jobs: Sequence[tuple[Sequence[str], str]], timeout: float = 30) -> None:
    """Run (argv, stdin) jobs concurrently; per-namespace setup waits on forks, not CPU."""
    procs = [subprocess.Popen(_argv(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv, _ in jobs]
    failures = []
    try:
        for proc, (argv, stdin) in zip(procs, jobs):
            _, err = proc.communicate(stdin, timeout=timeout)
            if proc.returncode:
                failures.append(f"{shlex.join(argv)}: {err.strip()}")
    finally:
        for proc in procs:
            if proc.poll() is None:  # only after a timeout
                proc.kill()
                proc.wait()
    if failures:
        raise NetClusterError("; ".join(failures))


def _ip_batch(commands: Sequence[str], netns: str | None = None, force: bool = False) -> None:
    if not commands:
        return
    argv = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"]
    _run(argv, input="\n".join(commands) + "\n", check=not force)


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _ns_identity(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # gone, or a zombie (which no longer holds namespaces)
        return None
    return st.st_dev, st.st_ino


def _processes_in(namespaces: Iterable[str]) -> dict[int, int]:
    """{pid: ppid} of live processes inside the named netns; `ip netns pids` in one /proc pass."""
    wanted = {ident for ns in namespaces if (ident := _ns_identity(NETNS_DIR / ns))}
    found = {}
    for entry in os.listdir("/proc") if wanted else ():
        if entry.isdigit() and int(entry) != os.getpid() \
                and _ns_identity(f"/proc/{entry}/ns/net") in wanted:
            found[int(entry)] = _ppid(int(entry))
    return found


def _kill_processes_in(namespaces: Sequence[str], timeout: float = 10.0) -> None:
    # Leaves go first so that every parent still alive reaps its children;
    # orphans would be reparented to pid 1, which in containers may never reap.
    deadline = time.monotonic() + timeout
    while procs := _processes_in(namespaces):
        if time.monotonic() > deadline:
            raise NetClusterError(f"processes survive SIGKILL in {list(namespaces)}: {sorted(procs)}")
        parents = set(procs.values())
        for pid in [p for p in procs if p not in parents] or list(procs):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _kind(name: str) -> str:
    return _OBJECT_RE.match(name)[2]


def _remove_objects(names: Iterable[str], veth_grace: float = 2.0) -> None:
    """Delete our namespaces and root-namespace links, told apart by their names."""
    names = list(names)
    veths = [n for n in names if _kind(n) == "v"]
    # Deleting a namespace frees all its veth pairs in one batched kernel pass,
    # much faster than `ip link del` per veth (~20 ms each), but asynchronously
    # and only once nothing pins the namespace; stragglers are deleted by name.
    _ip_batch([f"netns del {n}" for n in names if _kind(n) == "h"], force=True)
    deadline = time.monotonic() + veth_grace
    while set(veths) & set(os.listdir(SYS_NET)) and time.monotonic() < deadline:
        time.sleep(0.005)
    present = set(os.listdir(SYS_NET))
    _ip_batch([f"link del {n}" for n in veths + [n for n in names if _kind(n) == "b"] if n in present],
              force=True)


# ------------------------------------------------------------ stale leftovers


def _existing_objects() -> list[str]:
    """Named namespaces and root-namespace links that follow our naming scheme."""
    netns = os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else []
    return sorted(n for n in os.listdir(SYS_NET) + netns if _OBJECT_RE.match(n))


def _state_dirs() -> dict[Path, tuple[str, bool]]:
    """{state dir: (cluster id, owner alive)}."""
    dirs = {}
    for path in STATE_ROOT.glob("pfnc-*"):
        if m := _STATE_RE.match(path.name):
            dirs[path] = (m[1], _start_time(int(m[2])) == int(m[3]))
    return dirs


def _sweep_stale() -> None:
    """Remove what crashed runs left behind, sparing clusters of live processes."""
    # Objects are listed before state dirs: an object seen here belongs to a
    # cluster whose state dir already existed, so a cluster being built right
    # now by another process cannot be mistaken for an ownerless one.
    objects = _existing_objects()
    dirs = _state_dirs()
    live = {cid for cid, alive in dirs.values() if alive}
    stale = [n for n in objects if _OBJECT_RE.match(n)[1] not in live]
    _kill_processes_in([n for n in stale if _kind(n) == "h"])
    _remove_objects(stale)
    for path, (_, alive) in dirs.items():
        if not alive:
            _remove_unreachable_routes(path)
            shutil.rmtree(path, ignore_errors=True)
    # CPU-limit cgroups (throttle) of clusters whose owner died; their processes are gone with the namespaces.
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")):
        for cg in root.glob(f"{_PREFIX}*-*"):
            if re.match(rf"^{_PREFIX}([0-9a-f]{{{_ID_HEX}}})-", cg.name) and cg.name[len(_PREFIX):].split("-")[0] \
                    not in live:
                try:
                    cg.rmdir()
                except OSError:
                    pass


_UNREACHABLE_FILE = "unreachable_routes"  # in the state dir: the subnets unroute() turned into unreachable routes


def _remove_unreachable_routes(state_dir: Path) -> None:
    # Not tied to a device, an unreachable route outlives the bridge: it goes by the list its cluster kept.
    cidrs = (_read(state_dir / _UNREACHABLE_FILE) or "").split()
    _ip_batch([f"route del unreachable {cidr}" for cidr in cidrs], force=True)


def _reserve_state_dir() -> tuple[str, Path]:
    taken = {_OBJECT_RE.match(n)[1] for n in _existing_objects()} | {c for c, _ in _state_dirs().values()}
    owner = f"{os.getpid()}-{_start_time(os.getpid())}"
    while (cid := secrets.token_hex(_ID_HEX // 2)) in taken:
        pass
    path = STATE_ROOT / f"pfnc-{cid}-{owner}"
    path.mkdir(mode=0o700)
    return cid, path


# ----------------------------------------------------------------- files


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _keypair(comment: str = "") -> tuple[str, str]:
    """(OpenSSH private key, public key line); in-process, far faster than ssh-keygen."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption())
    public = key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH)
    return private.decode(), f"{public.decode()} {comment}".strip()


def _write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Truncate in place (same inode) so bind mounts of the file see updates.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def _setup_line(command: SetupCommand) -> str:
    return command if isinstance(command, str) else shlex.join(command)


def _nft_port_set(ports: Ports) -> str:
    items = [ports] if isinstance(ports, (int, str)) else list(ports)
    specs = [s.strip() for item in items for s in str(item).split(",")]
    bad = [s for s in specs if not _PORTS_RE.match(s)]
    if bad or not specs:
        raise ValueError(f"not a port or port range: {bad or ports!r}")
    return "{ " + ", ".join(specs) + " }"


def _address(subnet: int, octet: int) -> str:
    """Address `octet` in the subnet-th /24 of 198.18.0.0/15."""
    return f"198.{18 + subnet // 256}.{subnet % 256}.{octet}"


def _routed_subnets() -> set[int]:
    routes = _run(["ip", "-4", "-o", "route", "show", "table", "main"]).stdout
    # An `unreachable` route (NetCluster.unroute) holds its /24 as well.
    return {(int(m[1]) - 18) * 256 + int(m[2])
            for m in re.finditer(r"^(?:unreachable )?198\.(18|19)\.(\d+)\.0/24 ", routes, re.M)}


def _claim_subnet(bridge: str, taken: set[int]) -> int:
    """Route the first free /24 to `bridge`; the kernel's route table is the lock.

    Concurrent clusters (other processes, or a module fixture alongside a test's
    own cluster) share the root namespace, so each needs distinct subnets, and
    `ip route add` of an existing prefix fails atomically with EEXIST.
    """
    for subnet in range(SUBNETS):
        if subnet not in taken and _run(["ip", "route", "add", f"{_address(subnet, 0)}/24",
                                         "dev", bridge], check=False).returncode == 0:
            taken.add(subnet)
            return subnet
    raise NetClusterError("no free /24 left in 198.18.0.0/15")


# ------------------------------------------------------------ availability


@functools.lru_cache(maxsize=None)
def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return f"NetCluster needs root (running as uid {os.geteuid()})"
    for tool in ("ip", "unshare", "nsenter", "sshd"):
        if not _which(tool):
            return f"NetCluster needs `{tool}`, which is not installed (searched {_search_path()})"
    try:
        import cryptography.hazmat.primitives.asymmetric.ed25519  # noqa: F401
    except ImportError:
        return "NetCluster needs the Python package `cryptography` to generate ed25519 keys"
    probe = subprocess.run(_argv(["unshare", "--net", "--mount", "--uts", "true"]),
                           capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    if probe.returncode:
        return f"creating namespaces is not permitted here: {probe.stderr.strip()}"
    return None


# ----------------------------------------------------------------- cluster

_LIVE: set[NetCluster] = set()


@atexit.register
def _close_live_clusters() -> None:
    # A forked child inherits _LIVE; only the creating process may tear down.
    for cluster in [c for c in _LIVE if c.owner_pid == os.getpid()]:
        try:
            cluster.close()
        except Exception as exc:  # keep closing the others; atexit cannot fail usefully
            print(f"netcluster: {exc}", file=sys.stderr)


class NetCluster:
    """N hosts, each a netns with its own hostname, mounts and sshd, on bridged networks.

    Network k is a /24 of 198.18.0.0/15 (198.18.k.0/24 when no other cluster is
    alive): host i is .(i+1) on it and the root namespace, i.e. the test process
    acting as coordinator, is .254.  Use as a context manager.
    """

    def __init__(self, n: int = 3, networks: int = 1, names: Sequence[str] | None = None,
                 setup: Mapping[str, Sequence[SetupCommand]] | None = None,
                 ready_timeout: float = 20.0, ssh_port: int = SSH_PORT):
        """Build and start the cluster; on any failure, remove what was built and raise.

        names: host names, default node01, node02, ...
        setup: {host name: commands} run in that host's namespaces before sshd
            starts; a str command is a shell line, a sequence is an argv (quoted).
        ssh_port: the one port every sshd listens on (and the ssh config's and
            known_hosts' port: [addr]:port entries off 22).
        """
        if unit := os.environ.get("PREFLIGHT_TEST_NO_NAMESPACES"):  # tests/conftest.py sets it around a unit test
            raise NetClusterError(f"{unit} is marked unit (tests/conftest.py) but builds namespace hosts: mark it "
                                  "cluster there (NEEDS_ROOT), or give it a cluster fixture")
        self.ssh_port = int(ssh_port)
        names = list(names) if names is not None else [f"node{i + 1:02d}" for i in range(n)]
        setup = dict(setup or {})
        self._validate(n, networks, names, setup)
        self.networks = networks
        self._subnets: list[int] = []  # index into the /24s of 198.18.0.0/15, per network
        self.hosts: list[Host] = []
        self.fault_hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._cgroups: dict[str, Path] = {}  # host name -> its CPU-limiting cgroup (throttle)
        self._closed = False
        self.owner_pid = os.getpid()
        _sweep_stale()
        self.id, self.dir = _reserve_state_dir()
        _LIVE.add(self)
        try:
            started = time.monotonic()
            self._build(names, setup, ready_timeout)
            self.build_seconds = time.monotonic() - started
        except BaseException:
            try:
                self.close()
            except NetClusterError:
                pass  # the build error is the one worth reporting
            raise

    # -- addresses and coordinator-side files ---------------------------------

    @property
    def subnets(self) -> list[str]:
        """CIDR of each network; 198.18.k.0/24 unless other clusters hold those."""
        return [f"{_address(subnet, 0)}/24" for subnet in self._subnets]

    @property
    def coordinator_addresses(self) -> list[str]:
        """The root namespace's (test process's) address on each network."""
        return [_address(subnet, ROOT_OCTET) for subnet in self._subnets]

    @property
    def user_key(self) -> Path:
        return self.dir / "user_key"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def authorized_keys(self) -> Path:
        return self.dir / "authorized_keys"

    def empty_known_hosts(self, path: str | Path | None = None) -> Path:
        """An empty known_hosts file, for tests of the unknown-host-key path."""
        return _write(Path(path) if path else self.dir / "known_hosts.empty", "")

    def hostfile(self, path: str | Path | None = None, names: Sequence[str] | None = None,
                 slots: int = 1) -> Path:
        """Write a DeepSpeed hostfile (`name slots=N` per line) and return its path."""
        names = [h.name for h in self.hosts] if names is None else list(names)
        return _write(Path(path) if path else self.dir / "hostfile",
                      "".join(f"{name} slots={slots}\n" for name in names))

    # -- running things on hosts ---------------------------------------------

    def host(self, host: Host | str) -> Host:
        if isinstance(host, Host):
            return host
        for candidate in self.hosts + self.fault_hosts:
            if candidate.name == host:
                return candidate
        raise KeyError(f"no host named {host!r} in cluster {self.id}")

    def nsenter_argv(self, host: Host | str) -> list[str]:
        """argv prefix entering the host's net, mount and uts namespaces (those of its sshd)."""
        self._check_open()
        h = self.host(host)
        if not h.host_key_line:
            raise NetClusterError(f"{h.name} is a fault host and runs no sshd to enter")
        return ["nsenter", "-t", str(h.pid), "-n", "-m", "-u", "--"]

    def exec(self, host: Host | str, argv: Sequence[str] | str, timeout: float = 30,
             check: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
        """Run argv (a str runs via `sh -c`) inside the host; returns text CompletedProcess."""
        return subprocess.run(_argv(self.nsenter_argv(host) + self._command(argv)),
                              input=input, capture_output=True, text=True, timeout=timeout,
                              check=check, stdin=None if input is not None else subprocess.DEVNULL)

    def popen(self, host: Host | str, argv: Sequence[str] | str, **kwargs) -> subprocess.Popen:
        """Start argv inside the host in the background; killed and reaped by close()."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(_argv(self.nsenter_argv(host) + self._command(argv)), **kwargs)
        self._procs.append(proc)
        return proc

    @staticmethod
    def _command(argv: Sequence[str] | str) -> list[str]:
        return ["sh", "-c", argv] if isinstance(argv, str) else list(argv)

    # -- network conditions --------------------------------------------------

    def shape(self, host: Host | str, mbit: float, network: int = 0, jitter: Sequence[str] | None = None) -> None:
        """Limit both directions of the host's link on `network` to `mbit` Mbit/s; with `jitter` (delay, spread,
        e.g. ("1ms", "0.5ms")) a netem below the rate limit also delays each packet normally distributed."""
        for netns, dev in self._link_ends(host, network):
            _run(["tc", *netns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *self._tbf(mbit)])
            if jitter:
                _run(["tc", *netns, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                      "delay", jitter[0], jitter[1], "distribution", "normal"])

    def unshape(self, host: Host | str, network: int = 0) -> None:
        for netns, dev in self._link_ends(host, network):
            _run(["tc", *netns, "qdisc", "del", "dev", dev, "root"], check=False)  # may be unshaped

    def _link_ends(self, host: Host | str, network: int) -> list[tuple[list[str], str]]:
        """(tc namespace option, device) for both ends of the host's veth on `network`."""
        h = self.host(host)
        # A qdisc shapes egress only: the root-side end's egress is traffic to
        # the host, the host-side end's egress is traffic from it.
        return [([], h.veths[network]), (["-n", h.ns], f"eth{network}")]

    @staticmethod
    def _tbf(mbit: float) -> list[str]:
        # veths pass 64 KiB GSO super-packets.  A bucket smaller than one makes
        # tbf split every packet, and a queue shorter than a few of them makes
        # TCP collapse at low rates (10 Mbit measured ~55%); 200 ms of queue and
        # a 5 ms (min 64 KiB) bucket measure 94-98% of the rate from 1 to 1000 Mbit.
        burst = int(max(mbit * 1e6 / 8 * 0.005, 64 * 1024 + 1514))
        return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"]

    def firewall(self, host: Host | str, drop_tcp_dports: Ports = "1024-65535") -> None:
        """Drop new inbound TCP to the given ports; the SSH port and established flows pass."""
        rules = f"""
table inet {_FIREWALL_TABLE}
delete table inet {_FIREWALL_TABLE}
table inet {_FIREWALL_TABLE} {{
    chain input {{
        type filter hook input priority 0; policy accept;
        ct state established,related accept
        tcp dport {self.ssh_port} accept
        tcp dport {_nft_port_set(drop_tcp_dports)} drop
    }}
}}
"""
        self._nft(self.host(host), rules)

    def unfirewall(self, host: Host | str) -> None:
        # Declaring the table first makes the delete succeed even when absent.
        self._nft(self.host(host), f"table inet {_FIREWALL_TABLE}\ndelete table inet {_FIREWALL_TABLE}\n")

    @staticmethod
    def _nft(h: Host, rules: str) -> None:
        _run(["ip", "netns", "exec", h.ns, "nft", "-f", "-"], input=rules)

    # -- topology: networks the coordinator cannot reach ---------------------

    def detach(self, host: Host | str, network: int) -> None:
        """Take the host off `network`: its link there is deleted, with its address on it (which stays listed
        in `addresses`, unreachable). The host keeps its other networks."""
        self._check_open()
        h = self.host(host)
        _run(["ip", "link", "del", h.veths[network]])

    def unroute(self, network: int) -> None:
        """Make `network` unreachable from the root namespace (the coordinator): its route becomes an
        `unreachable` route (connects fail at once, and nothing leaks out by another route) and the root's
        address on it goes. Hosts on it still reach each other, so a host on it and on a routed network is a
        jump host. close() deletes the route, and so does the sweep of a crashed run."""
        self._check_open()
        cidr = self.subnets[network]
        with open(self.dir / _UNREACHABLE_FILE, "a") as f:  # recorded before the route exists
            f.write(cidr + "\n")
        # `replace` swaps the bridge route for the unreachable one atomically: the /24 stays claimed throughout.
        _ip_batch([f"route replace unreachable {cidr}",
                   f"addr del {self.coordinator_addresses[network]}/24 dev {self._bridges()[network]}"])

    # -- CPU limits -----------------------------------------------------------

    @staticmethod
    def _cpu_cgroup_root() -> tuple[Path, str]:
        """(hierarchy root, "v2" or "v1") that holds the cpu controller: cgroup v2 where it is there, else the
        v1 `cpu` hierarchy (hybrid hosts, like this machine)."""
        v2 = Path("/sys/fs/cgroup")
        if "cpu" in (_read(v2 / "cgroup.controllers") or "").split():
            return v2, "v2"
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            return v1, "v1"
        raise NetClusterError("no cgroup cpu controller (neither cgroup v2 cpu nor v1 cpu) to throttle a host")

    def throttle(self, host: Host | str, cores: float = 0.5) -> None:
        """Limit every process of the host to `cores` CPUs: a cgroup with cpu.max (v2) or cpu.cfs_quota_us (v1)
        holding its sshd, so every later SSH session (and all it starts) is limited too."""
        h = self.host(host)
        root, version = self._cpu_cgroup_root()
        cg = root / f"{_PREFIX}{self.id}-{h.name}"
        if version == "v2":
            (root / "cgroup.subtree_control").write_text("+cpu")
        cg.mkdir(exist_ok=True)
        self._cgroups[h.name] = cg
        period = 100_000
        if version == "v2":
            (cg / "cpu.max").write_text(f"{int(cores * period)} {period}")
        else:
            (cg / "cpu.cfs_period_us").write_text(str(period))
            (cg / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
        for pid in _processes_in([h.ns]):
            try:
                (cg / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass

    def unthrottle(self, host: Host | str) -> None:
        h = self.host(host)
        cg = self._cgroups.pop(h.name, None)
        if cg is not None:
            self._remove_cgroup(cg)

    @staticmethod
    def _remove_cgroup(cg: Path) -> None:
        for line in (_read(cg / "cgroup.procs") or "").split():
            try:
                (cg.parent / "cgroup.procs").write_text(line)
            except (ProcessLookupError, OSError):
                pass
        for _ in range(50):  # a process that just exited leaves the cgroup a moment later
            try:
                cg.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        raise NetClusterError(f"cgroup {cg} is still busy")

    def _remove_cgroups(self) -> None:
        for name in list(self._cgroups):
            self._remove_cgroup(self._cgroups.pop(name))

    # -- host keys -----------------------------------------------------------

    def rekey(self, host: Host | str, timeout: float = 20.0) -> str:
        """Give the host a new SSH host key, as a reinstalled machine has, and restart its sshd (boot script and
        all) with it. Nothing else changes: every known_hosts written so far still has the old key. Returns the
        new key line ("ssh-ed25519 AAAA...")."""
        self._check_open()
        h = self.host(host)
        if not h.host_key_line:
            raise NetClusterError(f"{h.name} is a fault host and runs no sshd")
        private, h.host_key_line = _keypair()
        _write(self._host_dir(h) / "ssh_host_ed25519_key", private, 0o600)
        h.proc.kill()  # its open sessions go with it, as on a reboot
        h.proc.wait(timeout=10)
        self._start_sshd(h)
        self._wait_listening([h], timeout)
        return h.host_key_line

    # -- fault hosts ---------------------------------------------------------

    def add_blackhole(self, name: str) -> str:
        """A network-0 address whose namespace drops every inbound packet: connects time out."""
        h = self._add_fault_host(name)
        self._nft(h, _BLACKHOLE_RULES)
        return h.addresses[0]

    def add_silent(self, name: str) -> str:
        """A network-0 address whose port 22 accepts TCP but never sends an SSH banner."""
        h = self._add_fault_host(name)
        self._spawn_server(h, [sys.executable, "-c", _SILENT_LISTENER, h.addresses[0], str(self.ssh_port)])
        self._wait_listening([h], timeout=10)
        return h.addresses[0]

    def add_seat(self, name: str) -> Host:
        """A network namespace with a network-0 address and nothing running in it: a seat for a coordinator of its
        own (``ip netns exec seat.ns ...``), whose per-namespace settings (sysctls such as the ephemeral port
        range, routes) are the test's alone. close() kills what runs in it and removes it."""
        return self._add_fault_host(name)

    def _add_fault_host(self, name: str) -> Host:
        self._check_open()
        self._validate_names([h.name for h in self.hosts + self.fault_hosts] + [name])
        h = self._new_host(len(self.hosts) + len(self.fault_hosts), name, networks=1)
        self.fault_hosts.append(h)
        self._create_hosts_network([h])
        self._configure_namespaces([h])
        self._write_ssh_config()
        return h

    # -- teardown ------------------------------------------------------------

    def close(self) -> None:
        """Kill everything the cluster runs, delete its kernel objects and files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        errors = []
        for step in (self._kill_all, self._remove_cgroups, self._remove_network, self._remove_routes,
                     self._remove_state):
            try:
                step()
            except Exception as exc:  # later steps must still run
                errors.append(f"{step.__name__}: {exc}")
        if leftovers := self.leftovers():
            errors.append(f"left behind: {leftovers}")
        if errors:
            raise NetClusterError(f"closing cluster {self.id}: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """Namespaces, links, live processes and files of this cluster that still exist."""
        found = [n for n in _existing_objects() if _OBJECT_RE.match(n)[1] == self.id]
        found += [f"pid {pid}" for pid in self._pids() if _is_alive(pid)]
        found += [str(self.dir)] if self.dir.exists() else []
        if self._closed:  # unroute()'s routes (a bridge's own route may already belong to a newer cluster)
            routes = _run(["ip", "-4", "-o", "route", "show", "table", "main", "type", "unreachable"]).stdout
            found += [f"unreachable route {c}" for c in self.subnets if f"{c} " in routes + " "]
        return found

    def __enter__(self) -> NetCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.hosts)} hosts"
        return f"<NetCluster {self.id} {state} at {self.dir}>"

    def _kill_all(self) -> None:
        _kill_processes_in(self._namespaces())
        for proc in self._popens():
            proc.kill()  # no-op when already reaped; covers a child that left its netns
            proc.wait(timeout=10)

    def _remove_network(self) -> None:
        _remove_objects(self._namespaces() + self._bridges()
                        + [v for h in self.hosts + self.fault_hosts for v in h.veths])

    def _remove_routes(self) -> None:
        _remove_unreachable_routes(self.dir)

    def _remove_state(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts + self.fault_hosts]

    def _bridges(self) -> list[str]:
        return [f"{_PREFIX}{self.id}b{k}" for k in range(self.networks)]

    def _popens(self) -> list[subprocess.Popen]:
        return [h.proc for h in self.hosts + self.fault_hosts if h.proc] + self._procs

    def _pids(self) -> list[int]:
        return [p.pid for p in self._popens()]

    def _check_open(self) -> None:
        if self._closed:
            raise NetClusterError(f"cluster {self.id} is closed")

    # -- building ------------------------------------------------------------

    @classmethod
    def _validate(cls, n: int, networks: int, names: list[str], setup: dict) -> None:
        if len(names) != n:
            raise ValueError(f"{len(names)} names given for {n} hosts")
        if not 1 <= n <= MAX_NAMESPACES:
            raise ValueError(f"n must be 1..{MAX_NAMESPACES}, not {n}")
        if not 1 <= networks <= MAX_NETWORKS:
            raise ValueError(f"networks must be 1..{MAX_NETWORKS}, not {networks}")
        cls._validate_names(names)
        if unknown := set(setup) - set(names):
            raise ValueError(f"setup for unknown hosts: {sorted(unknown)}")

    @staticmethod
    def _validate_names(names: list[str]) -> None:
        if bad := [name for name in names if not _HOSTNAME_RE.match(name)]:
            raise ValueError(f"not valid host names: {bad}")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate host names in {names}")
        if len(names) > MAX_NAMESPACES:
            raise ValueError(f"at most {MAX_NAMESPACES} hosts and fault hosts per cluster")

    def _build(self, names: list[str], setup: dict, ready_timeout: float) -> None:
        self._create_bridges()
        self.hosts = [self._new_host(i, name, self.networks) for i, name in enumerate(names)]
        self._write_files(setup)
        self._create_hosts_network(self.hosts)
        self._configure_namespaces(self.hosts)
        # sshd refuses to start without its privilege-separation chroot dir,
        # which only exists here if the system sshd has run since boot.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for h in self.hosts:
            self._start_sshd(h)
        self._wait_listening(self.hosts, ready_timeout)

    def _new_host(self, index: int, name: str, networks: int) -> Host:
        return Host(name=name, ns=f"{_PREFIX}{self.id}h{index}",
                    addresses=[_address(self._subnets[k], index + 1) for k in range(networks)],
                    veths=[f"{_PREFIX}{self.id}v{index}n{k}" for k in range(networks)], port=self.ssh_port,
                    machine_id=secrets.token_hex(16), boot_id=str(uuid.uuid4()))

    def _host_dir(self, h: Host) -> Path:
        return self.dir / "hosts" / h.name

    def _write_files(self, setup: dict) -> None:
        user_private, user_public = _keypair(f"netcluster-{self.id}")
        _write(self.user_key, user_private, 0o600)
        _write(self.authorized_keys, user_public + "\n")
        for h in self.hosts:
            host_private, h.host_key_line = _keypair()
            _write(self._host_dir(h) / "ssh_host_ed25519_key", host_private, 0o600)
        known_hosts = "".join(h.known_hosts_line + "\n" for h in self.hosts)
        _write(self.known_hosts, known_hosts)
        self._write_ssh_config()
        etc_hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + \
            "".join(f"{h.addresses[0]}\t{h.name}\n" for h in self.hosts)
        for h in self.hosts:
            self._write_host_files(h, etc_hosts, known_hosts, user_private, user_public,
                                   setup.get(h.name, ()))

    def _write_ssh_config(self) -> None:
        entries = "".join(f"Host {h.name}\n    HostName {h.addresses[0]}\n"
                          for h in self.hosts + self.fault_hosts)
        _write(self.ssh_config, f"""# coordinator view of NetCluster {self.id}
{entries}
Host *
    User root
    Port {self.ssh_port}
    IdentityFile {self.user_key}
    IdentitiesOnly yes
    UserKnownHostsFile {self.known_hosts}
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
""")

    def _write_host_files(self, h: Host, etc_hosts: str, known_hosts: str, user_private: str,
                          user_public: str, setup: Sequence[SetupCommand]) -> None:
        hdir = self._host_dir(h)
        _write(hdir / "etc_hosts", etc_hosts)
        dot_ssh = hdir / "dot_ssh"  # becomes /root/.ssh on the host
        _write(dot_ssh / "id_ed25519", user_private, 0o600)
        _write(dot_ssh / "id_ed25519.pub", user_public + "\n")
        _write(dot_ssh / "authorized_keys", user_public + "\n")
        _write(dot_ssh / "known_hosts", known_hosts)
        _write(dot_ssh / "config", "Host *\n    StrictHostKeyChecking yes\n    BatchMode yes\n")
        _write(hdir / "sshd_config", self._sshd_config(h))
        _write(hdir / "machine_id", h.machine_id + "\n")
        _write(hdir / "boot_id", h.boot_id + "\n")
        _write(hdir / "boot.sh", self._boot_script(h, setup))
        if _needs_home_overlay():
            (hdir / "home_upper" / ".ssh").mkdir(parents=True)
            (hdir / "home_work").mkdir()
            os.chmod(hdir / "home_upper", _ROOT_HOME.stat().st_mode & 0o7777)

    def _sshd_config(self, h: Host) -> str:
        hdir = self._host_dir(h)
        listen = "".join(f"ListenAddress {addr}:{self.ssh_port}\n" for addr in h.addresses)
        # No AcceptEnv line: the client's environment must not leak into checks.
        return f"""{listen}HostKey {hdir / 'ssh_host_ed25519_key'}
PidFile {hdir / 'sshd.pid'}
AuthorizedKeysFile {self.authorized_keys}
PermitRootLogin prohibit-password
AllowTcpForwarding yes
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 200
MaxSessions 100
PrintMotd no
Subsystem sftp internal-sftp
"""

    @staticmethod
    def _through_tmp() -> list[Path]:
        return _under_tmp([Path(__file__).resolve().parent.parent, Path(sys.prefix)])

    @property
    def tmp_entries(self) -> set[str]:
        """The names in a host's /tmp that are this checkout or its .venv bound through (see _boot_script), not
        something a test left there."""
        return {p.relative_to("/tmp").parts[0] for p in self._through_tmp()}

    def _boot_script(self, h: Host, setup: Sequence[SetupCommand]) -> str:
        """Shell run in the host's fresh uts+mount namespaces; ends by exec'ing sshd."""
        hdir = self._host_dir(h)
        q = shlex.quote
        # -x traces each step into server.log, so a failing setup line is named there.
        lines = ["set -eux", f"hostname {q(h.name)}",
                 # The private copy of /run/netns would pin every namespace that
                 # exists now, other clusters' included, for this host's lifetime.
                 f"if mountpoint -q {NETNS_DIR}; then umount -l {NETNS_DIR}; fi"]
        # A checkout under /tmp (`git clone . /tmp/fresh`) and its .venv, the interpreter the tests give the hosts as
        # --python, stay visible through the private /tmp: held aside under /run, then bound back at their path.
        through = self._through_tmp()
        for i, path in enumerate(through):
            lines.append(f"mkdir -p {q(str(hdir / f'through{i}'))} && mount --bind {q(str(path))} "
                         f"{q(str(hdir / f'through{i}'))}")
        lines.append("mount -t tmpfs -o mode=1777 tmpfs /tmp")
        for i, path in enumerate(through):
            lines.append(f"mkdir -p {q(str(path))} && mount --bind {q(str(hdir / f'through{i}'))} {q(str(path))}")
        lines.append(f"mount --bind {q(str(hdir / 'etc_hosts'))} /etc/hosts")
        if _needs_home_overlay():
            options = f"lowerdir={_ROOT_HOME},upperdir={hdir / 'home_upper'},workdir={hdir / 'home_work'}"
            lines.append(f"mount -t overlay overlay -o {q(options)} {q(str(_ROOT_HOME))}")
        lines.append(f"mount --bind {q(str(hdir / 'dot_ssh'))} {q(str(_ROOT_HOME / '.ssh'))}")
        # Each host is a machine of its own, as a real cluster's are: its own machine-id and boot id (namespaces
        # would share the machine's, and two hosts would read as one machine under two names).
        for path in MACHINE_ID_FILES:
            lines.append(f"if [ -e {path} ]; then mount --bind {q(str(hdir / 'machine_id'))} {path}; fi")
        lines.append(f"mount --bind {q(str(hdir / 'boot_id'))} {BOOT_ID_FILE} || true")  # best effort
        lines += [_setup_line(cmd) for cmd in setup]
        lines.append(f"exec {q(_which('sshd'))} -D -e -f {q(str(hdir / 'sshd_config'))}")
        return "\n".join(lines) + "\n"

    def _create_bridges(self) -> None:
        _ip_batch([cmd for bridge in self._bridges()
                   for cmd in (f"link add {bridge} type bridge", f"link set {bridge} up")])
        taken = _routed_subnets()
        self._subnets = [_claim_subnet(bridge, taken) for bridge in self._bridges()]
        # noprefixroute: the claimed route already exists and must stay the only one.
        _ip_batch([f"addr add {_address(subnet, ROOT_OCTET)}/24 noprefixroute dev {bridge}"
                   for subnet, bridge in zip(self._subnets, self._bridges())])

    def _create_hosts_network(self, hosts: list[Host]) -> None:
        commands = []
        for h in hosts:
            commands.append(f"netns add {h.ns}")
            # The peer is born inside the namespace already named eth<k>,
            # which saves a move and a rename per interface.
            commands += [f"link add {veth} master {bridge} up type veth peer name eth{k} netns {h.ns}"
                         for k, (veth, bridge) in enumerate(zip(h.veths, self._bridges()))]
        _ip_batch(commands)

    @staticmethod
    def _configure_namespaces(hosts: list[Host]) -> None:
        def commands(h: Host) -> str:
            lines = ["link set lo up"]
            for k, addr in enumerate(h.addresses):
                lines += [f"addr add {addr}/24 dev eth{k}", f"link set eth{k} up"]
            return "\n".join(lines) + "\n"
        _run_all([(["ip", "-n", h.ns, "-batch", "-"], commands(h)) for h in hosts])

    def _start_sshd(self, h: Host) -> None:
        self._spawn_server(h, ["unshare", "--uts", "--mount", "--propagation", "private", "--",
                               "sh", str(self._host_dir(h) / "boot.sh")])

    def _spawn_server(self, h: Host, argv: list[str]) -> None:
        """Start the host's one server process, logging to its server.log."""
        log_path = self._host_dir(h) / "server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            # ip netns exec, unshare (without --fork) and sh's `exec` all
            # replace themselves, so the Popen pid is the server's own pid.
            h.proc = subprocess.Popen(_argv(["ip", "netns", "exec", h.ns, *argv]),
                                      stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        h.pid = h.proc.pid

    def _wait_listening(self, hosts: list[Host], timeout: float) -> None:
        """Block until every host accepts TCP on port 22; fail fast if its server died."""
        deadline = time.monotonic() + timeout
        pending = list(hosts)
        while pending:
            for h in list(pending):
                if h.proc.poll() is not None:
                    raise NetClusterError(f"{h.name}: server exited with {h.proc.returncode}; "
                                          f"its output: {self._server_output(h)}")
                if _accepts(h.addresses[0], self.ssh_port):
                    pending.remove(h)
            if pending and time.monotonic() > deadline:
                raise NetClusterError(f"not listening on port {self.ssh_port} after {timeout}s: "
                                      + "; ".join(f"{h.name}: {self._server_output(h)}" for h in pending))
            if pending:
                time.sleep(0.01)

    def _server_output(self, h: Host) -> str:
        log = self._host_dir(h) / "server.log"
        return log.read_text(errors="replace").strip()[-2000:] or "(no output)"

    # -- availability --------------------------------------------------------

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this machine cannot build a NetCluster, or None when it can."""
        return _unavailable_reason()


_ROOT_HOME = Path(pwd.getpwuid(0).pw_dir)


def _needs_home_overlay() -> bool:
    # Binding a private ~/.ssh needs a mountpoint.  Where root has no ~/.ssh,
    # an overlay on home provides one without creating the real directory.
    return not (_ROOT_HOME / ".ssh").is_dir()


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def _is_alive(pid: int) -> bool:
    """True for a running process; zombies count as gone (they hold no resources)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
