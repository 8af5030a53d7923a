"""The all-reduce's straggler detector (pure): repeated per-link timings of the straggler rounds in, named hosts out.

After the sweep, ``orchestrate`` pairs the hosts around the ring (every host with both neighbours, all pairs of a
round at once) and times a few all-reduces per pair, each iteration on its own. A host's rate is its best pair's
median busbw: a slow host drags down both of its pairs, a healthy neighbour of it still has its other, fast pair.
Each host is compared with the other hosts' rates (leave-one-out: in a small fleet a straggler would pull the
median and widen the spread it is judged by) by the moderated t prediction test of ``hostside/stats.py``: the other
hosts' spread, moderated by ``prior_spread``/``prior_df``, at least ``noise_floor`` and the pairs' own measured noise
(the spread of their iterations); the p of every host is Holm-adjusted together. A host is named when:

- its adjusted p is below ``max_p`` AND it is at least ``min_deficit`` below the other hosts' median: WARN, or
  FAIL below ``straggler_fail_fraction`` of it;
- every pair it was in failed while other hosts' pairs succeeded: FAIL (a failed pair is evidence, never dropped).

For example (recorded, 4 namespace hosts at 1000 Mbit, node02 shaped to 900)::

    find({"bytes": 16777216, "pairs": [{"hosts": ["node01", "node02"], "ok": true, "iter_s": [0.155, ...]}, ...]},
         limits)  ->  {"node02": {"ratio": 0.898, "t": -5.6, "p_adj": 0.003, "status": "warn", "by": "statistics", ...}}

(tests/fixtures/allreduce/straggler-rounds.json).

Thresholds: ``[allreduce]`` in thresholds.toml in this package.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional

from ...hostside.fmt import gbps, human_bytes
from ...hostside import stats
from ...hostside.robust import MEDIAN_SE, rel_noise


def pair_rates(facts: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each successful pair's busbw per iteration (GB/s; a 2-rank all-reduce's bus factor is 1), its median and
    the relative standard error of that median."""
    nbytes = int(facts.get("bytes") or 0)
    out = []
    for p in facts.get("pairs") or []:
        if not isinstance(p, dict) or not p.get("ok") or len(p.get("hosts") or []) != 2:
            continue
        times = [float(t) for t in p.get("iter_s") or [] if isinstance(t, (int, float)) and t > 0]
        if not times or nbytes <= 0:
            continue
        samples = [nbytes / t / 1e9 for t in times]
        noise = rel_noise(samples)
        out.append({"hosts": list(p["hosts"]), "busbw_GBps": statistics.median(samples), "samples": len(samples),
                    "noise": MEDIAN_SE * noise / math.sqrt(len(samples)) if noise is not None else 0.0})
    return out


def host_rates(facts: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """{host: its best pair's rate, that pair's partner and noise, and how many pairs it had}."""
    best: Dict[str, Dict[str, Any]] = {}
    for p in pair_rates(facts):
        for h in p["hosts"]:
            partner = p["hosts"][1] if p["hosts"][0] == h else p["hosts"][0]
            mine = best.get(h)
            if mine is None or p["busbw_GBps"] > mine["busbw_GBps"]:
                best[h] = {"busbw_GBps": p["busbw_GBps"], "partner": partner, "noise": p["noise"],
                           "samples": p["samples"], "pairs": (mine or {}).get("pairs", 0) + 1}
            else:
                mine["pairs"] += 1
    return best


def failed_pairs(facts: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The pairs whose timing failed, as {"hosts": [a, b], "error": why}."""
    return [{"hosts": list(p["hosts"]), "error": str(p.get("error") or "no timing reported")}
            for p in (facts or {}).get("pairs") or []
            if isinstance(p, dict) and not p.get("ok") and len(p.get("hosts") or []) == 2]


def _failed_hosts(facts: Optional[Dict[str, Any]], rates: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """{host: its failed pairs} for each host whose every pair failed while some other host's pair succeeded: the
    failures point at that host. When no pair succeeded at all, nothing points at one host (see failed_pairs)."""
    if not rates:
        return {}
    out: Dict[str, Dict[str, Any]] = {}
    for p in failed_pairs(facts):
        for h in p["hosts"]:
            if h not in rates:
                out.setdefault(h, {"failed_pairs": []})["failed_pairs"].append(p)
    return out


# The ring's best-pair rates understate the hosts' own spread: a host's rate is at most its own (a pair runs at its
# slower host), and a host faster than both neighbours gets the faster neighbour's. In a lognormal fleet of spread
# sigma their downside spread is 0.84 sigma (2-3% spread, 4,096 hosts simulated; their mean sits 0.29 sigma low,
# which errs the safe way), so the downside is scaled by 1 / 0.84 to estimate sigma itself, as 1.4826 scales a MAD:
# without it a healthy 64-host ring named a host in 2-2.5% of runs at max_p 0.01 (bench/calibration.py).
RING_CONSISTENCY = 1.19


def find(facts: Optional[Dict[str, Any]], cfg: Dict[str, Any],
         unsure: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Dict[str, Any]]:
    """{host: {"busbw_GBps", "partner", "reference_GBps", "ratio", "t", "df", "p", "p_adj", "family", "status",
    "by"}} for the hosts named slow, and {host: {"failed_pairs", "status": "fail", "by": "failed_pairs"}} for those
    whose every pair failed (see the module docstring); the rates need at least 3 measured hosts (a host and two
    peers: one peer has no spread). A host at least ``min_deficit`` slower, with its own p below ``max_p``, that the
    statistics do not name among all the hosts goes into ``unsure`` (when given) with the same keys, so that the
    report can say so (as iperf3's "in doubt")."""
    rates = host_rates(facts or {})
    named: Dict[str, Dict[str, Any]] = {h: dict(f, status="fail", by="failed_pairs")
                                        for h, f in _failed_hosts(facts, rates).items()}
    if len(rates) < stats.MIN_PEERS + 1:
        return named
    floor, max_p = float(cfg["min_deficit"]), float(cfg["max_p"])
    fail_below = float(cfg["straggler_fail_fraction"])
    names = list(rates)
    # Each host against the others; the others' typical own noise is their median, so that one noisy pair does not
    # set it for all.
    # A pair runs at its slower host's rate and a host's rate is its best pair's: the hosts above the median look
    # alike, so the rates' lower half is what says how far a healthy host falls (stats.downside).
    values = [rates[h]["busbw_GBps"] for h in names]
    compared = dict(zip(names, stats.compare_all(values, float(cfg["prior_spread"]), float(cfg["prior_df"]),
                                                 [rates[h]["noise"] for h in names], float(cfg["noise_floor"]),
                                                 [RING_CONSISTENCY * d for d in stats.downside(values)])))
    family = stats.adjust(list(compared.values()))
    for h, c in compared.items():
        if c is None or h in named:
            continue
        status, by = ("fail", "fail_fraction") if c.ratio < fail_below else ("warn", "statistics")
        entry = dict(rates[h], reference_GBps=c.median, ratio=c.ratio, t=c.t, df=c.df, p=c.p, p_adj=c.p_adj,
                     family=family, peers=c.peers, status=status, by=by)
        if stats.named(c, max_p, floor):
            named[h] = entry
        elif unsure is not None and c.ratio < 1.0 - floor and c.p < max_p:
            # However large the deficit looks, noise may explain it: no finding on weak evidence, but said, where it
            # would be a finding alone (its own p below max_p) but not among all the hosts compared. A deficit at
            # t -0.7 on a loaded machine is no evidence at all: saying it would only be noise in the line.
            unsure[h] = dict(entry, status="pass", by="weak_evidence")
    return named


def _confidence(s: Dict[str, Any], cfg: Dict[str, Any]) -> str:
    return (f"t {s['t']:.1f}, {s['df']:.0f} df; adjusted {stats.p_text(s['p_adj'], float(cfg['max_p']))} over "
            f"{s['family']} host{'' if s['family'] == 1 else 's'} ({stats.TEST_NAME})")


def short(host: str, s: Dict[str, Any]) -> str:
    """A few words for the cluster line: the ratio and adjusted p, or the failed pairs."""
    if s["by"] == "failed_pairs":
        return f"{host}: all {len(s['failed_pairs'])} of its pairs failed"
    return (f"{host} at {100 * s['ratio']:.0f}% of the median of {s['peers']} peers (t {s['t']:.1f}, adjusted "
            f"{stats.p_text(s['p_adj'])})")


def weak(unsure: Dict[str, Dict[str, Any]], cfg: Dict[str, Any]) -> str:
    """What the cluster line adds for the hosts left unnamed on weak evidence, or "": ``not named, the evidence is
    weak (adjusted p >= 0.01): node02 at 90% of the median of 3 peers (t -3.8, adjusted p = 0.02)``."""
    if not unsure:
        return ""
    listed = "; ".join(short(h, s) for h, s in list(unsure.items())[:4])
    more = f" and {len(unsure) - 4} more" if len(unsure) > 4 else ""
    return f"not named, the evidence is weak (adjusted p >= {float(cfg['max_p']):g}): {listed}{more}"


def describe(host: str, s: Dict[str, Any], facts: Dict[str, Any], cfg: Dict[str, Any]) -> str:
    """One line: the measured ratio, why it is named, and the test that decided; or the pairs that failed."""
    if s["by"] == "failed_pairs":
        first = s["failed_pairs"][0]
        partner = first["hosts"][1] if first["hosts"][0] == host else first["hosts"][0]
        n = len(s["failed_pairs"])
        plural = "" if n == 1 else "s"
        return (f"straggler rounds: every pair with this host failed ({n} pair{plural}; with {partner}: "
                f"{first['error'][:200]}) while other hosts' pairs ran")
    why = (f"below {100 * float(cfg['straggler_fail_fraction']):.0f}%" if s["by"] == "fail_fraction" else
           f"at least {100 * float(cfg['min_deficit']):.0f}% slower")
    size = human_bytes(int(facts.get("bytes") or 0))
    return (f"straggler: its best ring pair (with {s['partner']}) reaches {gbps(s['busbw_GBps'])} GB/s busbw, "
            f"{100 * s['ratio']:.0f}% of the median of {s['peers']} peers {gbps(s['reference_GBps'])} GB/s "
            f"({size} x {s['samples']} iterations per pair; {why}; confidence: {_confidence(s, cfg)})")
