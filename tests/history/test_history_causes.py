"""History and diff count causes (issue 30 item 8): one unreachable host is one new cause, not a new failure per
cell it blocked; `history` lists each run's causes and its blocked cells apart; a victim's cell reads BLOCKED.
A real SQLite store (--history PATH) and the real CLI, on reports built in memory (tests/verdict/test_verdict.py's 6 hosts).
"""
from __future__ import annotations

import sqlite3
import time

from preflight import history
from preflight.hostside.outcome import BlockedBy, Outcome, Status
from preflight.results import Result
from tests.history.test_history import cli, rows
from tests.verdict.test_verdict import cluster_report


def test_diff_against_last_after_one_unreachable_host_is_one_new_cause(tmp_path):
    db = tmp_path / "h.db"
    t0 = time.time() - 3600
    healthy = cluster_report(6)
    healthy.started_at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0))
    history.record_report(healthy, {}, db)
    down = cluster_report(6, down=["node03"])
    down.started_at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0 + 60))
    history.record_report(down, {}, db)
    failed_cells = sum(1 for r in down.results if r.status in (Status.FAIL, Status.ERROR))
    blocked = down.counts()["blocked"]
    assert failed_cells == 8 and blocked == 6  # ssh ERROR, launcher_ssh FAIL, 6 blocked cells
    proc = cli("diff", "--against", "last", "--history", str(db))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == f"new causes: 1 ({failed_cells} failed cells, {blocked} of them blocked)", proc.stdout
    assert lines[2].startswith("  node03::ssh ERROR (was PASS) - connection to 198.18.0.3:22 refused")
    assert lines[2].endswith(f"(also launcher_ssh; and {blocked} blocked cells)") and lines[3] == "fixed hosts: 0", proc.stdout
    # `history` lists the causes, and the failed cells with the blocked ones apart.
    runs = cli("history", "--history", str(db)).stdout.splitlines()
    assert runs[0].split()[-3:] == ["causes", "failed", "cells"]
    assert runs[1].split()[-2:] == ["0", "0"] and runs[2].split()[-4:] == ["1", "8", "(6", "blocked)"], runs
    assert rows(db, "SELECT causes FROM runs ORDER BY id") == [(0,), (1,)]
    node03 = cli("history", "node03", "--history", str(db)).stdout.splitlines()
    assert sum("BLOCKED" in ln for ln in node03) == 6 and sum(" ERROR " in ln for ln in node03) == 1, node03
    # And the host back: its one cause is fixed, with its victims.
    again = cluster_report(6)
    again.started_at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0 + 120))
    history.record_report(again, {}, db)
    out = cli("diff", "--against", "last", "--history", str(db)).stdout.splitlines()
    assert out[1] == "new causes: 0" and out[2] == "fixed hosts: 1 (node03)"
    assert out[3] == "  node03::ssh ERROR -> PASS (also launcher_ssh; and 6 blocked cells)", out


def test_a_victim_of_another_host_is_recorded_blocked_under_that_hosts_cause(tmp_path):
    db = tmp_path / "h.db"
    report = cluster_report(3, extra=[
        Result("node02", "ports", Status.FAIL, "inbound TCP to node02:40000 blocked", "allow TCP"),
        Result.from_outcome("*", "allreduce", Outcome(Status.FAIL, "rank 1 timed out",
                                                      blocked_by=BlockedBy("node02", "ports")))])
    history.record_report(report, {}, db)
    assert rows(db, "SELECT host, check_name, status, cause, blocked FROM result_rows WHERE status != 'pass' "
                    "ORDER BY host") == [("*", "allreduce", "fail", "ports:1", 1), ("node02", "ports", "fail",
                                                                                     "ports:1", 0)]


def test_a_store_written_before_causes_is_read_cell_by_cell(tmp_path):
    """Schema 1 (no cause, no blocked): `diff` and `history` still read it, each failed cell a cause."""
    db = tmp_path / "old.db"
    con = sqlite3.connect(str(db))
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in history.MIGRATIONS[0].split(";"):
        if statement.strip():
            con.execute(statement)
    con.execute("INSERT INTO schema_version VALUES (1)")
    con.execute("INSERT INTO hosts (id, name) VALUES (1, 'node01')")
    for run, status in ((1, "pass"), (2, "fail")):
        con.execute("INSERT INTO runs (id, run_id, started, kind, hosts, exit_code) VALUES (?, ?, ?, 'run', "
                    "'[\"node01\"]', 0)", (run, f"r{run}", time.time() - 100 + run))
        con.execute("INSERT INTO results (host, check_name, run, status, context, message) VALUES (1, 'nvme', ?, ?, "
                    "'x', ?)", (run, status, "slow" if status == "fail" else None))
    con.commit()
    con.close()
    proc = cli("diff", "--against", "last", "--history", str(db))
    assert proc.returncode == 0 and "new causes: 1" in proc.stdout and "node01::nvme FAIL (was PASS) - slow" in \
        proc.stdout, proc.stdout + proc.stderr
    listed = cli("history", "--history", str(db)).stdout.splitlines()
    assert listed[2].split()[-2:] == ["?", "1"], listed  # its causes were not recorded: "?"
