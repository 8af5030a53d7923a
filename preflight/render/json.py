"""The JSON report (``--json FILE``; its contract is docs/json-contract.md): the Report's ``to_dict`` with its causes
(``report_dict``: results.py cannot import causes.py, which imports it), one host, one result and one cause per
line, so that a diff shows which changed::

    {
     "version": 1,
     "started_at": "2026-11-23T10:00:00+00:00",
     "hosts": [
      {"name": "node01", "address": "198.18.0.1", "slots": 8, "reachable": true}
     ],
     "results": [
      {"host": "node01", "check": "...", "status": "pass", "message": "...", "fix": "", "metrics": {}, ...},
      {"host": "node03", "check": "CHECK", "status": "error", ..., "blocked_by": "CONNECTION"},
      {"host": "*", "check": "...", "status": "fail", ...}
     ],
     "causes": [
      {"id": "CONNECTION:1", "status": "error", "check": "CONNECTION", "hosts": ["node03"], "nodeset": "node03", ...}
     ],
     ...
     "summary": {"pass": 10, ..., "error": 1, "blocked": 14, "exit_code": 1, "causes": 1, "warning_causes": 0}
    }
"""
from __future__ import annotations

import json
from typing import Any, Dict, TextIO

from preflight.causes import BAD, causes
from preflight.hostside.outcome import Status
from preflight.render import Settings
from preflight.results import Report

# json's C encoder: with indent= json.dumps runs its pure-Python encoder instead, which was 8% of the
# coordinator's GIL-holding samples at 1,000 hosts (bench/results/profile-1000.txt).
_ENCODE = json.JSONEncoder(default=str).encode


def report_dict(report: Report) -> Dict[str, Any]:
    """The whole JSON document: the report's results and its causes; the summary counts the causes too
    (``causes``: FAIL/ERROR causes, what the verdict names; ``warning_causes``: WARN causes)."""
    found = causes(report)
    summary = {"causes": sum(1 for c in found if c.status in BAD),
               "warning_causes": sum(1 for c in found if c.status == Status.WARN)}
    return report.to_dict([c.to_dict() for c in found], summary)


def to_json(report: Report) -> str:
    lines = []
    for key, value in report_dict(report).items():
        if isinstance(value, list) and value:
            items = ",\n".join("  " + _ENCODE(item) for item in value)
            lines.append(f" {_ENCODE(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {_ENCODE(key)}: {_ENCODE(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write(report: Report, out: TextIO, settings: Settings) -> None:
    out.write(to_json(report))
