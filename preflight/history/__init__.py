"""Each run's results kept in a small SQLite store, each host's figures judged against its own past, and the
``preflight history`` / ``preflight diff`` commands that read them back.

A run records its id, time, preflight's version and commit, the hosts, every (host, check) status and every numeric
metric of the results, flattened: ``{"paths": [{"path": "/local_nvme", "write_Bps": 3.1e9}]}`` is the row
``(node07, nvme, "paths[/local_nvme].write_Bps", 3.1e9)``. A figure a check declares in ``SPEC.baseline`` is then
compared with the median of the same host's last healthy runs (no FAIL or ERROR, and not named itself), e.g.::

    node07 nvme paths[/local_nvme].write_Bps 1.9 GB/s is 61% of its median of the last 20 runs (3.1 GB/s);
    robust z -6.2, p = 0.0001 (t, 7.8 df)

The store is one file (default ``~/.local/share/preflight/history.db``) in WAL mode with a busy timeout: gates and
node-checks may write it at once, each in one short transaction. A store that is corrupt, locked past the timeout or
unwritable never fails the gate: one warning line, and the run goes on without history.

The package: ``store`` (the SQLite file, its schema and migrations), ``baseline`` (the statistics), ``record`` (a
run's hook) and ``commands`` (``preflight history`` and ``preflight diff``). The names callers use are here.
"""
from __future__ import annotations

from pathlib import Path

from preflight.history.baseline import (SECTION, TREND_POINTS, Cell, Drop, Settings, apply_drops, declared,
                                        direction, judge, trend)
from preflight.history.commands import (Recorded, Run, diff_lines, find_run, history_lines, main_diff, main_history,
                                        parse_age, previous_run, runs, size_line)
from preflight.history.record import (MAX_DEPTH, MAX_KEY_CHARS, MAX_LIST_ITEMS, MAX_METRICS_PER_RESULT, Recorder,
                                      context, flatten, record_outcomes, record_report)
from preflight.history.store import (BAD, CAUSES_SCHEMA, ENV, HEALTHY, KEEP_MESSAGE, MAX_MESSAGE_CHARS, MIGRATIONS,
                                     OFF_WORDS, SCHEMA_VERSION, HistoryError, Store, choose_path, default_path,
                                     new_run_id)

__all__ = [
    "BAD", "CAUSES_SCHEMA", "ENV", "HEALTHY", "KEEP_MESSAGE", "MAX_DEPTH", "MAX_KEY_CHARS", "MAX_LIST_ITEMS",
    "MAX_MESSAGE_CHARS", "MAX_METRICS_PER_RESULT", "MIGRATIONS", "OFF_WORDS", "SCHEMA_VERSION", "SECTION",
    "TREND_POINTS", "Cell", "Drop", "HistoryError", "Path", "Recorded", "Recorder", "Run", "Settings", "Store",
    "apply_drops", "choose_path", "context", "declared", "default_path", "diff_lines", "direction", "find_run",
    "flatten", "history_lines", "judge", "main_diff", "main_history", "new_run_id", "parse_age", "previous_run",
    "record_outcomes", "record_report", "runs", "size_line", "trend",
]
