"""The run's structured results: every reporter (matrix, lines, JSON, JUnit, env file) reads only these.

A result is one (host, check) cell, e.g. ``Result("node03", "libaio", Status.ERROR, "blocked: ...",
blocked_by="ssh")``: a blocked cell (a victim) only follows from another (host, check)'s fault, its blocker: its
host's failed connection, or another host's (``blocked_host``), or the cluster row's (host "*"). The report counts
a victim as blocked when its blocker is in the report and at least as bad (``Report.victims``); a victim whose
blocker passed or is missing stands as a cause of its own, so a failure is never hidden. ``preflight.causes``
groups the results into causes, a victim in its blocker's cause.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from preflight.hostside.outcome import Outcome, Status

CLUSTER = "*"  # the host of a cluster-wide result in the model and the JSON contract
# Its one display name everywhere else: the terminal matrix, JUnit classnames (CLI and pytest plugin), the HTML
# and pytest ids (cluster::ports). A host of this name would be ambiguous, so the CLI and the plugin refuse it.
CLUSTER_NAME = "cluster"


# How bad a status is when a victim is weighed against its blocker: a blocker holds a victim no worse than itself
# (a WARN never hides a FAIL), and a PASS holds none.
_WEIGHT = {Status.PASS: 0, Status.SKIP: 1, Status.WARN: 2, Status.ERROR: 3, Status.FAIL: 3}


def display_host(host: str) -> str:
    """The name a report shows for a result's host: CLUSTER_NAME for the cluster-wide row."""
    return CLUSTER_NAME if host == CLUSTER else host


@dataclass
class Result:
    host: str
    check: str
    status: Status
    message: str
    fix: str = ""
    metrics: Dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    # The check whose failure kept this one from running or from telling anything of its own: by default of the same
    # host (its connection check, e.g. "ssh"); of another host where blocked_host says so (a rank that waited for a
    # rank of node02 which raised: blocked_by="launch", blocked_host="node02"). Such a cell keeps its status (for
    # JUnit and the pytest plugin it is not a pass), but it is counted as blocked, not as a cause: the terminal
    # prints its cause once, and the matrix shows it as a dot.
    blocked_by: Optional[str] = None
    blocked_host: Optional[str] = None
    # A cause fixed in no host (outcome.WHERE: "launch shell", "coordinator", "every host"): the verdict names it so.
    where: Optional[str] = None

    @classmethod
    def from_outcome(cls, host: str, check: str, outcome: Outcome, duration_s: float = 0.0) -> "Result":
        blocked = outcome.blocked_by
        return cls(host, check, outcome.status, outcome.message, outcome.fix, dict(outcome.metrics), duration_s,
                   blocked.check if blocked else None,
                   blocked.host if blocked and blocked.host != host else None, outcome.where)

    @property
    def nodeid(self) -> str:
        return f"{display_host(self.host)}::{self.check}"

    @property
    def blocked(self) -> bool:
        return self.blocked_by is not None

    @property
    def blocker(self) -> Optional[tuple]:
        """(host, check) of the result that blocked this one, or None."""
        if self.blocked_by is None:
            return None
        return (self.blocked_host or self.host, self.blocked_by)

    def to_dict(self) -> Dict[str, Any]:
        out = {"host": self.host, "check": self.check, "status": self.status.value, "message": self.message,
               "fix": self.fix, "metrics": self.metrics, "duration_s": round(self.duration_s, 3)}
        if self.blocked_by is not None:  # only on blocked cells: the other results stay as they were
            out["blocked_by"] = self.blocked_by
            if self.blocked_host is not None:  # blocked by another host's fault
                out["blocked_host"] = self.blocked_host
        if self.where is not None:
            out["where"] = self.where
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Result":
        """Inverse of to_dict (the JSON report's ``results`` entries)."""
        return cls(data["host"], data["check"], Status(data["status"]), data["message"], data.get("fix", ""),
                   dict(data.get("metrics", {})), float(data.get("duration_s", 0.0)), data.get("blocked_by"),
                   data.get("blocked_host"), data.get("where"))


@dataclass
class HostRecord:
    name: str
    address: str
    slots: int
    reachable: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "address": self.address, "slots": self.slots, "reachable": self.reachable}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "HostRecord":
        return cls(data["name"], data["address"], int(data["slots"]), bool(data.get("reachable", False)))


@dataclass
class Report:
    started_at: str
    duration_s: float
    hosts: List[HostRecord]
    results: List[Result]
    checks: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    reasons: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    strict: bool = False
    # Each recommended (or inherited, owned) variable against what the launcher passes the ranks today
    # (preflight.recommend.env_diff): {name: {"state", "recommended", "inherited", "source", "measured"}}.
    env_diff: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # When each phase of the run ran, in seconds from its start (preflight.runner): [{"phase": "host checks",
    # "start_s": 0.4, "end_s": 3.1}, {"phase": "iperf3", ...}], in the order they began. Phases overlap where the
    # runner runs them together.
    timeline: List[Dict[str, Any]] = field(default_factory=list)

    def victims(self) -> Dict[int, int]:
        """{index of a blocked result: index of the result its fault follows from}, for each blocked result whose
        blocker is in the report and at least as bad (followed to its root: a victim of a victim is the first
        one's). The blocker (``Result.blocker``) is looked up by (host, check); a blocker on the cluster row that
        has no such cell (``no host's ssh check passed``) is the first FAIL/ERROR of that check on any host. A
        blocker that passed, or that is missing, or a loop of blockers: the result is no victim (its own cause)."""
        results = self.results
        at = {(r.host, r.check): i for i, r in enumerate(results)}
        first_bad: Dict[str, int] = {}
        for i, r in enumerate(results):
            if r.status in (Status.FAIL, Status.ERROR) and not r.blocked:
                first_bad.setdefault(r.check, i)

        def target(i: int) -> Optional[int]:
            host, check = results[i].blocker or ("", "")
            j = at.get((host, check))
            if j is None and host == CLUSTER:
                j = first_bad.get(check)
            return None if j == i else j

        def holds(blocker: Status, victim: Status) -> bool:
            return blocker != Status.PASS and _WEIGHT[blocker] >= _WEIGHT[victim]

        def root(i: int) -> Optional[int]:
            chain = [i]
            j = target(i)
            while j is not None and results[j].blocked:
                if j in chain:
                    return None  # a loop of blockers: none of them is the cause, each stands as its own
                chain.append(j)
                j = target(j)
            if j is None:  # the chain ends at a blocked result whose blocker is missing: that one is a cause
                if len(chain) == 1:
                    return None
                j = chain.pop()
            for k in reversed(chain):  # a result its blocker does not hold (a FAIL after a WARN) is the cause
                if not holds(results[j].status, results[k].status):
                    j = k
            return None if j == i else j

        out: Dict[int, int] = {}
        for i, r in enumerate(results):
            if r.blocked:
                found = root(i)
                if found is not None:
                    out[i] = found
        return out

    def counts(self, victims: Optional[Dict[int, int]] = None) -> Dict[str, int]:
        """Results by status, and the victims apart (``blocked``): the six counts add up to the number of results.
        A blocked result that is no victim (its blocker passed or is missing) counts by its status."""
        victims = self.victims() if victims is None else victims
        counts = {s.value: 0 for s in (Status.PASS, Status.WARN, Status.FAIL, Status.SKIP, Status.ERROR)}
        counts["blocked"] = 0
        for i, r in enumerate(self.results):
            counts["blocked" if i in victims else r.status.value] += 1
        return counts

    @property
    def exit_code(self) -> int:
        """0: no FAIL/ERROR (warnings allowed); 1: any FAIL or ERROR, a victim's too (its cause is one), or any
        WARN with --strict. The same as: any FAIL/ERROR cause (a victim is held only by a blocker as bad)."""
        bad = (Status.FAIL, Status.ERROR, Status.WARN) if self.strict else (Status.FAIL, Status.ERROR)
        return 1 if any(r.status in bad for r in self.results) else 0

    def to_dict(self, causes: Optional[Sequence[Dict[str, Any]]] = None,
                summary: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The JSON report (docs/json-contract.md). The causes are preflight.causes' (it imports this module, so
        the caller passes them: preflight.render.json.report_dict); without them the key is left out. ``summary``
        adds keys to the summary (the number of causes)."""
        counts: Dict[str, Any] = dict(self.counts())
        counts["exit_code"] = self.exit_code
        counts.update(summary or {})
        out: Dict[str, Any] = {"version": 1, "started_at": self.started_at, "duration_s": round(self.duration_s, 3),
                               "hosts": [h.to_dict() for h in self.hosts],
                               "results": [r.to_dict() for r in self.results]}
        if causes is not None:
            out["causes"] = list(causes)
        out["recommendations"] = {"env": dict(self.env), "reasons": dict(self.reasons), "notes": list(self.notes),
                                  "diff": dict(self.env_diff)}
        out["summary"] = counts
        if self.timeline:
            out["timeline"] = [dict(t) for t in self.timeline]
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any], strict: bool = False) -> "Report":
        """Inverse of to_dict. The JSON has no ``strict`` (only its effect on exit_code) and no check list:
        the caller passes strict, and the checks are those of the results, in their order. ``causes`` is not read
        back: it is derived from the results."""
        results = [Result.from_dict(r) for r in data["results"]]
        recommendations = data.get("recommendations", {})
        return cls(data["started_at"], float(data["duration_s"]), [HostRecord.from_dict(h) for h in data["hosts"]],
                   results, list(dict.fromkeys(r.check for r in results)), dict(recommendations.get("env", {})),
                   dict(recommendations.get("reasons", {})), list(recommendations.get("notes", [])), strict,
                   dict(recommendations.get("diff", {})), [dict(t) for t in data.get("timeline") or []])
