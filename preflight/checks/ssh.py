"""Reachability of each host: SSH connection, authentication, remote hostname and round-trip latency; and
hostfile names that are one machine.

Facts come from the coordinator's connection attempt and the agent's hello, not from a check on the host, e.g.:

    {"connected": true, "hostname": "node01", "address": "198.18.0.1", "connect_s": 0.21, "rtt_ms": 3.2}
    {"connected": true, "hostname": "node03", ..., "via": "jump host bastion"}
    {"connected": false, "error": "TCP connect to 198.18.0.9:22 timed out after 5s", "fix": "...", "status": "error"}
    {"connected": true, ..., "same_machine": {"hosts": ["node01", "198.18.1.1"], "slots": [4, 4],
     "gpu_ids": [[0, 1, 2, 3], [0, 1, 2, 3]], "gpus": 8, "machine_id": "3d12...", "boot_id": "ddb4..."}}

``same_machine`` (runner.mark_same_machines: the hellos' machine id and boot id agree and the names share an
address) is a FAIL when the names' ranks together need more GPUs than the machine has, or two names would put
ranks on the same GPU (each name's ranks get CUDA_VISIBLE_DEVICES from its own slots: 0..N-1 by default); a WARN
otherwise, a machine without GPUs included (DeepSpeed would still start every name's ranks on the one box).

Thresholds: [ssh] in ssh.toml beside this module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..hostside.outcome import Outcome, Status, limits
from ..hostside.seams import CheckSpec, PromSample

NAME = "ssh"


def _names(hosts: List[str]) -> str:
    return hosts[0] if len(hosts) == 1 else f"{', '.join(hosts[:-1])} and {hosts[-1]}"


def same_machine(same: Dict[str, Any], metrics: Dict[str, Any]) -> Outcome:
    """The outcome of hostfile names that are one machine: the same text on each of them (one cause)."""
    hosts = [str(h) for h in same.get("hosts", [])]
    slots = [int(n) for n in same.get("slots", [])]
    gpu_ids: List[List[int]] = [list(ids) for ids in same.get("gpu_ids", [])]
    gpus = int(same.get("gpus") or 0)
    total = sum(slots)
    ident = f"machine-id {str(same.get('machine_id') or '?')[:8]}, boot id {str(same.get('boot_id') or '?')[:8]}"
    head = f"{_names(hosts)} are one machine ({ident})"
    per_name = ", ".join(f"{h} slots={n}" for h, n in zip(hosts, slots))
    used = [i for ids in gpu_ids for i in ids]
    shared = sorted({i for i in used if used.count(i) > 1})
    keep = hosts[0]
    others = _names(hosts[1:])
    metrics = dict(metrics, same_machine=same)
    if gpus and total > gpus:
        return Outcome(Status.FAIL, f"{head}: DeepSpeed would start {total} ranks on it ({per_name}) and it has "
                       f"{gpus} GPU(s)",
                       f"list the machine once in the hostfile: {keep} slots={gpus}, without {others}", metrics)
    if gpus and shared:
        return Outcome(Status.FAIL, f"{head}: each name's ranks would use GPU {','.join(map(str, shared))} "
                       f"(CUDA_VISIBLE_DEVICES from each name's slots), two ranks on one GPU ({per_name})",
                       f"list the machine once in the hostfile: {keep} slots={min(total, gpus)}, without {others}",
                       metrics)
    if gpus:
        return Outcome(Status.WARN, f"{head}: DeepSpeed would start a launcher for each name on it ({per_name}; no "
                       "GPU shared)",
                       f"unless two launchers per machine are meant, list it once: {keep} slots={total}, without "
                       f"{others}", metrics)
    return Outcome(Status.WARN, f"{head} without GPUs: DeepSpeed would start {total} ranks on this one box "
                   f"({per_name})",
                   f"list the machine once in the hostfile: keep {keep}, without {others}", metrics)


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    lim = limits(thresholds, NAME)
    metrics: Dict[str, Any] = {k: facts[k] for k in ("hostname", "address", "connect_s", "rtt_ms", "local")
                               if k in facts}
    if not facts.get("connected"):
        status = Status.FAIL if facts.get("status") == "fail" else Status.ERROR
        return Outcome(status, facts.get("error", "could not connect"), facts.get("fix", ""), metrics)
    same: Optional[Dict[str, Any]] = facts.get("same_machine")
    if same and len(same.get("hosts", [])) > 1:
        return same_machine(same, metrics)
    if facts.get("local"):
        return Outcome(Status.PASS, f"local host, no SSH needed (hostname {facts.get('hostname')})",
                       metrics=metrics)
    rtt = facts.get("rtt_ms")
    if facts.get("via") == "srun":
        # A step launch goes through slurmctld and slurmd: its time is not a network round trip.
        step = "one step shared by every node" if facts.get("step") == "shared" else "a job step of its own"
        return Outcome(Status.PASS, f"reached {facts.get('hostname')} in {step} (srun), no SSH; step launch "
                       f"{rtt or 0.0:.0f} ms", metrics=metrics)
    via = facts.get("via")
    # Through a jump host or a ProxyCommand the round trip is timed at the SSH level (no TCP socket of ours).
    through = f" through {via}" if via else ""
    timed = "SSH" if via else "network"
    message = (f"connected to {facts.get('hostname')} as {facts.get('user', '?')} in "
               f"{facts.get('connect_s', 0.0):.2f}s{through}, {timed} round trip {rtt or 0.0:.1f} ms")
    if rtt is not None and rtt > lim["warn_rtt_ms"]:
        return Outcome(Status.WARN, message + f" (above {lim['warn_rtt_ms']:.0f} ms)",
                       "a slow control path slows every check and the launcher; check the network to this host",
                       metrics)
    return Outcome(Status.PASS, message, metrics=metrics)


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: each host's connect time and round trip (seconds); none for the local host."""
    out: List[PromSample] = []
    for r in results:
        m = r.get("metrics") or {}
        if m.get("local"):
            continue
        if isinstance(m.get("connect_s"), (int, float)):
            out.append(PromSample("preflight_ssh_connect_seconds", "TCP connect and SSH handshake time", "gauge",
                                  {"host": r["host"]}, float(m["connect_s"])))
        if isinstance(m.get("rtt_ms"), (int, float)):
            out.append(PromSample("preflight_ssh_rtt_seconds", "round trip to the host (with srun: a job step's "
                                  "launch)", "gauge", {"host": r["host"]}, float(m["rtt_ms"]) / 1000))
    return out


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="host reachable over SSH: authenticated, hostname, connect time and round-trip latency",
    scope="connection",
    default=True,
    evaluate=evaluate,
    prom_metrics=prom_metrics,
)
