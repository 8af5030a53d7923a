"""The all-reduce check's verdict (pure): recorded facts in, one outcome for the cluster row and one per suspect.

Reads the facts ``coordinator.coordinate`` returns, e.g. ``{"status": "ok", "world_size": 3, "sizes": [{"bytes":
8388608, "time_s": 0.48}], ...}``, and judges busbw against ``--min-busbw``, the published single-node baselines and
the iperf3 measurement, and each host by the straggler rounds (``stragglers.py``). Thresholds: the ``[allreduce]``
section of thresholds.toml in this package.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...hostside.fixes import firewall_fix, pip_install, python_word
from ...hostside.outcome import BlockedBy, Finding, Outcome, Status, combine, error, limits, skip
from ...hostside.fmt import gbps, human_bytes
from .common import NAME, bandwidth_table, names
from .stragglers import describe as describe_straggler
from .stragglers import failed_pairs
from .stragglers import find as find_stragglers
from .stragglers import host_rates, short
from .stragglers import weak as weak_evidence

def _gpu_baseline(facts: Dict[str, Any], cfg: Dict[str, Any]) -> Optional[Tuple[str, float]]:
    names = [n for ns in (facts.get("gpu_names") or {}).values() for n in ns]
    if not names or len(set(names)) != 1:
        return None
    model = names[0][len("NVIDIA "):] if names[0].startswith("NVIDIA ") else names[0]
    table = cfg["single_node_busbw"]
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
    min_busbw = float(cfg.get("min_busbw") or 0)  # [allreduce] min_busbw, which --min-busbw overrides
    if min_busbw:
        floor = gbps(float(min_busbw))
        if busbw < float(min_busbw):
            findings.append(Finding(Status.FAIL, f"busbw {gbps(busbw)} GB/s at {size} < --min-busbw {floor} GB/s",
                                    "look at the suspect host(s) named here (the iperf3 check measures each link); "
                                    "with GPUs check NCCL_SOCKET_IFNAME/NCCL_IB_HCA (NCCL_DEBUG=INFO shows the NIC)"))
        else:
            findings.append(Finding(Status.PASS, f"busbw >= --min-busbw {floor} GB/s"))
    single = len(facts.get("hosts") or []) == 1
    baseline = _gpu_baseline(facts, cfg) if facts.get("backend") == "nccl" else None
    if baseline and single and n == int(cfg["baseline_ranks"]):
        model, expected = baseline
        notes["baseline"] = {"gpu": model, "busbw_GBps": expected}
        if last["bytes"] < int(cfg["baseline_min_bytes"]):
            notes["baseline_note"] = (f"not compared: the largest size measured ({size}) is below baseline_min_bytes "
                                      f"({human_bytes(cfg['baseline_min_bytes'])}), where busbw has not plateaued")
        elif busbw < float(cfg["baseline_fail_fraction"]) * expected:
            fraction = 100 * float(cfg["baseline_fail_fraction"])
            findings.append(Finding(Status.FAIL, f"busbw {gbps(busbw)} GB/s at {size} is below {fraction:.0f}% of the "
                                    f"published {n} x {model} single-node baseline {gbps(expected)} GB/s",
                                    "check nvidia-smi topo -m (NVLink/NVSwitch), nvidia-fabricmanager, and GPU clocks"))
        elif busbw < expected:
            findings.append(Finding(Status.WARN, f"busbw {gbps(busbw)} GB/s at {size} is below the published {n} x "
                                    f"{model} single-node baseline {gbps(expected)} GB/s",
                                    "NVLS disabled (NCCL_NVLS_ENABLE=0) or a degraded NVLink gives this; compare "
                                    "with nccl-tests all_reduce_perf -b 1G -e 16G"))
    elif baseline and not single:
        n_hosts = len(facts.get("hosts") or [])
        notes["baseline_note"] = f"single-node baselines do not apply to a {n_hosts}-host run"
    iperf_gbps = facts.get("iperf3_median_gbps")
    if facts.get("backend") == "nccl" and not single and isinstance(iperf_gbps, (int, float)) and iperf_gbps > 0:
        expected = float(iperf_gbps) / 8
        if busbw < float(cfg["min_fraction_of_iperf3"]) * expected:
            fraction = 100 * float(cfg["min_fraction_of_iperf3"])
            findings.append(Finding(Status.WARN, f"busbw {gbps(busbw)} GB/s is below {fraction:.0f}% of the "
                                    f"{gbps(expected)} GB/s TCP bandwidth iperf3 measured on the chosen network",
                                    "NCCL may use a slower interface: set NCCL_SOCKET_IFNAME/NCCL_IB_HCA as "
                                    "recommended, and check NCCL_DEBUG=INFO's 'NET/' lines"))
    return findings, notes



# Templates: _host_fix and _failed fill in {port} and {master} once they know the host.
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
    "torch_missing": "pass --python with the job's interpreter, or install torch into it on every host with its own "
                     "pip (`-m pip install torch` run by that interpreter; the python check's fix names it per host)",
    "no_gpu": "fix the hostfile's slots or the GPUs (see the gpu check)",
    "oom": "free the GPUs (nvidia-smi shows who holds them)",
    "wrong_result": "a GPU or NIC corrupts data: run nccl-tests with -c 1 and check dmesg for Xid errors",
}


def _host_fix(suspect: Dict[str, Any], facts: Dict[str, Any], default: str) -> str:
    host = suspect["host"]
    if suspect.get("kind") in ("rendezvous", "mesh"):
        # Port master_port and 1024-65535 (gloo and NCCL connect on ephemeral ports): the range holds both. The
        # commands are for the firewall the host runs, read there after the failure (hostside/fixes.py).
        network = facts.get("network")
        others = [a for h, a in (facts.get("addresses") or {}).items() if h != host]
        return firewall_fix(host, (facts.get("firewalls") or {}).get(host), [network] if network else others,
                            "1024-65535")
    if suspect.get("kind") == "slow":
        return (f"check {host}'s link: ethtool (speed), ip -s link (errors, drops), the cable and switch port; "
                "compare with the iperf3 check")
    return _FIX.get(suspect.get("kind") or "", default).format(port=facts.get("master_port"), master=host)


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    """The run among the hosts that took part, then the hosts left out because ports/iperf3 proved them unreachable
    (each FAILs with that evidence, and so does the cluster row: the job's all-reduce would hang at init)."""
    result = _evaluate_run(facts, thresholds)
    excluded = [e for e in facts.get("excluded") or [] if isinstance(e, dict) and e.get("host")]
    if not excluded:
        return result
    fix = _host_fix(excluded[0], facts, "")
    for e in excluded:
        result[e["host"]] = Outcome(Status.FAIL, f"all-reduce: left out, already found unreachable: {e['reason']}",
                                    _host_fix(e, facts, fix), blocked_by=_proven_by(e))
    rest = result["*"]
    others = len(facts.get("hosts") or [])
    plural = "" if others == 1 else "s"
    if rest.status == Status.SKIP:
        tail = f"no all-reduce among the other {others} host{plural} ({rest.message})"
    else:
        tail = f"among the other {others} host{plural}: {rest.message}"
    left_out = names([e["host"] for e in excluded])
    reasons = "; ".join(e["reason"] for e in excluded[:4])
    pronoun = "it" if len(excluded) == 1 else "them"
    message = f"left out {left_out}: {reasons}; a job including {pronoun} hangs at init; {tail}"
    metrics = dict(rest.metrics, excluded=excluded)
    result["*"] = Outcome(Status.FAIL, message, rest.fix if rest.status in (Status.FAIL, Status.WARN) and rest.fix
                          else fix, metrics, rest.findings)
    left = {e["host"] for e in excluded}
    named = any(o.status in (Status.WARN, Status.FAIL) for h, o in result.items() if h != "*" and h not in left)
    if not rest.blocked_by and (rest.status in (Status.PASS, Status.SKIP) or rest.status == Status.WARN and named):
        # Among the others all is well, or what is not is a WARN that a host's own row says (a straggler): the FAIL
        # is the left-out host's fault (the check that proved it), not the cluster's. A FAIL among the others, or a
        # WARN no host's row carries, keeps the row a cause of its own.
        result["*"].blocked_by = _proven_by(excluded[0])
    return result


def _sole_suspect(suspects: List[Dict[str, Any]]) -> Optional[BlockedBy]:
    """A failed run that one host explains (its ranks' errors, the pairwise runs or the probe named it alone; not
    iperf3's hint): the cluster row follows from that host's row."""
    if len(suspects) == 1 and suspects[0].get("source") in ("errors", "pairwise", "probe"):
        return BlockedBy(str(suspects[0]["host"]), NAME)
    return None


def _proven_by(entry: Dict[str, Any]) -> Optional[BlockedBy]:
    """The (host, check) whose result proved a left-out host unreachable: ports, else iperf3 (known_unreachable's
    "sources")."""
    sources = [s for s in entry.get("sources") or [] if isinstance(s, str)]
    return BlockedBy(str(entry["host"]), sources[0]) if sources else None


def _evaluate_run(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    cfg = limits(thresholds, NAME)
    status = facts.get("status")
    base_metrics = {k: facts.get(k) for k in ("backend", "world_size", "hosts", "master", "master_addr",
                                              "master_port", "network", "unreachable", "duration_s")}
    base_metrics["interfaces"] = {h: (i or {}).get("ifname") for h, i in (facts.get("interfaces") or {}).items()}
    not_run = _not_run(status, facts, thresholds, base_metrics)
    if not_run is not None:
        return not_run
    suspects = (facts.get("localization") or {}).get("suspects") or []
    metrics = dict(base_metrics)
    metrics["localization"] = facts.get("localization")
    if status == "failed":
        return _failed(facts, suspects, metrics)
    n = int(facts.get("world_size") or 0)
    table = bandwidth_table(facts.get("sizes") or [], n)
    if not table:
        return {"*": error("the all-reduce ran but reported no timing", "rerun with -v", **base_metrics)}
    findings, notes = judge(facts, cfg)
    last = table[-1]
    ifnames = sorted({v for v in (base_metrics["interfaces"] or {}).values() if v})
    n_hosts = len(facts.get("hosts") or [])
    plural = "" if n_hosts == 1 else "s"
    over = (" over " + ",".join(ifnames)) if ifnames else ""
    summary = (f"busbw {gbps(last['busbw_GBps'])} GB/s (algbw {gbps(last['algbw_GBps'])} GB/s) at "
               f"{human_bytes(last['bytes'])}; {n} ranks on {n_hosts} host{plural}, {facts.get('backend')}{over}")
    if facts.get("stopped_early"):
        summary += f" (sweep stopped early: {facts['stopped_early']})"
    metrics.update(sizes=table, largest_bytes=last["bytes"], busbw_GBps=last["busbw_GBps"],
                   algbw_GBps=last["algbw_GBps"], stopped_early=facts.get("stopped_early"), ranks=facts.get("ranks"),
                   min_busbw=float(cfg.get("min_busbw") or 0) or None, **notes)
    flagged = [f for f in findings if f.status in (Status.WARN, Status.FAIL)]
    if flagged and suspects:
        findings.append(Finding(flagged[0].status, "suspect: " + "; ".join(
            f"{s['host']} ({s['reason']})" for s in suspects[:4])))
    rounds = facts.get("stragglers")
    unsure: Dict[str, Dict[str, Any]] = {}
    named = find_stragglers(rounds, cfg, unsure)
    if isinstance(rounds, dict):
        # The raw rounds (each pair's iteration times) as well: the detector can be rerun on a report.
        metrics["stragglers"] = dict(rounds, hosts=host_rates(rounds), named=named, unsure=unsure)
        findings.extend(_straggler_round_findings(rounds, named))
    if unsure:
        summary += "; " + weak_evidence(unsure, cfg)
    out = combine(findings, summary, metrics)
    if out.status != Status.PASS:
        out.message = summary + ": " + out.message
    result: Dict[str, Outcome] = {"*": out}
    result.update(_host_rows(facts, cfg, flagged, suspects, named))
    return result


_SLOW_FIX = ("check the named host's link: ethtool (speed), ip -s link (errors, drops), the cable and switch "
             "port; compare with the iperf3 check")


def _not_run(status: Any, facts: Dict[str, Any], thresholds: Dict[str, Any],
             base_metrics: Dict[str, Any]) -> Optional[Dict[str, Outcome]]:
    """The cluster row of a run that did not happen: skipped, no torch (FAIL unless [python] require_torch is
    false) or preflight's own error; None when it ran."""
    if status == "skipped":
        return {"*": skip(facts.get("reason", "not run"), **base_metrics)}
    if status == "no_torch":
        hosts = facts.get("hosts_without_torch") or []
        msg = f"torch is not importable on {names(hosts)} ({facts.get('reason')}): the all-reduce cannot run"
        fix = _torch_fix(hosts, facts.get("executables") or {})
        # The job is a PyTorch job: without torch it cannot start, so this FAILs like [python] require_torch does.
        if limits(thresholds, "python")["require_torch"]:
            # The python check FAILs those hosts for the same reason: this row is theirs, not the cluster's.
            return {"*": Outcome(Status.FAIL, msg, fix, metrics=base_metrics,
                                 blocked_by=BlockedBy(str(hosts[0]), "python") if hosts else None)}
        return {"*": skip(msg + " ([python] require_torch = false)", **base_metrics)}
    if status == "error":
        reason = facts.get("reason") or (facts.get("failure") or {}).get("message")
        return {"*": error(f"could not run the all-reduce: {reason}",
                           "rerun with -v; check that --python works on every host", **base_metrics)}
    return None


def _torch_fix(hosts: List[str], executables: Dict[str, Any]) -> str:
    """--python, or torch installed by each host's own interpreter (as the host reported it): one line per
    interpreter, saying where it runs when they differ."""
    by_line: Dict[str, List[str]] = {}
    for h in hosts:
        if python_word(executables.get(h)) is not None:
            by_line.setdefault(pip_install(executables[h], "torch"), []).append(h)
    if not by_line:
        return _FIX["torch_missing"]
    lines = ([f"  {next(iter(by_line))}"] if len(by_line) == 1 else
             [f"  {line}  # on {names(on)}" for line, on in by_line.items()])
    return (f"pass --python with the job's interpreter, or install torch into it on {names(hosts)}:\n"
            + "\n".join(lines))


def _failed(facts: Dict[str, Any], suspects: List[Dict[str, Any]], metrics: Dict[str, Any]) -> Dict[str, Outcome]:
    """A run that failed: FAIL for the cluster, with the failure and its suspects, and for each suspect host."""
    failure = facts.get("failure") or {}
    kind = failure.get("kind", "other")
    msg = failure.get("message", "the all-reduce failed")
    if suspects:
        listed = "; ".join(f"{s['host']} ({s['reason']})" for s in suspects[:4])
        msg += f"; suspect{'s' if len(suspects) > 1 else ''}: {listed}"
    fix = _FIX.get(kind, "rerun with -v for every rank's error").format(
        port=facts.get("master_port"), master=facts.get("master"))
    metrics.update(errors=facts.get("errors"), failure_kind=kind, ranks=facts.get("ranks"))
    by_host = {"*": Outcome(Status.FAIL, msg, fix, metrics=metrics, blocked_by=_sole_suspect(suspects))}
    for s in suspects:
        by_host[s["host"]] = Outcome(Status.FAIL, f"all-reduce: {s['reason']}", _host_fix(s, facts, fix))
    return by_host


def _straggler_round_findings(rounds: Dict[str, Any], named: Dict[str, Dict[str, Any]]) -> List[Finding]:
    """The stragglers the rounds named, and the failed pairs that point at no named host."""
    findings: List[Finding] = []
    if named:
        listed = "; ".join(short(h, s) for h, s in list(named.items())[:4])
        findings.append(Finding(Status.FAIL if any(s["status"] == "fail" for s in named.values()) else Status.WARN,
                                f"straggler{'s' if len(named) > 1 else ''}: {listed}", _SLOW_FIX))
    failed = failed_pairs(rounds)
    unexplained = [p for p in failed if not any(h in named for h in p["hosts"])]
    if unexplained:
        # A failed pair that points at no single host still means a link that did not work: say so.
        pairs = len(rounds.get("pairs") or [])
        listed = "; ".join(f"{p['hosts'][0]}-{p['hosts'][1]}: {p['error'][:120]}" for p in unexplained[:3])
        findings.append(Finding(Status.WARN, f"straggler rounds: {len(failed)} of {pairs} pairs failed ({listed})",
                                _SLOW_FIX))
    return findings


def _host_rows(facts: Dict[str, Any], cfg: Dict[str, Any], flagged: List[Finding], suspects: List[Dict[str, Any]],
               named: Dict[str, Dict[str, Any]]) -> Dict[str, Outcome]:
    """The hosts' rows of a run that finished: each suspect of a flagged busbw, then each named straggler (a host
    that is both keeps the worse status)."""
    result: Dict[str, Outcome] = {}
    if flagged:
        for s in suspects:
            result[s["host"]] = Outcome(max((f.status for f in flagged), key=lambda st: st.rank),
                                        f"all-reduce: {s['reason']}", _host_fix(s, facts, flagged[0].fix))
    for h, s in named.items():
        status = Status.FAIL if s["status"] == "fail" else Status.WARN
        prev = result.get(h)
        if prev is not None:  # already a suspect of the flagged busbw: its reason includes this (coordinator)
            result[h] = Outcome(max((prev.status, status), key=lambda st: st.rank), prev.message, prev.fix)
        else:
            described = describe_straggler(h, s, facts.get("stragglers") or {}, cfg)
            result[h] = Outcome(status, f"all-reduce: {described}",
                                _host_fix({"host": h, "kind": "slow"}, facts, _SLOW_FIX))
    return result
