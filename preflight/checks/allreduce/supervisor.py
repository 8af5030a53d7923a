"""Host side of the all-reduce check, run by the agent: ``probe`` (torch, GPUs, interface) and ``run`` (start one
rank process per slot of this host, watch their phases, stop them all on a failure or a hang).

Called by the coordinator as ``"allreduce.supervisor.probe"`` and ``"allreduce.supervisor.run"``; reads the ranks'
phase lines and results from their stdout, e.g.::

    @@ALLREDUCE-PHASE {"phase": "init"}
    @@PREFLIGHT-RESULT {"ok": true, "value": {"rank": 1, "ok": true, "sizes": [...]}}
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from ...hostside.proc import sh
from ...hostside.torchview import torch_view
from .common import PHASE

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
    return dict(torch_view(), interface=interface(params, ctx), executable=sys.executable)


def interface(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """The interface for this host's ranks (no torch import: the python check already gave torch_view)."""
    return pick_interface(params.get("bind_address"), params.get("master_addr"))


# --- the ranks of one host ----------------------------------------------------------------------------

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
        from ...hostside import agent
        assert self.proc.stdout is not None  # spawned with stdout=PIPE
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
        stderr = self.proc.stderr
        assert stderr is not None  # spawned with stderr=PIPE
        for chunk in iter(lambda: stderr.read(4096), b""):
            self.err.extend(chunk)
            if len(self.err) > 16384:  # keep the tail: the last lines hold the error
                del self.err[:-8192]

    def failed(self) -> bool:
        """For an exited rank: did it fail (no result, or a result with ok false)?"""
        from ...hostside import agent
        if self.proc.returncode != 0 or not self.result_line:
            return True
        payload = agent.read_result(self.result_line.encode())
        return not (payload.get("ok") and isinstance(payload.get("value"), dict) and payload["value"].get("ok"))

    def outcome(self) -> Dict[str, Any]:
        from ...hostside import agent
        entry: Dict[str, Any] = {"tag": self.spec["tag"], "rank": self.spec["rank"],
                                 "local_rank": self.spec["local_rank"], "world_size": self.spec["world_size"],
                                 "host": self.spec["host"], "ok": False}
        payload = agent.read_result((self.result_line or "").encode())
        if payload.get("ok") and isinstance(payload.get("value"), dict):
            entry.update(payload["value"])
        elif self.result_line:
            entry.update(kind="other", error=f"rank agent failed: {payload.get('error')}")
        if self.killed and not entry.get("ok"):
            hung = self.killed.startswith("hung")
            entry.update(kind="hung" if hung else "stopped", error=self.killed, phase=self.phase,
                         phase_s=round(self.killed_after, 1))
        elif not entry.get("ok") and "error" not in entry:
            entry.update(kind="other", phase=self.phase,
                         error=f"rank exited with code {self.proc.returncode} without a result in phase {self.phase}")
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
    from ...hostside import proc as procs
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
        procs.stop(j.proc, grace=0)  # reaps and forgets


def _allowance(phase: str, params: Dict[str, Any]) -> float:
    """How long a rank may stay in one phase before it counts as hung (C code ignores our signals meanwhile)."""
    init = float(params["init_timeout_s"])
    starting = float(params["start_timeout_s"]) + init + 10  # the rank's own start deadline, and a margin
    return {"start": float(params["start_timeout_s"]), "import": float(params["start_timeout_s"]),
            "rendezvous": starting, "join": starting, "init": init + 10, "connect": init + 10,
            "sweep": float(params["sweep_budget_s"]) + 2 * float(params["size_budget_s"]) + init + 10,
            # each round: creating the groups and the barrier (init each at most), its pairs' size_budget_s
            "stragglers": len((params.get("stragglers") or {}).get("rounds") or [])
            * (float(params["size_budget_s"]) + init) + init + 10,
            }.get(phase, 30.0)


def run(params: Dict[str, Any], ctx: Any) -> Dict[str, Any]:
    """Start one rank process per job on this host and watch them; on a failure, give the others grace_s to report
    their own errors, then kill them all. Returns every rank's result (or the phase it was killed in)."""
    from ...hostside import agent
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
            proc = agent.fork_call("allreduce.rank.run", dict(params["rank_params"], job=spec, host=params["host"]),
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
        # A short tick: the ranks' exit is seen within 50 ms (the check's result waits on it), and looking at a
        # few processes 20 times a second costs nothing.
        while any(j.proc.poll() is None for j in jobs):
            if ctx is not None and ctx.wait_stop is not None:
                if ctx.wait_stop(0.05):
                    stop_reason = "stopped by preflight: a rank on another host failed"
                    break
            else:
                time.sleep(0.05)
            now = time.monotonic()
            if now > deadline:
                stop_reason = "hung: no result within the %.0fs deadline (phase %%s)" % (deadline - started)
                break
            for j in jobs:
                if j.proc.poll() is None:
                    if now - j.phase_since > _allowance(j.phase, params["rank_params"]):
                        j.killed_after = now - j.phase_since
                        j.killed = f"hung in phase {j.phase} for {j.killed_after:.0f}s and was killed"
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

