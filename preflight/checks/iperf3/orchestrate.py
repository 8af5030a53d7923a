"""On the coordinator: ``coordinate(cluster)`` lists the candidate networks, and on each starts a server per host
and tests disjoint pairs in rounds (again where a host is in doubt), giving the facts ``verdict.evaluate`` reads::

    {"hosts": [...], "networks": [{"network", "devices", "addresses", "links": [...], "median_gbps", "blocked"}],
     "chosen": {"network", "devices", "addresses", "median_gbps", "hosts"}, "errors": {host: why}, "rounds": 5}
"""
from __future__ import annotations

from typing import AbstractSet, Any, Callable, Dict, List, Sequence, Set, Tuple

from .common import NAME, SERVER_READY_S, median, ok_links
from .networks import below_floor, choose, link_floor, shared_networks
from ...hostside.mesh import blocked_hosts, find_stragglers
from ...hostside.outcome import limits
from ...hostside.seams import ClusterView

AGENT_MARGIN_S = 20.0     # SSH channel + interpreter start + shipping the checks zip, per call


def _err(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 400 else text[:400] + "..."


def _parallel(fn: Any, items: Sequence[Any], timeout: float) -> List[Any]:
    from ...hostside.proc import parallel_map
    return parallel_map(fn, list(items), max(1, len(items)), timeout)


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    from ...hostside.schedule import pair_rounds, ring_rounds

    t = limits(cluster.thresholds, NAME)
    hosts = [h.name for h in cluster.hosts]
    duration = float(t["duration_s"])
    connect_timeout = float(t["connect_timeout_s"])
    facts: Dict[str, Any] = {"hosts": hosts, "networks": [], "chosen": None, "errors": {}, "subnets": {},
                             "unreachable": [h.name for h in getattr(cluster, "all_hosts", cluster.hosts)
                                             if h.name not in hosts],
                             "duration_s": duration, "rounds": 0}
    if len(hosts) < 2:
        reachable = ", ".join(hosts) or "none"
        facts["skipped"] = f"needs at least 2 reachable hosts to measure between them (reachable: {reachable})"
        return facts

    iface = _host_interfaces(cluster, hosts, facts["errors"])
    usable = [h for h in hosts if iface.get(h)]
    networks, facts["subnets"] = shared_networks({h: v for h, v in iface.items() if v}, usable,
                                                   int(t["max_networks"]))
    if len(usable) < 2 or not networks:
        return facts

    rounds = pair_rounds(len(usable), int(t["extra_rounds"]), 0)
    ring = len(ring_rounds(len(usable)))  # pair_rounds' first rounds: the extra matchings follow
    facts["rounds_planned"] = len(rounds)
    per_call = duration + connect_timeout + AGENT_MARGIN_S
    # The servers stay up through the rounds and, where a host is in doubt, through `confirm` repeats of them.
    serve_budget = (1 + int(t["confirm"])) * len(rounds) * (per_call + 5) + SERVER_READY_S + 60
    progress = getattr(cluster, "progress", None)
    _announce_phase(progress, networks, rounds)
    for net in networks:
        _measure_network(cluster, net, usable, rounds, ring, facts, t, per_call, serve_budget, progress)
    # the rounds measured (each network's; the ring alone where its links agreed), confirm repeats not counted
    facts["rounds"] = max([int(n.get("rounds") or 0) for n in facts["networks"]] or [0])
    facts["chosen"] = choose(facts["networks"], usable)
    # The ports check's facts say which end of a failed test is blocked. This check may start before ports (SPEC.early,
    # beside the host checks): it has measured, and waits for them now (runner.Schedule).
    wait_for = getattr(cluster, "wait_for", None)
    if callable(wait_for):
        wait_for("ports")
    ports_facts = (cluster.facts.get("*") or {}).get("ports")
    for net in facts["networks"]:
        net["blocked"] = _blocked_by_ports(ports_facts, net.get("addresses") or {})
    return facts


def _host_interfaces(cluster: ClusterView, hosts: Sequence[str], errors: Dict[str, str]) -> Dict[str, Any]:
    """Each host's interfaces, as the interfaces check read them, else listed here (the networks to measure on
    come from them); a host whose listing fails is noted in `errors` and left without."""
    iface = {h: (cluster.facts.get(h) or {}).get("interfaces") for h in hosts}
    missing = [h for h in hosts if not iface[h]]
    if missing:  # the interfaces check did not run (or failed): list them ourselves
        got = cluster.call_all(NAME + ".interfaces", {h: {} for h in missing}, timeout=30)
        for h, value in got.items():
            if isinstance(value, BaseException):
                errors[h] = f"could not list the interfaces: {_err(value)}"
            else:
                iface[h] = value
    return iface


def _announce_phase(progress: Any, networks: Sequence[Any], rounds: Sequence[Any]) -> None:
    """Tell the progress display (where there is one) how many steps follow: one per network and round."""
    if progress is not None:
        # +1: the runner advances once more when the check ends.
        nets_s, rounds_s = "s"[:len(networks) != 1], "s"[:len(rounds) != 1]
        progress.phase(f"iperf3 ({len(networks)} network{nets_s} x {len(rounds)} round{rounds_s})",
                       len(networks) * len(rounds) + 1)


def _measure_network(cluster: ClusterView, net: Dict[str, Any], usable: Sequence[str], rounds: Sequence[Any],
                     ring: int, facts: Dict[str, Any], t: Dict[str, Any], per_call: float, serve_budget: float,
                     progress: Any) -> None:
    """Measure one network: servers up on it, the rounds run (and repeated to confirm a suspect), the network with
    its links added to facts["networks"]; every server that was started is stopped whatever happens."""
    # The servers of one network listen on that network's addresses only, and only while it is measured.
    services: Dict[str, Any] = {}
    ports: Dict[str, int] = {}
    try:
        _start_servers(cluster, net, usable, t, serve_budget, services, ports, facts["errors"])
        blocked: Set[str] = set()  # hosts the ports check proved blocked here, once a test failed: not tested again

        def measure(previous: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
            """The ring's rounds, then the extra matchings only where the links so far (each pair at its best over
            ``previous``, a confirm repeat's earlier tests) disagree: there is a host to localize, or to clear."""
            def best(more: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
                return best_links(previous + more) if previous else more

            new = _run_rounds(cluster, rounds[:ring], usable, net, ports, facts["errors"], t, per_call, progress,
                              blocked)
            links = best(new)
            net["rounds"] = max(ring, int(net.get("rounds") or 0))
            if len(rounds) > ring and not ring_agrees(links, usable, net, t):
                blocked.update(_proved_blocked(cluster, links, net))
                new += _run_rounds(cluster, rounds[ring:], usable, net, ports, facts["errors"], t, per_call, progress,
                                   blocked)
                links = best(new)
                net["rounds"] = len(rounds)
            return links

        net["links"] = _measure_confirmed(measure, usable, net, t, progress, blocked)
        net["median_gbps"] = median([ln["gbps"] for ln in ok_links(net)])
        facts["networks"].append(net)
    finally:
        _stop_servers(services, ports, facts)


def _start_servers(cluster: ClusterView, net: Dict[str, Any], usable: Sequence[str], t: Dict[str, Any],
                   serve_budget: float, services: Dict[str, Any], ports: Dict[str, int],
                   errors: Dict[str, str]) -> None:
    """Start an iperf3 server on each host, bound to its address on `net`, all in parallel: `services` gets every
    server started (for the caller to stop), `ports` the port of each that listens, `errors` why the others do not."""
    def start(h: str) -> int:
        services[h] = cluster.start(h, NAME + ".serve", {"port": int(t["port"]),
                                                         "bind": net["addresses"][h]}, serve_budget)
        return int(services[h].wait_ready(SERVER_READY_S + AGENT_MARGIN_S)["port"])

    for h, res in zip(usable, _parallel(start, usable, SERVER_READY_S + AGENT_MARGIN_S + 10)):
        if isinstance(res, BaseException):
            errors[h] = f"iperf3 server did not start: {_err(res)}"
        else:
            ports[h] = res


def _measure_confirmed(measure: Callable[[List[Dict[str, Any]]], List[Dict[str, Any]]], usable: Sequence[str],
                       net: Dict[str, Any], t: Dict[str, Any], progress: Any,
                       blocked: Set[str]) -> List[Dict[str, Any]]:
    """The links of one network: the rounds once, then again while a host is named, in doubt or below the floor,
    up to `confirm` times, each pair keeping its best rate (``measure(previous)``: each time the ring first, the
    extra rounds only where the links so far disagree)."""
    links = measure([])
    # While a host is named or in doubt (below the straggler fraction, but the other hosts' links disagree
    # too much to tell), measure every pair again, up to `confirm` times, and let each pair keep its best
    # rate, as compute keeps each device's best: a slow host is slow every time, while a moment of
    # contention on a loaded host (another process starving its iperf3) passes. Doubt is met by measuring
    # more, not by failing; a healthy cluster costs nothing.
    # A host below the link-rate floor is confirmed the same way before it is named.
    floor = link_floor(net, t)[0]
    for _ in range(int(t["confirm"])):
        doubt: Dict[str, Dict[str, Any]] = {}
        named = find_stragglers(links, usable, float(t["straggler_warn_fraction"]), t, doubt)
        slow = below_floor(links, usable, floor)
        # A host the ports check proved blocked is not in doubt: its failed tests would only fail again.
        suspects_set = (set(named) | set(doubt) | set(slow)) - blocked
        if not suspects_set:
            break
        if progress is not None:
            suspects = ", ".join(sorted(suspects_set))
            progress.note(f"iperf3: measuring {net['network']} again to confirm {suspects}")
        net["remeasured"] = int(net.get("remeasured") or 0) + 1
        links = measure(links)  # each pair keeps its best (best_links)
    return links


def ring_agrees(links: List[Dict[str, Any]], usable: Sequence[str], net: Dict[str, Any], t: Dict[str, Any]) -> bool:
    """Whether the ring's links agree, so that the extra rounds, which localize a slow host, have none to localize
    (thresholds.toml, agree_deficit): no test failed, no host below the link-rate floor, and the straggler test with
    min_deficit at agree_deficit names no host and leaves none in doubt."""
    agree = float(t.get("agree_deficit", 0.0))
    if agree <= 0 or any(ln.get("error") or ln.get("gbps") is None for ln in links):
        return False
    doubt: Dict[str, Dict[str, Any]] = {}
    named = find_stragglers(links, usable, float(t["straggler_warn_fraction"]), dict(t, min_deficit=agree), doubt)
    return not named and not doubt and not below_floor(links, usable, link_floor(net, t)[0])


def _proved_blocked(cluster: ClusterView, links: List[Dict[str, Any]], net: Dict[str, Any]) -> Set[str]:
    """The ends of this network's failed tests whose TCP the ports check proved blocked (waiting for ports, bounded
    by the run's schedule; only once a test failed, so a healthy run never waits): a firewalled host's tests would
    only wait out the connect timeout again, in every extra round and confirm repeat (bench/failfast.py: 5 rounds
    of it). Empty without ports' facts."""
    failed = {h for ln in links if ln.get("error") or ln.get("gbps") is None for h in (ln["src"], ln["dst"])}
    wait_for = getattr(cluster, "wait_for", None)
    if not failed or not callable(wait_for) or not wait_for("ports"):
        return set()
    proved = _blocked_by_ports((cluster.facts.get("*") or {}).get("ports"), net.get("addresses") or {})
    return failed & set(proved)


def _stop_servers(services: Dict[str, Any], ports: Dict[str, int], facts: Dict[str, Any]) -> None:
    """Stop every server started, in parallel, killing one whose stop fails; a failed stop of a server that
    listened is noted in facts["stop_errors"]."""
    def halt(h: str) -> Any:
        try:
            return services[h].stop(15)
        except BaseException:
            services[h].kill()  # its agent sees EOF and kills iperf3 (and the runner reaps after all)
            raise
    done = _parallel(halt, list(services), 30)
    for h, res in zip(list(services), done):
        if isinstance(res, BaseException) and h in ports:
            facts.setdefault("stop_errors", {})[h] = _err(res)


def _blocked_by_ports(ports_facts: Any, addresses: Dict[str, str]) -> List[str]:
    """Hosts whose TCP the ports check proved blocked on these addresses: the evidence that says which end of a
    failed test to blame when the tests alone cannot (3 hosts measure each pair once)."""
    if not isinstance(ports_facts, dict) or not addresses:
        return []
    try:
        return sorted(blocked_hosts(ports_facts, addresses))
    except Exception:  # another check's facts: a schema change there must not break this check
        return []


def best_links(links: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per measured (src, dst) pair, its best rate over the repeats (``tests``: how many); every failed
    test is kept as its own record, since a failure is evidence whatever a repeat did."""
    best: Dict[Tuple[str, str], Dict[str, Any]] = {}
    tests: Dict[Tuple[str, str], int] = {}
    failed = []
    for ln in links:
        pair = (ln["src"], ln["dst"])
        tests[pair] = tests.get(pair, 0) + 1
        if ln.get("error") or ln.get("gbps") is None:
            failed.append(ln)
        elif pair not in best or ln["gbps"] > best[pair]["gbps"]:
            best[pair] = ln
    return [dict(ln, tests=tests[pair]) for pair, ln in best.items()] + failed


def _run_rounds(cluster: ClusterView, rounds: Sequence[Any], usable: Sequence[str], net: Dict[str, Any],
                ports: Dict[str, int], errors: Dict[str, str], t: Dict[str, Any], per_call: float,
                progress: Any, blocked: AbstractSet[str] = frozenset()) -> List[Dict[str, Any]]:
    """One iperf3 test per pair of each round (the pairs of a round at once), as link records; a pair with an end
    in ``blocked`` is not tested (its earlier failed test stands)."""
    links: List[Dict[str, Any]] = []
    for rnd in rounds:
        params: Dict[str, Dict[str, Any]] = {}
        for a, b in rnd:
            src, dst = usable[a], usable[b]
            if src in blocked or dst in blocked:
                continue
            if dst not in ports:
                links.append({"src": src, "dst": dst, "gbps": None, "retransmits": None, "blame": dst,
                              "error": f"no iperf3 server on {dst} ({errors.get(dst)})"})
                continue
            params[src] = {"addr": net["addresses"][dst], "port": ports[dst], "dst": dst,
                           "bind": net["addresses"][src], "duration_s": float(t["duration_s"]),
                           "connect_timeout_s": float(t["connect_timeout_s"]), "streams": int(t["streams"]),
                           "interval_s": float(t["interval_s"])}
        got = cluster.call_all(NAME + ".client", params, per_call) if params else {}
        for src, value in got.items():
            link = {"src": src, "dst": params[src]["dst"], "gbps": None, "retransmits": None, "error": None}
            if isinstance(value, BaseException):
                link["error"] = f"the client on {src} did not report: {_err(value)}"
                link["agent_failed"] = True  # preflight's machinery, not evidence about the network
            else:
                link.update(gbps=value.get("gbps"), retransmits=value.get("retransmits"),
                            error=value.get("error"), sent_gbps=value.get("sent_gbps"))
                if value.get("samples_gbps"):
                    link["samples_gbps"] = value["samples_gbps"]
                if value.get("missing"):
                    link["blame"] = src
            links.append(link)
        if progress is not None:
            progress.advance(net["network"], f"round of {len(rnd)} pair{'s'[:len(rnd) != 1]}")
    return links
