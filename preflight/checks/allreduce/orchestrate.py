"""Coordinator side of the all-reduce check: plan the ranks, run the sweep on every host, and localize failures.

``coordinate(cluster)`` probes every host (``allreduce.supervisor.probe``), starts ``allreduce.supervisor.run`` on
each with its ranks, collects every rank's result, orders the errors by likely root cause and, when the run fails or
busbw is flagged, runs pairwise all-reduces over the ring of hosts to name the host. It returns the facts that
``verdict.evaluate`` judges, e.g.::

    {"status": "failed", "world_size": 3, "backend": "gloo", "failure": {"kind": "rendezvous", "message": "..."},
     "localization": {"suspects": [{"host": "node01", "kind": "rendezvous", "source": "errors", "reason": "..."}]}}

Thresholds: the ``[allreduce]`` section (and ``[iperf3] straggler_warn_fraction`` for the iperf3 map's stragglers).
"""
from __future__ import annotations

import re
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...hostside.outcome import Status, limits
from ...hostside.fmt import gbps
from ...hostside.robust import MAD_TO_SIGMA
from ...hostside.mesh import blocked_hosts, unreachable_hosts
from ...hostside.mesh import find_stragglers as find_link_stragglers
from ...hostside.seams import ClusterView
from .common import KIND_ORDER, NAME, addresses_in, bandwidth_table, classify, names, rank_list, sweep_sizes
from .stragglers import describe as describe_straggler
from .stragglers import find as find_stragglers
from .stragglers import host_rates
from .verdict import judge

MAX_RANKS_IN_METRICS = 512


def _iperf3(cluster: ClusterView) -> Dict[str, Any]:
    facts = (cluster.facts.get("*") or {}).get("iperf3")
    return facts if isinstance(facts, dict) else {}


def _iperf3_stragglers(iperf: Dict[str, Any], hosts: Sequence[str], fraction: float,
                       stats: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Stragglers of the iperf3 check's links on the chosen network, by that check's own rule (a host's median link
    against the median of the links without it: below the fraction, or statistically clear with ``stats``, the
    [iperf3] thresholds), so that both checks blame the same host."""
    chosen = iperf.get("chosen") or {}
    nets = [n for n in iperf.get("networks") or [] if isinstance(n, dict) and n.get("links")]
    net = next((n for n in nets if n.get("network") == chosen.get("network")), None) or (nets[0] if nets else None)
    if not net:
        return []
    try:
        found = find_link_stragglers([ln for ln in net["links"] if isinstance(ln, dict)], list(hosts), fraction, stats)
    except Exception:  # another check's facts: a schema change there must not break this check
        return []
    return [{"host": h, "reason": _iperf3_reason(net.get("network"), s), "source": "iperf3", "kind": "slow"}
            for h, s in found.items()]


def _iperf3_reason(network: Any, s: Dict[str, Any]) -> str:
    """Why the iperf3 straggler ``s`` (find_link_stragglers' entry) is named, on ``network``."""
    z = f" (robust z {s['z']:.1f})" if "z" in s else ""
    return (f"iperf3 on {network}: its median link {s['median_gbps']:.2f} Gbit/s is {100 * s['ratio']:.0f}% "
            f"of the other links' {s['reference_gbps']:.2f}{z}")


def _plan_jobs(hosts: Sequence[Any], master_addr: str, port: int) -> Dict[str, List[Dict[str, Any]]]:
    """Global ranks in hostfile order, one per slot; LOCAL_RANK indexes the host's GPUs (DeepSpeed's layout)."""
    world = sum(h.slots for h in hosts)
    jobs: Dict[str, List[Dict[str, Any]]] = {}
    base_rank = 0
    for h in hosts:
        gpus = list(h.gpus or []) or list(range(h.slots))
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
        tag = f"pair:{a.name},{b.name}"
        for r, h in enumerate((a, b)):
            mine = jobs.setdefault(h.name, [])
            gpus = list(h.gpus or []) or [0]
            mine.append({"tag": tag, "rank": r, "local_rank": 0, "local_world_size": 1, "world_size": 2,
                         "master_addr": addr_of[a.name], "master_port": port,
                         "device": gpus[len(mine) % len(gpus)]})
    return jobs


def _host_failed(value: Any) -> bool:
    if isinstance(value, BaseException):
        return True
    return any(not r.get("ok") for r in value.get("ranks", []))


def _run_groups(cluster: ClusterView, jobs: Dict[str, List[Dict[str, Any]]], common: Dict[str, Any], grace: float
                ) -> Dict[str, Any]:
    """Start supervisor.run on every host, wait for all; after the first failure wait grace seconds, then stop the
    rest. Every Service is stopped (or killed) before returning, whatever happens."""
    timeout = float(common["rank_timeout_s"]) + 20
    services: Dict[str, Any] = {}
    results: Dict[str, Any] = {}
    lock = threading.Lock()
    arrived = threading.Event()  # a host's result came: the loop below looks at once, not at its next tick

    def waiter(host: str) -> None:
        try:
            value = services[host].result(timeout + 15)
        except BaseException as exc:  # noqa: BLE001 - an agent failure is this host's result
            value = exc
        with lock:
            results.setdefault(host, value)
        arrived.set()

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
                services[host] = cluster.start(host, "allreduce.supervisor.run", params, timeout)
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
            while len(results) < len(services) and time.monotonic() < deadline:
                arrived.wait(0.2)
                arrived.clear()
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
        results.setdefault(host, RuntimeError(f"not started on {host}: starting the ranks failed on another host"
                                              if host not in services else f"no answer from {host}"))
    return results


def _collect_ranks(results: Dict[str, Any], jobs: Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    ranks: List[Dict[str, Any]] = []
    for host, value in results.items():
        if isinstance(value, BaseException):
            for spec in jobs.get(host, []):
                ranks.append({"tag": spec["tag"], "rank": spec["rank"], "local_rank": spec["local_rank"],
                              "world_size": spec["world_size"], "host": host, "ok": False, "kind": "other",
                              "phase": "start", "error": f"the agent on {host} failed: {value}"})
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
            error_text = f"still connecting after {r['phase_s']:.0f}s, phase {phase}"
        targets = [r["target"]] if r.get("target") else addresses_in(r.get("error", ""))
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
    if peers:
        who = f"{rank_list([r for r, h in entry['from'] if h != host])} on {names(peers)}"
    else:
        who = f"its own rank {entry['from'][0][0]}"
    return f"connections from {who} to its port {entry['port']} {entry['why']}{where}"


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


def _pair_suspects(pairs: Sequence[Dict[str, Any]], mode: str, fraction: float,
                   stats: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
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
            tried = ", ".join(o for p in ps for o in p["hosts"] if o != h)
            suspects[h] = {"host": h, "reason": f"its all-reduce fails with every peer tried ({tried})",
                           "source": "pairwise", "kind": "mesh"}
    if mode == "bandwidth":
        best = {h: max([p["busbw_GBps"] for p in ps if p["ok"] and p.get("busbw_GBps")] or [0.0])
                for h, ps in per_host.items()}
        if len(best) >= 3:
            median = statistics.median(best.values())
            # The same rule as the iperf3 map: below the fraction, or a statistically clear deficit (robust z
            # against the hosts' spread, 1.4826 x MAD, at least noise_floor) that is also larger than min_deficit.
            spread = MAD_TO_SIGMA * statistics.median([abs(b - median) for b in best.values()])
            sigma = max(spread, float((stats or {}).get("noise_floor", 1.0)) * median, 1e-12)
            for h, b in best.items():
                z = (b - median) / sigma
                clear = stats is not None and z < -float(stats["z_threshold"]) \
                    and b < (1 - float(stats["min_deficit"])) * median
                if (b < fraction * median or clear) and h not in suspects:
                    percent = 100 * b / median if median else 0
                    suspects[h] = {"host": h, "reason": f"its best pairwise all-reduce reaches {gbps(b)} GB/s busbw, "
                                   f"{percent:.0f}% of the median host's {gbps(median)} GB/s (robust z {z:.1f})",
                                   "source": "pairwise", "kind": "slow"}
    return list(suspects.values())


def _pairwise(cluster: ClusterView, hosts: Sequence[Any], addr_of: Dict[str, str], common: Dict[str, Any],
              cfg: Dict[str, Any], mode: str, nbytes: int, owner: Dict[str, str]) -> Dict[str, Any]:
    """Bounded pairwise all-reduce runs: the ring (each host paired with both neighbours). For a failure, all ring
    pairs at once (only connectivity matters); for bandwidth, rounds of disjoint pairs (2 or 3 rounds)."""
    from ...hostside.schedule import ring_rounds
    n = len(hosts)
    rounds = ring_rounds(n)
    if mode == "failure":
        rounds = [[p for rnd in rounds for p in rnd]]
    rank_params = dict(common["rank_params"], sizes=[int(nbytes)], init_timeout_s=float(cfg["pair_init_timeout_s"]),
                       iters=1 if mode == "failure" else int(cfg["iters"]), stragglers=None)
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
            tag = f"pair:{a.name},{b.name}"
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
                entry["error"] = f"rank {primary.get('rank')} on {primary.get('host')}: {primary['error']}"
                entry["kind"] = primary["kind"]
                where = f" in the pair {a.name}+{b.name}"
                entry["unreachable"] = {h: _describe_unreachable(h, u, where)
                                        for h, u in _unreachable(errs, int(common["port"])).items()}
            out.append(entry)
    return {"mode": mode, "bytes": int(nbytes), "pairs": out,
            "suspects": _pair_suspects(out, mode, float(cfg["straggler_fraction"]), cfg)}


def _straggler_plan(hosts: Sequence[Any], cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The straggler rounds the main run's ranks do after the sweep (rank.py): the hosts paired around the ring
    (checks/schedule.py, 2 rounds of disjoint pairs for an even host count, 3 for odd), each pair the two hosts'
    first global ranks (hostfile order, as ``_plan_jobs``). None below 3 hosts or when turned off."""
    if not cfg["straggler_rounds"] or len(hosts) < 3:
        return None
    from ...hostside.schedule import ring_rounds
    first, base = [], 0
    for h in hosts:
        first.append(base)
        base += h.slots
    return {"bytes": int(cfg["straggler_bytes"]) // 4 * 4, "iters": int(cfg["straggler_iters"]),
            "rounds": [[[first[a], first[b]] for a, b in rnd] for rnd in ring_rounds(len(hosts))]}


def _list(value: Any) -> List[Any]:
    return value if isinstance(value, list) else []


def _straggler_facts(plan: Dict[str, Any], ranks: Sequence[Dict[str, Any]], hosts: Sequence[Any]) -> Dict[str, Any]:
    """The rounds' per-pair iteration times as ``stragglers.find`` reads them: {"bytes", "iters", "rounds",
    "pairs": [{"hosts": [a, b], "ok", "iter_s"}], "duration_s"}. Both ranks of a pair report the pair's times
    (the hosts' output: only numbers are kept, at most ``iters`` of them; the names come from the plan)."""
    by_rank = {r.get("rank"): r for r in ranks if isinstance(r, dict)}
    name_of: Dict[int, str] = {}
    base = 0
    for h in hosts:
        name_of[base] = h.name
        base += h.slots
    pairs: List[Dict[str, Any]] = []
    for i, rnd in enumerate(plan["rounds"]):
        for ra, rb in rnd:
            a, b = by_rank.get(ra) or {}, by_rank.get(rb) or {}
            entry: Dict[str, Any] = {"hosts": [name_of.get(ra), name_of.get(rb)], "round": i}
            got = [p for r in (a, b) for p in _list(r.get("stragglers"))
                   if isinstance(p, dict) and p.get("round") == i and p.get("ranks") == [ra, rb]]
            times = [[float(t) for t in _list(p.get("iter_s"))
                      if isinstance(t, (int, float)) and not isinstance(t, bool)][:int(plan["iters"])] for p in got]
            times = [t for t in times if t]
            if times:
                entry.update(ok=True, iter_s=[max(ts) for ts in zip(*times)])
            else:
                why = a.get("stragglers_error") or b.get("stragglers_error") or "no timing reported"
                entry.update(ok=False, error=str(why)[:300])
            pairs.append(entry)
    spent = [float(r["stragglers_s"]) for r in ranks if isinstance(r.get("stragglers_s"), (int, float))]
    return {"bytes": plan["bytes"], "iters": plan["iters"], "rounds": len(plan["rounds"]), "pairs": pairs,
            "duration_s": max(spent) if spent else None}


def known_unreachable(cluster_facts: Dict[str, Any], addr_of: Dict[str, str]) -> List[Dict[str, Any]]:
    """Hosts that the ports or iperf3 check already proved unreachable over TCP on the addresses the all-reduce
    will use: a full run including them can only wait out init_timeout_s, so they are left out and named."""
    found: Dict[str, Dict[str, Any]] = {}
    for check in ("ports", "iperf3"):
        facts = cluster_facts.get(check)
        if not isinstance(facts, dict):
            continue
        try:
            hits = blocked_hosts(facts, addr_of) if check == "ports" else unreachable_hosts(facts, addr_of)
        except Exception:  # another check's facts: a schema change there must not break this check
            continue
        for h, why in hits.items():
            if h in found:
                found[h]["reason"] += "; " + why
                found[h]["sources"].append(check)
            else:
                found[h] = {"host": h, "reason": why, "sources": [check], "kind": "mesh"}
    return [found[h] for h in addr_of if h in found]


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    cfg = limits(cluster.thresholds, NAME)
    t0 = time.monotonic()
    hosts = list(cluster.hosts)
    reachable = {x.name for x in hosts}
    port = cluster.options.master_port
    iperf = _iperf3(cluster)
    chosen = iperf.get("chosen") or {}
    chosen_addr = chosen.get("addresses") or {}
    excluded = _leave_out_unreachable(cluster, cfg, hosts, chosen_addr)
    # Each host's address on the run's network (the sources of a firewall fix), and the firewalls the ports check
    # read on the hosts it found blocked: a left-out host's fix names the tool and chain it runs.
    addresses = {h.name: chosen_addr.get(h.name) or cluster.address(h.name) for h in hosts}
    ports_firewalls = ((cluster.facts.get("*") or {}).get("ports") or {}).get("firewalls") or {}
    firewalls = {e["host"]: ports_firewalls[e["host"]] for e in excluded
                 if isinstance(ports_firewalls.get(e["host"]), dict)}
    hosts = [h for h in hosts if h.name not in {e["host"] for e in excluded}]
    facts: Dict[str, Any] = {"hosts": [h.name for h in hosts], "slots": {h.name: h.slots for h in hosts},
                             "world_size": sum(h.slots for h in hosts), "master_port": port,
                             "excluded": excluded,
                             "unreachable": [h.name for h in cluster.all_hosts if h.name not in reachable],
                             "addresses": addresses, **({"firewalls": firewalls} if firewalls else {})}

    def done(status: str, **more: Any) -> Dict[str, Any]:
        facts.update(status=status, duration_s=round(time.monotonic() - t0, 3), **more)
        return facts

    if not hosts:
        return done("skipped", reason="no host is left to run it on")
    master = cluster.master if cluster.master.name in facts["slots"] else hosts[0]
    master_addr = chosen_addr.get(master.name) or cluster.address(master.name)
    addr_of = {h.name: chosen_addr.get(h.name) or cluster.address(h.name) for h in hosts}
    owner = {a: h for h, a in addr_of.items()}
    owner.update({cluster.address(h.name): h.name for h in hosts})
    facts.update(master=master.name, master_addr=master_addr, network=chosen.get("network"),
                 iperf3_median_gbps=chosen.get("median_gbps"), init_timeout_s=float(cfg["init_timeout_s"]))
    if facts["world_size"] <= 1:
        return done("skipped", reason=f"world size {facts['world_size']}: NCCL turns a 1-rank all-reduce into a "
                                      "no-op (and gloo a local copy), so it measures no bandwidth")
    # 1. probe: torch, GPUs and interface on every host, so that every rank gets the same backend.
    probes = _probe(cluster, cfg, hosts, master_addr, chosen_addr)
    broken = {h: str(v) for h, v in probes.items() if isinstance(v, BaseException)}
    if broken:
        first = next(iter(broken.values()))[:300]
        return done("error", reason=f"could not probe torch on {names(list(broken))}: {first}")
    facts["torch"] = {h: p.get("torch") for h, p in probes.items()}
    no_torch = {h: p["error"] for h, p in probes.items() if p.get("torch") is None}
    if no_torch:
        return done("no_torch", hosts_without_torch=sorted(no_torch), reason=next(iter(no_torch.values())),
                    python=cluster.options.python,
                    executables={h: probes[h].get("executable") for h in sorted(no_torch)})
    facts["interfaces"] = {h: p.get("interface") for h, p in probes.items()}
    ifnames = {h: (p.get("interface") or {}).get("ifname") for h, p in probes.items()}
    backend, no_gpu = _backend(cluster, hosts, probes, facts)
    if no_gpu is not None:
        return done("failed", **no_gpu)
    facts["backend"] = backend
    # 2. the all-reduce itself.
    plan = _straggler_plan(hosts, cfg)
    common = {"rank_params": _rank_params(cfg, backend, plan), "rank_timeout_s": _rank_timeout(cfg, plan),
              "grace_s": float(cfg["grace_s"]), "ifnames": ifnames, "port": port}
    jobs = _plan_jobs(hosts, master_addr, port)
    then = f", then {len(plan['rounds'])} straggler rounds" if plan else ""
    cluster.progress.note(f"allreduce: {facts['world_size']} ranks ({backend}) on {len(hosts)} hosts{then}")
    results = _run_groups(cluster, jobs, common, float(cfg["grace_s"]))
    ranks = [r for r in _collect_ranks(results, jobs) if r.get("tag") == "main"]
    facts["ranks"] = _layout(ranks)[:MAX_RANKS_IN_METRICS]
    agent_errors = {h: str(v) for h, v in results.items() if isinstance(v, BaseException)}
    errors = _rank_errors(ranks, owner, float(cfg["init_timeout_s"]))
    ok = not errors and not agent_errors and len(ranks) == facts["world_size"]
    sizes, stopped = _group_table(ranks)
    facts.update(sizes=sizes, stopped_early=stopped, errors=errors[:64], error_count=len(errors))
    iperf_limits = limits(cluster.thresholds, "iperf3")
    iperf_suspects = _iperf3_stragglers(iperf, [h.name for h in hosts], float(iperf_limits["straggler_warn_fraction"]),
                                        iperf_limits)
    pairwise = _Pairwise(cluster, hosts, addr_of, common, cfg, owner)
    if not ok:
        primary = errors[0] if errors else {"kind": "other", "error": "; ".join(agent_errors.values())}
        facts["failure"] = {"kind": primary["kind"], "message": _failure_message(errors, facts, agent_errors)}
        if agent_errors and not any(e["kind"] not in ("other", "stopped", "aborted") for e in errors):
            # preflight's own machinery failed (the agent could not start the ranks): not a verdict on the cluster
            return done("error", reason=facts["failure"]["message"])
        facts["localization"] = _localize_failure(pairwise, errors, primary["kind"], iperf_suspects)
        _read_firewalls(cluster, facts, addr_of)
        return done(facts.get("status") or "failed")
    if plan is not None:
        facts["stragglers"] = _straggler_facts(plan, ranks, hosts)
    facts["localization"] = _localize_slow(pairwise, facts, iperf_suspects)
    return done("ok")


def _read_firewalls(cluster: ClusterView, facts: Dict[str, Any], addr_of: Dict[str, str]) -> None:
    """facts["firewalls"]: the firewall of each host suspected of blocking connections (rendezvous, mesh), read
    there (hostside/fixes.py), so that its fix names the tool and chain it runs; facts["addresses"]: each host's
    address on the run's network (the fix's sources)."""
    from ...hostside.fixes import FIREWALL_CALL
    from ...hostside.proc import parallel_map
    suspects = [s["host"] for s in (facts.get("localization") or {}).get("suspects") or []
                if s.get("kind") in ("rendezvous", "mesh") and s.get("host") in addr_of]
    facts["addresses"].update(addr_of)
    if not suspects:
        return
    answers = parallel_map(lambda h: cluster.call(h, FIREWALL_CALL, {"addresses": [addr_of[h]]}, 30.0), suspects,
                           cluster.parallel, 40.0)
    facts.setdefault("firewalls", {}).update({h: a if isinstance(a, dict) else {"error": str(a) or type(a).__name__}
                                              for h, a in zip(suspects, answers)})


def _leave_out_unreachable(cluster: ClusterView, cfg: Dict[str, Any], hosts: List[Any],
                           chosen_addr: Dict[str, str]) -> List[Dict[str, Any]]:
    """Fail fast: what the ports and iperf3 checks already proved is not waited out again (init_timeout_s, then
    pairwise runs). Those hosts are named (and noted), and the all-reduce runs among the others."""
    if not (cfg["exclude_unreachable"] and len(hosts) >= 2):
        return []
    excluded = known_unreachable(cluster.facts.get("*") or {}, {
        h.name: chosen_addr.get(h.name) or cluster.address(h.name) for h in hosts})
    if excluded:
        reasons = "; ".join(e["reason"] for e in excluded)[:300]
        cluster.progress.note(f"allreduce: leaving out {names([e['host'] for e in excluded])}, "
                              f"already found unreachable ({reasons})")
    return excluded


def _probe(cluster: ClusterView, cfg: Dict[str, Any], hosts: List[Any], master_addr: str,
           chosen_addr: Dict[str, str]) -> Dict[str, Any]:
    """{host: what a rank there will see (torch, CUDA, GPUs, the interface toward the master), or the exception}."""
    where = {h.name: {"master_addr": master_addr, "bind_address": chosen_addr.get(h.name)} for h in hosts}
    seen = {h.name: (cluster.facts.get(h.name) or {}).get("python", {}).get("rank_view") for h in hosts}
    if all(isinstance(v, dict) for v in seen.values()):  # the python check saw torch as a rank will
        cluster.progress.note(f"allreduce: choosing interfaces on {len(hosts)} hosts")
        ifaces = cluster.call_all("allreduce.supervisor.interface", where, float(cfg["start_timeout_s"]))
        exe = {h.name: (cluster.facts.get(h.name) or {}).get("python", {}).get("executable") for h in hosts}
        return {h: iface if isinstance(iface, BaseException) else dict(seen[h], interface=iface, executable=exe[h])
                for h, iface in ifaces.items()}
    cluster.progress.note(f"allreduce: probing torch on {len(hosts)} hosts")
    return cluster.call_all("allreduce.supervisor.probe", where, float(cfg["start_timeout_s"]))


def _no_gpu(backend: str, message: str, suspects: Dict[str, str]) -> Dict[str, Any]:
    """The facts of a run that cannot start for want of GPUs; {host: why} are its suspects."""
    return {"backend": backend, "failure": {"kind": "no_gpu", "message": message}, "errors": [],
            "localization": {"suspects": [{"host": h, "reason": why, "source": "probe", "kind": "no_gpu"}
                                          for h, why in suspects.items()]}}


def _blind_text(host: str, gpus: int, probe: Dict[str, Any]) -> str:
    """Why torch on ``host`` sees none of the ``gpus`` GPUs the gpu check found."""
    why = ": " + probe["cuda_error"] if probe.get("cuda_error") else ": a CPU-only torch build?"
    return (f"{host} has {gpus} GPU(s) but torch {probe.get('torch')} there sees none "
            f"(torch.cuda.is_available() is False{why})")


def _backend(cluster: ClusterView, hosts: List[Any], probes: Dict[str, Any],
             facts: Dict[str, Any]) -> Tuple[str, Optional[Dict[str, Any]]]:
    """(backend, None) when every rank can run it: "nccl" (its GPU names and NCCL versions go into facts) when
    torch sees CUDA everywhere, "gloo" when nowhere; ("", the facts of the failed run) when GPUs are missing."""
    cuda = {h: bool(p.get("cuda")) for h, p in probes.items()}
    # GPUs that the gpu check found but torch cannot use would silently turn this into a CPU (gloo) measurement.
    blind = {h.name: len(((cluster.facts.get(h.name) or {}).get("gpu") or {}).get("gpus") or []) for h in hosts}
    blind = {h: n for h, n in blind.items() if n and not cuda[h]}
    if blind:
        return "", _no_gpu("none", "; ".join(_blind_text(h, n, probes[h]) for h, n in blind.items()),
                           {h: f"torch does not see its {n} GPU(s)" for h, n in blind.items()})
    if all(cuda.values()):
        short = {h.name: f"slots={h.slots} needs GPUs {list(h.gpus or [])} but torch sees "
                         f"{probes[h.name]['device_count']}"
                 for h in hosts if max(list(h.gpus or []) or [h.slots - 1]) >= probes[h.name]["device_count"]}
        if short:
            return "", _no_gpu("nccl", "; ".join(f"{h}: {why}" for h, why in short.items()), short)
        facts["gpu_names"] = {h.name: [probes[h.name]["gpu_names"][g] for g in (list(h.gpus or []) or range(h.slots))]
                              for h in hosts}
        facts["nccl"] = {h: p.get("nccl") for h, p in probes.items()}
        return "nccl", None
    if any(cuda.values()):
        without = sorted(h for h, c in cuda.items() if not c)
        return "", _no_gpu("mixed", f"torch sees no CUDA GPU on {names(without)} while the other hosts have GPUs: "
                                    "NCCL cannot run there",
                           {h: "torch.cuda.is_available() is False" for h in without})
    return "gloo", None


def _layout(ranks: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Where each rank ran, in rank order."""
    return [{"rank": r.get("rank"), "local_rank": r.get("local_rank"), "host": r.get("host"), "pid": r.get("pid"),
             "device": r.get("device"), "torch_preloaded": r.get("torch_preloaded")}
            for r in sorted(ranks, key=lambda r: r.get("rank") or 0)]


def _rank_params(cfg: Dict[str, Any], backend: str, plan: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    max_bytes = int(cfg["gpu_max_bytes"] if backend == "nccl" else cfg["max_bytes"])
    return {"backend": backend, "sizes": sweep_sizes(int(cfg["min_bytes"]), max_bytes),
            "iters": int(cfg["iters"]), "size_budget_s": float(cfg["size_budget_s"]),
            "sweep_budget_s": float(cfg["sweep_budget_s"]), "init_timeout_s": float(cfg["init_timeout_s"]),
            "start_timeout_s": float(cfg["start_timeout_s"]), "stragglers": plan}


def _rank_timeout(cfg: Dict[str, Any], plan: Optional[Dict[str, Any]]) -> float:
    # Joining ends by start + init (every rank's own deadline); init and the first collective get init each; the
    # straggler rounds get what supervisor._allowance gives them.
    rank_timeout = float(cfg["start_timeout_s"]) + 3 * float(cfg["init_timeout_s"]) \
        + float(cfg["sweep_budget_s"]) + 2 * float(cfg["size_budget_s"]) + 15
    if plan is not None:
        rank_timeout += len(plan["rounds"]) * (float(cfg["size_budget_s"]) + float(cfg["init_timeout_s"])) \
            + float(cfg["init_timeout_s"]) + 10
    return rank_timeout


class _Pairwise:
    """The pairwise runs over the ring of hosts that localize a failed or slow all-reduce, as the run was set up."""

    def __init__(self, cluster: ClusterView, hosts: List[Any], addr_of: Dict[str, str], common: Dict[str, Any],
                 cfg: Dict[str, Any], owner: Dict[str, str]) -> None:
        self.cluster, self.hosts, self.addr_of, self.common, self.cfg, self.owner = (cluster, hosts, addr_of, common,
                                                                                      cfg, owner)

    def wanted(self) -> bool:
        return bool(self.cfg["pairwise"]) and len(self.hosts) >= 3

    def run(self, note: str, why: str, nbytes: int) -> Dict[str, Any]:
        self.cluster.progress.note(note)
        return _pairwise(self.cluster, self.hosts, self.addr_of, self.common, self.cfg, why, nbytes, self.owner)


def _localize_failure(pairwise: _Pairwise, errors: List[Dict[str, Any]], kind: str,
                      iperf_suspects: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The suspects of a failed run: from the ranks' errors, then pairwise runs, then (only if none) iperf3's."""
    localization: Dict[str, Any] = {"suspects": _failure_suspects(errors, pairwise.common["port"])}
    if pairwise.wanted() and kind not in ("torch_missing", "no_gpu", "port_in_use"):
        localization["pairwise"] = pairwise.run("allreduce: failed; pairwise runs to find the host", "failure",
                                                int(pairwise.cfg["min_bytes"]))
        _merge(localization["suspects"], localization["pairwise"]["suspects"])
    if not localization["suspects"]:  # a slow link rarely breaks a run, but a dead one does: a hint at least
        _merge(localization["suspects"], iperf_suspects)
    return localization


def _localize_slow(pairwise: _Pairwise, facts: Dict[str, Any],
                   iperf_suspects: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The suspects of a run that finished: none unless its verdict is WARN or FAIL; then iperf3's stragglers, the
    straggler rounds' and, when those did not measure enough pairs, pairwise runs'."""
    cfg = pairwise.cfg
    localization: Dict[str, Any] = {"suspects": []}
    named = find_stragglers(facts.get("stragglers"), cfg)
    findings, _ = judge(facts, cfg)
    if any(f.status in (Status.WARN, Status.FAIL) for f in findings) and len(pairwise.hosts) >= 2:
        _merge(localization["suspects"], iperf_suspects)
        _merge(localization["suspects"], [{"host": h, "reason": describe_straggler(h, s, facts["stragglers"], cfg),
                                           "source": "stragglers", "kind": "slow"} for h, s in named.items()])
        # The straggler rounds measured every ring pair already: the pairwise runs would measure them again.
        if pairwise.wanted() and len(host_rates(facts.get("stragglers") or {})) < 3:
            nbytes = min(int(facts["sizes"][-1]["bytes"]), int(cfg["pair_max_bytes"]))
            localization["pairwise"] = pairwise.run("allreduce: busbw low; pairwise runs to find the slow host",
                                                    "bandwidth", nbytes)
            _merge(localization["suspects"], localization["pairwise"]["suspects"])
    return localization


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
        listed = "; ".join(f"{h}: {err}" for h, err in agent_errors.items())[:500]
        return f"the all-reduce did not run: {listed}"
    primary = errors[0]
    kind = primary["kind"]
    same = [e for e in errors if e["kind"] == kind]
    timeout = facts.get("init_timeout_s") or 0
    master = f"MASTER_ADDR {facts.get('master_addr')}:{facts.get('master_port')}"
    if kind == "rendezvous":
        peers = [e for e in same if not all(t.get("host") == e["host"] for t in e["targets"])] or same
        selves = [e for e in same if e not in peers]
        text = peers[0]["error"]
        if "could not connect to MASTER_ADDR" not in text:  # torch's own message (rank 0 included)
            why = _why(text) if _why(text) != "failed" else text[:200]
            text = f"could not connect to {master} within {timeout:.0f}s ({why})"
        msg = f"{_who(peers)} {text}"
        if selves:
            msg += f"; so did {_who(selves)} itself"
        if "timed out" in text and "firewall" not in text:
            msg += f": is inbound TCP to {facts.get('master')} (MASTER_ADDR's host) blocked?"
    else:
        who = _who(same)
        if kind == "incomplete":
            joined = re.search(r"(\d+)/(\d+) clients joined", " ".join(e["error"] for e in same))
            arrived = f" ({joined.group(1)} of {joined.group(2)} ranks arrived)" if joined else ""
            msg = (f"{who} waited in vain for the other ranks at the rendezvous{arrived} within {timeout:.0f}s: "
                   f"a rank did not start, or could not reach {master}")
        elif kind == "mesh":
            msg = (f"{who} could not connect to the other ranks after the rendezvous ({primary['error'][:200]}): "
                   "does a host drop inbound TCP on the ephemeral ports (1024-65535) gloo/NCCL connect to?")
        elif kind in ("hung", "torch_missing"):
            msg = f"{who}: {primary['error']}"
        else:
            msg = f"{who} failed in phase {primary.get('phase')}: {primary['error'][:300]}"
    others = len(errors) - len(same)
    if others:
        msg += f" ({others} other rank(s) failed or were stopped after it)"
    return msg


def _who(errors: Sequence[Dict[str, Any]]) -> str:
    """The ranks and hosts of these errors, e.g. "ranks 3, 5 on node02, node03"."""
    return f"{rank_list([e['rank'] for e in errors])} on {names([e['host'] for e in errors])}"

