"""Each run's results kept in a small SQLite store, each host's figures judged against its own past, and the
``preflight history`` / ``preflight diff`` commands that read them back.

A run records its id, time, preflight's version and commit, the hosts, every (host, check) status and every numeric
metric of the results, flattened: ``{"paths": [{"path": "/local_nvme", "write_Bps": 3.1e9}]}`` is the row
``(node07, nvme, "paths[/local_nvme].write_Bps", 3.1e9)``. A figure a check declares in ``SPEC.baseline`` is then
compared with the median of the same host's last healthy runs (no FAIL or ERROR, and not named itself), e.g.::

    node07 nvme paths[/local_nvme].write_Bps 1.9 GB/s is 61% of its median of the last 20 runs (3.1 GB/s);
    robust z -6.2, p < 1e-9

The store is one file (default ``~/.local/share/preflight/history.db``) in WAL mode with a busy timeout: gates and
node-checks may write it at once, each in one short transaction. A store that is corrupt, locked past the timeout or
unwritable never fails the gate: one warning line, and the run goes on without history.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import sqlite3
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, TextIO, Tuple

from preflight import __version__
from preflight.hostside.outcome import Status
from preflight.hostside.robust import MAX_P, MEDIAN_SE, p_text, p_value, robust_z, significant
from preflight.results import CLUSTER, display_host

ENV = "PREFLIGHT_HISTORY"  # a path, or "off": the store when neither --history nor --no-history is given
OFF_WORDS = ("off", "no", "none", "0", "false")
SECTION = "history"  # its thresholds' section in preflight/defaults.toml

# Bounds on what one result may put in the store: a host reports its metrics, and a run of 1,000 hosts must stay
# a few MB. Past them, the rest of that result's figures are not recorded.
MAX_METRICS_PER_RESULT = 256
MAX_KEY_CHARS = 200
MAX_DEPTH = 6
MAX_LIST_ITEMS = 64
MAX_MESSAGE_CHARS = 200
KEEP_MESSAGE = ("warn", "fail", "error")  # what `history` and `diff` print: why a cell was not clean; a pass or a
# skip (its reason repeats run after run) keeps its status alone
# What names an entry of a list of dicts in its flattened key, first found wins: a link by its ends, a path, a
# network, a GPU by index, an all-reduce size by its bytes. Else its position.
IDENTITY_KEYS = ("path", "network", "index", "bytes", "name", "device")
# Top-level metric keys that are not the check's own figures: the history's own verdicts and series, the findings.
NOT_RECORDED = ("baseline", "trend", "findings")
# metrics.trend keeps at most this many past values per figure, however many runs a baseline takes (the report's
# sparkline; a bounded payload).
TREND_POINTS = 50

# A run of a (host, check) counts toward its baseline when its cell neither failed nor errored, and none of its
# figures was named against its own past. Not "only when it passed": where a check WARNs on the same figure (nvme
# below min_write_gbps), the passing runs would be the fast ones, a baseline biased high that names normal runs.
HEALTHY = ("pass", "warn")
BAD = ("fail", "error")


# ------------------------------------------------------------------------------------------------ the schema

# Applied in order, each in the transaction that raises schema_version to its position: a store written by an
# older preflight is brought up to date when it is opened for writing; one written by a newer preflight is left
# alone (read-only commands still read it; a run goes on without history).
MIGRATIONS: Tuple[str, ...] = (
    # Hosts and metric names are stored once and referred to by number: a host's run is ~15 results and ~80
    # figures, and the names would be most of their bytes (docs/history.md has the measured size). The views give
    # the rows with their names, for reading.
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL UNIQUE,
        started REAL NOT NULL,
        kind TEXT NOT NULL,
        version TEXT,
        commit_id TEXT,
        hosts TEXT NOT NULL,
        exit_code INTEGER
    );
    CREATE INDEX runs_started ON runs (started);
    CREATE TABLE hosts (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
    CREATE TABLE names (id INTEGER PRIMARY KEY, check_name TEXT NOT NULL, key TEXT NOT NULL,
                        UNIQUE (check_name, key));
    CREATE TABLE results (
        host INTEGER NOT NULL,
        check_name TEXT NOT NULL,
        run INTEGER NOT NULL,
        status TEXT NOT NULL,
        context TEXT NOT NULL,
        message TEXT,
        drops INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (host, check_name, run)
    ) WITHOUT ROWID;
    CREATE TABLE metrics (
        host INTEGER NOT NULL,
        name INTEGER NOT NULL,
        run INTEGER NOT NULL,
        value REAL NOT NULL,
        PRIMARY KEY (host, name, run)
    ) WITHOUT ROWID;
    CREATE VIEW result_rows AS
        SELECT h.name AS host, r.check_name AS check_name, r.run AS run, r.status AS status, r.context AS context,
               r.message AS message
        FROM results r JOIN hosts h ON h.id = r.host;
    CREATE VIEW metric_rows AS
        SELECT h.name AS host, n.check_name AS check_name, n.key AS key, m.run AS run, m.value AS value
        FROM metrics m JOIN hosts h ON h.id = m.host JOIN names n ON n.id = m.name;
    """,
    # Issue 30: each non-pass cell's cause within its run (preflight.causes' id, "ssh:1"), and whether it is a
    # victim (blocked: it follows from another cell's fault); each run's number of FAIL/ERROR causes. `history`
    # and `diff` count causes, not cells: one unreachable host is one new cause, not 15 new failures.
    """
    ALTER TABLE results ADD COLUMN cause TEXT;
    ALTER TABLE results ADD COLUMN blocked INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE runs ADD COLUMN causes INTEGER;
    DROP VIEW result_rows;
    CREATE VIEW result_rows AS
        SELECT h.name AS host, r.check_name AS check_name, r.run AS run, r.status AS status, r.context AS context,
               r.message AS message, r.cause AS cause, r.blocked AS blocked
        FROM results r JOIN hosts h ON h.id = r.host;
    """,
)
CAUSES_SCHEMA = 2  # the first schema with results.cause, results.blocked and runs.causes
SCHEMA_VERSION = len(MIGRATIONS)


class HistoryError(Exception):
    """The store cannot be used: one line naming the file and what to do."""


def default_path() -> Path:
    """``$XDG_DATA_HOME/preflight/history.db``, else ``~/.local/share/preflight/history.db``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "preflight" / "history.db"


def choose_path(option: Optional[str], disabled: bool = False) -> Optional[Path]:
    """The store a run writes: None with --no-history (or PREFLIGHT_HISTORY=off), else --history, else
    PREFLIGHT_HISTORY, else the default."""
    if disabled:
        return None
    if option:
        return Path(option).expanduser()
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in OFF_WORDS or not env.strip() else Path(env).expanduser()
    return default_path()


@dataclass(frozen=True)
class Settings:
    """The ``[history]`` section: how many runs a baseline takes and how clear a drop must be."""

    runs: int = 20
    min_runs: int = 5
    max_p: float = MAX_P
    min_deficit: float = 0.1
    noise_floor: float = 0.02
    busy_timeout_s: float = 5.0
    z_threshold: float = 3.0

    @classmethod
    def from_thresholds(cls, thresholds: Mapping[str, Any]) -> "Settings":
        section = thresholds.get(SECTION) or {}
        base = cls()
        return cls(int(section.get("runs", base.runs)), int(section.get("min_runs", base.min_runs)),
                   float(section.get("max_p", base.max_p)), float(section.get("min_deficit", base.min_deficit)),
                   float(section.get("noise_floor", base.noise_floor)),
                   float(section.get("busy_timeout_s", base.busy_timeout_s)),
                   float(section.get("z_threshold", base.z_threshold)))


# ------------------------------------------------------------------------------------------------ flattening

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


def _pattern(key: str) -> "re.Pattern[str]":
    return re.compile("".join(".*" if part == "*" else re.escape(part) for part in re.split(r"(\*)", key)))


def declared(check: str) -> List[Tuple["re.Pattern[str]", str]]:
    """(pattern, "higher"/"lower") of the check's ``SPEC.baseline``; none for a name the registry does not have
    (the coordinator's own row, node-check's "preflight")."""
    from preflight import checks as registry
    if check not in registry.ORDER:
        return []
    return [(_pattern(k), v) for k, v in registry.spec(check).baseline.items()]


def direction(patterns: Sequence[Tuple["re.Pattern[str]", str]], key: str) -> Optional[str]:
    return next((d for p, d in patterns if p.fullmatch(key)), None)


# --------------------------------------------------------------------------------------------- what is judged

@dataclass
class Cell:
    """One (host, check) of a run as the history sees it. ``target`` is the report's object (a ``Result`` or an
    ``Outcome``: anything with status, message, fix and metrics), which a baseline WARN changes in place."""

    host: str
    check: str
    target: Any
    context: str = ""
    figures: List[Tuple[str, float]] = field(default_factory=list)
    drops: int = 0  # its figures named against its own past: this run is then no part of its next baselines
    cause: Optional[str] = None  # the id of its cause in the run (preflight.causes), for a cell that is no pass
    blocked: bool = False  # a victim: it follows from another cell's fault, counted in that one's cause


@dataclass(frozen=True)
class Drop:
    """A figure significantly worse than the host's own median: the WARN's numbers."""

    host: str
    check: str
    key: str
    better: str
    value: float
    median: float
    runs: int
    z: float
    p: float

    @property
    def ratio(self) -> float:
        return self.value / self.median

    def message(self, max_p: float = MAX_P) -> str:
        unit, scale = _unit(self.key)
        value, median = _num(self.value / scale, unit), _num(self.median / scale, unit)
        if self.better == "higher":
            how = f"is {100 * self.ratio:.0f}% of"
        else:
            how = f"is {self.ratio:.2g}x"
        runs = f"the last {self.runs} runs" if self.runs != 1 else "its last run"
        return (f"{display_host(self.host)} {self.check} {self.key} {value} {how} its median of {runs} ({median}); "
                f"robust z {self.z:+.1f}, {p_text(self.z, max_p)}")

    def fix(self) -> str:
        host = display_host(self.host)
        return (f"compare with its own past: preflight history {host} --check {self.check} (a disk, link or GPU that "
                "wears or was reconfigured drops against its own runs before it leaves the fleet's spread)")

    def to_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "value": self.value, "median": self.median, "runs": self.runs,
                "ratio": round(self.ratio, 4), "z": round(self.z, 2), "p": self.p, "better": self.better}


def _unit(key: str) -> Tuple[str, float]:
    """(unit, scale) a figure is printed in, from its key's suffix; ("", 1) where the suffix is ambiguous."""
    leaf = key.rsplit(".", 1)[-1]
    for suffix, unit, scale in (("_Bps", "GB/s", 1e9), ("_GBps", "GB/s", 1.0), ("_ms", "ms", 1.0),
                                ("_s", "s", 1.0), ("_tflops", "TFLOPS", 1.0), ("_gflops", "GFLOPS", 1.0)):
        if leaf.endswith(suffix):
            return unit, scale
    return "", 1.0


def _num(x: float, unit: str) -> str:
    return f"{x:.3g} {unit}" if unit else f"{x:.3g}"


def judge(value: float, past: Sequence[float], better: str, settings: Settings) -> Optional[Tuple[float, float, float]]:
    """(median, z, p) of value against the host's own past runs when it is significantly worse than their median
    (robust z beyond z_threshold, one-sided p < max_p) by at least min_deficit; else None. sigma is the past runs'
    robust spread (1.4826 x MAD), at least noise_floor x the median, widened by the median's own uncertainty over
    n runs (as the peer comparison's median of n links is)."""
    if len(past) < settings.min_runs:
        return None
    med, sigma, _ = robust_z(past, value, settings.noise_floor)
    if med <= 0:
        return None
    sigma *= math.sqrt(1.0 + MEDIAN_SE ** 2 / len(past))
    z = (value - med) / sigma
    worse = -z if better == "lower" else z  # negative: worse, whichever way is better
    deficit = (1.0 - value / med) if better == "higher" else (value / med - 1.0)
    if deficit < settings.min_deficit or worse > -settings.z_threshold or not significant(worse, settings.max_p):
        return None
    return med, z, p_value(z)


def trend(key: str, value: float, past: Sequence[float], better: str, flagged: bool,
          settings: Settings) -> Optional[Dict[str, Any]]:
    """The report's sparkline for one figure with a baseline: the past values (oldest first, at most TREND_POINTS),
    this run's value, the median and the band median +/- z_threshold robust sigmas (sigma as ``judge`` takes it);
    None below min_runs."""
    if len(past) < settings.min_runs:
        return None
    med, sigma, _ = robust_z(past, value, settings.noise_floor)
    sigma *= math.sqrt(1.0 + MEDIAN_SE ** 2 / len(past))
    def num(x: float) -> float:
        return float(f"{x:.6g}")
    return {"key": key, "value": num(value), "series": [num(x) for x in past[-TREND_POINTS:]], "median": num(med),
            "low": num(med - settings.z_threshold * sigma), "high": num(med + settings.z_threshold * sigma),
            "better": better, "flagged": flagged}


def apply_drops(cell: Cell, drops: Sequence[Drop], settings: Settings) -> None:
    """The cell gets each drop as a WARN finding: its status the worst of its own and WARN, the drops' lines
    before a passing cell's message (after a failing one's), the fix added, and the numbers in metrics.baseline."""
    if not drops:
        return
    target = cell.target
    lines = [d.message(settings.max_p) for d in drops]
    status = Status(target.status)
    if status.rank < Status.WARN.rank:
        target.message = "; ".join(lines + ([target.message] if target.message else []))
        target.status = Status.WARN
    else:
        target.message = "; ".join(([target.message] if target.message else []) + lines)
    fix = drops[0].fix()
    target.fix = "; ".join(x for x in (target.fix, fix) if x)
    target.metrics["baseline"] = [d.to_dict() for d in drops]


# ------------------------------------------------------------------------------------------------ the store

def _commit_id() -> Optional[str]:
    """The git commit preflight runs from, when it runs from a checkout (read from .git, no subprocess)."""
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:40] or None
        ref = head[5:]
        path = git / ref
        if path.is_file():
            return path.read_text().strip()[:40] or None
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:40]
    except OSError:
        pass
    return None


def new_run_id(now: Optional[float] = None) -> str:
    """``20250107-141503-3fa2``: sortable by time, and short to type. A thousand nodes' health checks in one second
    can draw one twice: ``Store.record`` draws again when the id is taken."""
    stamp = _dt.datetime.fromtimestamp(time.time() if now is None else now).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{uuid.uuid4().hex[:4]}"


def _why(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.rstrip(".")


class Store:
    """One open history file. Every method raises HistoryError, never sqlite3's or the OS's exceptions."""

    def __init__(self, path: Path, busy_timeout_s: float = 5.0, readonly: bool = False):
        self.path = path
        self.readonly = readonly
        if readonly and not path.is_file():
            raise HistoryError(f"{path}: no history there yet (a run records it; or pass --history PATH)")
        try:
            if readonly:
                self.db = sqlite3.connect(f"file:{_uri_path(path)}?mode=ro", uri=True, timeout=busy_timeout_s,
                                          isolation_level=None)
            else:
                if path.parent.exists() and not path.parent.is_dir():  # mkdir would only say "File exists"
                    raise HistoryError(f"{path}: {path.parent} is not a directory; pass --history PATH")
                path.parent.mkdir(parents=True, exist_ok=True)
                self.db = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise HistoryError(f"{path}: {_sqlite_why(exc)}") from None
        except OSError as exc:
            raise HistoryError(f"{path}: {_why(exc)}") from None
        try:
            self.db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            if not readonly:
                self._wal(busy_timeout_s)
                self.db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at each checkpoint, never corrupt
            self.version = self._migrate()
        except sqlite3.Error as exc:
            self.close()
            raise HistoryError(f"{path}: {_sqlite_why(exc)}") from None
        except HistoryError:
            self.close()
            raise

    def _wal(self, busy_timeout_s: float) -> None:
        # Switching a new file to WAL takes a lock that the busy handler does not always wait for: retry it
        # within the busy timeout (every writer of the file races here the first time).
        until = time.monotonic() + busy_timeout_s
        while True:
            try:
                self.db.execute("PRAGMA journal_mode = WAL").fetchone()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > until:
                    raise
                time.sleep(0.05)

    def _schema_version(self) -> int:
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" not in tables:
            if tables:
                found = ", ".join(sorted(tables))[:100]
                raise HistoryError(f"{self.path}: not a preflight history (it has tables {found}); move it away or "
                                   "pass --history PATH")
            return 0
        row = self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def _migrate(self) -> int:
        version = self._schema_version()
        if self.readonly:  # reading needs no migration: the tables it reads are the first schema's
            if version == 0:
                raise HistoryError(f"{self.path}: no history there yet (a run records it)")
            return version
        if version > SCHEMA_VERSION:
            raise HistoryError(f"{self.path}: written by a newer preflight (schema {version}; this one knows "
                               f"{SCHEMA_VERSION}); upgrade preflight or pass --history PATH")
        if version == SCHEMA_VERSION:
            return version
        self.db.execute("BEGIN IMMEDIATE")
        try:
            version = self._schema_version()  # another writer may have migrated it while this one waited
            if version == 0:
                self.db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            for number in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[number - 1].split(";"):
                    if statement.strip():
                        self.db.execute(statement)
                self.db.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return SCHEMA_VERSION

    def close(self) -> None:
        try:
            self.db.close()
        except sqlite3.Error:
            pass

    # -- reading --------------------------------------------------------------------------------------------
    def past(self, host: str, check: str, context: str, keys: Iterable[str], runs: int,
             before: Optional[int] = None) -> Dict[str, List[float]]:
        """{key: values} of the host's last ``runs`` healthy runs (HEALTHY) of the check in the same context (oldest
        first), before run row ``before`` if given."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        try:
            found = self.db.execute("SELECT id FROM hosts WHERE name = ?", (host,)).fetchone()
            if found is None:
                return {}
            host_id = found[0]
            ids = [r[0] for r in self.db.execute(
                "SELECT run FROM results WHERE host = ? AND check_name = ? AND context = ? AND status IN (?, ?) "
                "AND drops = 0 AND run < ? ORDER BY run DESC LIMIT ?",
                (host_id, check, context, *HEALTHY, before if before is not None else 2 ** 62, int(runs)))]
            if not ids:
                return {}
            out: Dict[str, List[float]] = {}
            marks = ",".join("?" * len(ids))
            for key in wanted:  # one key at a time: the primary key's prefix, not the host's whole history
                values = [float(v) for v, in self.db.execute(
                    "SELECT m.value FROM metrics m JOIN names n ON n.id = m.name WHERE n.check_name = ? "
                    f"AND n.key = ? AND m.host = ? AND m.run IN ({marks}) ORDER BY m.run",
                    (check, key, host_id, *ids))]
                if values:
                    out[key] = values
            return out
        except sqlite3.Error as exc:
            raise HistoryError(f"{self.path}: {_sqlite_why(exc)}") from None

    def query(self, sql: str, params: Sequence[Any] = ()) -> List[Tuple[Any, ...]]:
        try:
            return list(self.db.execute(sql, tuple(params)))
        except sqlite3.Error as exc:
            raise HistoryError(f"{self.path}: {_sqlite_why(exc)}") from None

    # -- writing --------------------------------------------------------------------------------------------
    def record(self, started: float, kind: str, hosts: Sequence[str], exit_code: Optional[int],
               cells: Sequence[Cell], causes: Optional[int] = None) -> str:
        """One run in one short transaction; its run id. ``causes``: its number of FAIL/ERROR causes."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for _ in range(8):  # inside the write lock: no other writer takes it between
                    run_id = new_run_id(started)
                    if not self.db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone():
                        break
                cur = self.db.execute(
                    "INSERT INTO runs (run_id, started, kind, version, commit_id, hosts, exit_code, causes) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, started, kind, __version__, _commit_id(), json.dumps(list(hosts)), exit_code, causes))
                row = int(cur.lastrowid or 0)
                hosts_ids = self._ids("hosts", ("name",), sorted({(c.host,) for c in cells}))
                name_ids = self._ids("names", ("check_name", "key"),
                                     sorted({(c.check, key) for c in cells for key, _ in c.figures}))
                self.db.executemany(
                    "INSERT OR REPLACE INTO results (host, check_name, run, status, context, message, drops, cause, "
                    "blocked) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(hosts_ids[(c.host,)], c.check, row, Status(c.target.status).value, c.context,
                      str(c.target.message)[:MAX_MESSAGE_CHARS] if Status(c.target.status).value in KEEP_MESSAGE
                      else None, c.drops, c.cause, int(c.blocked))
                     for c in cells])
                self.db.executemany(
                    "INSERT OR REPLACE INTO metrics (host, name, run, value) VALUES (?, ?, ?, ?)",
                    [(hosts_ids[(c.host,)], name_ids[(c.check, key)], row, value) for c in cells
                     for key, value in c.figures])
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return run_id
        except sqlite3.Error as exc:
            raise HistoryError(f"{self.path}: {_sqlite_why(exc)}") from None

    def _ids(self, table: str, columns: Tuple[str, ...],
             values: Sequence[Tuple[str, ...]]) -> Dict[Tuple[str, ...], int]:
        """{values: id} of a name table's rows, added where new (inside the caller's transaction)."""
        cols = ", ".join(columns)
        match = " AND ".join(f"{c} = ?" for c in columns)
        marks = ", ".join("?" * len(columns))
        self.db.executemany(f"INSERT OR IGNORE INTO {table} ({cols}) VALUES ({marks})", values)
        out = {}
        for v in values:
            out[v] = int(self.db.execute(f"SELECT id FROM {table} WHERE {match}", v).fetchone()[0])
        return out

    def prune(self, older_than: float) -> int:
        """Delete the runs started before ``older_than`` (unix time) with their results; how many."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                ids = [r[0] for r in self.db.execute("SELECT id FROM runs WHERE started < ?", (older_than,))]
                if ids:
                    self.db.execute("CREATE TEMP TABLE IF NOT EXISTS gone (id INTEGER PRIMARY KEY)")
                    self.db.execute("DELETE FROM gone")
                    self.db.executemany("INSERT INTO gone (id) VALUES (?)", [(i,) for i in ids])
                    for table in ("metrics", "results"):
                        self.db.execute(f"DELETE FROM {table} WHERE run IN (SELECT id FROM gone)")
                    self.db.execute("DELETE FROM runs WHERE id IN (SELECT id FROM gone)")
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            if ids:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self.db.execute("VACUUM")  # give the space back: pruning is when a site wants the file smaller
            return len(ids)
        except sqlite3.Error as exc:
            raise HistoryError(f"{self.path}: {_sqlite_why(exc)}") from None


def _uri_path(path: Path) -> str:
    from urllib.parse import quote
    return quote(str(path.resolve()))


def _sqlite_why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if "not a database" in text or "malformed" in text:
        return f"{text} (corrupt? move it away, or pass --history PATH or --no-history)"
    if "locked" in text or "busy" in text:
        return f"{text} (another preflight held it past the busy timeout, [history] busy_timeout_s)"
    if "readonly" in text or "unable to open" in text:
        return f"{text} (check the file's and its directory's permissions, or pass --history PATH)"
    return text


# ------------------------------------------------------------------------------------------------ a run's hook

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
        """Each cell's declared figures against the host's own past; a drop becomes a WARN on its cell."""
        if self.store is None:
            return []
        found: List[Drop] = []
        patterns = {c.check: declared(c.check) for c in cells}
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
                return found
            drops = []
            trends = []
            for key, value in cell.figures:
                better = directions.get(key)
                verdict = judge(value, past.get(key, []), better, self.settings) if better else None
                if verdict:
                    med, z, p = verdict
                    drops.append(Drop(cell.host, cell.check, key, str(better), value, med, len(past[key]), z, p))
                line = trend(key, value, past.get(key, []), str(better), bool(verdict), self.settings) \
                    if better else None
                if line:
                    trends.append(line)
            apply_drops(cell, drops, self.settings)
            metrics = getattr(cell.target, "metrics", None)
            if trends and isinstance(metrics, dict):  # metrics.trend: every compared figure, flagged or not
                metrics["trend"] = trends
            cell.drops = len(drops)
            found.extend(drops)
        return found

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


# --------------------------------------------------------------------------------------- history and diff

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
            _, sigma, _ = robust_z(spread if len(spread) >= settings.min_runs else [x], x, settings.noise_floor)
            z = (y - x) / sigma
            change = y / x - 1.0
            if abs(change) < settings.min_deficit or abs(z) < settings.z_threshold \
                    or not significant(-abs(z), settings.max_p):
                continue
            better = direction(patterns, key)
            worse = (change < 0) == (better == "higher")
            unit, scale = _unit(key)
            out.append(f"{display_host(host)}::{check} {key} {_num(x / scale, unit)} -> {_num(y / scale, unit)} "
                       f"({100 * change:+.0f}%, {'worse' if worse else 'better'}; z {z:+.1f})")
    return out


def history_lines(store: Store, host: Optional[str], check: Optional[str], since: Optional[float]) -> List[str]:
    """``preflight history``: the runs (no host), or one host's results over time, oldest first."""
    if host is None:
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
        text = "  ".join(f"{k} {_num(v / _unit(k)[1], _unit(k)[0])}" for k, v in shown[:8 if check else 4])
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

