"""The status vocabulary every check speaks: the Status enum, findings, outcomes, and the thresholds accessor.

Pure and standard-library only (it runs on the hosts too, Python 3.9). A check's ``evaluate`` returns an
``Outcome``; its sub-results are ``Finding``s folded by ``combine``::

    combine([Finding(Status.WARN, "memlock 64 KiB < unlimited")], "ok") -> Outcome(WARN, "memlock 64 KiB ...")

Thresholds are the merged config (each check's defaults + ``--config``), read only through
``limits(thresholds, NAME)``, e.g. ``limits(thresholds, "nvme")["min_write_gbps"]``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union


class Status(str, enum.Enum):
    """PASS/WARN/FAIL are verdicts about the host; SKIP always carries a reason; ERROR means 'could not run'."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    @property
    def word(self) -> str:
        """How a report line says it, pytest-style: PASSED, WARNED, FAILED, SKIPPED, ERROR."""
        return {"pass": "PASSED", "warn": "WARNED", "fail": "FAILED", "skip": "SKIPPED", "error": "ERROR"}[self.value]

    @property
    def rank(self) -> int:
        # A definite FAIL outranks ERROR when one check has both: it is the more useful thing to show.
        return {"skip": 0, "pass": 1, "warn": 2, "error": 3, "fail": 4}[self.value]


@dataclass
class Finding:
    """One sub-result of a check (one GPU's ECC errors, one config key); the check's status is the worst."""

    status: Status
    message: str
    fix: str = ""

    def to_dict(self) -> Dict[str, str]:
        return {"status": self.status.value, "message": self.message, "fix": self.fix}


# Where a cause with no host to fix is fixed (``Outcome.where``): the shell that launches the job (an inherited
# variable), the coordinator (its options or files), or every host alike (the job's interpreter missing everywhere).
WHERE = ("launch shell", "coordinator", "every host")


@dataclass(frozen=True)
class BlockedBy:
    """The (host, check) whose fault kept a result from telling anything of its own: a rank that waited for a rank
    which raised, a cluster-wide FAIL that one host's fault explains. ``host`` is CLUSTER ("*") for the cluster row."""

    host: str
    check: str

    def __str__(self) -> str:
        return f"{self.host}::{self.check}"


@dataclass
class Outcome:
    """What ``evaluate`` returns for one (host, check): the message states actual vs expected.

    ``blocked_by``: set when this result only follows from another result's fault (that one is the cause; this one is
    its victim, counted as blocked). ``where``: one of WHERE when the cause is fixed in no host (an inherited variable:
    "launch shell"); the verdict then names no host to fix.
    """

    status: Status
    message: str
    fix: str = ""
    metrics: Dict[str, Any] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)
    blocked_by: Optional[BlockedBy] = None
    where: Optional[str] = None


def combine(findings: Sequence[Finding], ok_message: str, metrics: Optional[Dict[str, Any]] = None) -> Outcome:
    """Fold findings into one outcome: worst status wins; the message lists every non-PASS finding.

    With no findings at all the outcome is PASS with ``ok_message``.
    """
    metrics = dict(metrics or {})
    findings = list(findings)
    if not findings:
        return Outcome(Status.PASS, ok_message, metrics=metrics)
    worst = max((f.status for f in findings), key=lambda s: s.rank)
    shown = [f for f in findings if f.status not in (Status.PASS,)] or findings
    if worst == Status.SKIP or all(f.status == Status.SKIP for f in shown):
        shown = [f for f in findings if f.status == Status.SKIP]
    else:
        shown = [f for f in shown if f.status != Status.SKIP] or shown
    message = "; ".join(f.message for f in shown)
    fixes: List[str] = []
    for f in shown:
        if f.fix and f.fix not in fixes:
            fixes.append(f.fix)
    if worst == Status.PASS:
        message = ok_message if ok_message else message
    metrics.setdefault("findings", [f.to_dict() for f in findings])
    # A fix with command lines (prose, then "\n  command" lines) ends in a command: "; " after it would append the
    # next fix's prose to that command when pasted, so such fixes go one after the other on lines of their own.
    sep = "\n" if any("\n" in fx for fx in fixes) else "; "
    return Outcome(worst, message, sep.join(fixes), metrics, findings)


def skip(reason: str, **metrics: Any) -> Outcome:
    return Outcome(Status.SKIP, reason, metrics=dict(metrics))


def error(reason: str, fix: str = "", **metrics: Any) -> Outcome:
    return Outcome(Status.ERROR, reason, fix, metrics=dict(metrics))


class ThresholdsError(KeyError):
    """A check asked for a [section] that the thresholds do not have: a bug, or its TOML missing beside it."""


def limits(thresholds: Mapping[str, Any], name: str) -> Dict[str, Any]:
    """The one accessor for a check's thresholds: the ``[name]`` section of the merged config.

    The check's TOML beside it (``nvme.toml``) is the only source of the numbers; there are no fallback copies in the
    checks, so a missing section is an error that names it rather than a silently different default.
    """
    section = thresholds.get(name)
    if not isinstance(section, dict):
        raise ThresholdsError(f"thresholds have no [{name}] section (the TOML beside each check is the source of every "
                              "threshold)")
    return section


Evaluation = Union[Outcome, Dict[str, Outcome]]
