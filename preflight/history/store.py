"""The history's SQLite file: where it is, its schema and migrations, and one run's rows written and read back in
short transactions, e.g. the row ``(node07, nvme, run 12, "paths[/local_nvme].write_Bps", 3.1e9)``.

Every ``Store`` method raises ``HistoryError`` (one line naming the file and what to do), never sqlite3's or the OS's
exceptions.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

from preflight import __version__
from preflight.hostside.outcome import Status

if TYPE_CHECKING:
    from preflight.history.baseline import Cell

ENV = "PREFLIGHT_HISTORY"  # a path, or "off": the store when neither --history nor --no-history is given
OFF_WORDS = ("off", "no", "none", "0", "false")

MAX_MESSAGE_CHARS = 200
KEEP_MESSAGE = ("warn", "fail", "error")  # what `history` and `diff` print: why a cell was not clean; a pass or a
# skip (its reason repeats run after run) keeps its status alone

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



# ------------------------------------------------------------------------------------------------ the store

def _commit_id() -> Optional[str]:
    """The git commit preflight runs from, when it runs from a checkout (read from .git, no subprocess)."""
    git = Path(__file__).resolve().parents[2] / ".git"
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
