"""The seams between the checks and the coordinator: what a check receives (HostContext, ClusterView) and is.

Standard library only (runs on the hosts). The checks never import the coordinator (``preflight.*`` outside
``preflight.checks`` and ``preflight.hostside``); a cluster check gets what it needs through ``ClusterView``,
which the coordinator's ``runner.Cluster`` satisfies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, runtime_checkable

from .outcome import Evaluation


@dataclass
class HostContext:
    """What ``collect(ctx)`` receives on the host.

    params: per-host options from the coordinator: {"host": name, "slots": N, "master": address,
            "master_name": name, "nvme_paths": [...], "required_ops": [...], "gpus_expected": bool, ...}
            (never every host's address: that would be O(N^2) bytes over a run)
    deadline: time.monotonic() value by which collect must return (the agent enforces it too).
    """

    params: Dict[str, Any]
    deadline: float
    # Set by the agent for long-lived host-side functions (listeners, iperf3 servers, workers):
    # ready(info) tells the coordinator the service is up (and e.g. which port it bound);
    # wait_stop(max_s) blocks until the coordinator says stop, the deadline passes, or the SSH channel drops.
    ready: Any = None
    wait_stop: Any = None

    def remaining(self, cap: float) -> float:
        return max(0.5, min(cap, self.deadline - time.monotonic()))


# --- the seams -------------------------------------------------------------------------------

# The values a check module's SCOPE may take:
#   "host"        collect(ctx) runs on every host through the agent; evaluate(facts, thresholds) -> Outcome.
#   "cluster"     coordinate(cluster: ClusterView) runs on the coordinator, drives host-side functions of the
#                 module through the agent, and returns facts; evaluate(facts, thresholds) ->
#                 {host name or "*": Outcome} (or one Outcome for the cluster row).
#   "connection"  the coordinator itself gathers the facts while connecting (the ``ssh`` check): no collect
#                 and no coordinate; evaluate(facts, thresholds) -> Outcome for one host.
SCOPES = ("host", "cluster", "connection")


class HostRef(Protocol):
    """A host as the coordinator knows it: its hostfile name, slot count and GPU ids."""

    name: str
    slots: int
    gpus: Optional[List[int]]


class ProgressSink(Protocol):
    def phase(self, name: str, total: int) -> None: ...

    def advance(self, name: str, detail: str = "") -> None: ...

    def note(self, text: str) -> None: ...


class ServiceHandle(Protocol):
    """A long-lived host-side function started with ``ClusterView.start`` (listener, iperf3 server, rank)."""

    def wait_ready(self, timeout: float) -> Dict[str, Any]: ...

    def stop(self, timeout: float = 15.0) -> Any: ...

    def result(self, timeout: Optional[float] = None) -> Any: ...

    def kill(self) -> None: ...


@runtime_checkable
class ClusterView(Protocol):
    """What a cluster check's ``coordinate(cluster)`` receives; the coordinator's ``runner.Cluster`` is one.

    hosts: reachable hosts; all_hosts: every host of the hostfile, in order; master: the first host.
    facts: {host name: {check name: facts}} from the host checks (and "ssh"); options: run options the checks
    read (nvme_paths, master_port, deepspeed_config, ...); thresholds: the merged config (read it with
    ``limits``); parallel: the fan-out limit. ``call``/``call_all``/``start`` run a host-side function
    ``"module.func"`` of this package through the agent on a host.
    """

    hosts: List[Any]
    all_hosts: List[Any]
    master: Any
    world_size: int
    facts: Dict[str, Dict[str, Any]]
    options: Dict[str, Any]
    thresholds: Dict[str, Dict[str, Any]]
    parallel: int
    local: bool
    progress: Any

    def address(self, host: str) -> str: ...

    def call(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any: ...

    def call_all(self, func: str, params_by_host: Dict[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]: ...

    def start(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any: ...


class CheckModule(Protocol):
    """A check: one module (or subpackage) of this package, listed in ``ORDER`` in ``__init__``.

    NAME: stable lowercase id used in JSON, JUnit and ``preflight list``; DESCRIPTION: one line;
    SCOPE: one of ``SCOPES``; DEFAULT: runs without ``--checks``. A "host" check also has ``collect(ctx)``,
    a "cluster" check ``coordinate(cluster)``. ``evaluate`` is pure: recorded facts in, outcome(s) out.
    """

    NAME: str
    DESCRIPTION: str
    SCOPE: str
    DEFAULT: bool

    def evaluate(self, facts: Dict[str, Any], thresholds: Dict[str, Dict[str, Any]]) -> Evaluation: ...


def validate_check_module(module: Any) -> None:
    """Raise TypeError naming the module and what it lacks, if it does not satisfy ``CheckModule``."""
    where = getattr(module, "__name__", repr(module))
    problems = []
    for attr, kind in (("NAME", str), ("DESCRIPTION", str), ("SCOPE", str), ("DEFAULT", bool)):
        if not isinstance(getattr(module, attr, None), kind):
            problems.append("%s must be a %s" % (attr, kind.__name__))
    scope = getattr(module, "SCOPE", None)
    if isinstance(scope, str) and scope not in SCOPES:
        problems.append("SCOPE %r is not one of %s" % (scope, ", ".join(SCOPES)))
    needs = ["evaluate"] + {"host": ["collect"], "cluster": ["coordinate"]}.get(scope or "", [])
    for fn in needs:
        if not callable(getattr(module, fn, None)):
            problems.append("SCOPE %r needs a function %s()" % (scope, fn))
    if problems:
        raise TypeError("check module %s: %s" % (where, "; ".join(problems)))
