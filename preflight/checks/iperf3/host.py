"""On each host, through the agent: ``serve`` (an ``iperf3 -s`` for the whole check), ``client`` (one test) and
``interfaces`` (the interfaces check's facts, when that check did not run).

Parses ``iperf3 -c ADDR -p PORT -J -t 2`` (iperf3 >= 3.1) on the sending host, e.g.::

    {"start": {"connected": [{"local_host": "198.18.1.1", "remote_host": "198.18.1.2", ...}], ...},
     "end": {"sum_sent": {"bits_per_second": 199733114.2, "retransmits": 0, ...},
             "sum_received": {"seconds": 2.04, "bytes": 49414728, "bits_per_second": 193624470.1, ...}}}
    {"start": {"connected": []}, "intervals": [], "end": {},
     "error": "unable to connect to server: Connection refused"}

and ``/proc/net/tcp{,6}`` (state 0A = LISTEN) to know when the server listens, without connecting to it::

      sl  local_address rem_address   st tx_queue rx_queue ...
       0: 00000000:1451 00000000:0000 0A 00000000:00000000 ...
"""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from .common import SERVER_READY_S
from ...hostside import validate
from ...hostside.proc import read_text, sh, spawn, stop
from ...hostside.seams import HostContext

LISTEN = "0A"


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
    from ...hostside.depends import collect_facts
    return collect_facts("interfaces", ctx)
