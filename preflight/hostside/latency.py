"""Small-message latency between hosts, per host pair, from the TCP handshakes the ports check already makes: a
connect() returns when the SYN-ACK arrives, one round trip of the smallest packets, e.g. the ports probes::

    {"src": "node01", "dst": "node03", "network": "ssh", "port": 41234, "result": "ok", "ms": 40.31}
    {"src": "node03", "dst": "node01", "network": "ssh", "port": 38811, "result": "ok", "ms": 40.12}
    -> node01 <-> node03: 40.12 ms (the fastest of its handshakes, both directions)

The fastest handshake of a pair is its round trip: a probe can only be slowed (by the probing host's own load, as
64 connects start at once), never sped up. Pure; the ports check's evaluate reads it.

Why it matters: NCCL's small messages (its LL protocol; the all-reduce of each small gradient bucket, ZeRO-3's
parameter gathers, barriers) cost about one round trip each, at every step. On one LAN a TCP round trip takes tens
to hundreds of microseconds; milliseconds mean another site, a VPN or overlay network, a netem qdisc left on a
link, or a host too loaded to answer (docs/checks.md, [ports] rtt_warn_ms).
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import validate
from .outcome import Finding, Outcome, Status, combine

Pair = Tuple[str, str]  # (host, host), sorted


def pair_rtt(probes: Sequence[Dict[str, Any]], network: str = "ssh") -> Dict[Pair, Dict[str, Any]]:
    """{(a, b): {"ms": the fastest successful handshake either way, "samples": how many}} on ``network``."""
    out: Dict[Pair, Dict[str, Any]] = {}
    for p in probes:
        if p.get("result") != "ok" or p.get("network") != network or not isinstance(p.get("ms"), (int, float)):
            continue
        a, b = str(p.get("src")), str(p.get("dst"))
        if a == b:
            continue
        key = (a, b) if a < b else (b, a)
        entry = out.setdefault(key, {"ms": float(p["ms"]), "samples": 0})
        entry["ms"] = min(entry["ms"], float(p["ms"]))
        entry["samples"] += 1
    return out


def peers_of(host: str, pairs: Dict[Pair, Dict[str, Any]]) -> Dict[str, float]:
    """{peer: round trip ms} of one host's measured pairs."""
    return {(b if a == host else a): round(v["ms"], 3) for (a, b), v in pairs.items() if host in (a, b)}


def judge(host: str, pairs: Dict[Pair, Dict[str, Any]], warn_ms: float,
          addresses: Optional[Dict[str, str]] = None) -> Tuple[Optional[Finding], Dict[str, Any]]:
    """(a WARN when the host's typical round trip is above ``warn_ms``, its figures). Typical: the lower median of
    its pairs, so one slow host is named alone (its peers' other pairs are fast); with one peer both ends are.
    addresses: {host: the address it was probed at}, for the fix's `ip route get`."""
    peers = peers_of(host, pairs)
    if not peers:
        return None, {}
    values = sorted(peers.values())
    typical = values[(len(values) - 1) // 2]
    figures = {"rtt_ms": dict(sorted(peers.items())), "rtt_ms_typical": typical}
    if typical <= warn_ms:
        return None, figures
    slow = sorted(peers.items(), key=lambda kv: -kv[1])
    peer = slow[0][0]
    address = str((addresses or {}).get(peer) or peer)
    route = (f"ip route get {shlex.quote(address)}" if validate.ip_address(address) else
             f"ip route get $(getent hosts {shlex.quote(peer)} | cut -d' ' -f1)")
    listed = ", ".join(f"{p} {ms:.2f} ms" for p, ms in slow[:4]) + (", ..." if len(slow) > 4 else "")
    return (Finding(Status.WARN, f"TCP round trip between {host} and its peers {typical:.2f} ms ({listed}; the fastest "
                    f"handshake of each pair), above {warn_ms:g} ms: every small message of the job (NCCL's LL "
                    f"protocol, small all-reduce buckets, ZeRO-3 gathers, barriers) waits about that long; on one LAN "
                    f"it is well under 1 ms",
                    f"on {host}: tc qdisc show (a netem delay or a full shaper left on a link), {route} (the path to "
                    f"{peer}: a VPN, an overlay, another site), uptime (a host too loaded to answer); or leave {host} "
                    f"out of the hostfile"), figures)


def annotate(outcome: Outcome, finding: Optional[Finding], figures: Dict[str, Any]) -> Outcome:
    """The host's ports row with its round-trip figures (metrics, and the PASS message) and the WARN, if any."""
    if not figures:
        return outcome
    metrics = dict(outcome.metrics, **figures)
    if finding is None:
        if outcome.status == Status.PASS:
            typical, peers = figures["rtt_ms_typical"], len(figures["rtt_ms"])
            outcome.message += f"; TCP round trip {typical:.2f} ms (median of {peers} peer{'s' if peers > 1 else ''})"
        outcome.metrics = metrics
        return outcome
    mine: List[Finding] = list(outcome.findings) or (
        [Finding(outcome.status, outcome.message, outcome.fix)] if outcome.status != Status.PASS else [])
    metrics.pop("findings", None)
    merged = combine(mine + [finding], "", metrics)
    if outcome.status == Status.PASS:
        merged.message += f"; {outcome.message}"
    merged.blocked_by, merged.where = outcome.blocked_by, outcome.where
    return merged
