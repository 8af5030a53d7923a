"""A run's hook: each result flattened into figures, judged against its host's past, and the run recorded, e.g.
``{"paths": [{"path": "/local_nvme", "write_Bps": 3.1e9}]}`` -> ``("paths[/local_nvme].write_Bps", 3.1e9)``.

A store that is corrupt, locked past the timeout or unwritable never fails the gate: one warning line, and the run
goes on without history.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from preflight.history.baseline import (Cell, Drift, Drop, Settings, apply_drops, declared, direction, drifts, judge,
                                        one_sided_p, trend)
from preflight.history.store import BAD, HistoryError, Store
from preflight.hostside.stats import holm
from preflight.hostside.outcome import Status
from preflight.results import CLUSTER, Result

# Bounds on what one result may put in the store: a host reports its metrics, and a run of 1,000 hosts must stay
# a few MB. Past them, the rest of that result's figures are not recorded.
MAX_METRICS_PER_RESULT = 256
MAX_KEY_CHARS = 200
MAX_DEPTH = 6
MAX_LIST_ITEMS = 64
# What names an entry of a list of dicts in its flattened key, first found wins: a link by its ends, a path, a
# network, a GPU by index, an all-reduce size by its bytes. Else its position.
IDENTITY_KEYS = ("path", "network", "index", "bytes", "name", "device")
# Top-level metric keys that are not the check's own figures: the history's own verdicts and series, the findings.
NOT_RECORDED = ("baseline", "trend", "findings")


def _identity(item: Any, position: int) -> str:
    if isinstance(item, dict):
        src, dst = item.get("src"), item.get("dst")
        if isinstance(src, (str, int)) and isinstance(dst, (str, int)) and not isinstance(src, bool):
            return f"{src}->{dst}"
        for key in IDENTITY_KEYS:
            value = item.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                return str(value)[:80]
    return str(position)


def flatten(metrics: Mapping[str, Any], limit: int = MAX_METRICS_PER_RESULT) -> List[Tuple[str, float]]:
    """Every finite number of a result's metrics as (flattened key, value), at most ``limit`` of them:
    ``{"median_gbps": 0.2, "links": [{"src": "a", "dst": "b", "gbps": 0.19}]}`` ->
    ``[("median_gbps", 0.2), ("links[a->b].gbps", 0.19)]``. Booleans are not figures; the first of two equal keys
    wins."""
    out: Dict[str, float] = {}

    def walk(value: Any, key: str, depth: int) -> None:
        if len(out) >= limit or len(key) > MAX_KEY_CHARS:
            return
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            if math.isfinite(value) and key not in out:
                out[key] = float(value)
            return
        if depth >= MAX_DEPTH:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                if depth == 0 and k in NOT_RECORDED:
                    continue
                walk(v, f"{key}.{k}" if key else str(k), depth + 1)
        elif isinstance(value, (list, tuple)) and key:
            for i, v in enumerate(value[:MAX_LIST_ITEMS]):
                walk(v, f"{key}[{_identity(v, i)}]", depth + 1)

    if isinstance(metrics, dict):
        walk(metrics, "", 0)
    return list(out.items())


Figure = Tuple[str, float, str, List[float]]  # a compared figure: key, value, "higher"/"lower", its past values


class Recorder:
    """The history of one run: open the store, judge the cells against their past, record the run. A problem with
    the store is one warning (``warn``, once) and the run goes on without history."""

    def __init__(self, path: Optional[Path], thresholds: Mapping[str, Any],
                 warn: Optional[Callable[[str], None]] = None):
        self.path = path
        self.thresholds = thresholds
        self.settings = Settings.from_thresholds(thresholds)
        self._warn = warn or _stderr_warning
        self.warned = False
        self.store: Optional[Store] = None
        self.run_id: Optional[str] = None
        self.drifts: List[Drift] = []  # judge(): the figures the fleet dropped on together in this run
        if path is not None:
            try:
                self.store = Store(path, self.settings.busy_timeout_s)
            except HistoryError as exc:
                self.warn(str(exc))

    def warn(self, text: str) -> None:
        if not self.warned:
            self.warned = True
            self._warn(f"history: {text}; this run goes on without history")

    def cells(self, entries: Iterable[Tuple[str, str, Any]], hosts: Sequence[str]) -> List[Cell]:
        """A Cell per (host, check, result) with its context and figures (flattened before any baseline WARN)."""
        out = []
        for host, check, target in entries:
            out.append(Cell(host, check, target, context(check, host, hosts, self.thresholds),
                            flatten(getattr(target, "metrics", None) or {})))
        return out

    def judge(self, cells: Sequence[Cell]) -> List[Drop]:
        """Each cell's declared figures against the host's own past, after the fleet's common drop on that figure
        is taken out (``Drift``; a notable one is kept in self.drifts for the run's cluster row); a drop, significant
        after Holm's adjustment over every figure compared in the run, becomes a WARN on its cell."""
        if self.store is None:
            return []
        compared = self._compared(cells)
        if compared is None:
            return []
        # The fleet is the hosts: a cluster row's figure is their aggregate, its drop said with theirs (below).
        figures = [(cell.host, cell.check, key, value, past, better) for cell, rows in compared
                   for key, value, better, past in rows if cell.host != CLUSTER]
        fleet = drifts(figures, self.settings)
        self.drifts = [d for d in fleet.values() if d.notable(self.settings)]
        said: Dict[str, Drift] = {}  # a check's first notable drift: its line also says the cluster row's own drops
        for d in self.drifts:
            said.setdefault(d.check, d)
        # Each figure as judged: with the fleet's common drop on it taken out.
        judged = {(id(cell), key): fleet[(cell.check, key)].adjust(value, self.settings)
                  if (cell.check, key) in fleet and cell.host != CLUSTER else value
                  for cell, rows in compared for key, value, _, _ in rows}
        # Holm over every figure compared against a baseline in this run: the stated p holds for the run.
        family = [(id(cell), key, better, past) for cell, rows in compared
                  for key, _, better, past in rows if len(past) >= self.settings.min_runs]
        adjusted = holm([one_sided_p(judged[(c, key)], past, better, self.settings) for c, key, better, past in family])
        p_adj = {(c, key): p for (c, key, *_), p in zip(family, adjusted)}
        found: List[Drop] = []
        for cell, rows in compared:
            drops, trends = [], []
            for key, value, better, past in rows:
                verdict = judge(judged[(id(cell), key)], past, better, self.settings)
                p = p_adj.get((id(cell), key), 1.0)
                if verdict and p < self.settings.max_p:
                    med, z, raw = verdict
                    drift = fleet.get((cell.check, key)) if cell.host != CLUSTER else None
                    drops.append(Drop(cell.host, cell.check, key, better, value, med, len(past), z, raw, p,
                                      len(family), drift.common(self.settings) if drift else 1.0))
                line = trend(key, value, past, better, bool(drops and drops[-1].key == key), self.settings)
                if line:
                    trends.append(line)
            metrics = getattr(cell.target, "metrics", None)
            if cell.host == CLUSTER and cell.check in said and drops and isinstance(metrics, dict):
                # The cluster's own figure fell with its hosts': the same cause, said once, on the fleet's line.
                said[cell.check].also.extend(drops)
                metrics["baseline"] = [d.to_dict() for d in drops]
            else:
                apply_drops(cell, drops, self.settings)
            if trends and isinstance(metrics, dict):  # metrics.trend: every compared figure, flagged or not
                metrics["trend"] = trends
            cell.drops = len(drops)
            found.extend(drops)
        return found

    def _compared(self, cells: Sequence[Cell]) -> Optional[List[Tuple[Cell, List[Figure]]]]:
        """Each cell that is no victim with its declared figures as (key, value, better, past values); None when the
        store failed (said once; the run goes on without history)."""
        assert self.store is not None
        patterns = {c.check: declared(c.check) for c in cells}
        out = []
        for cell in cells:
            if getattr(cell.target, "blocked_by", None):
                continue
            directions = {k: direction(patterns[cell.check], k) for k, _ in cell.figures}
            keys = [k for k, d in directions.items() if d]
            if not keys:
                continue
            try:
                past = self.store.past(cell.host, cell.check, cell.context, keys, self.settings.runs)
            except HistoryError as exc:
                self.warn(str(exc))
                self.close()
                return None
            out.append((cell, [(key, value, str(directions[key]), list(past.get(key, [])))
                               for key, value in cell.figures if directions.get(key)]))
        return out

    def record(self, kind: str, hosts: Sequence[str], cells: Sequence[Cell], exit_code: Optional[int],
               started: Optional[float] = None, causes: Optional[int] = None) -> Optional[str]:
        if self.store is None:
            return None
        try:
            run_id = self.store.record(time.time() if started is None else started, kind, hosts, exit_code, cells,
                                       causes)
        except HistoryError as exc:
            self.warn(str(exc))
            return None
        finally:
            self.close()
        self.run_id = run_id
        return run_id

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def _stderr_warning(text: str) -> None:
    print(f"preflight: warning: {text}", file=sys.stderr, flush=True)


def context(check: str, host: str, hosts: Sequence[str], thresholds: Mapping[str, Any]) -> str:
    """What makes two runs of a check comparable: the same settings (its thresholds section: a test size, a
    duration) and, for a check across hosts or the cluster row, the same hosts (a host's link rate depends on
    its partners). A short hash of those."""
    from preflight import checks as registry
    across = host == CLUSTER or (check in registry.ORDER and registry.spec(check).scope == "cluster")
    text = json.dumps(thresholds.get(check) or {}, sort_keys=True, default=str)
    if across:
        text += "|" + ",".join(sorted(hosts))
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def record_report(report: Any, thresholds: Mapping[str, Any], path: Optional[Path],
                  warn: Optional[Callable[[str], None]] = None, kind: str = "run") -> Optional[str]:
    """`preflight run`'s hook, before the report is written: every result judged against its host's past (a drop
    is a WARN on that cell) and the run recorded. The run id, or None without history."""
    if path is None:
        return None
    recorder = Recorder(path, thresholds, warn)
    if recorder.store is None:
        return None
    hosts = [h.name for h in report.hosts]
    cells = recorder.cells(((r.host, r.check, r) for r in report.results), hosts)
    recorder.judge(cells)  # first: a baseline WARN is part of the causes
    for drift in recorder.drifts:
        added = _fleet_warning(report, drift)
        if added is not None:  # a row of its own: its cell, at the same index as the report's results
            cells.append(added)
    from preflight.causes import BAD as CAUSE_BAD
    from preflight.causes import causes as group
    found = group(report)
    victims = report.victims()
    for cause in found:
        for i in cause.results:
            cells[i].cause, cells[i].blocked = cause.id, i in victims
    started = _parse_time(getattr(report, "started_at", ""))
    bad = sum(1 for c in found if c.status in CAUSE_BAD)
    return recorder.record(kind, hosts, cells, report.exit_code, started, bad)


def _fleet_warning(report: Any, drift: Drift) -> Optional[Cell]:
    """A fleet's common drop as one WARN on the check's cluster row (the report's own, or one added for it): one
    cause, where a WARN on every host would be as many. The Cell of an added row; None where the row was the
    report's own (its cell is there already)."""
    line = drift.message()
    extra = {"check": drift.check, "key": drift.key, "factor": round(drift.factor, 4), "hosts": drift.hosts,
             "dropped": {h: {"value": v, "median": m} for h, (v, m) in drift.dropped.items()}}
    row = next((r for r in report.results if r.host == CLUSTER and r.check == drift.check), None)
    if row is None:
        row = Result(CLUSTER, drift.check, Status.WARN, line, drift.fix(), {"fleet_drift": [extra]})
        report.results.append(row)
        return Cell(CLUSTER, drift.check, row)
    if Status(row.status).rank < Status.WARN.rank:
        row.status, row.message = Status.WARN, "; ".join(x for x in (line, row.message) if x)
    else:
        row.message = "; ".join(x for x in (row.message, line) if x)
    row.fix = "; ".join(x for x in (row.fix, drift.fix()) if x)
    row.metrics.setdefault("fleet_drift", []).append(extra)
    return None


def record_outcomes(node: str, outcomes: Sequence[Tuple[str, Any]], thresholds: Mapping[str, Any],
                    path: Optional[Path], exit_code: Callable[[], int],
                    warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """`preflight node-check`'s hook: the node's outcomes judged against its own past and recorded."""
    if path is None:
        return None
    recorder = Recorder(path, thresholds, warn)
    if recorder.store is None:
        return None
    cells = recorder.cells(((node, check, outcome) for check, outcome in outcomes), [node])
    recorder.judge(cells)
    for cell in cells:  # one node: each cell that is not a pass is a cause of its own
        if Status(cell.target.status) != Status.PASS:
            cell.cause = f"{cell.check}:1"
    bad = sum(1 for c in cells if Status(c.target.status).value in BAD)
    return recorder.record("node-check", [node], cells, exit_code(), causes=bad)


def _parse_time(text: str) -> Optional[float]:
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None

