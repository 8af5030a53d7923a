"""Reachability of each host: SSH connection, authentication, remote hostname and round-trip latency.

Facts come from the coordinator's connection attempt, not from the host, e.g.:

    {"connected": true, "hostname": "node01", "address": "198.18.0.1", "connect_s": 0.21, "rtt_ms": 3.2}
    {"connected": true, "hostname": "node03", ..., "via": "jump host bastion"}
    {"connected": false, "error": "TCP connect to 198.18.0.9:22 timed out after 5s", "fix": "...", "status": "error"}

Thresholds: [ssh] in ssh.toml beside this module.
"""
from __future__ import annotations

from typing import Any, Dict

from ..hostside.outcome import Outcome, Status, limits
from ..hostside.seams import CheckSpec

NAME = "ssh"


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    lim = limits(thresholds, NAME)
    metrics: Dict[str, Any] = {k: facts[k] for k in ("hostname", "address", "connect_s", "rtt_ms", "local")
                               if k in facts}
    if not facts.get("connected"):
        status = Status.FAIL if facts.get("status") == "fail" else Status.ERROR
        return Outcome(status, facts.get("error", "could not connect"), facts.get("fix", ""), metrics)
    if facts.get("local"):
        return Outcome(Status.PASS, "local host, no SSH needed (hostname %s)" % facts.get("hostname"),
                       metrics=metrics)
    rtt = facts.get("rtt_ms")
    if facts.get("via") == "srun":
        # A step launch goes through slurmctld and slurmd: its time is not a network round trip.
        step = "one step shared by every node" if facts.get("step") == "shared" else "a job step of its own"
        return Outcome(Status.PASS, "reached %s in %s (srun), no SSH; step launch %.0f ms"
                       % (facts.get("hostname"), step, rtt or 0.0), metrics=metrics)
    via = facts.get("via")
    # Through a jump host or a ProxyCommand the round trip is timed at the SSH level (no TCP socket of ours).
    message = "connected to %s as %s in %.2fs%s, %s round trip %.1f ms" % (
        facts.get("hostname"), facts.get("user", "?"), facts.get("connect_s", 0.0),
        f" through {via}" if via else "", "SSH" if via else "network", rtt or 0.0)
    if rtt is not None and rtt > lim["warn_rtt_ms"]:
        return Outcome(Status.WARN, message + " (above %.0f ms)" % lim["warn_rtt_ms"],
                       "a slow control path slows every check and the launcher; check the network to this host",
                       metrics)
    return Outcome(Status.PASS, message, metrics=metrics)


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="host reachable over SSH: authenticated, hostname, connect time and round-trip latency",
    scope="connection",
    default=True,
    evaluate=evaluate,
)
