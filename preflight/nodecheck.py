"""`preflight node-check`: the per-host checks on this node only, as Slurm's HealthCheckProgram or a prolog.

No SSH and no coordinator: the agent runs here under one total deadline, and the verdict is one line short enough
for a Slurm drain reason, e.g.::

    preflight: libaio: libaio.so.1 present but cannot be loaded; nvme /local_nvme: 0.4 GB/s < 1.0

With ``--drain`` a failing node is drained with that reason (``scontrol update nodename=NODE state=drain
reason=...``, argv, no shell); a passing node that preflight itself drained earlier is resumed, any other drain
is left alone.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple

from preflight import checks as registry
from preflight.answer import host_outcome
from preflight.hostside.outcome import Outcome, Status
from preflight.hostside.seams import CheckSpec
from preflight.remote import Agent, AgentError
from preflight.results import HostRecord, Report, Result
from preflight.transport import LocalTransport, RunningCommand, Transport

# Every reason preflight sets starts with this, so it can tell its own drains from an admin's or NHC's.
REASON_PREFIX = "preflight:"
# Slurm keeps a reason of any length, but sinfo -R shows ~40 columns and NHC keeps its reasons short: the line
# names every failed check and is cut to this length.
MAX_REASON = 200
SCONTROL_TIMEOUT_S = 20.0


@dataclass
class NodeCheckOptions:
    checks: List[str]
    thresholds: Dict[str, Dict[str, Any]]
    python: str = "python3"
    deadline: float = 60.0
    timeout: float = 60.0             # per check, capped by what is left of the deadline
    slots: int = 1
    strict: bool = False
    drain: bool = False
    node_name: Optional[str] = None
    host_params: Dict[str, Any] = field(default_factory=dict)
    history: Optional[Path] = None    # the history store to judge and record this run in (preflight.history)


@dataclass
class NodeVerdict:
    node: str
    outcomes: List[Tuple[str, Outcome]]
    line: str
    failed: bool
    drain_action: str = ""            # what --drain did: "drained", "resumed", "left drained (...)", ""
    durations: Dict[str, float] = field(default_factory=dict)  # check -> seconds on the host, where the agent said
    started_at: str = ""              # ISO 8601, as a run's report
    duration_s: float = 0.0
    slots: int = 1

    def report(self, strict: bool = False) -> Report:
        """The verdict as a run's Report of this one host (for --prom-textfile and the other renderers)."""
        results = [Result.from_outcome(self.node, check, outcome, self.durations.get(check, 0.0))
                   for check, outcome in self.outcomes]
        return Report(self.started_at, self.duration_s, [HostRecord(self.node, "localhost", self.slots, True)],
                      results, [check for check, _ in self.outcomes], strict=strict)


def node_name(explicit: Optional[str] = None) -> str:
    """Slurm's name of this node: slurmd exports SLURMD_NODENAME to prologs; else `hostname -s` (as NHC does)."""
    return explicit or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


class _DeadlineTransport(LocalTransport):
    """LocalTransport whose commands are all killed when the node-check's total deadline passes."""

    def __init__(self, name: str, deadline: float):
        super().__init__(name)
        self._commands: List[RunningCommand] = []
        self._lock = threading.Lock()
        self.expired = False
        self._timer = threading.Timer(deadline, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        cmd = super().start(argv, stdin, keep_stdin_open, max_output)
        with self._lock:
            self._commands.append(cmd)
            expired = self.expired
        if expired:
            cmd.kill()
        return cmd

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            commands = list(self._commands)
        for cmd in commands:
            cmd.kill()

    def close(self) -> None:
        self._timer.cancel()


def _params(specs: Sequence[CheckSpec], options: NodeCheckOptions, name: str) -> Dict[str, Any]:
    params: Dict[str, Any] = {"host": name, "slots": options.slots, "gpus": list(range(options.slots)),
                              "master": "", "master_name": name, "hosts": [name]}
    for spec in specs:
        if spec.host_params:
            params.update(spec.host_params(options.thresholds))
    params.update(options.host_params)
    return params


def _is_bad(status: Status, strict: bool) -> bool:
    return status in (Status.FAIL, Status.ERROR) or (strict and status == Status.WARN)


def _clause(check: str, outcome: Outcome) -> str:
    # One clause per check: the first sentence of its message, on one line (reasons are shown in one column).
    text = re.sub(r"\s+", " ", outcome.message).strip()
    if outcome.status == Status.ERROR:  # the label says "could not check" already: the reason stays short
        text = text.removeprefix("could not run: ")
    text = re.split(r"(?<=[^\d\s])\. |; ", text, maxsplit=1)[0].rstrip(".")
    label = check if outcome.status != Status.ERROR else f"{check} (could not check)"
    return f"{label}: {text}"


def reason_line(outcomes: Sequence[Tuple[str, Outcome]], strict: bool = False) -> str:
    """The one-line verdict: ``preflight: ok (...)`` or ``preflight: check: why; check: why``."""
    bad = [(c, o) for c, o in outcomes if _is_bad(o.status, strict)]
    if not bad:
        names = ", ".join(c for c, _ in outcomes)
        # What "ok" rests on: skipped checks proved nothing and warnings are worth a look (issue 26).
        counts = [f"{len(outcomes)} check{'s' if len(outcomes) != 1 else ''}"]
        for status, word in ((Status.SKIP, "skipped"), (Status.WARN, "warning")):
            n = sum(1 for _, o in outcomes if o.status == status)
            if n:
                counts.append(f"{n} {word}" + ("s" if n != 1 and status == Status.WARN else ""))
        return f"{REASON_PREFIX} ok ({', '.join(counts)}: {names})"
    line = f"{REASON_PREFIX} " + "; ".join(_clause(c, o) for c, o in bad)
    # Printable ASCII only: the reason is host-reported text going into the scheduler's state.
    line = "".join(ch if " " <= ch <= "~" else "?" for ch in line)
    return line if len(line) <= MAX_REASON else line[:MAX_REASON - 3] + "..."


def run_checks(options: NodeCheckOptions, transport: Optional[Transport] = None) -> NodeVerdict:
    """Run the host checks here within options.deadline and evaluate them."""
    name = node_name(options.node_name)
    started_at, t0 = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"), time.monotonic()
    specs = [registry.spec(n) for n in options.checks]
    own = transport is None
    t = transport or _DeadlineTransport(name, options.deadline)
    outcomes: List[Tuple[str, Outcome]] = []
    try:
        agent = Agent(t, options.python, f"preflight-{uuid.uuid4().hex[:12]}")
        # Each check's own deadline leaves the agent time to start and to report the others' results.
        per_check = max(1.0, min(options.timeout, options.deadline - 5))
        try:
            out = agent.collect([s.name for s in specs], _params(specs, options, name), per_check)
        except AgentError as exc:
            expired = isinstance(t, _DeadlineTransport) and t.expired
            why = (f"did not finish within the {options.deadline:g}s deadline" if expired else str(exc))
            if expired and not agent.said_hello:  # the interpreter itself hung: say so in the drain reason
                why = f"{options.python} did not start within the {options.deadline:g}s deadline"
            outcomes = [("preflight", Outcome(Status.ERROR, why, "look at the node (load, hung disks, D-state "
                                              "processes) or raise --deadline"))]
            return NodeVerdict(name, outcomes, reason_line(outcomes, options.strict), True, started_at=started_at,
                               duration_s=time.monotonic() - t0, slots=options.slots)
    finally:
        if own:
            t.close()
    durations: Dict[str, float] = {}
    for spec in specs:
        answer = host_outcome(spec, out, options.thresholds)  # as a run reads it (preflight.answer)
        entry = out.get(spec.name)
        if isinstance(entry, dict) and "duration_s" in entry:
            durations[spec.name] = answer.duration_s
        outcomes.append((spec.name, answer.outcome))
    if options.history is not None:  # a figure well below the node's own past is a WARN on its check
        from preflight import history
        history.record_outcomes(name, outcomes, options.thresholds, options.history,
                                lambda: int(any(_is_bad(o.status, options.strict) for _, o in outcomes)))
    failed = any(_is_bad(o.status, options.strict) for _, o in outcomes)
    return NodeVerdict(name, outcomes, reason_line(outcomes, options.strict), failed, durations=durations,
                       started_at=started_at, duration_s=time.monotonic() - t0, slots=options.slots)


def _scontrol(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *argv], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def node_state(node: str) -> Tuple[str, str]:
    """(State, Reason) of the node from `scontrol show node -o NODE`, e.g. ("IDLE+DRAIN", "preflight: ...")."""
    proc = _scontrol(["show", "node", "-o", node])
    if proc.returncode:
        raise RuntimeError(f"scontrol show node {node} failed: {(proc.stderr or proc.stdout).strip()[:200]}")
    text = proc.stdout
    state = re.search(r"\bState=(\S+)", text)
    # Reason is the last field of the one-line form and may hold spaces; scontrol appends " [user@time]".
    reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?\s*$", text)
    return (state[1] if state else ""), (reason[1] if reason else "")


def apply_drain(verdict: NodeVerdict) -> str:
    """Drain a failed node with the verdict as reason; resume a passing node only if preflight drained it.

    A node already drained for another reason keeps that reason, failing or not: overwriting it would make the
    drain look like preflight's, and a later passing check would resume a node that an admin, NHC or Slurm took
    out.
    """
    state, reason = node_state(verdict.node)
    drained = "DRAIN" in state
    if drained and not reason.startswith(REASON_PREFIX):
        return f"left drained (not drained by preflight: {reason or 'no reason'})"
    if verdict.failed:
        proc = _scontrol(["update", f"nodename={verdict.node}", "state=drain", f"reason={verdict.line}"])
        if proc.returncode:
            raise RuntimeError(f"scontrol update nodename={verdict.node} state=drain failed: "
                               f"{(proc.stderr or proc.stdout).strip()[:200]}")
        return "drained"
    if not drained:
        return ""
    proc = _scontrol(["update", f"nodename={verdict.node}", "state=resume"])
    if proc.returncode:
        raise RuntimeError(f"scontrol update nodename={verdict.node} state=resume failed: "
                           f"{(proc.stderr or proc.stdout).strip()[:200]}")
    return "resumed (preflight had drained it)"
