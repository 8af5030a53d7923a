"""Pairwise TCP tests between hosts read as per-host verdicts: stragglers, failures' culprits, unreachable hosts.

Pure, standard library only (Python 3.9). Inputs are the records the ports and iperf3 checks keep in their facts:
iperf3 links ``{"src": "n1", "dst": "n2", "gbps": 9.4, "samples_gbps": [...], "error": null, "blame": null}``
(under ``{"networks": [{"network": "10.0.0.0/24", "addresses": {host: ip}, "links": [...]}]}``) and ports probes
``{"src": "n1", "dst": "n2", "address": "10.0.0.2", "port": 40123, "result": "ok" | "timeout" | "refused" | ...}``.
The checks that measure use them to judge; the all-reduce, which reads their facts (``SPEC.reads``), uses them to
blame the same hosts without importing those checks.
"""
from __future__ import annotations

import bisect
import math
import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .robust import MEDIAN_SE, rel_noise
from .stats import compare_all, downside

# The run's significance level when the caller gives none.
MAX_P = 0.01

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

def _without(ordered: List[float], removed: Sequence[float]) -> Optional[float]:
    """The median of the sorted list ``ordered`` with the values ``removed`` (each one of its elements) taken out, in
    O(k log n): every host's reference is all the links but its own few, and 1,024 hosts have ~2,000 links."""
    n = len(ordered) - len(removed)
    if n <= 0:
        return None
    taken: List[int] = []
    for v in sorted(removed):
        i = bisect.bisect_left(ordered, v)
        while taken and i <= taken[-1]:
            i = taken[-1] + 1  # duplicates: the next copy of the value
        taken.append(i)

    def nth(j: int) -> float:
        for idx in taken:
            if idx <= j:
                j += 1
        return ordered[j]

    return nth((n - 1) // 2) if n % 2 else (nth(n // 2 - 1) + nth(n // 2)) / 2.0


# The link ratios' lower half understates how far a healthy host falls: a host's links run at the slower of each
# pair, so a low host's ratio carries its whole own deficit (slope 0.9-0.98 on its own rate) while the hosts above the
# median are squeezed together. In simulated lognormal fleets (the ring and 2 random rounds) the ratios' downside
# spread is 0.84, 0.80, 0.76 and 0.735 of the hosts' spread at 8, 16, 64 and 256 hosts; the downside is scaled by the
# inverse (interpolated in log2 of the host count), as 1.4826 scales a MAD. Without it 2.7% of healthy 64-host runs
# named a host at max_p 0.01 (bench/calibration.py).
LINK_CONSISTENCY = ((8, 1.19), (16, 1.245), (64, 1.32), (256, 1.36))


def link_consistency(hosts: int) -> float:
    """The factor for a network of ``hosts`` hosts (LINK_CONSISTENCY, flat outside its range)."""
    if hosts <= LINK_CONSISTENCY[0][0]:
        return LINK_CONSISTENCY[0][1]
    for (n0, c0), (n1, c1) in zip(LINK_CONSISTENCY, LINK_CONSISTENCY[1:]):
        if hosts <= n1:
            return c0 + (c1 - c0) * math.log2(hosts / n0) / math.log2(n1 / n0)
    return LINK_CONSISTENCY[-1][1]


def find_stragglers(links: List[Dict[str, Any]], hosts: Sequence[str], fraction: float,
                    stats: Optional[Dict[str, Any]] = None,
                    unsure: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Dict[str, Any]]:
    """Hosts whose links are consistently slow, with the slowness attributed to the host the slow links share.

    A slow host drags down every link it is part of, so its partners look slow too. Each step compares every
    host's median link rate with the median of the links that do not involve it (its ``ratio``), flags only one
    host, then forgets the flagged host's links (they are explained) and repeats. A partner of the straggler keeps
    its other, fast links and is not flagged.

    Without ``stats`` a host is flagged when its ratio is below ``fraction``. With ``stats`` (the [iperf3] keys
    ``max_p``, ``min_deficit``, ``prior_spread``, ``prior_df``, ``noise_floor``) each host's ratio is tested against
    the other hosts' ratios by the moderated t prediction test of ``stats.py`` (the spread of the ratios,
    moderated by the prior; at least noise_floor and the measurement's own noise: each link's interval rates give
    its spread, a host's median over n links is known to about 1.25 x spread / sqrt(n), and its reference as well),
    and the steps are Holm's: the step that has flagged k of n hosts tests the smallest p at max_p / (n - k), the
    adjusted p never below the last step's. A host is flagged when its adjusted p < max_p AND its ratio is at least
    min_deficit below 1. Returns {host: {"median_gbps", "links", "reference_gbps", "ratio", "t", "df", "p", "p_adj",
    "family", "peers", "by"}}, "by" being "fraction" (no stats) or "statistics".

    A host below ``fraction`` (or, with ``stats``, at least ``min_deficit`` slower) that is not flagged is put in
    ``unsure`` (when given), for the caller to measure more: its deficit is not yet evidence (issue 26).
    """
    good = [ln for ln in links if not ln.get("error") and ln.get("gbps") is not None]
    noise_of = {id(ln): rel_noise(ln.get("samples_gbps") or []) for ln in good}
    flagged: Dict[str, Dict[str, Any]] = {}
    max_p = float((stats or {}).get("max_p", MAX_P))
    total = len(hosts)
    last_adj = 0.0
    while True:
        if unsure is not None:
            unsure.clear()  # the last pass, whose hosts are the unflagged ones, says who is in doubt
        active = [ln for ln in good if ln["src"] not in flagged and ln["dst"] not in flagged]
        rates = sorted(float(ln["gbps"]) for ln in active)
        noises = sorted(n for n in (noise_of[id(ln)] for ln in active) if n is not None)
        own_links: Dict[str, List[Dict[str, Any]]] = {}
        for ln in active:
            own_links.setdefault(ln["src"], []).append(ln)
            if ln["dst"] != ln["src"]:
                own_links.setdefault(ln["dst"], []).append(ln)
        # A host's links are repeated measurements of it too: their spread (each host's own, the median over the
        # hosts so that a straggler's partners, with one slow link each, do not set it) is the link-to-link noise, as
        # the intervals' spread is each link's own. The larger of the two is the measurement's noise.
        spreads = [x for x in (rel_noise([float(ln["gbps"]) for ln in own_links.get(h) or []]) for h in hosts
                               if h not in flagged) if x is not None]
        link_spread = statistics.median(spreads) if spreads else 0.0
        entries: Dict[str, Dict[str, Any]] = {}
        for h in hosts:
            own = own_links.get(h) or []
            if h in flagged or not own:
                continue
            ref = _without(rates, [float(ln["gbps"]) for ln in own])
            if not ref:
                continue  # nothing to compare with (2 hosts, or every other link failed)
            med = statistics.median([float(ln["gbps"]) for ln in own])
            mine = [n for n in (noise_of[id(ln)] for ln in own) if n is not None]
            typical = _without(noises, mine) if len(noises) > len(mine) else None
            typical = typical if typical is not None else (statistics.median(mine) if mine else None)
            rest = len(active) - len(own)
            typical = max(typical or 0.0, link_spread)
            meas = MEDIAN_SE * typical * math.sqrt(1.0 / len(own) + 1.0 / max(1, rest)) if typical else 0.0
            entries[h] = {"median_gbps": med, "links": len(own), "reference_gbps": ref, "ratio": med / ref,
                          "noise": meas}
        worst = None
        if stats:
            names = list(entries)
            ratios = [entries[h]["ratio"] for h in names]
            # A host's partners share its slow links, so their ratios follow its own: a partner with 2 links, one
            # of them to a host at 75%, sits at 87% and alone made the downside spread 8% (a 75% host of 8 passed
            # at t -3.2); they are left out of its downside spread. (Out of its peers altogether, 4 of 8 hosts
            # remain, and the prior then holds a clear 90% host at t -4.2: never named.)
            index = {h: k for k, h in enumerate(names)}
            partners = [[index[o] for ln in own_links.get(h) or [] for o in (ln["src"], ln["dst"])
                         if o != h and o in index] for h in names]
            # A link runs at its slower host's rate: the hosts above the median all look alike, so the ratios'
            # lower half is what says how far a healthy host falls (stats.downside).
            tested = compare_all(ratios, float(stats.get("prior_spread", 0.02)), float(stats.get("prior_df", 4.0)),
                                 [entries[h]["noise"] for h in names], float(stats.get("noise_floor", 0.0)),
                                 [link_consistency(len(ratios)) * d for d in downside(ratios, partners)])
            compared = {h: c for h, c in zip(names, tested) if c is not None}
            for h, c in compared.items():
                entries[h].update(t=c.t, df=c.df, peers=c.peers, sigma=c.sigma)
            family = max(1, total - len(flagged))
            # The p of the hosts that may be named or in doubt only (each p is a continued fraction: at 1,024 hosts
            # the others' would cost more than the rest of the step).
            doubt_below = max(fraction, 1.0 - float(stats.get("min_deficit", 0.0)))
            for h, c in compared.items():
                if entries[h]["ratio"] < doubt_below:
                    entries[h]["p"] = c.p
            candidates = [(h, e) for h, e in entries.items() if "p" in e
                          and e["ratio"] < 1.0 - float(stats.get("min_deficit", 0.0))]
            if candidates:
                h, e = min(candidates, key=lambda item: item[1]["p"])
                adj = max(last_adj, min(1.0, family * e["p"]))
                if max_p >= 1.0 or adj < max_p:
                    e.update(p_adj=adj, family=total, by="statistics")
                    worst = (h, e)
                    last_adj = adj
            if unsure is not None:
                # In doubt: below the fraction, or at least min_deficit slower, and not named: the caller measures
                # again (a 90% host whose first tests were noisy is confirmed, not passed on one look).
                for h, e in entries.items():
                    if e["ratio"] < doubt_below and (worst is None or h != worst[0]):
                        e.setdefault("p_adj", max(last_adj, min(1.0, family * e.get("p", 1.0))))
                        e.setdefault("family", total)
                        unsure[h] = e
        else:
            for h, e in entries.items():
                if e["ratio"] < fraction and (worst is None or e["ratio"] < worst[1]["ratio"]):
                    e["by"] = "fraction"
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
