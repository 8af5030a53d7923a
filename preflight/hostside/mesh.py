"""Pairwise TCP tests between hosts read as per-host verdicts: stragglers, failures' culprits, unreachable hosts.

Pure, standard library only (Python 3.9). Inputs are the records the ports and iperf3 checks keep in their facts:
iperf3 links ``{"src": "n1", "dst": "n2", "gbps": 9.4, "samples_gbps": [...], "error": null, "blame": null}``
(under ``{"networks": [{"network": "10.0.0.0/24", "addresses": {host: ip}, "links": [...]}]}``) and ports probes
``{"src": "n1", "dst": "n2", "address": "10.0.0.2", "port": 40123, "result": "ok" | "timeout" | "refused" | ...}``.
The checks that measure use them to judge; the all-reduce, which reads their facts (``SPEC.reads``), uses them to
blame the same hosts without importing those checks.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .robust import MAD_TO_SIGMA, MAX_P, MEDIAN_SE, p_value, rel_noise, significant

# A ports probe's result, as a reason.
REASONS = {
    "timeout": "timed out: a firewall drops the packets",
    "refused": "refused while our listener was up: a firewall rejects them",
    "unreachable": "no route to the host (ICMP unreachable)",
    "unresolved": "the address does not resolve on the source",
    "skipped": "not probed: the probe ran out of time",
    "error": "connect failed",
}


def short_list(items: Iterable[str]) -> str:
    """Sorted, unique, at most 8 named: 'a, b, c' or 'a, ..., h and 4 more'."""
    items = sorted(set(items))
    return ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8 else "")


def median_or_none(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


# --- iperf3's links -------------------------------------------------------------------------------------------

def find_stragglers(links: List[Dict[str, Any]], hosts: Sequence[str], fraction: float,
                    stats: Optional[Dict[str, Any]] = None,
                    unsure: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Dict[str, Any]]:
    """Hosts whose links are consistently slow, with the slowness attributed to the host the slow links share.

    A slow host drags down every link it is part of, so its partners look slow too. Each step compares every
    host's median link rate with the median of the links that do not involve it (its ``ratio``), flags only the
    worst host, then forgets the flagged host's links (they are explained) and repeats. A partner of the straggler
    keeps its other, fast links and is not flagged.

    A host is flagged when its ratio is below ``fraction`` (the hard floor), or, with ``stats`` (``z_threshold``,
    ``min_deficit``, ``noise_floor``), when its deficit is statistically clear and large enough: robust z =
    (ratio - median ratio) / sigma below -z_threshold and ratio below 1 - min_deficit. sigma is the largest of the
    fleet's spread (1.4826 x MAD of the hosts' ratios), the measurement's own noise (each link's interval rates give
    its spread; a host's median over n links is known to about 1.25 x spread / sqrt(n), and the reference as well)
    and noise_floor. Returns {host: {"median_gbps", "links", "reference_gbps", "ratio", "z", "p", "sigma", "by"}},
    "by" being "fraction" or "statistics".

    With ``stats`` every flag needs significance, the fraction's too: a one-sided p of z below ``stats["max_p"]``
    (default 0.05), so that no host is named on evidence its own message calls weak (issue 26: a WARN at p = 0.2
    flipped between identical runs). A host below ``fraction`` at p >= max_p is not flagged; it is put in
    ``unsure`` (when given) for the caller to measure more.
    """
    good = [ln for ln in links if not ln.get("error") and ln.get("gbps") is not None]
    flagged: Dict[str, Dict[str, Any]] = {}
    max_p = float((stats or {}).get("max_p", MAX_P))
    while True:
        if unsure is not None:
            unsure.clear()  # the last pass, whose hosts are the unflagged ones, says who is in doubt
        active = [ln for ln in good if ln["src"] not in flagged and ln["dst"] not in flagged]
        entries: Dict[str, Dict[str, Any]] = {}
        for h in hosts:
            if h in flagged:
                continue
            own = [ln for ln in active if h in (ln["src"], ln["dst"])]
            rest = [ln for ln in active if h not in (ln["src"], ln["dst"])]
            ref = median_or_none([ln["gbps"] for ln in rest])
            if not own or not ref:
                continue  # nothing to compare with (2 hosts, or every other link failed)
            med = median_or_none([ln["gbps"] for ln in own]) or 0.0
            noise = [n for n in (rel_noise(ln.get("samples_gbps") or []) for ln in own + rest) if n is not None]
            meas = MEDIAN_SE * statistics.median(noise) * math.sqrt(1.0 / len(own) + 1.0 / len(rest)) if noise else 0.0
            entries[h] = {"median_gbps": med, "links": len(own), "reference_gbps": ref, "ratio": med / ref,
                          "noise": meas}
        worst = None
        ratios = [e["ratio"] for e in entries.values()]
        if ratios:
            center = statistics.median(ratios)
            spread = MAD_TO_SIGMA * statistics.median([abs(r - center) for r in ratios])
        for h, e in entries.items():
            if stats:
                sigma = max(spread, e["noise"], float(stats["noise_floor"]))
                e.update(sigma=sigma, z=(e["ratio"] - center) / sigma)
                e["p"] = p_value(e["z"])
                sure = significant(e["z"], max_p)
                clear = (sure and e["z"] < -float(stats["z_threshold"])
                         and e["ratio"] < 1.0 - float(stats["min_deficit"]))
                if e["ratio"] < fraction and not sure:
                    if unsure is not None:
                        unsure[h] = e
                    continue
            else:
                clear = False
            if e["ratio"] < fraction or clear:
                e["by"] = "fraction" if e["ratio"] < fraction else "statistics"
                if worst is None or e["ratio"] < worst[1]["ratio"]:
                    worst = (h, e)
        if worst is None:
            return flagged
        flagged[worst[0]] = worst[1]


def blame_failures(links: List[Dict[str, Any]], blocked: Iterable[str] = ()) -> Dict[str, List[Dict[str, Any]]]:
    """{host: [failed links attributed to it]}: a failed test is blamed on its known culprit ("blame"), else on
    the end that also fails elsewhere; when both do equally, on the one end in ``blocked`` (hosts whose TCP the
    ports check proved blocked on this network: node03 firewalled makes node02->node03 fail once on 3 hosts, and
    only the ports probes from node01 and node02 say which end it is); else on both ends, as suspects."""
    known = set(blocked)
    failed = [ln for ln in links if ln.get("error")]
    count: Dict[str, int] = {}
    for ln in failed:
        for h in (ln["src"], ln["dst"]):
            count[h] = count.get(h, 0) + 1
    blamed: Dict[str, List[Dict[str, Any]]] = {}
    for ln in failed:
        a, b = count[ln["src"]] - 1, count[ln["dst"]] - 1
        ends = [ln["src"]] if a > b else [ln["dst"]] if b > a else [ln["src"], ln["dst"]]
        proven = [h for h in ends if h in known]
        if len(ends) == 2 and len(proven) == 1:
            ends = proven
        if ln.get("blame") in (ln["src"], ln["dst"]):
            ends = [ln["blame"]]  # the cause is known: no server there, or no iperf3 on the client
        for h in ends:
            blamed.setdefault(h, []).append(ln)
    return blamed


def sole_culprits(links: List[Dict[str, Any]], blamed: Dict[str, List[Dict[str, Any]]]) -> Optional[List[str]]:
    """The hosts that every failed test is blamed on, each test on one host alone (blame_failures' result), in the
    order they are first blamed; None when a failed test has two suspects or none (then no host explains them).
    A cluster-wide verdict that follows only from these failures is those hosts' fault, not the cluster's."""
    owners: Dict[int, List[str]] = {}
    for h, bad in blamed.items():
        for ln in bad:
            owners.setdefault(id(ln), []).append(h)
    found: List[str] = []
    for ln in links:
        if not ln.get("error"):
            continue
        who = owners.get(id(ln)) or []
        if len(who) != 1:
            return None
        if who[0] not in found:
            found.append(who[0])
    return found


def unreachable_hosts(facts: Dict[str, Any], addresses: Dict[str, str]) -> Dict[str, str]:
    """{host: why} for hosts that no iperf3 test could connect to, on the network whose addresses are given
    ({host: address}): every inbound test to the host failed (two at least), the failures are blamed on it (its
    peers succeed elsewhere), and its server was up (so it is the network, not a missing iperf3). Used by the
    all-reduce to leave such hosts out."""
    found: Dict[str, str] = {}
    for net in facts.get("networks") or []:
        if not isinstance(net, dict) or not net.get("links"):
            continue
        net_addrs = net.get("addresses") or {}
        hosts = [h for h in addresses if net_addrs.get(h) == addresses[h]]
        if not hosts:
            continue
        links = [ln for ln in net["links"] if isinstance(ln, dict)]
        blamed = blame_failures(links)
        for h in hosts:
            inbound = [ln for ln in links if ln.get("dst") == h]
            bad = [ln for ln in blamed.get(h, []) if ln.get("dst") == h and ln.get("blame") is None
                   and not ln.get("agent_failed")]
            # Two failed tests at least: one lost connect under load must not take a host out of a run.
            if len(bad) >= 2 and len(bad) == len(inbound) and h not in found:
                tests = "; ".join(f"{ln['src']}->{h}: {str(ln.get('error'))[:120]}" for ln in bad[:2])
                found[h] = f"iperf3: every test to {h} on {net.get('network')} failed ({tests})"
    return found


# --- the ports check's probes ----------------------------------------------------------------------------

def egress_blocked(probes: List[Dict[str, Any]]) -> Dict[str, List[str]]:
    """Sources that reached none of their (>= 2) destinations, each of which another source did reach:
    their own outbound traffic is filtered, so the destinations are not to blame."""
    by_src: Dict[str, Dict[str, bool]] = {}
    reached_by: Dict[str, set] = {}
    for p in probes:
        if p["result"] == "skipped":
            continue
        ok = p["result"] == "ok"
        by_src.setdefault(p["src"], {})
        by_src[p["src"]][p["dst"]] = by_src[p["src"]].get(p["dst"], False) or ok
        if ok:
            reached_by.setdefault(p["dst"], set()).add(p["src"])
    out = {}
    for src, dsts in by_src.items():
        if len(dsts) >= 2 and not any(dsts.values()) and \
                all(reached_by.get(d, set()) - {src} for d in dsts):
            out[src] = sorted(dsts)
    return out


def blocked_hosts(facts: Dict[str, Any], addresses: Dict[str, str]) -> Dict[str, str]:
    """{host: why} for hosts that the ports check proved other hosts cannot open TCP connections to (or from) on
    the given addresses ({host: address}, the network a later phase will use): a failed inbound probe to the
    host's address from a source whose own egress works, or the host's own egress blocked. The all-reduce uses it
    to leave such hosts out instead of waiting for its init timeout."""
    probes = [p for p in facts.get("probes") or [] if isinstance(p, dict) and p.get("result") != "skipped"]
    egress = egress_blocked(probes)
    found: Dict[str, str] = {}
    for h, dsts in egress.items():
        if h in addresses:
            found[h] = (f"ports: outbound TCP from {h} to high ports is blocked "
                        f"(none of {short_list(dsts)} reachable from it)")
    failed: Dict[str, Dict[str, Any]] = {}
    for p in probes:
        dst = p.get("dst")
        if p.get("result") == "ok" or dst not in addresses or p.get("address") != addresses[dst] \
                or p.get("src") in egress:
            continue
        entry = failed.setdefault(dst, {"srcs": set(), "ports": set(), "result": p.get("result")})
        entry["srcs"].add(p.get("src"))
        entry["ports"].add(p.get("port"))
    for h, e in failed.items():
        plural = "s" if len(e["ports"]) > 1 else ""
        ports = ", ".join(str(x) for x in sorted(e["ports"]))
        reason = REASONS.get(e["result"], e["result"])
        found.setdefault(h, f"ports: inbound TCP to {h} ({addresses[h]}) port{plural} {ports} "
                            f"from {short_list(e['srcs'])} {reason}")
    return found
