"""The report as Prometheus metrics for node_exporter's textfile collector (``--prom-textfile FILE``), e.g.::

    # HELP preflight_check_status preflight check result per host and check: 0 pass, 1 warn, 2 fail, 3 error, ...
    # TYPE preflight_check_status gauge
    preflight_check_status{host="node01",check="CHECK"} 0
    preflight_CHECK_write_bytes_per_second{host="node01",path="/local_nvme"} 2100000000

Every check's status and duration come from the results; the measured figures from the checks themselves
(``SPEC.prom_metrics``, preflight/hostside/seams.py), so this module names no check. Names are validated, label
values escaped (backslash, double quote, newline) after anything the format cannot carry (lone surrogates, other
control characters) is replaced; a sample that is invalid, or repeats a series, is left out with a comment line.
The file is replaced atomically (render.write_atomic): the collector must never read half of it.
"""
from __future__ import annotations

import math
import re
import time
from datetime import datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, TextIO, Tuple

from preflight import checks as registry
from preflight.hostside.outcome import Status
from preflight.hostside.seams import PromSample
from preflight.render import Settings, write_atomic
from preflight.results import Report, display_host

# The values of preflight_check_status, as the issue fixed them: pass to error by how bad, then skip (so an alert on
# FAIL and ERROR is ``== 2 or == 3``, docs/prometheus.md).
STATUS_VALUES = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2, Status.ERROR: 3, Status.SKIP: 4}
TYPES = ("gauge", "counter", "untyped")
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Label values are UTF-8; a lone surrogate (a host's undecodable byte) cannot be encoded, and control characters
# other than the newline (which is escaped) have no business in a host or path name.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_LABEL = 256  # a host-reported path or name longer than this is cut: a label is not a message

STATUS = ("preflight_check_status", "preflight check result per host and check: 0 pass, 1 warn, 2 fail, 3 error, "
          "4 skip (a blocked check is 3)")
BLOCKED = ("preflight_check_blocked", "1 where the result only follows from another result's fault (a victim, "
           "counted in that one's cause; its status stays as it was)")
CAUSES = ("preflight_causes", "FAIL and ERROR causes of the run (what the verdict names; a victim is none)")
DURATION = ("preflight_check_duration_seconds", "how long the check took on the host")
LAST_RUN = ("preflight_last_run_timestamp_seconds", "when preflight last finished a run (Unix time), by command")


def label_value(text: Any) -> str:
    """``text`` as a label value, escaped for the text format: backslash, double quote and newline."""
    value = UNSAFE.sub("\ufffd", str(text))
    if len(value) > MAX_LABEL:
        value = value[:MAX_LABEL - 3] + "..."
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _help(text: str) -> str:
    return UNSAFE.sub("\ufffd", text).replace("\\", "\\\\").replace("\n", "\\n")


def _comment(text: str) -> str:
    # One line of printable ASCII: a comment must not end early and start a sample line.
    return "# preflight: " + "".join(ch if " " <= ch <= "~" else "?" for ch in text)[:300]


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value == int(value) and abs(value) < 1e15 else repr(value)


def finished_at(report: Report, now: Optional[float] = None) -> float:
    """The run's end as Unix time: started_at (ISO 8601) plus its duration; ``now`` when started_at is unreadable."""
    try:
        started = datetime.fromisoformat(report.started_at).timestamp()
    except (TypeError, ValueError):
        return time.time() if now is None else now
    return started + max(0.0, report.duration_s)


class _Families:
    """The metric families in first-seen order, each with its HELP, TYPE and samples; one series once."""

    def __init__(self) -> None:
        self.families: Dict[str, Tuple[str, str, List[str]]] = {}
        self.series: set = set()
        self.dropped: List[str] = []

    def add(self, sample: PromSample, where: str) -> None:
        name, help_text, kind, labels, value = sample
        why = self._invalid(name, kind, labels, value)
        if why:
            self.dropped.append(f"{where}: left out {str(name)[:80]!r}: {why}")
            return
        family = self.families.setdefault(name, (str(help_text), kind, []))
        if family[1] != kind:
            self.dropped.append(f"{where}: left out {name}: type {kind} differs from the {family[1]} declared first")
            return
        rendered = ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items())
        series = f"{name}{{{rendered}}}" if rendered else name
        if series in self.series:
            self.dropped.append(f"{where}: left out a repeated series of {name}")
            return
        self.series.add(series)
        family[2].append(f"{series} {_number(float(value))}")

    @staticmethod
    def _invalid(name: Any, kind: Any, labels: Any, value: Any) -> str:
        if not isinstance(name, str) or not METRIC_NAME.match(name) or not name.startswith("preflight_"):
            return "a metric name is [a-zA-Z_:][a-zA-Z0-9_:]* and preflight's start with preflight_"
        if kind not in TYPES:
            return f"type must be one of {', '.join(TYPES)}"
        if not isinstance(labels, Mapping) or not all(isinstance(k, str) and LABEL_NAME.match(k)
                                                      and not k.startswith("__") for k in labels):
            return "label names are [a-zA-Z_][a-zA-Z0-9_]*, not starting with __"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"value {type(value).__name__} is not a number"
        return ""

    def lines(self) -> Iterable[str]:
        for name, (help_text, kind, samples) in self.families.items():
            yield f"# HELP {name} {_help(help_text)}"
            yield f"# TYPE {name} {kind}"
            yield from samples
        for why in self.dropped:
            yield _comment(why)


def _check_samples(check: str, results: Sequence[Mapping[str, Any]]) -> Tuple[List[PromSample], str]:
    """(the samples a registered check declares for its results, why none if its function failed)."""
    if check not in registry.ORDER:
        return [], ""
    spec = registry.spec(check)
    if spec.prom_metrics is None:
        return [], ""
    try:
        return list(spec.prom_metrics(results)), ""
    except Exception as exc:  # a check's bug costs its figures, never the file
        return [], f"{check}: its metrics were left out: {type(exc).__name__}: {exc}"


def render(report: Report, command: str = "run", now: Optional[float] = None) -> str:
    """The whole text of the file. ``command`` labels preflight_last_run_timestamp_seconds, so that a node whose
    node_exporter reads both a ``run``'s file and a ``node-check``'s keeps the two apart."""
    out = _Families()
    out.add(PromSample(*LAST_RUN, "gauge", {"command": command}, finished_at(report, now)), "run")
    from preflight.causes import BAD, causes
    out.add(PromSample(*CAUSES, "gauge", {"command": command},
                       sum(1 for c in causes(report) if c.status in BAD)), "run")
    for r in report.results:
        labels = {"host": display_host(r.host), "check": r.check}
        out.add(PromSample(*STATUS, "gauge", labels, STATUS_VALUES[r.status]), r.check)
    for i in sorted(report.victims()):  # an alert can leave victims out: `unless on(host, check) ... == 1`
        r = report.results[i]
        out.add(PromSample(*BLOCKED, "gauge", {"host": display_host(r.host), "check": r.check}, 1), r.check)
    for r in report.results:
        if r.duration_s > 0:  # 0: not measured (a blocked cell, a cluster row)
            out.add(PromSample(*DURATION, "gauge", {"host": display_host(r.host), "check": r.check},
                               round(r.duration_s, 3)), r.check)
    by_check: Dict[str, List[Dict[str, Any]]] = {}
    for r in report.results:
        by_check.setdefault(r.check, []).append(r.to_dict())
    for check, results in by_check.items():
        samples, failed = _check_samples(check, results)
        if failed:
            out.dropped.append(failed)
        for sample in samples:
            out.add(sample, check)
    return "\n".join(out.lines()) + "\n"


def write(report: Report, out: TextIO, settings: Settings) -> None:
    """The renderer (RENDERERS' "prometheus"): ``preflight run --prom-textfile FILE``."""
    out.write(render(report))


def write_file(report: Report, path: str, command: str = "run") -> None:
    """Replace ``path`` atomically with the metrics (node-check's ``--prom-textfile``); OSError if it cannot."""
    write_atomic(path, lambda fh: fh.write(render(report, command)))
