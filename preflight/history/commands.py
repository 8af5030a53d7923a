"""The ``preflight history`` and ``preflight diff`` commands: the recorded runs, one host's results over time, and
what changed between two runs by cause, e.g. ``node03::ssh ERROR (was PASS) - ... (and 6 blocked cells)``.
"""
from __future__ import annotations

import datetime as _dt
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from preflight.history.baseline import Settings, declared, direction, in_unit, tail_p, unit_of
from preflight.history.store import BAD, CAUSES_SCHEMA, KEEP_MESSAGE, HistoryError, Store
from preflight.hostside.robust import p_value, robust_z
from preflight.results import CLUSTER, display_host

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_AGE_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str, option: str) -> float:
    """Seconds of ``7d``, ``12h``, ``30m``, ``2w``, ``90s``; ValueError naming the option otherwise."""
    m = _AGE.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{option} {text!r} is not an age; give a number and a unit, e.g. 7d, 12h, 30m, 2w")
    return float(m.group(1)) * _AGE_SECONDS[m.group(2)]


@dataclass
class Run:
    row: int
    run_id: str
    started: float
    kind: str
    hosts: List[str]
    exit_code: Optional[int]
    version: Optional[str] = None
    commit: Optional[str] = None

    def when(self) -> str:
        return _dt.datetime.fromtimestamp(self.started).strftime("%Y-%m-%d %H:%M:%S")

    def title(self) -> str:
        n = len(self.hosts)
        return f"{self.run_id} ({self.when()}, {self.kind}, {n} host{'' if n == 1 else 's'})"


_RUN_COLUMNS = "id, run_id, started, kind, hosts, exit_code, version, commit_id"


def _run(row: Sequence[Any]) -> Run:
    try:
        hosts = [str(h) for h in json.loads(row[4])]
    except (TypeError, ValueError):
        hosts = []
    return Run(int(row[0]), str(row[1]), float(row[2]), str(row[3]), hosts, row[5], row[6], row[7])


def runs(store: Store, since: Optional[float] = None, host: Optional[str] = None) -> List[Run]:
    """The runs in time order, since a unix time, and with a host, if given."""
    sql = f"SELECT {_RUN_COLUMNS} FROM runs"
    where: List[str] = []
    params: List[Any] = []
    if since is not None:
        where.append("started >= ?")
        params.append(since)
    if host is not None:
        where.append("id IN (SELECT run FROM result_rows WHERE host = ?)")
        params.append(host)
    if where:
        sql += " WHERE " + " AND ".join(where)
    return [_run(r) for r in store.query(sql + " ORDER BY id", params)]


def find_run(store: Store, text: str) -> Run:
    """A run by its id, a unique prefix of it, or ``last``; HistoryError naming what matched otherwise."""
    if text == "last":
        rows = store.query(f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY id DESC LIMIT 1")
        if not rows:
            raise HistoryError(f"{store.path}: no run recorded yet")
        return _run(rows[0])
    like = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    rows = store.query(f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id LIKE ? ESCAPE '\\' ORDER BY id LIMIT 3",
                       (like,))
    if not rows:
        raise HistoryError(f"no run {text!r} in {store.path} (`preflight history` lists them)")
    if len(rows) > 1 and not any(r[1] == text for r in rows):
        first = ", ".join(r[1] for r in rows[:2])
        raise HistoryError(f"run {text!r} is ambiguous in {store.path}: {first}, ...")
    return _run(next((r for r in rows if r[1] == text), rows[0]))


def previous_run(store: Store, run: Run) -> Run:
    """The last run before ``run`` of the same kind that shares a host with it (``--against last``)."""
    for row in store.query(f"SELECT {_RUN_COLUMNS} FROM runs WHERE id < ? AND kind = ? ORDER BY id DESC LIMIT 1000",
                           (run.row, run.kind)):
        candidate = _run(row)
        if set(candidate.hosts) & set(run.hosts):
            return candidate
    raise HistoryError(f"{store.path}: no {run.kind} run before {run.run_id} with any of its hosts")


@dataclass(frozen=True)
class Recorded:
    """One (host, check) of a recorded run: its status, message, context, cause id and whether it is a victim."""

    status: str
    message: str
    context: str
    cause: Optional[str] = None
    blocked: bool = False


def _cells(store: Store, run: Run) -> Dict[Tuple[str, str], Recorded]:
    """{(host, check): Recorded} of a run. A store written before causes were recorded (schema 1): each cell that
    is no pass is a cause of its own, and none is blocked."""
    if store.version >= CAUSES_SCHEMA:
        rows = store.query("SELECT host, check_name, status, message, context, cause, blocked FROM result_rows "
                           "WHERE run = ?", (run.row,))
    else:
        rows = [(*r, None, 0) for r in store.query(
            "SELECT host, check_name, status, message, context FROM result_rows WHERE run = ?", (run.row,))]
    return {(h, c): Recorded(s, m or "", ctx, cause, bool(blocked)) for h, c, s, m, ctx, cause, blocked in rows}


def _figures(store: Store, run: Run) -> Dict[Tuple[str, str], Dict[str, float]]:
    out: Dict[Tuple[str, str], Dict[str, float]] = {}
    for h, c, k, v in store.query("SELECT host, check_name, key, value FROM metric_rows WHERE run = ?", (run.row,)):
        out.setdefault((h, c), {})[k] = float(v)
    return out


def _word(status: str) -> str:
    return status.upper()


def _bad_causes(cells: Mapping[Tuple[str, str], Recorded]) -> Dict[str, List[Tuple[str, str]]]:
    """{cause id: its cells} of the cells that FAILed or ERRORed: the cells of the check the cause is named after
    first (``ssh:1``), then the other checks that noticed it, its victims last. A cell recorded without a cause
    (schema 1) is a cause of its own."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for key, cell in sorted(cells.items()):
        if cell.status in BAD:
            out.setdefault(cell.cause or f"{key[0]}::{key[1]}", []).append(key)
    for cause, keys in out.items():
        named = cause.rsplit(":", 1)[0] if "::" not in cause else keys[0][1]
        keys.sort(key=lambda k: (cells[k].blocked, k[1] != named))
    return out


def _cause_line(keys: Sequence[Tuple[str, str]], cells: Mapping[Tuple[str, str], Recorded], change: str,
                message: bool = True) -> str:
    """``node03::ssh ERROR (was PASS) - message (also launcher_ssh; and 6 blocked cells)``: a cause by the cells
    of the check it is named after (their hosts as a NodeSet), the first one's message, the other checks that
    noticed it and how many victims it holds."""
    from preflight.causes import nodeset
    own = [k for k in keys if not cells[k].blocked] or list(keys)
    check = own[0][1]
    first = cells[own[0]]
    line = f"  {nodeset([h for h, c in own if c == check])}::{check} {change}"
    if message and first.message:
        line += f" - {first.message[:200]}"
    notes = []
    others = list(dict.fromkeys(c for _, c in own if c != check))
    if others:
        notes.append(f"also {', '.join(others)}")
    blocked = len(keys) - len(own) if len(own) < len(keys) else 0
    if blocked:
        notes.append(f"and {blocked} blocked cell{'s' if blocked != 1 else ''}")
    return line + (f" ({'; '.join(notes)})" if notes else "")


def diff_lines(store: Store, a: Run, b: Run, settings: Settings) -> List[str]:
    """What changed from run a to run b, by cause: new causes (one unreachable host is one, however many cells it
    blocked), fixed hosts and causes, and the declared figures that moved significantly (judged as a baseline is:
    against the host's own past spread, or the noise floor)."""
    before, after = _cells(store, a), _cells(store, b)
    lines = [f"preflight diff: {a.title()} -> {b.title()}"]

    def was_bad(key: Tuple[str, str]) -> bool:
        return key in before and before[key].status in BAD

    # A cause of b is new when one of its own cells (not a victim) was not bad in a.
    new = {cause: keys for cause, keys in _bad_causes(after).items()
           if any(not was_bad(k) for k in ([k for k in keys if not after[k].blocked] or keys))}
    cells = sum(len(keys) for keys in new.values())
    blocked = sum(1 for keys in new.values() for k in keys if after[k].blocked)
    counted = f" ({cells} failed cells, {blocked} of them blocked)" if cells != len(new) else ""
    lines.append(f"new causes: {len(new)}{counted}")
    for keys in new.values():
        first = next((k for k in keys if not after[k].blocked), keys[0])
        was = before[first].status if first in before else "not run"
        lines.append(_cause_line(keys, after, f"{_word(after[first].status)} (was {was.upper()})"))
    bad_before = {h for (h, _), v in before.items() if v.status in BAD}
    bad_after = {h for (h, _), v in after.items() if v.status in BAD}
    hosts_b = {h for h, _ in after}
    fixed_hosts = [h for h in b.hosts + [CLUSTER] if h in bad_before and h in hosts_b and h not in bad_after]
    named = f" ({', '.join(display_host(h) for h in fixed_hosts)})" if fixed_hosts else ""
    lines.append(f"fixed hosts: {len(fixed_hosts)}{named}")
    # A cause of a is fixed when none of its own cells is bad in b (its victims are then fixed with it).
    for keys in _bad_causes(before).values():
        own = [k for k in keys if not before[k].blocked] or keys
        if any(k in after and after[k].status in BAD for k in own) or not any(k in after for k in own):
            continue
        host, _ = own[0]
        now = after[own[0]].status if own[0] in after else "not run"
        still = "" if host not in bad_after else " (the host still fails elsewhere)"
        lines.append(_cause_line(keys, before, f"{_word(before[own[0]].status)} -> {now.upper()}{still}", False))
    moved = _moved(store, a, b, before, after, settings)
    lines.append(f"metrics that moved: {len(moved)}")
    lines.extend("  " + m for m in moved)
    gone = sorted(set(a.hosts) - set(b.hosts))
    if gone:
        lines.append(f"hosts only in {a.run_id}: {', '.join(gone)}")
    return lines


def _moved(store: Store, a: Run, b: Run, before: Mapping[Tuple[str, str], Recorded],
           after: Mapping[Tuple[str, str], Recorded], settings: Settings) -> List[str]:
    fa, fb = _figures(store, a), _figures(store, b)
    out = []
    for (host, check), figures in sorted(fb.items()):
        patterns = declared(check)
        old = fa.get((host, check), {})
        ctx = after[(host, check)].context if (host, check) in after else ""
        keys = [k for k in figures if k in old and direction(patterns, k)]
        if not keys:
            continue
        past = store.past(host, check, ctx, keys, settings.runs, before=b.row)
        for key in keys:
            x, y = old[key], figures[key]
            if x <= 0:
                continue
            spread = past.get(key, [])  # the host's own run-to-run spread, once there is a baseline's worth
            based = len(spread) >= settings.min_runs
            _, sigma, _ = robust_z(spread if based else [x], x, settings.noise_floor)
            z = (y - x) / sigma
            change = y / x - 1.0
            # Without a baseline sigma is the noise floor itself, a constant: the normal tail; with one, as judged.
            p = tail_p(-abs(z), len(spread)) if based else p_value(-abs(z))
            if abs(change) < settings.min_deficit or abs(z) < settings.z_threshold or not p < settings.max_p:
                continue
            better = direction(patterns, key)
            worse = (change < 0) == (better == "higher")
            unit, scale = unit_of(key)
            out.append(f"{display_host(host)}::{check} {key} {in_unit(x / scale, unit)} -> {in_unit(y / scale, unit)} "
                       f"({100 * change:+.0f}%, {'worse' if worse else 'better'}; z {z:+.1f})")
    return out


def _runs_table(store: Store, since: Optional[float]) -> List[str]:
    """``preflight history`` without a host: one line per run, its causes and failed cells."""
    found = runs(store, since)
    if not found:
        return [f"no runs recorded{' in that period' if since else ''} in {store.path}"]
    width = max(len(r.run_id) for r in found)
    lines = [f"{'run':<{width}}  {'time':<19}  {'kind':<10}  {'hosts':>5}  {'causes':>6}  failed cells"]
    if store.version >= CAUSES_SCHEMA:
        causes = dict(store.query("SELECT id, causes FROM runs"))
        cells = {run: (n, blocked or 0) for run, n, blocked in store.query(
            "SELECT run, COUNT(*), SUM(blocked) FROM results WHERE status IN ('fail', 'error') GROUP BY run")}
    else:
        causes, cells = {}, {run: (n, 0) for run, n in store.query(
            "SELECT run, COUNT(*) FROM results WHERE status IN ('fail', 'error') GROUP BY run")}
    for r in found:
        n, blocked = cells.get(r.row, (0, 0))
        counted = causes.get(r.row)
        number = "?" if counted is None and n else str(counted or 0)  # "?": recorded before causes were
        failed = f"{n}" + (f" ({blocked} blocked)" if blocked else "")
        lines.append(f"{r.run_id:<{width}}  {r.when()}  {r.kind:<10}  {len(r.hosts):>5}  {number:>6}  {failed}")
    return lines


def history_lines(store: Store, host: Optional[str], check: Optional[str], since: Optional[float]) -> List[str]:
    """``preflight history``: the runs (no host), or one host's results over time, oldest first."""
    if host is None:
        return _runs_table(store, since)
    key = CLUSTER if host == "cluster" else host
    blocked = "x.blocked" if store.version >= CAUSES_SCHEMA else "0"
    sql = (f"SELECT r.id, r.run_id, r.started, x.check_name, x.status, x.message, {blocked} FROM result_rows x "
           "JOIN runs r ON r.id = x.run WHERE x.host = ?")
    params: List[Any] = [key]
    if check:
        sql += " AND x.check_name = ?"
        params.append(check)
    if since is not None:
        sql += " AND r.started >= ?"
        params.append(since)
    rows = store.query(sql + " ORDER BY r.id, x.check_name", params)
    if not rows:
        of_check = " for " + check if check else ""
        period = " in that period" if since else ""
        return [f"no results of {host}{of_check} recorded{period} in {store.path}"]
    figures: Dict[Tuple[int, str], List[Tuple[str, float]]] = {}
    runs_of = sorted({r[0] for r in rows})
    marks = ",".join("?" * len(runs_of))
    figures_sql = f"SELECT run, check_name, key, value FROM metric_rows WHERE host = ? AND run IN ({marks})"
    for run, c, k, v in store.query(figures_sql, (key, *runs_of)):
        figures.setdefault((run, c), []).append((k, float(v)))
    width = max(len(r[3]) for r in rows)
    lines = [f"{host}: {len(runs_of)} run{'' if len(runs_of) == 1 else 's'}"]
    patterns: Dict[str, List[Tuple["re.Pattern[str]", str]]] = {}
    for run, run_id, started, c, status, message, victim in rows:
        if c not in patterns:
            patterns[c] = declared(c)
        shown = [(k, v) for k, v in sorted(figures.get((run, c), [])) if check or direction(patterns[c], k)]
        text = "  ".join(f"{k} {in_unit(v / unit_of(k)[1], unit_of(k)[0])}" for k, v in shown[:8 if check else 4])
        if status in KEEP_MESSAGE and message:
            text = (text + "  " if text else "") + "- " + message[:160]
        when = _dt.datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M:%S")
        word = "BLOCKED" if victim else status.upper()  # a victim of another cell's fault, not a cause
        lines.append(f"{when}  {run_id}  {c:<{width}}  {word:<5}  {text}".rstrip())
    return lines


def size_line(path: Path) -> str:
    try:
        size = sum(p.stat().st_size for p in (path, Path(str(path) + "-wal")) if p.exists())
    except OSError:
        return ""
    return f"{size} bytes"


def main_history(path: Path, host: Optional[str], check: Optional[str], since: Optional[str],
                 prune: bool, keep: Optional[str], out: TextIO, err: TextIO,
                 thresholds: Mapping[str, Any]) -> int:
    """``preflight history``; exit 0, or 2 with one line for bad input or a store it cannot read."""
    settings = Settings.from_thresholds(thresholds)
    try:
        if prune or keep:
            if not (prune and keep):
                raise ValueError("--prune and --keep go together: preflight history --prune --keep 90d")
            if host or check or since:
                raise ValueError("--prune --keep AGE prunes every host's runs; leave out HOST, --check and --since")
            age = parse_age(keep, "--keep")
            before = size_line(path)
            store = Store(path, settings.busy_timeout_s)
            try:
                gone = store.prune(time.time() - age)
            finally:
                store.close()
            plural = "" if gone == 1 else "s"
            print(f"pruned {gone} run{plural} older than {keep} from {path} ({before} -> {size_line(path)})", file=out)
            return 0
        cutoff = time.time() - parse_age(since, "--since") if since else None
        store = Store(path, settings.busy_timeout_s, readonly=True)
        try:
            lines = history_lines(store, host, check, cutoff)
        finally:
            store.close()
    except (ValueError, HistoryError) as exc:
        print(f"preflight history: error: {exc}", file=err)
        return 2
    out.write("\n".join(lines) + "\n")
    return 0


def main_diff(path: Path, run_a: Optional[str], run_b: Optional[str], against: Optional[str], out: TextIO,
              err: TextIO, thresholds: Mapping[str, Any]) -> int:
    """``preflight diff RUN_A RUN_B`` or ``preflight diff [RUN] --against last``; exit 0, or 2 with one line."""
    settings = Settings.from_thresholds(thresholds)
    try:
        if against is not None:
            if against != "last":
                raise ValueError("--against takes 'last' (the run before); to compare two runs name both: "
                                 "preflight diff RUN_A RUN_B")
            if run_b is not None:
                raise ValueError("--against last compares one run with the one before it: name at most one run")
        elif run_a is None or run_b is None:
            raise ValueError("name two runs (preflight diff RUN_A RUN_B), or one and --against last "
                             "(`preflight history` lists the runs)")
        store = Store(path, settings.busy_timeout_s, readonly=True)
        try:
            if against is not None:
                b = find_run(store, run_a or "last")
                a = previous_run(store, b)
            else:
                a, b = find_run(store, str(run_a)), find_run(store, str(run_b))
            lines = diff_lines(store, a, b, settings)
        finally:
            store.close()
    except (ValueError, HistoryError) as exc:
        print(f"preflight diff: error: {exc}", file=err)
        return 2
    out.write("\n".join(lines) + "\n")
    return 0


