"""Pure: the facts of ``orchestrate.coordinate`` and the ``[iperf3]`` thresholds in, one outcome per host and the
cluster row (``*``) out, e.g. ``node03: median 95.1 Mbit/s over 3 links vs median of the other hosts 190.2 Mbit/s
(50%) on 198.18.0.0/24 via eth0 (straggler: ...)``.
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional

from .common import CLUSTER, NAME, median, ok_links
from .networks import link_floor
from ...hostside import validate
from ...hostside.fmt import rate
from ...hostside.mesh import blame_failures, find_stragglers, short_list, sole_culprits
from ...hostside.outcome import BlockedBy, Finding, Outcome, Status, combine, limits, skip
from ...hostside.stats import TEST_NAME
from ...hostside.stats import p_text as stats_p_text


def _confidence(s: Dict[str, Any], max_p: float) -> str:
    """``t -8.6, 10 df; adjusted p = 3e-05 over 6 hosts (moderated t prediction test, Holm-adjusted)``"""
    if "t" not in s:
        return "n/a"
    family = int(s.get("family") or 1)
    return (f"t {s['t']:.1f}, {s['df']:.0f} df; adjusted {stats_p_text(float(s.get('p_adj', 1.0)), max_p)} over "
            f"{family} host{'' if family == 1 else 's'} ({TEST_NAME})")


def fix_slow(host: str, dev: Optional[str]) -> str:
    d = shlex.quote(str(dev)) if validate.ifname(dev) else "<nic>"
    return (f"on {host}: ethtool {d} (negotiated speed/duplex), ip -s link show {d} (errors/drops), tc qdisc show "
            f"dev {d} (a leftover rate limit), and CPU load during the test; then swap the cable/switch port, or "
            "leave the host out of the hostfile")


def _network_line(net: Dict[str, Any]) -> str:
    devs = sorted(set(net["devices"].values()))
    good = ok_links(net)
    failed = len(net.get("links") or []) - len(good)
    failed_note = f", {failed} failed" if failed else ""
    return (f"{net['network']} ({','.join(devs)}): median {rate(net.get('median_gbps'))} over {len(good)} "
            f"links{failed_note}")


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    t = limits(thresholds, NAME)
    hosts: List[str] = list(facts.get("hosts") or [])
    errors: Dict[str, str] = facts.get("errors") or {}
    out: Dict[str, Outcome] = {}
    for h in facts.get("unreachable") or []:
        out[h] = Outcome(Status.ERROR, "not run: the host is unreachable (see its ssh result)")
    if facts.get("skipped"):
        out[CLUSTER] = skip(facts["skipped"])
        return out
    for h, msg in errors.items():
        installed = "not installed" not in msg and "command not found" not in msg
        out[h] = Outcome(Status.ERROR, msg, "rerun with -v for the host-side error" if installed
                         else f"install iperf3 on {h} (apt-get install iperf3 / dnf install iperf3)")
    networks: List[Dict[str, Any]] = facts.get("networks") or []
    unlisted = [h for h in hosts if h in errors and h not in (facts.get("subnets") or {})]
    if not networks and unlisted and len(facts.get("subnets") or {}) < 2:
        # Not a finding about the subnets: fewer than 2 hosts' interfaces are known, those hosts' errors say why.
        out[CLUSTER] = Outcome(Status.ERROR, f"no network compared: the interfaces of {short_list(unlisted)} could "
                                             "not be listed (see their iperf3 results)", "see those hosts' results",
                               blocked_by=BlockedBy(unlisted[0], NAME))
        return out
    if not networks:
        listing = "; ".join(f"{h}: {', '.join(s) or 'none'}" for h, s in (facts.get("subnets") or {}).items())
        out[CLUSTER] = Outcome(Status.FAIL, "no IPv4 network is shared by all hosts (usable subnets per host: "
                                            f"{listing or 'unknown'})",
                               "put every host on one common subnet on a non-virtual NIC (NCCL needs direct "
                               "TCP between all hosts); see each host's interfaces result")
        return out
    measured = [h for h in hosts if h not in errors or any(h in n["devices"] for n in networks)]
    chosen = facts.get("chosen")
    net = next((n for n in networks if chosen and n["network"] == chosen["network"]), None)
    # Without a network that reaches everyone, judge hosts on the one with the most successful tests.
    judged = net or max(networks, key=lambda n: (len(ok_links(n)), n.get("median_gbps") or 0))
    links = judged.get("links") or []
    doubt: Dict[str, Dict[str, Any]] = {}
    stragglers = find_stragglers(links, measured, float(t["straggler_warn_fraction"]), t, doubt)
    blamed = blame_failures(links, judged.get("blocked") or ())
    for h in measured:
        if h not in out:
            out[h] = _host_outcome(h, judged, networks, stragglers, doubt, blamed, t)
    culprit = _culprit(judged, hosts, measured, blamed, out)
    out[CLUSTER] = _cluster_outcome(chosen, networks, judged, stragglers, len(measured), facts, t, culprit)
    return out


def _culprit(judged: Dict[str, Any], hosts: List[str], measured: List[str], blamed: Dict[str, List[Dict[str, Any]]],
             out: Dict[str, Outcome]) -> Optional[BlockedBy]:
    """The host whose own fault explains every failed test of the judged network (each test blamed on it alone, and
    every host no test reached among them), whose own row says so (FAIL/ERROR): the cluster row's failed tests, or
    its "no network reaches all hosts", are then that host's, blocked by its ports result when the ports check proved
    its TCP blocked, else by its iperf3 result. None when the failures point at no one host."""
    found = sole_culprits(judged.get("links") or [], blamed)
    if not found or any(out.get(h) is None or out[h].status not in (Status.FAIL, Status.ERROR) for h in found):
        return None
    good = ok_links(judged)
    if any(h not in found and not any(h in (ln["src"], ln["dst"]) for ln in good) for h in measured):
        return None  # a host that no test reached, and no failure blamed on it: not explained
    order = {h: i for i, h in enumerate(hosts)}
    first = min(found, key=lambda h: order.get(h, len(order)))
    return BlockedBy(first, "ports" if first in (judged.get("blocked") or ()) else NAME)


def _host_outcome(h: str, judged: Dict[str, Any], networks: List[Dict[str, Any]],
                  stragglers: Dict[str, Dict[str, Any]], doubt: Dict[str, Dict[str, Any]],
                  blamed: Dict[str, List[Dict[str, Any]]], t: Dict[str, Any]) -> Outcome:
    """One host's row: its links on the judged network, whether it is a straggler (or below the fraction on weak
    evidence: said, not named), below the minimum, or the common end of failed tests."""
    min_gbps = float(t["min_gbps"])
    max_p = float(t["max_p"])
    where = str(judged["network"])
    links = judged.get("links") or []
    dev = judged["devices"].get(h)
    mine = [ln for ln in links if h in (ln["src"], ln["dst"])]
    mine_ok = [ln["gbps"] for ln in mine if not ln.get("error") and ln.get("gbps") is not None]
    med = median(mine_ok)
    findings: List[Finding] = []
    if h in stragglers:
        findings.append(_straggler_finding(h, stragglers[h], judged, dev, t))
    if min_gbps > 0 and med is not None and med < min_gbps:
        findings.append(Finding(Status.FAIL, f"{h}: median {rate(med)} over {len(mine_ok)} links on {where}, below "
                                             f"the minimum {rate(min_gbps)}", fix_slow(h, dev)))
    floor, floor_basis = link_floor(judged, t)
    if floor is not None and med is not None and med < floor and not (min_gbps > 0 and med < min_gbps):
        findings.append(Finding(Status.WARN, f"{h}: median {rate(med)} over {len(mine_ok)} links on {where}, below "
                                             f"the {floor_basis} (expected a healthy NIC to give iperf3 at least "
                                             f"that)", fix_slow(h, dev)))
    if h in blamed:
        bad = blamed[h]
        shown = "; ".join(f"{ln['src']}->{ln['dst']}: {ln['error']}" for ln in bad[:3])
        what = (f"every iperf3 test to and from {h} failed" if not mine_ok
                else f"{len(bad)} of {len(mine)} iperf3 tests with {h} failed")
        findings.append(Finding(Status.FAIL, f"{what} on {where} ({shown})",
                                f"check the firewall on {h}: NCCL and torch.distributed need TCP on arbitrary "
                                "ports between all hosts (nft list ruleset / iptables -S); is iperf3 "
                                f"installed and the address {judged['addresses'].get(h)} up?"))
    peers = ", ".join(f"-> {ln['dst']} {rate(ln['gbps'])}" if ln["src"] == h else f"<- {ln['src']} {rate(ln['gbps'])}"
                      for ln in mine if not ln.get("error"))
    ok_msg = (f"median {rate(med)} over {len(mine_ok)} links on {where} via {dev} ({peers or 'none'}); cluster "
              f"median {rate(judged.get('median_gbps'))}")
    proven = h in blamed and len(findings) == 1 and h in (judged.get("blocked") or ())
    if h in doubt:
        # Below the straggler fraction, but the other hosts' links disagree too much for that to be evidence
        # (measured again first: coordinate's confirm rounds): said, not named.
        d = doubt[h]
        ok_msg += (f"; not named, the evidence is weak (adjusted p >= {max_p:g}): {100 * d['ratio']:.0f}% of the "
                   f"median of the other hosts {rate(d['reference_gbps'])} (confidence: {_confidence(d, max_p)})")
    metrics = _host_metrics(h, judged, networks, mine, med, floor, stragglers, doubt)
    out = combine(findings, ok_msg, metrics)
    if proven:  # its failed tests are what the ports check proved of its TCP: that result is the cause
        out.blocked_by = BlockedBy(h, "ports")
    return out


def _host_metrics(h: str, judged: Dict[str, Any], networks: List[Dict[str, Any]], mine: List[Dict[str, Any]],
                  med: Optional[float], floor: Optional[float], stragglers: Dict[str, Dict[str, Any]],
                  doubt: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """A host row's metrics: its address and links on the judged network, its median on each network, and the
    straggler statistics where it was named or in doubt."""
    metrics = {"network": judged["network"], "device": judged["devices"].get(h), "address": judged["addresses"].get(h),
               "median_gbps": med, "cluster_median_gbps": judged.get("median_gbps"), "floor_gbps": floor,
               "link_mbps": (judged.get("link_mbps") or {}).get(h),
               "links": [dict({k: ln.get(k) for k in ("src", "dst", "gbps", "retransmits", "error")},
                              **({"tests": ln["tests"]} if "tests" in ln else {})) for ln in mine],
               "by_network": {n["network"]: median([ln["gbps"] for ln in ok_links(n)
                                                     if h in (ln["src"], ln["dst"])]) for n in networks}}
    if h in stragglers:
        metrics.update(reference_gbps=stragglers[h]["reference_gbps"], ratio=round(stragglers[h]["ratio"], 3),
                       t=round(stragglers[h].get("t", 0.0), 2), p_adj=stragglers[h].get("p_adj"),
                       detected_by=stragglers[h]["by"])
    elif h in doubt:
        metrics.update(reference_gbps=doubt[h]["reference_gbps"], ratio=round(doubt[h]["ratio"], 3),
                       t=round(doubt[h].get("t", 0.0), 2), p_adj=doubt[h].get("p_adj"), detected_by=None,
                       unsure=True)
    return metrics


def _straggler_finding(h: str, s: Dict[str, Any], judged: Dict[str, Any], dev: Any, t: Dict[str, Any]) -> Finding:
    """WARN for a straggler, FAIL below straggler_fail_fraction; says by which rule it was found, how sure, and
    whether every pair was measured again."""
    warn_frac, fail_frac = float(t["straggler_warn_fraction"]), float(t["straggler_fail_fraction"])
    again = (f"; every pair measured {1 + int(judged['remeasured'])} times, each judged by its best"
             if judged.get("remeasured") else "")
    status = Status.FAIL if s["ratio"] < fail_frac else Status.WARN
    why = (f"below {warn_frac * 100:.0f}%" if s["by"] == "fraction" else
           f"below {fail_frac * 100:.0f}%" if status == Status.FAIL else
           f"at least {100 * float(t['min_deficit']):.0f}% slower")
    # "median of the other hosts": of the links without this host (the reference it is judged by), not
    # the cluster median of every link that the PASS lines and the cluster row print.
    return Finding(status, f"{h}: median {rate(s['median_gbps'])} over {s['links']} links vs median of the other "
                           f"hosts {rate(s['reference_gbps'])} ({s['ratio'] * 100:.0f}%) on {judged['network']} via "
                           f"{dev} (straggler: {why}; confidence: {_confidence(s, float(t['max_p']))}){again}",
                   fix_slow(h, dev))


def _cluster_outcome(chosen: Optional[Dict[str, Any]], networks: List[Dict[str, Any]], judged: Dict[str, Any],
                     stragglers: Dict[str, Dict[str, Any]], measured: int, facts: Dict[str, Any],
                     t: Dict[str, Any], culprit: Optional[BlockedBy] = None) -> Outcome:
    """The cluster row: the chosen network and its median, the stragglers, and whether the best network is fast
    enough and its tests all passed; FAIL when no network reaches every host. Blocked by ``culprit`` when that
    host's fault is all it reports (failed tests, no network reaching all hosts)."""
    min_gbps = float(t["min_gbps"])
    links = judged.get("links") or []
    good = ok_links(judged)
    summary = "; ".join(_network_line(n) for n in networks)
    metrics = {"networks": [{"network": n["network"], "devices": n["devices"], "median_gbps": n.get("median_gbps"),
                             "links": len(n.get("links") or []), "ok": len(ok_links(n))} for n in networks],
               "chosen": chosen, "stragglers": {h: round(s["ratio"], 3) for h, s in stragglers.items()},
               "by_network": {n["network"]: n.get("median_gbps") for n in networks}, "rounds": facts.get("rounds"),
               "duration_s": facts.get("duration_s"),
               "remeasured": {n["network"]: n["remeasured"] for n in networks if n.get("remeasured")}}
    floor, floor_basis = link_floor(judged, t)
    metrics.update(floor_gbps=floor, floor=floor_basis)
    if not chosen:
        return Outcome(Status.FAIL, f"no network reaches all hosts with iperf3 ({summary})",
                       "see the hosts' iperf3 results: a firewall or a down interface blocks the tests", metrics,
                       blocked_by=culprit)
    devs = sorted(set(chosen["devices"]))
    message = (f"chosen {chosen['network']} via {','.join(devs)}: cluster median {rate(chosen['median_gbps'])} "
               f"({len(good)} of {len(links)} tests ok); measured {summary}")
    if stragglers:
        message += "; stragglers: " + ", ".join(f"{h} ({s['ratio'] * 100:.0f}%)" for h, s in stragglers.items())
    elif measured == 2:
        message += " (2 hosts: a slow link cannot be attributed to either of them)"
    message += "; " + floor_basis
    status, problems, fixes = Status.PASS, [], []
    if floor is not None and chosen["median_gbps"] < floor and not (min_gbps > 0 and chosen["median_gbps"] < min_gbps):
        status = Status.WARN
        problems.append(f"the best network's median {rate(chosen['median_gbps'])} is below its link-rate "
                        f"{floor_basis}")
        fixes.append("on every host: ethtool <nic> (negotiated speed/duplex), ip -s link show <nic> (errors), tc qdisc "
                     "show dev <nic> (a leftover rate limit); with streams = 1, raise [iperf3] streams on links above "
                     "~20 Gbit/s")
    if min_gbps > 0 and chosen["median_gbps"] < min_gbps:
        status = Status.FAIL
        problems.append(f"the best network's median {rate(chosen['median_gbps'])} is below the minimum "
                        f"{rate(min_gbps)}")
        fixes.append("check the NICs and switch ports (ethtool); a faster network may lack IPv4 addresses on "
                     "some hosts")
    if len(good) < len(links):
        status = Status.FAIL if status == Status.FAIL else Status.WARN
        problems.append(f"{len(links) - len(good)} of {len(links)} tests on the chosen network failed (see the "
                        "hosts' results)")
        fixes.append("see the failing hosts' iperf3 results")
    only_failed = len(problems) == 1 and len(good) < len(links)  # the failed tests are all it reports
    return Outcome(status, "; ".join(problems + [message]), "; ".join(fixes), metrics,
                   blocked_by=culprit if only_failed else None)
