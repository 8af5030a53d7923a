"""One interpretation of a host's answer to the host checks, shared by ``preflight run`` and ``preflight node-check``.

An agent's collect answer holds one entry per check, e.g. ``{"libaio": {"facts": {...}, "duration_s": 0.1}}`` or
``{"nvme": {"error": "PermissionError: ...", "traceback": "...", "duration_s": 0.0}}`` (its shape is checked by
``remote.check_collect_shape``); ``host_outcome(spec, answer, thresholds)`` turns one check's entry into its cell.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from preflight.hostside.outcome import Evaluation, Outcome, Status
from preflight.hostside.seams import CheckSpec, Thresholds

NO_RESULT = "no result from the agent"
HOST_ERROR_FIX = "see --verbose for the host-side traceback"


@dataclass
class HostAnswer:
    """One check's cell on one host: its outcome, the seconds it took there, and its facts when it ran."""

    outcome: Outcome
    duration_s: float = 0.0
    facts: Optional[Dict[str, Any]] = None


def evaluate_safely(spec: CheckSpec, facts: Dict[str, Any], thresholds: Thresholds) -> Evaluation:
    """spec.evaluate(facts, thresholds); a bug in it costs one cell (ERROR), never the run."""
    try:
        return spec.evaluate(facts, thresholds)
    except Exception as exc:
        return Outcome(Status.ERROR, f"preflight internal error while evaluating: {type(exc).__name__}: {exc}",
                       "please report this with the JSON report attached")


def host_outcome(spec: CheckSpec, answer: Mapping[str, Any], thresholds: Thresholds) -> HostAnswer:
    """The cell of a host check from the agent's whole collect answer: ERROR "could not run: X" (with the host-side
    traceback kept in its metrics) when the check raised there or is missing, else its evaluated facts."""
    entry = answer.get(spec.name)
    if not isinstance(entry, Mapping):
        entry = {"error": NO_RESULT}
    duration = entry.get("duration_s", 0.0)
    seconds = float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool) else 0.0
    if "error" in entry or not isinstance(entry.get("facts"), dict):
        error = str(entry.get("error", NO_RESULT))
        return HostAnswer(Outcome(Status.ERROR, f"could not run: {error}", HOST_ERROR_FIX,
                                  {"traceback": str(entry.get("traceback", ""))}), seconds)
    facts: Dict[str, Any] = entry["facts"]
    evaluation = evaluate_safely(spec, facts, thresholds)
    if not isinstance(evaluation, Outcome):  # a host check judges its own host: one outcome
        evaluation = Outcome(Status.ERROR, f"preflight internal error: {spec.name}'s evaluate returned "
                                           f"{type(evaluation).__name__}, not one Outcome",
                             "please report this with the JSON report attached")
    return HostAnswer(evaluation, seconds, facts)
