"""Cross-host torch.distributed all-reduce (NCCL on GPUs, gloo on CPUs): bus bandwidth per size, and who breaks it.

One process per slot runs a message-size sweep; each rank reports its per-size times, and on failure the phase it
was in and torch's error, which this module parses, e.g.:

    The client socket has timed out after 30000ms while trying to connect to (198.18.0.1, 29500).
    Gloo connectFullMesh failed with [.../gloo/transport/tcp/pair.h:311] Connect timeout [none]
    [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete

Bandwidths follow nccl-tests: algbw = bytes / time (GB/s, 1e9), busbw = algbw * 2(n-1)/n for n ranks.
Host-side functions: ``probe`` (torch, GPUs, interface), ``host_group`` (starts and watches the ranks of one host),
``rank`` (one rank). ``coordinate`` drives them; ``evaluate`` is pure.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .base import Finding, Outcome, Status, combine, error, sh, skip

NAME = "allreduce"
DESCRIPTION = "torch.distributed all-reduce across all hosts, one process per slot: busbw per message size"
SCOPE = "cluster"
DEFAULT = True

# Fallbacks when the [allreduce] section is absent; preflight/defaults.toml documents where each comes from.
DEFAULTS: Dict[str, Any] = {
    "min_bytes": 1 << 20,
    "max_bytes": 64 << 20,
    "gpu_max_bytes": 1 << 30,
    "iters": 5,
    "size_budget_s": 10.0,
    "sweep_budget_s": 60.0,
    "start_timeout_s": 120.0,
    "init_timeout_s": 60.0,
    "grace_s": 5.0,
    "baseline_ranks": 8,
    "baseline_min_bytes": 1 << 30,
    "baseline_fail_fraction": 0.7,
    "single_node_busbw": {"H100 80GB HBM3": 460.0, "H200": 431.0, "A100-SXM4-80GB": 228.0,
                          "A100-SXM4-40GB": 228.0},
    "min_fraction_of_iperf3": 0.5,
    "pairwise": True,
    "pair_init_timeout_s": 30.0,
    "pair_max_bytes": 64 << 20,
    "straggler_fraction": 0.75,
}

PHASE = "@@ALLREDUCE-PHASE"
# The order in which failure kinds are reported: the first is most likely the root cause.
KIND_ORDER = ["torch_missing", "no_gpu", "port_in_use", "rendezvous", "incomplete", "mesh", "hung", "oom", "nccl",
              "wrong_result", "collective_timeout", "other", "peer_died", "aborted", "stopped"]
MAX_RANKS_IN_METRICS = 512
_IPV4 = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")


def settings(thresholds: Dict[str, Any]) -> Dict[str, Any]:
    cfg = dict(DEFAULTS)
    cfg.update(thresholds.get(NAME, {}) or {})
    return cfg


# --- pure helpers: sizes, bandwidths, error classification --------------------------------------------------------

def sweep_sizes(min_bytes: int, max_bytes: int) -> List[int]:
    """Doubling sizes from min to max, each a multiple of 4 (float32 elements)."""
    size = max(4, int(min_bytes) // 4 * 4)
    sizes = []
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes or [size]


def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus factor 2(n-1)/n: what each rank sends and receives per byte of the buffer."""
    return 2.0 * (n - 1) / n if n > 0 else 0.0


def bandwidth_table(sizes: Sequence[Dict[str, Any]], world_size: int) -> List[Dict[str, Any]]:
    rows = []
    for row in sizes:
        t = float(row["time_s"])
        algbw = row["bytes"] / t / 1e9 if t > 0 else 0.0
        rows.append({"bytes": int(row["bytes"]), "time_s": t, "iters": row.get("iters"),
                     "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(world_size)})
    return rows


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return ("%d %s" % (value, unit)) if value == int(value) else ("%.1f %s" % (value, unit))
    return "%d B" % n


def _gbps(x: float) -> str:
    return ("%.3g" % x) if x < 100 else ("%.0f" % x)


def classify(text: str, phase: str) -> str:
    """A failure kind from torch/gloo/NCCL error text and the phase the rank was in."""
    low = (text or "").lower()
    if phase == "import" or "no module named 'torch'" in low:
        return "torch_missing"
    if "address already in use" in low or "eaddrinuse" in low:
        return "port_in_use"
    if "out of memory" in low:
        return "oom"
    if "duplicate gpu" in low or "invalid device ordinal" in low or "no cuda gpus are available" in low:
        return "no_gpu"
    if "wrong sum" in low:
        return "wrong_result"
    if "trying to connect to" in low or "failed to connect to any network address" in low \
            or "could not connect to master_addr" in low:
        return "rendezvous"
    if "clients joined" in low or "ranks joined" in low or "waiting for clients" in low \
            or ("wait timeout" in low and "keys:" in low):
        return "incomplete"  # the store is up but not every rank arrived
    if "connectfullmesh" in low or "connect timeout" in low or ("connection refused" in low and phase == "init"):
        return "mesh"
    if "connection reset" in low or "connection closed" in low or "broken pipe" in low \
            or "read error" in low or "remote process exited" in low:
        return "peer_died"
    if "nccl" in low and ("error" in low or "warning" in low):
        return "nccl"
    if "timed out" in low or "timeout" in low:
        return "collective_timeout" if phase in ("sweep", "connect") else "mesh" if phase == "init" else "other"
    return "other"


def _addresses_in(text: str) -> List[str]:
    found = []
    for ip in _IPV4.findall(text or ""):
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            continue
        if ip not in found and not ip.startswith(("0.", "127.")):
            found.append(ip)
    return found


def _rank_list(ranks: Sequence[int]) -> str:
    ranks = sorted(set(ranks))
    if len(ranks) > 6:
        return "%d ranks (%s ... %s)" % (len(ranks), ", ".join(map(str, ranks[:3])), ranks[-1])
    return ("rank %d" % ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _names(hosts: Sequence[str], limit: int = 6) -> str:
    hosts = list(dict.fromkeys(hosts))
    return ", ".join(hosts[:limit]) + (" and %d more" % (len(hosts) - limit) if len(hosts) > limit else "")


# --- host side: probe --------------------------------------------------------------------------------------------

def _ipv4_interfaces() -> Dict[str, str]:
    """{IPv4 address: interface} from `ip -j -4 addr`, falling back to SIOCGIFADDR per interface."""
    found: Dict[str, str] = {}
    res = sh(["ip", "-j", "-4", "addr", "show"], timeout=5)
    if res.ok:
        try:
            for link in json.loads(res.out or "[]"):
                for addr in link.get("addr_info", []):
                    if addr.get("family") == "inet" and addr.get("local"):
                        found[addr["local"]] = link.get("ifname")
        except (ValueError, AttributeError):
            found = {}
    if found:
        return found
    try:
        import fcntl
        import struct
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _, name in socket.if_nameindex():
                try:
                    raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                    found[socket.inet_ntoa(raw[20:24])] = name
                except OSError:
                    continue
        finally:
            sock.close()
    except (ImportError, OSError):
        pass
    return found


def _source_address(dest: str) -> Optional[str]:
    """The local address the kernel would use to reach dest (a UDP connect sends nothing)."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.connect((dest, 9))
            return sock.getsockname()[0]
        finally:
            sock.close()
    except OSError:
        return None


def pick_interface(bind_address: Optional[str], master_addr: Optional[str]) -> Dict[str, Any]:
    """The interface the ranks of this host should use: the one holding the chosen network's address, else the
    one holding the source address of the route to MASTER_ADDR (what recommend.py tells the job to use)."""
    table = _ipv4_interfaces()
    if bind_address and table.get(bind_address):
        return {"ifname": table[bind_address], "address": bind_address, "source": "iperf3 chosen network"}
    src = _source_address(master_addr) if master_addr else None
    if src and table.get(src) and table[src] != "lo":
        return {"ifname": table[src], "address": src, "source": "route to MASTER_ADDR"}
    return {"ifname": None, "address": src, "source": None}


def probe(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """Can this host run a rank: torch importable, CUDA and enough GPUs, which interface to use."""
    out: Dict[str, Any] = {"torch": None, "error": None, "cuda": False, "device_count": 0, "gpu_names": [],
                           "nccl": None, "python": sys.version.split()[0]}
    out["interface"] = pick_interface(params.get("bind_address"), params.get("master_addr"))
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        out["error"] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
        return out
    out["torch"] = torch.__version__
    try:
        out["cuda"] = bool(torch.cuda.is_available())
        if out["cuda"]:
            out["device_count"] = torch.cuda.device_count()
            out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["device_count"])]
            version = torch.cuda.nccl.version()  # a tuple; an int such as 2708 on old torch
            out["nccl"] = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # a driver problem: the gpu check says more; here it only means "no NCCL run"
        out["cuda_error"] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
        out["cuda"] = False
    return out


# --- host side: one rank -----------------------------------------------------------------------------------------

class _Failed(Exception):
    def __init__(self, kind: str, message: str, target: Optional[str] = None):
        super().__init__(message)
        self.kind = kind
        self.target = target


def _mark(phase: str) -> None:
    # Read by host_group: if this rank is killed, the last phase still says where it was stuck.
    sys.stdout.write("%s %s\n" % (PHASE, json.dumps({"phase": phase})))
    sys.stdout.flush()


def _await_master(addr: str, port: int, timeout: float, starting_until: float) -> float:
    """Connect to MASTER_ADDR:MASTER_PORT (rank 0's TCPStore) until it accepts, so that a blocked or wrong address
    fails with our own precise message instead of torch's retry log. Returns the seconds waited.

    A refused connection may only mean that rank 0 is still importing torch: it is retried until
    ``starting_until`` (the ranks' start allowance). Dropped packets (a firewall) fail after ``timeout``.
    """
    start = time.monotonic()
    deadline = start + timeout
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.create_connection((addr, port), timeout=min(3.0, max(0.2, left)))
            sock.close()
            return time.monotonic() - start
        except socket.timeout:
            last = "connection timed out: packets dropped, inbound TCP to port %d blocked by a firewall?" % port
        except ConnectionRefusedError:
            last = "connection refused: nothing listens on port %d (rank 0 not started or failed?)" % port
            deadline = max(deadline, min(starting_until, time.monotonic() + timeout))
        except OSError as exc:
            last = "%s" % (exc.strerror or exc)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise _Failed("rendezvous", "could not connect to MASTER_ADDR %s:%d within %.0fs (%s)"
                  % (addr, port, time.monotonic() - start, last), target=addr)


JOINED_KEY = "preflight/joined"


def _join(dist: Any, addr: str, port: int, rank: int, world: int, until: float, init_timeout: float) -> Any:
    """rank 0's TCPStore, once every rank has joined it: the ranks' clocks start together.

    Ranks finish importing torch at very different times (a cold conda env on NFS, or many ranks on few cores),
    and torch's init timeout would count that stagger against the early ranks: a late rank looked like a
    network failure. Here every rank may take until ``until`` (its start allowance) to arrive; only then do
    init_process_group and the collectives get ``init_timeout`` each.
    """
    import datetime
    store = dist.TCPStore(addr, port, world_size=None, is_master=(rank == 0),
                          timeout=datetime.timedelta(seconds=max(1.0, until - time.monotonic())),
                          wait_for_workers=False)
    joined = store.add(JOINED_KEY, 1)
    while joined < world:
        if time.monotonic() >= until:
            raise _Failed("incomplete", "only %d of %d ranks joined rank 0's store by the start deadline: the "
                                        "others are still importing torch, or failed" % (joined, world))
        time.sleep(0.2)
        try:
            joined = store.add(JOINED_KEY, 0)
        except Exception as exc:  # rank 0 gave up (or died) first and its store went with it
            raise _Failed("incomplete", "rank 0's store closed when only %d of %d ranks joined (%s): rank 0 "
                                        "gave up waiting for the others, or failed" % (joined, world,
                                                                                      str(exc)[:120])) from None
    store.set_timeout(datetime.timedelta(seconds=init_timeout))
    return store


def _sweep(torch: Any, dist: Any, dev: Any, params: Dict[str, Any], world: int) -> Tuple[List[Dict[str, Any]],
                                                                                          Optional[str]]:
    """Warm-up plus timed iterations per size; every stop decision uses all-reduced (MAX) numbers so that all
    ranks take it together (a rank that stopped alone would leave the others waiting)."""
    cuda = dev.type == "cuda"
    budget = float(params["size_budget_s"])
    sweep_budget = float(params["sweep_budget_s"])
    iters = max(1, int(params["iters"]))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def agree(values: Sequence[float]) -> List[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def barrier() -> None:
        if cuda:
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    start = time.monotonic()
    rows: List[Dict[str, Any]] = []
    for nbytes in params["sizes"]:
        x = torch.ones(int(nbytes) // 4, dtype=torch.float32, device=dev)
        barrier()
        t0 = time.monotonic()
        dist.all_reduce(x)
        sync()
        warm = time.monotonic() - t0
        # Ones summed over n ranks must give n: catches silent corruption at no cost.
        wrong = 0.0 if (x[0].item() == world and x[-1].item() == world) else 1.0
        x.zero_()  # zeros stay zeros however often they are summed: no overflow over the timed iterations
        warm, wrong = agree([warm, wrong])
        if wrong:
            raise _Failed("wrong_result", "all-reduce of ones over %d ranks gave a wrong sum at %s"
                          % (world, human_bytes(nbytes)))
        k = max(1, min(iters, int((budget - warm) / max(warm, 1e-6))))
        barrier()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(k):
                dist.all_reduce(x)
            end.record()
            end.synchronize()
            per_iter = begin.elapsed_time(end) / 1000.0 / k
        else:
            t0 = time.monotonic()
            for _ in range(k):
                dist.all_reduce(x)
            per_iter = (time.monotonic() - t0) / k
        per_iter, spent = agree([per_iter, time.monotonic() - start])
        rows.append({"bytes": int(nbytes), "time_s": per_iter, "iters": k, "warmup_s": round(warm, 6)})
        del x
        total = warm + per_iter * k
        next_est = 2 * (warm + per_iter)  # the next size's warm-up plus one timed iteration
        if nbytes == params["sizes"][-1]:
            break
        if total > budget:
            return rows, "%s took %.1fs (> size_budget_s %.0fs)" % (human_bytes(nbytes), total, budget)
        if next_est > budget or spent + next_est > sweep_budget:
            return rows, "%s would take ~%.1fs (size_budget_s %.0fs, sweep_budget_s %.0fs, %.1fs spent)" % (
                human_bytes(nbytes * 2), next_est, budget, sweep_budget, spent)
    return rows, None


def rank(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """One rank (started by host_group with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set)."""
    from . import agent
    job = params["job"]
    info: Dict[str, Any] = {"tag": job["tag"], "rank": int(os.environ.get("RANK", "-1")),
                            "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
                            "world_size": int(os.environ.get("WORLD_SIZE", "0")), "host": params["host"],
                            "pid": os.getpid(), "ok": False, "phase": "import"}
    start = time.monotonic()
    dist = None
    initialized = False

    def phase(name: str) -> None:
        info["phase"] = name
        info.setdefault("phases", {})[name] = round(time.monotonic() - start, 3)
        _mark(name)

    try:
        phase("import")
        try:
            import datetime
            import torch
            import torch.distributed as dist
        except Exception as exc:
            raise _Failed("torch_missing", "torch is not importable by %s: %s: %s"
                          % (sys.executable, type(exc).__name__, str(exc)[:200])) from None
        backend = params["backend"]
        if backend == "nccl":
            torch.cuda.set_device(int(job["device"]))
            dev = torch.device("cuda", int(job["device"]))
            info["device"] = int(job["device"])
        else:
            dev = torch.device("cpu")
        timeout = float(params["init_timeout_s"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # Every rank gets the same start allowance, counted from its own launch (they launch together).
        starting_until = start + float(params["start_timeout_s"]) + timeout
        phase("rendezvous")
        if info["rank"] != 0:
            info["rendezvous_s"] = round(_await_master(addr, port, timeout, starting_until), 3)
        phase("join")
        store = _join(dist, addr, port, info["rank"], info["world_size"], starting_until, timeout)
        phase("init")
        # The timeout bounds init and every collective; torch's default (10 min) is far too long here.
        dist.init_process_group(backend=backend, store=store, rank=info["rank"], world_size=info["world_size"],
                                timeout=datetime.timedelta(seconds=timeout))
        initialized = True
        phase("connect")  # NCCL connects lazily: the first collective builds the rings
        one = torch.ones(1, dtype=torch.float32, device=dev)
        dist.all_reduce(one)
        if one.item() != info["world_size"]:
            raise _Failed("wrong_result", "all-reduce of ones over %d ranks gave a wrong sum %s"
                          % (info["world_size"], one.item()))
        phase("sweep")
        info["sizes"], info["stopped_early"] = _sweep(torch, dist, dev, params, info["world_size"])
        info["backend"] = backend
        info["ok"] = True
        phase("done")
    except agent.Abort as exc:
        info.update(kind="aborted", error="aborted (%s) in phase %s after %.0fs"
                    % (exc, info["phase"], time.monotonic() - start))
    except _Failed as exc:
        info.update(kind=exc.kind, error=str(exc), target=exc.target)
    except Exception as exc:
        text = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0][:600] if str(exc).strip() else "")
        info.update(kind=classify(text, info["phase"]), error=text)
    finally:
        info["elapsed_s"] = round(time.monotonic() - start, 3)
        if initialized and info["ok"] and dist is not None:
            try:  # only after success: tearing down a broken NCCL communicator can hang
                dist.destroy_process_group()
            except Exception:
                pass
    return info


# --- host side: the ranks of one host ----------------------------------------------------------------------------

class _Job:
    def __init__(self, spec: Dict[str, Any], proc: "subprocess.Popen[bytes]"):
        self.spec = spec
        self.proc = proc
        self.phase = "start"
        self.phase_since = time.monotonic()
        self.result_line: Optional[str] = None
        self.err = bytearray()
        self.killed: Optional[str] = None
        self.killed_after = 0.0  # seconds the rank had been in its phase when it was killed
        self.threads: List[threading.Thread] = []

    def read_out(self) -> None:
        from . import agent
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(PHASE + " "):
                try:
                    self.phase = json.loads(line[len(PHASE) + 1:])["phase"]
                    self.phase_since = time.monotonic()
                except (ValueError, KeyError):
                    pass
            elif line.startswith(agent.RESULT + " "):
                self.result_line = line

    def read_err(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read(4096), b""):
            self.err.extend(chunk)
            if len(self.err) > 16384:  # keep the tail: the last lines hold the error
                del self.err[:-8192]

    def failed(self) -> bool:
        """For an exited rank: did it fail (no result, or a result with ok false)?"""
        from . import agent
        if self.proc.returncode != 0 or not self.result_line:
            return True
        payload = agent.read_result(self.result_line.encode())
        return not (payload.get("ok") and isinstance(payload.get("value"), dict) and payload["value"].get("ok"))

    def outcome(self) -> Dict[str, Any]:
        from . import agent
        entry: Dict[str, Any] = {"tag": self.spec["tag"], "rank": self.spec["rank"],
                                 "local_rank": self.spec["local_rank"], "world_size": self.spec["world_size"],
                                 "host": self.spec["host"], "ok": False}
        payload = agent.read_result((self.result_line or "").encode())
        if payload.get("ok") and isinstance(payload.get("value"), dict):
            entry.update(payload["value"])
        elif self.result_line:
            entry.update(kind="other", error="rank agent failed: %s" % payload.get("error"))
        if self.killed and not entry.get("ok"):
            hung = self.killed.startswith("hung")
            entry.update(kind="hung" if hung else "stopped", error=self.killed, phase=self.phase,
                         phase_s=round(self.killed_after, 1))
        elif not entry.get("ok") and "error" not in entry:
            entry.update(kind="other", phase=self.phase,
                         error="rank exited with code %s without a result in phase %s" % (self.proc.returncode,
                                                                                         self.phase))
        tail = self.err.decode(errors="replace").strip().splitlines()
        # torch's C++ frames are noise; the lines before them say what happened.
        tail = [ln for ln in tail if not ln.startswith(("frame #", "Exception raised from", "<omitting"))]
        if not entry.get("ok"):
            entry["stderr_tail"] = "\n".join(tail[-8:])[-2000:]
        entry["exit_code"] = self.proc.returncode
        entry["last_phase"] = self.phase
        return entry


def _terminate(jobs: Sequence[_Job], grace: float) -> None:
    """SIGTERM every rank's process group at once, SIGKILL what is left after grace; never one after another,
    so that stopping many ranks stays within the agent's 2 s before it interrupts us."""
    from . import base
    alive = [j for j in jobs if j.proc.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for j in alive:
            try:
                os.killpg(j.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(j.proc.poll() is None for j in alive):
            time.sleep(0.05)
        alive = [j for j in alive if j.proc.poll() is None]
        if not alive:
            break
    for j in jobs:
        base.stop(j.proc, grace=0)  # reaps and forgets


def _allowance(phase: str, params: Dict[str, Any]) -> float:
    """How long a rank may stay in one phase before it counts as hung (C code ignores our signals meanwhile)."""
    init = float(params["init_timeout_s"])
    starting = float(params["start_timeout_s"]) + init + 10  # the rank's own start deadline, and a margin
    return {"start": float(params["start_timeout_s"]), "import": float(params["start_timeout_s"]),
            "rendezvous": starting, "join": starting, "init": init + 10, "connect": init + 10,
            "sweep": float(params["sweep_budget_s"]) + 2 * float(params["size_budget_s"]) + init + 10,
            }.get(phase, 30.0)


def host_group(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """Start one rank process per job on this host and watch them; on a failure, give the others grace_s to report
    their own errors, then kill them all. Returns every rank's result (or the phase it was killed in)."""
    from . import agent
    jobs: List[_Job] = []
    started = time.monotonic()
    stop_reason: Optional[str] = None
    failed_at: Optional[float] = None
    grace = float(params.get("grace_s", 5.0))
    ifname = params.get("ifname")
    try:
        for spec in params["jobs"]:
            env = {"MASTER_ADDR": spec["master_addr"], "MASTER_PORT": str(spec["master_port"]),
                   "RANK": str(spec["rank"]), "WORLD_SIZE": str(spec["world_size"]),
                   "LOCAL_RANK": str(spec["local_rank"]), "LOCAL_WORLD_SIZE": str(spec["local_world_size"]),
                   # one reduction thread per rank: many ranks per host must not oversubscribe the cores
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   # a NCCL timeout raises in the rank (with the reason) instead of killing it silently
                   "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
            if ifname:
                env["GLOO_SOCKET_IFNAME"] = ifname
                env["NCCL_SOCKET_IFNAME"] = "=" + ifname  # '=': exactly this name, not every eth1* prefix match
            spec = dict(spec, host=params["host"])
            proc = agent.spawn_call("allreduce.rank", dict(params["rank_params"], job=spec, host=params["host"]),
                                    float(params["rank_timeout_s"]), env=env)
            job = _Job(spec, proc)
            for target in (job.read_out, job.read_err):
                t = threading.Thread(target=target, daemon=True)
                t.start()
                job.threads.append(t)
            jobs.append(job)
        if ctx is not None and ctx.ready is not None:
            ctx.ready({"pids": [j.proc.pid for j in jobs], "ifname": ifname})
        deadline = (ctx.deadline if ctx is not None else started + float(params["rank_timeout_s"]) + 10) - 5
        while any(j.proc.poll() is None for j in jobs):
            if ctx is not None and ctx.wait_stop is not None:
                if ctx.wait_stop(0.2):
                    stop_reason = "stopped by preflight: a rank on another host failed"
                    break
            else:
                time.sleep(0.2)
            now = time.monotonic()
            if now > deadline:
                stop_reason = "hung: no result within the %.0fs deadline (phase %%s)" % (deadline - started)
                break
            for j in jobs:
                if j.proc.poll() is None:
                    if now - j.phase_since > _allowance(j.phase, params["rank_params"]):
                        j.killed_after = now - j.phase_since
                        j.killed = "hung in phase %s for %.0fs and was killed" % (j.phase, j.killed_after)
                        _terminate([j], 1.0)
                        failed_at = failed_at or now
                elif j.failed():
                    failed_at = failed_at or now
            if failed_at is not None and now - failed_at > grace:
                stop_reason = "stopped by preflight after another rank failed"
                break
    finally:
        for j in jobs:
            if j.proc.poll() is None and j.killed is None and stop_reason:
                j.killed_after = time.monotonic() - j.phase_since
                j.killed = stop_reason % j.phase if "%s" in stop_reason else stop_reason
        _terminate(jobs, 1.0)
        for j in jobs:
            for t in j.threads:
                t.join(2.0)
    return {"host": params["host"], "ifname": ifname, "elapsed_s": round(time.monotonic() - started, 3),
            "ranks": [j.outcome() for j in jobs]}


# --- coordinator ---------------------------------------------------------------------------------------------------

def _iperf3(cluster: Any) -> Dict[str, Any]:
    facts = (cluster.facts.get("*") or {}).get("iperf3")
    return facts if isinstance(facts, dict) else {}


def _iperf3_stragglers(iperf: Dict[str, Any], hosts: Sequence[str], fraction: float) -> List[Dict[str, Any]]:
    """Stragglers of the iperf3 check's links on the chosen network, by that check's own rule (a host's median link
    against the median of the links without it), so that both checks blame the same host."""
    chosen = iperf.get("chosen") or {}
    nets = [n for n in iperf.get("networks") or [] if isinstance(n, dict) and n.get("links")]
    net = next((n for n in nets if n.get("network") == chosen.get("network")), None) or (nets[0] if nets else None)
    if not net:
        return []
    try:
        from .iperf3 import find_stragglers
        found = find_stragglers([ln for ln in net["links"] if isinstance(ln, dict)], list(hosts), fraction)
    except Exception:  # another check's facts: a schema change there must not break this check
        return []
    return [{"host": h, "reason": "iperf3 on %s: its median link %.2f Gbit/s is %.0f%% of the other links' %.2f"
             % (net.get("network"), s["median_gbps"], 100 * s["ratio"], s["reference_gbps"]),
             "source": "iperf3", "kind": "slow"} for h, s in found.items()]


def _plan_jobs(hosts: Sequence[Any], master_addr: str, port: int) -> Dict[str, List[Dict[str, Any]]]:
    """Global ranks in hostfile order, one per slot; LOCAL_RANK indexes the host's GPUs (DeepSpeed's layout)."""
    world = sum(h.slots for h in hosts)
    jobs: Dict[str, List[Dict[str, Any]]] = {}
    base_rank = 0
    for h in hosts:
        gpus = list(h.gpus) or list(range(h.slots))
        jobs[h.name] = [{"tag": "main", "rank": base_rank + i, "local_rank": i, "local_world_size": h.slots,
                         "world_size": world, "master_addr": master_addr, "master_port": port,
                         "device": gpus[i] if i < len(gpus) else i} for i in range(h.slots)]
        base_rank += h.slots
    return jobs


def _pair_jobs(pairs: Sequence[Tuple[Any, Any]], addr_of: Dict[str, str], port: int) -> Dict[str, List[Dict[str, Any]]]:
    """Two-rank groups; the first host of a pair is its master, so with the ring every host is a master once and
    a host that drops inbound TCP fails its own pair's rendezvous."""
    jobs: Dict[str, List[Dict[str, Any]]] = {}
    for a, b in pairs:
        tag = "pair:%s,%s" % (a.name, b.name)
        for r, h in enumerate((a, b)):
            mine = jobs.setdefault(h.name, [])
            gpus = list(h.gpus) or [0]
            mine.append({"tag": tag, "rank": r, "local_rank": 0, "local_world_size": 1, "world_size": 2,
                         "master_addr": addr_of[a.name], "master_port": port,
                         "device": gpus[len(mine) % len(gpus)]})
    return jobs


def _host_failed(value: Any) -> bool:
    if isinstance(value, BaseException):
        return True
    return any(not r.get("ok") for r in value.get("ranks", []))


def _run_groups(cluster: Any, jobs: Dict[str, List[Dict[str, Any]]], common: Dict[str, Any], grace: float
                ) -> Dict[str, Any]:
    """Start host_group on every host, wait for all; after the first failure wait grace seconds, then stop the
    rest. Every Service is stopped (or killed) before returning, whatever happens."""
    timeout = float(common["rank_timeout_s"]) + 20
    services: Dict[str, Any] = {}
    results: Dict[str, Any] = {}
    lock = threading.Lock()

    def waiter(host: str) -> None:
        try:
            value = services[host].result(timeout + 15)
        except BaseException as exc:  # noqa: BLE001 - an agent failure is this host's result
            value = exc
        with lock:
            results.setdefault(host, value)

    def stopper(host: str) -> None:
        try:
            value = services[host].stop(15)
        except BaseException as exc:  # noqa: BLE001
            value = exc
        with lock:
            results.setdefault(host, value)

    threads: List[threading.Thread] = []
    try:
        for host, host_jobs in jobs.items():
            params = dict(common, host=host, jobs=host_jobs, ifname=common["ifnames"].get(host))
            params.pop("ifnames", None)
            try:
                services[host] = cluster.start(host, "allreduce.host_group", params, timeout)
            except Exception as exc:
                results[host] = exc
                break
        if len(services) == len(jobs):
            for host in services:
                t = threading.Thread(target=waiter, args=(host,), daemon=True)
                t.start()
                threads.append(t)
            deadline = time.monotonic() + timeout + 20
            failed_at: Optional[float] = None
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                time.sleep(0.2)
                with lock:
                    if failed_at is None and any(_host_failed(v) for v in results.values()):
                        failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > grace:
                    break
    finally:
        pending = [h for h in services if h not in results]
        stoppers = [threading.Thread(target=stopper, args=(h,), daemon=True) for h in pending]
        for t in stoppers:
            t.start()
        for t in stoppers + threads:
            t.join(20)
        for svc in services.values():
            cmd = getattr(svc, "cmd", None)
            if cmd is None or not cmd.done:
                try:
                    svc.kill()  # the last word for an agent that ignored its stdin closing
                except Exception:
                    pass
    for host in jobs:
        results.setdefault(host, RuntimeError("not started on %s: starting the ranks failed on another host" % host
                                              if host not in services else "no answer from %s" % host))
    return results


def _collect_ranks(results: Dict[str, Any], jobs: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    ranks: List[Dict[str, Any]] = []
    for host, value in results.items():
        if isinstance(value, BaseException):
            for spec in jobs.get(host, []):
                ranks.append({"tag": spec["tag"], "rank": spec["rank"], "local_rank": spec["local_rank"],
                              "world_size": spec["world_size"], "host": host, "ok": False, "kind": "other",
                              "phase": "start", "error": "the agent on %s failed: %s" % (host, value)})
        else:
            ranks.extend(value.get("ranks", []))
    return ranks


def _why(text: str) -> str:
    low = (text or "").lower()
    for word, short in (("timed out", "timed out"), ("refused", "refused"), ("unreachable", "unreachable"),
                        ("no route", "no route to host")):
        if word in low:
            return short
    return "failed"


def _rank_errors(ranks: Sequence[Dict[str, Any]], owner: Dict[str, str], init_timeout: float
                 ) -> List[Dict[str, Any]]:
    """Failed ranks, most likely root cause first: by kind, then errors naming a peer over a rank's own, by rank."""
    errors = []
    for r in ranks:
        if r.get("ok"):
            continue
        text = " ".join(str(r.get(k) or "") for k in ("error", "stderr_tail"))
        phase = r.get("phase") or r.get("last_phase") or ""
        kind = r.get("kind") or classify(text, phase)
        error_text = (r.get("error") or "")[:600]
        if kind == "stopped" and phase in ("init", "connect") and (r.get("phase_s") or 0) >= 0.9 * init_timeout:
            # Still connecting to its peers after the whole init timeout: this rank was waiting, not bystanding.
            kind = "mesh"
            error_text = "still connecting after %.0fs, phase %s" % (r["phase_s"], phase)
        targets = [r["target"]] if r.get("target") else _addresses_in(r.get("error", ""))
        errors.append({"tag": r.get("tag"), "rank": r.get("rank"), "local_rank": r.get("local_rank"),
                       "host": r.get("host"), "kind": kind, "phase": phase, "error": error_text,
                       "stderr_tail": (r.get("stderr_tail") or "")[-800:],
                       "targets": [{"address": a, "host": owner.get(a)} for a in targets],
                       "elapsed_s": r.get("elapsed_s")})

    def order(e: Dict[str, Any]) -> Tuple[int, int, int]:
        self_only = all(t.get("host") == e["host"] for t in e["targets"]) if e["targets"] else True
        return (KIND_ORDER.index(e["kind"]) if e["kind"] in KIND_ORDER else 99, 1 if self_only else 0,
                e["rank"] if isinstance(e["rank"], int) else 0)
    errors.sort(key=order)
    return errors


def _unreachable(errors: Sequence[Dict[str, Any]], port: int) -> Dict[str, Dict[str, Any]]:
    """{host: {"from": [(rank, host)], "why"}} for hosts whose rendezvous port a rank could not connect to."""
    found: Dict[str, Dict[str, Any]] = {}
    for e in errors:
        if e["kind"] != "rendezvous":
            continue
        for t in e["targets"]:
            if t.get("host"):
                entry = found.setdefault(t["host"], {"from": [], "why": _why(e["error"]), "port": port})
                entry["from"].append((e["rank"], e["host"]))
    return found


def _describe_unreachable(host: str, entry: Dict[str, Any], where: str = "") -> str:
    peers = [h for _, h in entry["from"] if h != host]
    who = ("%s on %s" % (_rank_list([r for r, h in entry["from"] if h != host]), _names(peers))) if peers \
        else "its own rank %s" % entry["from"][0][0]
    return "connections from %s to its port %s %s%s" % (who, entry["port"], entry["why"], where)


def _group_table(ranks: Sequence[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """Per size, the slowest rank's time (all ranks agreed on it already; max() keeps it right if not)."""
    by_size: Dict[int, Dict[str, Any]] = {}
    stopped = None
    for r in ranks:
        stopped = stopped or r.get("stopped_early")
        for row in r.get("sizes") or []:
            cur = by_size.get(row["bytes"])
            if cur is None or row["time_s"] > cur["time_s"]:
                by_size[row["bytes"]] = dict(row)
    return [by_size[b] for b in sorted(by_size)], stopped


def _failure_suspects(errors: Sequence[Dict[str, Any]], port: int) -> List[Dict[str, Any]]:
    """Hosts named by the errors alone: whose MASTER_ADDR port the others could not reach, or a host's own problem
    (port in use, no torch, no GPU, out of memory)."""
    suspects: List[Dict[str, Any]] = []
    for host, entry in _unreachable(errors, port).items():
        suspects.append({"host": host, "reason": _describe_unreachable(host, entry, " in the full run"),
                         "source": "errors", "kind": "rendezvous"})
    for e in errors:
        if e["kind"] in ("port_in_use", "torch_missing", "no_gpu", "oom", "wrong_result") \
                and e["host"] not in [x["host"] for x in suspects]:
            suspects.append({"host": e["host"], "reason": e["error"][:300], "source": "errors", "kind": e["kind"]})
    return suspects


def _pair_suspects(pairs: Sequence[Dict[str, Any]], mode: str, fraction: float) -> List[Dict[str, Any]]:
    """From pairwise runs: a host a peer could not reach, a host that fails with every peer, or (bandwidth mode)
    a host whose best pair is below fraction x the median host's best pair."""
    suspects: Dict[str, Dict[str, Any]] = {}
    per_host: Dict[str, List[Dict[str, Any]]] = {}
    for p in pairs:
        for h in p["hosts"]:
            per_host.setdefault(h, []).append(p)
    for p in pairs:
        for h, reason in (p.get("unreachable") or {}).items():
            suspects.setdefault(h, {"host": h, "reason": reason, "source": "pairwise", "kind": "rendezvous"})
    for h, ps in per_host.items():
        if len(ps) >= 2 and all(not p["ok"] for p in ps) and h not in suspects:
            suspects[h] = {"host": h, "reason": "its all-reduce fails with every peer tried (%s)"
                           % ", ".join(o for p in ps for o in p["hosts"] if o != h), "source": "pairwise",
                           "kind": "mesh"}
    if mode == "bandwidth":
        best = {h: max([p["busbw_GBps"] for p in ps if p["ok"] and p.get("busbw_GBps")] or [0.0])
                for h, ps in per_host.items()}
        if len(best) >= 3:
            ordered = sorted(best.values())
            median = ordered[len(ordered) // 2]
            for h, b in best.items():
                if b < fraction * median and h not in suspects:
                    suspects[h] = {"host": h, "reason": "its best pairwise all-reduce reaches %s GB/s busbw, the "
                                   "median host's %s GB/s" % (_gbps(b), _gbps(median)), "source": "pairwise",
                                   "kind": "slow"}
    return list(suspects.values())


def _pairwise(cluster: Any, hosts: Sequence[Any], addr_of: Dict[str, str], common: Dict[str, Any],
              cfg: Dict[str, Any], mode: str, nbytes: int, owner: Dict[str, str]) -> Dict[str, Any]:
    """Bounded pairwise all-reduce runs: the ring (each host paired with both neighbours). For a failure, all ring
    pairs at once (only connectivity matters); for bandwidth, rounds of disjoint pairs (2 or 3 rounds)."""
    from .schedule import ring_rounds
    n = len(hosts)
    rounds = ring_rounds(n)
    if mode == "failure":
        rounds = [[p for rnd in rounds for p in rnd]]
    rank_params = dict(common["rank_params"], sizes=[int(nbytes)], init_timeout_s=float(cfg["pair_init_timeout_s"]),
                       iters=1 if mode == "failure" else int(cfg["iters"]))
    # Joining (start + init at most), init, the first collective, the one size: as in the main run.
    rank_timeout = float(cfg["start_timeout_s"]) + 3 * float(cfg["pair_init_timeout_s"]) \
        + 2 * float(cfg["size_budget_s"]) + 15
    out: List[Dict[str, Any]] = []
    for rnd in rounds:
        pairs = [(hosts[a], hosts[b]) for a, b in rnd]
        jobs = _pair_jobs(pairs, addr_of, int(common["port"]))
        results = _run_groups(cluster, jobs, dict(common, rank_params=rank_params, rank_timeout_s=rank_timeout),
                              float(cfg["grace_s"]))
        ranks = _collect_ranks(results, jobs)
        for a, b in pairs:
            tag = "pair:%s,%s" % (a.name, b.name)
            mine = [r for r in ranks if r.get("tag") == tag]
            entry: Dict[str, Any] = {"hosts": [a.name, b.name], "master": a.name,
                                     "ok": len(mine) == 2 and all(r.get("ok") for r in mine)}
            if entry["ok"]:
                table = bandwidth_table(_group_table(mine)[0], 2)
                if table:
                    entry.update(bytes=table[-1]["bytes"], busbw_GBps=table[-1]["busbw_GBps"])
            else:
                errs = _rank_errors(mine, owner, float(cfg["pair_init_timeout_s"]))
                primary = errs[0] if errs else {"error": "no result", "kind": "other", "targets": []}
                entry["error"] = "rank %s on %s: %s" % (primary.get("rank"), primary.get("host"), primary["error"])
                entry["kind"] = primary["kind"]
                where = " in the pair %s+%s" % (a.name, b.name)
                entry["unreachable"] = {h: _describe_unreachable(h, u, where)
                                        for h, u in _unreachable(errs, int(common["port"])).items()}
            out.append(entry)
    return {"mode": mode, "bytes": int(nbytes), "pairs": out,
            "suspects": _pair_suspects(out, mode, float(cfg["straggler_fraction"]))}


def _gpu_baseline(facts: Dict[str, Any], cfg: Dict[str, Any]) -> Optional[Tuple[str, float]]:
    names = [n for ns in (facts.get("gpu_names") or {}).values() for n in ns]
    if not names or len(set(names)) != 1:
        return None
    model = names[0][len("NVIDIA "):] if names[0].startswith("NVIDIA ") else names[0]
    table = cfg.get("single_node_busbw") or {}
    return (model, float(table[model])) if model in table else None


def judge(facts: Dict[str, Any], cfg: Dict[str, Any]) -> Tuple[List[Finding], Dict[str, Any]]:
    """Bandwidth findings for a completed run: --min-busbw, the single-node per-GPU baseline, the iperf3 cross-check."""
    n = int(facts.get("world_size") or 0)
    table = bandwidth_table(facts.get("sizes") or [], n)
    notes: Dict[str, Any] = {}
    findings: List[Finding] = []
    if not table:
        return findings, notes
    last = table[-1]
    busbw, size = last["busbw_GBps"], human_bytes(last["bytes"])
    min_busbw = facts.get("min_busbw")
    if min_busbw:
        if busbw < float(min_busbw):
            findings.append(Finding(Status.FAIL, "busbw %s GB/s at %s < --min-busbw %s GB/s"
                                    % (_gbps(busbw), size, _gbps(float(min_busbw))),
                                    "look at the suspect host(s) named here (the iperf3 check measures each link); "
                                    "with GPUs check NCCL_SOCKET_IFNAME/NCCL_IB_HCA (NCCL_DEBUG=INFO shows the NIC)"))
        else:
            findings.append(Finding(Status.PASS, "busbw >= --min-busbw %s GB/s" % _gbps(float(min_busbw))))
    single = len(facts.get("hosts") or []) == 1
    baseline = _gpu_baseline(facts, cfg) if facts.get("backend") == "nccl" else None
    if baseline and single and n == int(cfg["baseline_ranks"]):
        model, expected = baseline
        notes["baseline"] = {"gpu": model, "busbw_GBps": expected}
        if last["bytes"] < int(cfg["baseline_min_bytes"]):
            notes["baseline_note"] = ("not compared: the largest size measured (%s) is below baseline_min_bytes (%s),"
                                      " where busbw has not plateaued" % (size, human_bytes(cfg["baseline_min_bytes"])))
        elif busbw < float(cfg["baseline_fail_fraction"]) * expected:
            findings.append(Finding(Status.FAIL, "busbw %s GB/s at %s is below %.0f%% of the published %d x %s "
                                    "single-node baseline %s GB/s" % (_gbps(busbw), size,
                                                                      100 * float(cfg["baseline_fail_fraction"]),
                                                                      n, model, _gbps(expected)),
                                    "check nvidia-smi topo -m (NVLink/NVSwitch), nvidia-fabricmanager, and GPU clocks"))
        elif busbw < expected:
            findings.append(Finding(Status.WARN, "busbw %s GB/s at %s is below the published %d x %s single-node "
                                    "baseline %s GB/s" % (_gbps(busbw), size, n, model, _gbps(expected)),
                                    "NVLS disabled (NCCL_NVLS_ENABLE=0) or a degraded NVLink gives this; compare "
                                    "with nccl-tests all_reduce_perf -b 1G -e 16G"))
    elif baseline and not single:
        notes["baseline_note"] = "single-node baselines do not apply to a %d-host run" % len(facts.get("hosts") or [])
    iperf_gbps = facts.get("iperf3_median_gbps")
    if facts.get("backend") == "nccl" and not single and isinstance(iperf_gbps, (int, float)) and iperf_gbps > 0:
        expected = float(iperf_gbps) / 8
        if busbw < float(cfg["min_fraction_of_iperf3"]) * expected:
            findings.append(Finding(Status.WARN, "busbw %s GB/s is below %.0f%% of the %s GB/s TCP bandwidth iperf3 "
                                    "measured on the chosen network" % (_gbps(busbw),
                                                                        100 * float(cfg["min_fraction_of_iperf3"]),
                                                                        _gbps(expected)),
                                    "NCCL may use a slower interface: set NCCL_SOCKET_IFNAME/NCCL_IB_HCA as "
                                    "recommended, and check NCCL_DEBUG=INFO's 'NET/' lines"))
    return findings, notes


def coordinate(cluster: Any) -> Dict[str, Any]:
    cfg = settings(cluster.thresholds)
    t0 = time.monotonic()
    hosts = list(cluster.hosts)
    port = int(cluster.options.get("master_port") or 29500)
    facts: Dict[str, Any] = {"hosts": [h.name for h in hosts], "slots": {h.name: h.slots for h in hosts},
                             "world_size": sum(h.slots for h in hosts), "master_port": port,
                             "min_busbw": cluster.options.get("min_busbw"),
                             "unreachable": [h.name for h in cluster.all_hosts if h.name not in
                                             {x.name for x in hosts}]}
    master = cluster.master if cluster.master.name in facts["slots"] else hosts[0]
    iperf = _iperf3(cluster)
    chosen = iperf.get("chosen") or {}
    chosen_addr = chosen.get("addresses") or {}
    master_addr = chosen_addr.get(master.name) or cluster.address(master.name)
    addr_of = {h.name: chosen_addr.get(h.name) or cluster.address(h.name) for h in hosts}
    owner = {a: h for h, a in addr_of.items()}
    owner.update({cluster.address(h.name): h.name for h in hosts})
    facts.update(master=master.name, master_addr=master_addr, network=chosen.get("network"),
                 iperf3_median_gbps=chosen.get("median_gbps"), init_timeout_s=float(cfg["init_timeout_s"]))

    def done(status: str, **more: Any) -> Dict[str, Any]:
        facts.update(status=status, duration_s=round(time.monotonic() - t0, 3), **more)
        return facts

    if facts["world_size"] <= 1:
        return done("skipped", reason="world size %d: NCCL turns a 1-rank all-reduce into a no-op (and gloo a local "
                                      "copy), so it measures no bandwidth" % facts["world_size"])
    # 1. probe: torch, GPUs and interface on every host, so that every rank gets the same backend.
    cluster.progress.note("allreduce: probing torch on %d hosts" % len(hosts))
    probes = cluster.call_all("allreduce.probe", {h.name: {"master_addr": master_addr,
                                                           "bind_address": chosen_addr.get(h.name)} for h in hosts},
                              float(cfg["start_timeout_s"]))
    broken = {h: str(v) for h, v in probes.items() if isinstance(v, BaseException)}
    if broken:
        return done("error", reason="could not probe torch on %s: %s" % (_names(list(broken)),
                                                                          next(iter(broken.values()))[:300]))
    facts["torch"] = {h: p.get("torch") for h, p in probes.items()}
    no_torch = {h: p["error"] for h, p in probes.items() if p.get("torch") is None}
    if no_torch:
        return done("no_torch", hosts_without_torch=sorted(no_torch), reason=next(iter(no_torch.values())),
                    python=cluster.options.get("python"))
    facts["interfaces"] = {h: p.get("interface") for h, p in probes.items()}
    ifnames = {h: (p.get("interface") or {}).get("ifname") for h, p in probes.items()}
    cuda = {h: bool(p.get("cuda")) for h, p in probes.items()}
    # GPUs that the gpu check found but torch cannot use would silently turn this into a CPU (gloo) measurement.
    blind = {h.name: len(((cluster.facts.get(h.name) or {}).get("gpu") or {}).get("gpus") or []) for h in hosts}
    blind = {h: n for h, n in blind.items() if n and not cuda[h]}
    if blind:
        return done("failed", backend="none", errors=[], failure={"kind": "no_gpu", "message": "; ".join(
            "%s has %d GPU(s) but torch %s there sees none (torch.cuda.is_available() is False%s)"
            % (h, n, probes[h].get("torch"), ": " + probes[h]["cuda_error"] if probes[h].get("cuda_error") else
               ": a CPU-only torch build?") for h, n in blind.items())},
            localization={"suspects": [{"host": h, "reason": "torch does not see its %d GPU(s)" % n,
                                        "source": "probe", "kind": "no_gpu"} for h, n in blind.items()]})
    if all(cuda.values()):
        backend = "nccl"
        short = {h.name: "slots=%d needs GPUs %s but torch sees %d" % (h.slots, list(h.gpus),
                                                                       probes[h.name]["device_count"])
                 for h in hosts if max(list(h.gpus) or [h.slots - 1]) >= probes[h.name]["device_count"]}
        if short:
            return done("failed", backend=backend, failure={"kind": "no_gpu", "message": "; ".join(
                "%s: %s" % kv for kv in short.items())}, errors=[],
                localization={"suspects": [{"host": h, "reason": why, "source": "probe", "kind": "no_gpu"}
                                           for h, why in short.items()]})
        facts["gpu_names"] = {h.name: [probes[h.name]["gpu_names"][g] for g in (list(h.gpus) or range(h.slots))]
                              for h in hosts}
        facts["nccl"] = {h: p.get("nccl") for h, p in probes.items()}
    elif any(cuda.values()):
        without = sorted(h for h, c in cuda.items() if not c)
        return done("failed", backend="mixed", failure={"kind": "no_gpu", "message": "torch sees no CUDA GPU on %s "
                                                        "while the other hosts have GPUs: NCCL cannot run there"
                                                        % _names(without)}, errors=[],
                    localization={"suspects": [{"host": h, "reason": "torch.cuda.is_available() is False",
                                                "source": "probe", "kind": "no_gpu"} for h in without]})
    else:
        backend = "gloo"
    facts["backend"] = backend
    # 2. the all-reduce itself.
    max_bytes = int(cfg["gpu_max_bytes"] if backend == "nccl" else cfg["max_bytes"])
    rank_params = {"backend": backend, "sizes": sweep_sizes(int(cfg["min_bytes"]), max_bytes),
                   "iters": int(cfg["iters"]), "size_budget_s": float(cfg["size_budget_s"]),
                   "sweep_budget_s": float(cfg["sweep_budget_s"]), "init_timeout_s": float(cfg["init_timeout_s"]),
                   "start_timeout_s": float(cfg["start_timeout_s"])}
    # Joining ends by start + init (every rank's own deadline); init and the first collective get init each.
    rank_timeout = float(cfg["start_timeout_s"]) + 3 * float(cfg["init_timeout_s"]) \
        + float(cfg["sweep_budget_s"]) + 2 * float(cfg["size_budget_s"]) + 15
    common = {"rank_params": rank_params, "rank_timeout_s": rank_timeout, "grace_s": float(cfg["grace_s"]),
              "ifnames": ifnames, "port": port}
    jobs = _plan_jobs(hosts, master_addr, port)
    cluster.progress.note("allreduce: %d ranks (%s) on %d hosts" % (facts["world_size"], backend, len(hosts)))
    results = _run_groups(cluster, jobs, common, float(cfg["grace_s"]))
    ranks = [r for r in _collect_ranks(results, jobs) if r.get("tag") == "main"]
    layout = [{"rank": r.get("rank"), "local_rank": r.get("local_rank"), "host": r.get("host"), "pid": r.get("pid"),
               "device": r.get("device")} for r in sorted(ranks, key=lambda r: r.get("rank") or 0)]
    facts["ranks"] = layout[:MAX_RANKS_IN_METRICS]
    agent_errors = {h: str(v) for h, v in results.items() if isinstance(v, BaseException)}
    errors = _rank_errors(ranks, owner, float(cfg["init_timeout_s"]))
    ok = not errors and not agent_errors and len(ranks) == facts["world_size"]
    sizes, stopped = _group_table(ranks)
    facts.update(sizes=sizes, stopped_early=stopped, errors=errors[:64], error_count=len(errors))
    localization: Dict[str, Any] = {"suspects": []}
    iperf_suspects = _iperf3_stragglers(iperf, [h.name for h in hosts], float(
        (cluster.thresholds.get("iperf3") or {}).get("straggler_warn_fraction", cfg["straggler_fraction"])))
    if not ok:
        primary = errors[0] if errors else {"kind": "other", "error": "; ".join(agent_errors.values())}
        facts["failure"] = {"kind": primary["kind"], "message": _failure_message(errors, facts, agent_errors)}
        if agent_errors and not any(e["kind"] not in ("other", "stopped", "aborted") for e in errors):
            # preflight's own machinery failed (the agent could not start the ranks): not a verdict on the cluster
            return done("error", reason=facts["failure"]["message"])
        localization["suspects"] = _failure_suspects(errors, port)
        if cfg["pairwise"] and len(hosts) >= 3 and primary["kind"] not in ("torch_missing", "no_gpu", "port_in_use"):
            cluster.progress.note("allreduce: failed; pairwise runs to find the host")
            localization["pairwise"] = _pairwise(cluster, hosts, addr_of, common, cfg, "failure",
                                                 int(cfg["min_bytes"]), owner)
            _merge(localization["suspects"], localization["pairwise"]["suspects"])
        if not localization["suspects"]:  # a slow link rarely breaks a run, but a dead one does: a hint at least
            _merge(localization["suspects"], iperf_suspects)
        facts["localization"] = localization
        return done(facts.get("status") or "failed")
    findings, _ = judge(facts, cfg)
    if any(f.status in (Status.WARN, Status.FAIL) for f in findings) and len(hosts) >= 2:
        _merge(localization["suspects"], iperf_suspects)
        if cfg["pairwise"] and len(hosts) >= 3:
            cluster.progress.note("allreduce: busbw low; pairwise runs to find the slow host")
            nbytes = min(int(sizes[-1]["bytes"]), int(cfg["pair_max_bytes"]))
            localization["pairwise"] = _pairwise(cluster, hosts, addr_of, common, cfg, "bandwidth", nbytes, owner)
            _merge(localization["suspects"], localization["pairwise"]["suspects"])
    facts["localization"] = localization
    return done("ok")


def _merge(into: List[Dict[str, Any]], more: Sequence[Dict[str, Any]]) -> None:
    seen = {s["host"]: s for s in into}
    for s in more:
        if s["host"] in seen:
            if s["reason"] not in seen[s["host"]]["reason"]:
                seen[s["host"]]["reason"] += "; " + s["reason"]
        else:
            into.append(dict(s))
            seen[s["host"]] = into[-1]


def _failure_message(errors: Sequence[Dict[str, Any]], facts: Dict[str, Any], agent_errors: Dict[str, str]) -> str:
    """One sentence naming the rank(s), host(s), what they tried and what happened."""
    if not errors:
        return "the all-reduce did not run: %s" % "; ".join("%s: %s" % kv for kv in agent_errors.items())[:500]
    primary = errors[0]
    kind = primary["kind"]
    same = [e for e in errors if e["kind"] == kind]
    if kind == "rendezvous":
        peers = [e for e in same if not all(t.get("host") == e["host"] for t in e["targets"])] or same
        selves = [e for e in same if e not in peers]
        text = peers[0]["error"]
        if "could not connect to MASTER_ADDR" not in text:  # torch's own message (rank 0 included)
            text = "could not connect to MASTER_ADDR %s:%s within %.0fs (%s)" % (
                facts.get("master_addr"), facts.get("master_port"), facts.get("init_timeout_s") or 0,
                _why(text) if _why(text) != "failed" else text[:200])
        msg = "%s on %s %s" % (_rank_list([e["rank"] for e in peers]), _names([e["host"] for e in peers]), text)
        if selves:
            msg += "; so did %s on %s itself" % (_rank_list([e["rank"] for e in selves]),
                                                 _names([e["host"] for e in selves]))
        if "timed out" in text and "firewall" not in text:
            msg += ": is inbound TCP to %s (MASTER_ADDR's host) blocked?" % facts.get("master")
    else:
        who = "%s on %s" % (_rank_list([e["rank"] for e in same]), _names([e["host"] for e in same]))
        if kind == "incomplete":
            joined = re.search(r"(\d+)/(\d+) clients joined", " ".join(e["error"] for e in same))
            msg = "%s waited in vain for the other ranks at the rendezvous%s within %.0fs: a rank did not start, or " \
                  "could not reach MASTER_ADDR %s:%s" % (
                      who, " (%s of %s ranks arrived)" % joined.groups() if joined else "",
                      facts.get("init_timeout_s") or 0, facts.get("master_addr"), facts.get("master_port"))
        elif kind == "mesh":
            msg = "%s could not connect to the other ranks after the rendezvous (%s): does a host drop inbound TCP " \
                  "on the ephemeral ports (1024-65535) gloo/NCCL connect to?" % (who, primary["error"][:200])
        elif kind in ("hung", "torch_missing"):
            msg = "%s: %s" % (who, primary["error"])
        else:
            msg = "%s failed in phase %s: %s" % (who, primary.get("phase"), primary["error"][:300])
    others = len(errors) - len(same)
    if others:
        msg += " (%d other rank(s) failed or were stopped after it)" % others
    return msg


# --- evaluate ------------------------------------------------------------------------------------------------------

_FIX = {
    "rendezvous": "open TCP port {port} on {master} to the other hosts (and 1024-65535 between all hosts: gloo and "
                  "NCCL connect on ephemeral ports), or pick a reachable MASTER_ADDR network",
    "mesh": "allow inbound TCP 1024-65535 between the hosts on the chosen network (firewalld/nftables/security "
            "groups); set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to an interface every host can reach",
    "incomplete": "look at the ranks that did not arrive (their errors are listed with -v); check that every host "
                  "can reach MASTER_ADDR {master}:{port}",
    "port_in_use": "another process holds port {port} on {master}: stop it or pass --master-port",
    "hung": "look at the host named above (load, firewall, NCCL_DEBUG=INFO output); raise init_timeout_s only if "
            "the hosts are merely slow",
    "torch_missing": "pass --python with the job's interpreter, or pip install torch on every host",
    "no_gpu": "fix the hostfile's slots or the GPUs (see the gpu check)",
    "oom": "free the GPUs (nvidia-smi shows who holds them)",
    "wrong_result": "a GPU or NIC corrupts data: run nccl-tests with -c 1 and check dmesg for Xid errors",
}


def _host_fix(suspect: Dict[str, Any], facts: Dict[str, Any], default: str) -> str:
    host = suspect["host"]
    if suspect.get("kind") in ("rendezvous", "mesh"):
        return ("allow inbound TCP from the other hosts on %s: port %s and 1024-65535 (gloo and NCCL connect on "
                "ephemeral ports); e.g. nft list ruleset / firewall-cmd --list-all there"
                % (host, facts.get("master_port")))
    if suspect.get("kind") == "slow":
        return ("check %s's link: ethtool (speed), ip -s link (errors, drops), the cable and switch port; compare "
                "with the iperf3 check" % host)
    return _FIX.get(suspect.get("kind") or "", default).format(port=facts.get("master_port"), master=host)


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    cfg = settings(thresholds)
    status = facts.get("status")
    base_metrics = {k: facts.get(k) for k in ("backend", "world_size", "hosts", "master", "master_addr",
                                              "master_port", "network", "unreachable", "duration_s")}
    base_metrics["interfaces"] = {h: (i or {}).get("ifname") for h, i in (facts.get("interfaces") or {}).items()}
    if status == "skipped":
        return {"*": skip(facts.get("reason", "not run"), **base_metrics)}
    if status == "no_torch":
        hosts = facts.get("hosts_without_torch") or []
        msg = "torch is not importable on %s (%s): the all-reduce cannot run" % (_names(hosts), facts.get("reason"))
        fix = "pass --python with the job's interpreter, or pip install torch on every host"
        # The job is a PyTorch job: without torch it cannot start, so this FAILs like [python] require_torch does.
        if thresholds.get("python", {}).get("require_torch", True):
            return {"*": Outcome(Status.FAIL, msg, fix, metrics=base_metrics)}
        return {"*": skip(msg + " ([python] require_torch = false)", **base_metrics)}
    if status == "error":
        return {"*": error("could not run the all-reduce: %s" % (facts.get("reason") or
                                                                (facts.get("failure") or {}).get("message")),
                           "rerun with -v; check that --python works on every host", **base_metrics)}
    suspects = (facts.get("localization") or {}).get("suspects") or []
    metrics = dict(base_metrics)
    metrics["localization"] = facts.get("localization")
    if status == "failed":
        failure = facts.get("failure") or {}
        kind = failure.get("kind", "other")
        msg = failure.get("message", "the all-reduce failed")
        if suspects:
            msg += "; suspect%s: %s" % ("s" if len(suspects) > 1 else "",
                                        "; ".join("%s (%s)" % (s["host"], s["reason"]) for s in suspects[:4]))
        fix = _FIX.get(kind, "rerun with -v for every rank's error").format(
            port=facts.get("master_port"), master=facts.get("master"))
        metrics.update(errors=facts.get("errors"), failure_kind=kind, ranks=facts.get("ranks"))
        out = {"*": Outcome(Status.FAIL, msg, fix, metrics=metrics)}
        for s in suspects:
            out[s["host"]] = Outcome(Status.FAIL, "all-reduce: %s" % s["reason"], _host_fix(s, facts, fix))
        return out
    n = int(facts.get("world_size") or 0)
    table = bandwidth_table(facts.get("sizes") or [], n)
    if not table:
        return {"*": error("the all-reduce ran but reported no timing", "rerun with -v", **base_metrics)}
    findings, notes = judge(facts, cfg)
    last = table[-1]
    ifnames = sorted({v for v in base_metrics["interfaces"].values() if v})
    summary = "busbw %s GB/s (algbw %s GB/s) at %s; %d ranks on %d host%s, %s%s" % (
        _gbps(last["busbw_GBps"]), _gbps(last["algbw_GBps"]), human_bytes(last["bytes"]), n,
        len(facts.get("hosts") or []), "" if len(facts.get("hosts") or []) == 1 else "s", facts.get("backend"),
        (" over " + ",".join(ifnames)) if ifnames else "")
    if facts.get("stopped_early"):
        summary += " (sweep stopped early: %s)" % facts["stopped_early"]
    metrics.update(sizes=table, largest_bytes=last["bytes"], busbw_GBps=last["busbw_GBps"],
                   algbw_GBps=last["algbw_GBps"], stopped_early=facts.get("stopped_early"), ranks=facts.get("ranks"),
                   min_busbw=facts.get("min_busbw"), **notes)
    flagged = [f for f in findings if f.status in (Status.WARN, Status.FAIL)]
    if flagged and suspects:
        findings.append(Finding(flagged[0].status, "suspect: " + "; ".join(
            "%s (%s)" % (s["host"], s["reason"]) for s in suspects[:4])))
    out = combine(findings, summary, metrics)
    if out.status != Status.PASS:
        out.message = summary + ": " + out.message
    result = {"*": out}
    if flagged:
        for s in suspects:
            result[s["host"]] = Outcome(max((f.status for f in flagged), key=lambda st: st.rank),
                                        "all-reduce: %s" % s["reason"], _host_fix(s, facts, flagged[0].fix))
    return result
