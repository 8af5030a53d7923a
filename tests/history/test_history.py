"""The run history (preflight/history/): flattening, each host against its own past, the store's schema, migrations,
retention and concurrency, `preflight history` and `preflight diff`, and end to end on namespace hosts (iperf3 over
shaped links, a firewalled host fixed) and with real node-checks writing one store at once.

Every test names its own store (--history PATH): the suite turns the default store off (tests/conftest.py), so no
other test's runs become a baseline here, and none of these runs one elsewhere.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from preflight import history, render
from preflight.history import baseline
from preflight.hostside.outcome import Outcome, Status
from preflight.results import CLUSTER, HostRecord, Report, Result

REPO = Path(__file__).resolve().parents[2]
GB = 1e9


def cli(*args: str, env=None, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "preflight", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL, env=env)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def history_warnings(stderr: str) -> list:
    return [ln for ln in stderr.splitlines() if "history" in ln]


def rows(db: Path, sql: str):
    con = sqlite3.connect(str(db))
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


# ------------------------------------------------------------------------------------------------- flattening

def test_flatten_keeps_the_numbers_and_names_list_entries_by_what_they_are():
    metrics = {"paths": [{"path": "/local_nvme", "fstype": "xfs", "write_Bps": 3.1e9, "direct": True}],
               "links": [{"src": "node01", "dst": "node02", "gbps": 0.19, "error": None}],
               "devices": [{"device": "gpu", "index": 3, "gemm_tflops": 700}],
               "sizes": [{"bytes": 65536, "busbw_GBps": 0.5}], "plain": [1.5, 2.5],
               "nan": float("nan"), "inf": float("inf"), "ok": True, "text": "x",
               "findings": [{"status": "warn", "n": 1}], "baseline": [{"z": -6.0}]}
    flat = dict(history.flatten(metrics))
    assert flat == {"paths[/local_nvme].write_Bps": 3.1e9, "links[node01->node02].gbps": 0.19,
                    "devices[3].index": 3.0, "devices[3].gemm_tflops": 700.0, "sizes[65536].bytes": 65536.0,
                    "sizes[65536].busbw_GBps": 0.5, "plain[0]": 1.5, "plain[1]": 2.5}
    # Bounded: a host that reports a million numbers records MAX_METRICS_PER_RESULT of them.
    many = {"x": list(range(10)), "y": {str(i): i for i in range(1000)}}
    assert len(history.flatten(many)) == history.MAX_METRICS_PER_RESULT
    assert history.flatten({"deep": {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}}) == []
    assert history.flatten({"k" * 300: 1}) == []


def test_the_declared_figures_are_the_checks_own():
    nvme = history.declared("nvme")
    assert history.direction(nvme, "paths[/local_nvme].write_Bps") == "higher"
    assert history.direction(nvme, "paths[/local_nvme].free_bytes") is None
    assert history.direction(history.declared("iperf3"), "median_gbps") == "higher"
    assert history.direction(history.declared("iperf3"), "cluster_median_gbps") is None
    assert history.direction(history.declared("compute"), "devices[0].gemm_tflops") == "higher"
    assert history.direction(history.declared("compute"), "devices[0].gemm_tflops_noise") is None
    assert history.direction(history.declared("allreduce"), "busbw_GBps") == "higher"
    assert history.declared("coordinator") == [] and history.declared("memlock") == []


# ------------------------------------------------------------------------------------------------- judging

SETTINGS = history.Settings()


def test_a_drop_s_p_holds_on_simulated_pasts():
    """A healthy host's run against its own past (every run drawn from one normal distribution) gets p < a in at most
    a of the runs, for the p a WARN states: past spreads at 1x, 1.5x and 3x the noise floor, baselines of 5 to 20
    runs. The normal tail that z was read against before stated 0.001 where 0.5-4% of healthy runs got there."""
    import random
    rng = random.Random(7)
    floor = SETTINGS.noise_floor
    for n in (5, 8, 20):
        for k in (1.0, 1.5, 3.0):
            draws, hits, normal_hits = 20000, 0, 0
            for _ in range(draws):
                past = [rng.gauss(1.0, k * floor) for _ in range(n)]
                value = rng.gauss(1.0, k * floor)
                hits += baseline.one_sided_p(value, past, "higher", SETTINGS) < 1e-3
                med, sigma = baseline.spread(value, past, SETTINGS)
                normal_hits += 0.5 * math.erfc(-((value - med) / sigma) / math.sqrt(2)) < 1e-3
            # the p holds: at most a = 0.001 (a binomial allowance of 3 sd over 20,000 draws)
            assert hits <= draws * 1e-3 + 3 * math.sqrt(draws * 1e-3), (n, k, hits)
            if k == 3.0 and n <= 8:  # what the normal tail did: many times its stated rate
                assert normal_hits > 10 * draws * 1e-3, (n, k, normal_hits)


def test_judge_needs_a_significant_and_large_enough_drop():
    past = [3.10, 3.05, 3.12, 3.08, 3.11, 3.09, 3.13, 3.07]
    med, z, p = history.judge(1.9, past, "higher", SETTINGS)
    # z -17.7 against 8 runs: Student's t on history.past_df(8) = 3 df, p 0.0002 (the normal tail said < 1e-9)
    assert med == pytest.approx(3.095) and z < -6 and 1e-4 < p < 1e-3
    assert history.judge(2.9, past, "higher", SETTINGS) is None      # 6% lower: below min_deficit
    assert history.judge(4.5, past, "higher", SETTINGS) is None      # better
    assert history.judge(1.9, past[:4], "higher", SETTINGS) is None  # fewer than min_runs earlier runs
    # "lower" is better: a round trip 2.5x its median is the drop
    assert history.judge(2.5, [1.0, 1.02, 0.98, 1.01, 0.99], "lower", SETTINGS)[1] > 6
    assert history.judge(0.5, [1.0, 1.02, 0.98, 1.01, 0.99], "lower", SETTINGS) is None
    # A noisy past widens sigma: the same 35% drop is not significant against runs that spread +-40%
    noisy = [3.1, 1.8, 4.4, 2.2, 4.0, 2.5, 3.6]
    assert history.judge(2.0, noisy, "higher", SETTINGS) is None
    assert history.judge(0.0, [0.0] * 6, "higher", SETTINGS) is None  # nothing measured before
    # A shared disk's read rate here (GB/s, 8 node-checks in a row): 21% below its median is z -1.8, p = 0.09 against
    # 8 runs (the normal tail said 0.04). With a few dozen figures per host that happens by chance every few runs:
    # z_threshold (3) keeps it from being named, and so does its p alone.
    disk = [1.08, 0.74, 1.22, 1.1, 1.18, 1.01, 1.01, 0.95]
    assert history.judge(0.83, disk, "higher", SETTINGS) is None
    assert history.judge(0.83, disk, "higher", history.Settings(z_threshold=0)) is None
    assert 0.08 < baseline.one_sided_p(0.83, disk, "higher", SETTINGS) < 0.1


def nvme_report(host_rates, started, statuses=None):
    """A run's Report with one nvme result per host: {host: write GB/s}."""
    results = []
    for host, rate in host_rates.items():
        status = (statuses or {}).get(host, Status.PASS)
        results.append(Result(host, "nvme", status, f"/local_nvme: write {rate:.2f} GB/s", "",
                              {"paths": [{"path": "/local_nvme", "write_Bps": rate * GB, "read_Bps": 5 * GB}]}))
    results.append(Result(CLUSTER, "coordinator", Status.PASS, "ok", metrics={"fds": 10}))
    return Report(time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), 1.0,
                  [HostRecord(h, h, 1, True) for h in host_rates], results, ["ssh", "nvme"])


def test_a_host_below_its_own_past_warns_on_its_cell_and_the_reports_stay_valid(tmp_path):
    db = tmp_path / "h.db"
    t0 = time.time() - 3600
    for i in range(20):  # node07 at 3.1 GB/s +- 1%, node08 at 3.0 (the fleet's spread is wider than node07's drop)
        report = nvme_report({"node07": 3.1 * (1 + 0.01 * (i % 3 - 1)), "node08": 3.0 * (1 + 0.01 * (i % 2))}, t0 + i)
        assert history.record_report(report, {}, db) is not None
        assert not any("baseline" in r.metrics for r in report.results)
    assert rows(db, "SELECT COUNT(*) FROM runs") == [(20,)]
    report = nvme_report({"node07": 1.9, "node08": 1.2}, t0 + 30, statuses={"node08": Status.FAIL})
    warnings = []
    run_id = history.record_report(report, {}, db, warnings.append)
    assert warnings == [] and run_id
    cells = {r.host: r for r in report.results}
    node07 = cells["node07"]
    assert node07.status == Status.WARN
    assert re.match(r"node07 nvme paths\[/local_nvme\]\.write_Bps 1\.9 GB/s is 61% of its median of the last 20 runs "
                    r"\(3\.1 GB/s\); robust z -\d+\.\d, p = 5e-08 \(t, 7\.8 df\); adjusted p = 1e-07 over 4 figures \(Holm\); "
                    r"/local_nvme: write 1\.90 GB/s$", node07.message)
    assert "preflight history node07 --check nvme" in node07.fix
    (drop,) = node07.metrics["baseline"]
    assert drop["key"] == "paths[/local_nvme].write_Bps" and drop["runs"] == 20 and drop["z"] < -6
    # A FAIL stays the cell's status; the drop is added after its own message
    node08 = cells["node08"]
    assert node08.status == Status.FAIL and node08.message.startswith("/local_nvme: write 1.20 GB/s; node08 nvme ")
    assert cells[CLUSTER].status == Status.PASS and "baseline" not in cells[CLUSTER].metrics
    # The JSON and JUnit reports carry it, and stay valid
    data = json.loads(json.dumps(report.to_dict()))
    assert [r["status"] for r in data["results"]] == ["warn", "fail", "pass"]
    assert data["summary"]["warn"] == 1 and data["summary"]["exit_code"] == 1
    out = io.StringIO()
    render.get("junit").load()(report, out, render.Settings())
    root = ET.fromstring(out.getvalue())
    assert root.iter("testcase") and "61% of its median" in out.getvalue()
    # What was recorded: the statuses as reported, so the WARNed run is no part of node07's next baseline
    assert rows(db, "SELECT status FROM result_rows WHERE host = 'node07' ORDER BY run DESC LIMIT 1") == [("warn",)]
    again = nvme_report({"node07": 1.9, "node08": 3.0}, t0 + 40)
    history.record_report(again, {}, db)
    assert "last 20 runs (3.1 GB/s)" in {r.host: r for r in again.results}["node07"].message


def _steady(db, hosts, runs=10, rate=3.0, spread=0.01, t0=None):
    """runs earlier runs of nvme on hosts, each host at rate +- spread (its own past)."""
    t0 = t0 if t0 is not None else time.time() - 3600
    for i in range(runs):
        assert history.record_report(nvme_report({h: rate * (1 + spread * (i % 3 - 1)) for h in hosts}, t0 + i),
                                     {}, db) is not None
    return t0 + runs


def test_a_drop_of_the_whole_fleet_is_one_cause_on_the_cluster_row_and_a_host_below_it_is_named(tmp_path):
    db = tmp_path / "h.db"
    hosts = [f"node0{i}" for i in range(1, 7)]
    t = _steady(db, hosts)
    # Every host 20% below its own past (a slower machine room, a power cap): one WARN on the cluster row, which
    # names the hosts with their real values, and no host's cell; node06 also 50% below the rest is its own cause.
    rates = dict.fromkeys(hosts, 2.4)
    rates.update(node05=2.38, node06=1.2)
    report = nvme_report(rates, t + 1)
    history.record_report(report, {}, db)
    cells = {(r.host, r.check): r for r in report.results}
    assert all(cells[(h, "nvme")].status == Status.PASS for h in hosts[:5]), [cells[(h, "nvme")].message for h in hosts]
    fleet = cells[(CLUSTER, "nvme")]
    assert fleet.status == Status.WARN, fleet
    assert re.match(r"nvme paths\[/local_nvme\]\.write_Bps: the fleet dropped against its own past, the median host at "
                    r"80% of its median \(6 hosts compared; 6 significantly: node06 1\.2 GB/s of 3 GB/s, node05 2\.38 "
                    r"GB/s of 3 GB/s, node01 2\.4 GB/s of 3 GB/s, node02 2\.4 GB/s of 3 GB/s and 2 more\): one cause ",
                    fleet.message), fleet.message
    # The fix's command, as pasted (with this test's store): every host's figure against the run before
    assert fleet.fix.endswith("preflight diff --against last")
    proc = cli("diff", "--against", "last", "--history", str(db))
    assert proc.returncode == 0 and "node06::nvme paths[/local_nvme].write_Bps 2.97 GB/s -> 1.2 GB/s (-60%" in proc.stdout, \
        proc.stdout
    assert fleet.metrics["fleet_drift"][0]["factor"] == pytest.approx(0.8, abs=0.005)
    node06 = cells[("node06", "nvme")]
    assert node06.status == Status.WARN and "is 40% of its median of the last 10 runs (3 GB/s, 50% after the fleet's " \
        "common 80% is taken out)" in node06.message, node06.message
    # One line each in the causes, and the run recorded with both
    from preflight.causes import causes
    found = causes(report)
    assert sorted((c.hosts, c.status) for c in found) == [([CLUSTER], Status.WARN), (["node06"], Status.WARN)]


def test_the_cluster_rows_own_drop_with_its_fleets_is_one_line(tmp_path):
    """A cluster row whose own figure (the hosts' median) fell with every host's is the same cause as the fleet's
    drop: one sentence on that row, which says the cluster's figure too, and the cluster's figure is no fleet host."""
    db = tmp_path / "h.db"
    hosts = [f"node0{i}" for i in range(1, 7)]

    def report(rates, started):
        out = nvme_report(rates, started)
        median = statistics.median(rates.values())
        out.results.append(Result(CLUSTER, "nvme", Status.PASS, f"median write {median:.2f} GB/s", "",
                                  {"paths": [{"path": "/local_nvme", "write_Bps": median * GB}]}))
        return out

    t0 = time.time() - 3600
    for i in range(10):
        assert history.record_report(report({h: 3.0 * (1 + 0.01 * (i % 3 - 1)) for h in hosts}, t0 + i), {}, db)
    run = report(dict.fromkeys(hosts, 2.4), t0 + 20)
    history.record_report(run, {}, db)
    row = next(r for r in run.results if r.host == CLUSTER and r.check == "nvme")
    assert row.status == Status.WARN, row
    assert "(6 hosts compared; 6 significantly" in row.message, row.message
    assert ("and 2 more; the cluster's own paths[/local_nvme].write_Bps 2.4 GB/s is 80% of its median of the last 10 "
            "runs (3 GB/s)): one cause common to the hosts, not one per host; median write 2.40 GB/s") in row.message, \
        row.message
    assert "robust z" not in row.message and row.message.count("80% of its median") == 2, row.message
    assert row.metrics["baseline"][0]["ratio"] == pytest.approx(0.8, abs=0.01)
    from preflight.causes import causes
    assert [(c.hosts, c.status) for c in causes(run)] == [([CLUSTER], Status.WARN)]


def test_a_few_hosts_below_their_past_are_not_the_fleet(tmp_path):
    db = tmp_path / "h.db"
    hosts = [f"node0{i}" for i in range(1, 7)]
    t = _steady(db, hosts)
    report = nvme_report(dict(dict.fromkeys(hosts, 3.0), node01=2.0, node02=2.1), t + 1)
    history.record_report(report, {}, db)
    cells = {(r.host, r.check): r for r in report.results}
    assert [h for h in hosts if cells[(h, "nvme")].status == Status.WARN] == ["node01", "node02"]
    assert (CLUSTER, "nvme") not in cells and "after the fleet" not in cells[("node01", "nvme")].message
    # A fleet 1% lower than its past is within what one run measures differently from the next (noise_floor 2%):
    # nothing is taken out, nothing said of the fleet.
    report = nvme_report(dict(dict.fromkeys(hosts, 2.97), node01=2.0), t + 2)
    history.record_report(report, {}, db)
    node01 = next(r for r in report.results if r.host == "node01")
    assert node01.status == Status.WARN and "after the fleet" not in node01.message, node01.message
    assert node01.metrics["baseline"][0]["fleet"] == 1.0


def test_the_stated_p_holds_over_every_figure_compared_in_the_run(tmp_path):
    # A host 38% below a past of 10 runs that spreads +-4%: robust z -6.0, p 0.002 (Student's t, 3.8 df). Among 4
    # figures (2 hosts) that is named (adjusted p 0.009); among 80 figures (40 hosts, Holm) the same drop is what
    # chance gives somewhere in the run (adjusted p 0.18): not named.
    for n, named in ((2, True), (40, False)):
        db = tmp_path / f"h{n}.db"
        hosts = [f"node{i:02d}" for i in range(1, n + 1)]
        t = _steady(db, hosts, spread=0.04)
        report = nvme_report(dict(dict.fromkeys(hosts, 3.0), node01=1.85), t + 1)
        history.record_report(report, {}, db)
        node01 = next(r for r in report.results if r.host == "node01")
        assert (node01.status == Status.WARN) is named, (n, node01.message)
        if named:
            (drop,) = node01.metrics["baseline"]
            assert -6.1 < drop["z"] < -5.9 and drop["family"] == 2 * n and drop["p_adj"] < 0.05
            assert "robust z -6.0, p = 0.002 (t, 3.8 df); adjusted p = 0.009" in node01.message, node01.message
            assert f"over {2 * n} figures (Holm)" in node01.message
        trend = {t["key"]: t for t in node01.metrics["trend"]}["paths[/local_nvme].write_Bps"]
        assert trend["flagged"] is named


def test_a_baseline_is_of_comparable_runs_only(tmp_path):
    """Another test size ([nvme] settings) starts a new baseline; for a check across hosts, so do other hosts."""
    db = tmp_path / "h.db"
    t0 = time.time() - 3600
    for i in range(6):
        history.record_report(nvme_report({"node07": 3.1}, t0 + i), {"nvme": {"test_mib": 1024}}, db)
    slow = nvme_report({"node07": 1.5}, t0 + 10)
    history.record_report(slow, {"nvme": {"test_mib": 64}}, db)
    assert slow.results[0].status == Status.PASS
    a = history.context("iperf3", "node01", ["node01", "node02"], {})
    assert a != history.context("iperf3", "node01", ["node01", "node03"], {})
    assert history.context("nvme", "node01", ["node01"], {}) == history.context("nvme", "node01", ["node01", "x"], {})


# -------------------------------------------------------------------------------------------------- the store

def test_schema_has_a_version_and_later_migrations_apply_in_order(tmp_path, monkeypatch):
    db = tmp_path / "h.db"
    store = history.Store(db)
    store.close()
    current = history.SCHEMA_VERSION  # 2 since issue 30 (each cell's cause, blocked cells, each run's causes)
    assert rows(db, "SELECT version FROM schema_version") == [(v,) for v in range(1, current + 1)]
    assert rows(db, "PRAGMA journal_mode") == [("wal",)]
    history.record_report(nvme_report({"node01": 3.0}, time.time()), {}, db)
    # A later preflight adds a migration: the file is brought up to date when next opened, its runs kept
    monkeypatch.setattr(history.store, "MIGRATIONS", history.MIGRATIONS + ("ALTER TABLE runs ADD COLUMN note TEXT",))
    monkeypatch.setattr(history.store, "SCHEMA_VERSION", current + 1)
    history.Store(db).close()
    assert rows(db, "SELECT version FROM schema_version ORDER BY version") == [(v,) for v in range(1, current + 2)]
    assert rows(db, "SELECT COUNT(*), COUNT(note) FROM runs") == [(1, 0)]
    # ... and this preflight does not write a file a newer one migrated past it, but still reads it
    monkeypatch.setattr(history.store, "MIGRATIONS", history.MIGRATIONS[:current])
    monkeypatch.setattr(history.store, "SCHEMA_VERSION", current)
    with pytest.raises(history.HistoryError, match="written by a newer preflight"):
        history.Store(db)
    assert history.Store(db, readonly=True).version == current + 1


def test_a_file_of_something_else_is_left_alone(tmp_path):
    other = tmp_path / "other.db"
    con = sqlite3.connect(str(other))
    con.execute("CREATE TABLE mine (x)")
    con.commit()
    con.close()
    with pytest.raises(history.HistoryError, match="not a preflight history"):
        history.Store(other)
    assert rows(other, "SELECT name FROM sqlite_master") == [("mine",)]


WRITER = r"""
import sys, time
from preflight import history
from preflight.hostside.outcome import Outcome, Status
db, writer, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
while time.time() < float(sys.argv[4]):  # start together
    time.sleep(0.005)
for i in range(n):
    outcomes = [("nvme", Outcome(Status.PASS, "ok", metrics={"paths": [{"path": f"/p{k}", "write_Bps": 1e9 + i}
                                                                       for k in range(5)]})),
                ("memlock", Outcome(Status.PASS, "ok", metrics={"soft_kib": 64, "hard_kib": 64}))]
    warned = []
    run = history.record_outcomes(f"node{writer:02d}", outcomes, {}, history.Path(db), lambda: 0, warned.append)
    assert run and not warned, warned
"""


def test_parallel_writers_lose_nothing(tmp_path):
    """8 processes recording 25 runs each into one new file at the same moment: every row is there."""
    db = tmp_path / "h.db"
    start = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(w), "25", str(start)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for w in range(8)]
    errors = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _ in errors), errors
    assert rows(db, "SELECT COUNT(*) FROM runs") == [(200,)]
    assert rows(db, "SELECT COUNT(*) FROM results") == [(400,)]
    assert rows(db, "SELECT COUNT(*) FROM metrics") == [(200 * (5 + 2),)]
    assert rows(db, "SELECT COUNT(DISTINCT host) FROM results") == [(8,)]
    assert rows(db, "SELECT COUNT(*) FROM schema_version") == [(history.SCHEMA_VERSION,)]  # each migration once


def test_a_run_id_drawn_twice_is_drawn_again(tmp_path, monkeypatch):
    """A thousand nodes' health checks in one second share the id's time part: a taken id is drawn again."""
    db = tmp_path / "h.db"
    drawn = iter(["20250107-141503-3fa2", "20250107-141503-3fa2", "20250107-141503-77d0"])
    monkeypatch.setattr(history.store, "new_run_id", lambda started=None: next(drawn))
    first = history.record_report(nvme_report({"node01": 3.0}, time.time()), {}, db, pytest.fail)
    second = history.record_report(nvme_report({"node02": 3.0}, time.time()), {}, db, pytest.fail)
    assert (first, second) == ("20250107-141503-3fa2", "20250107-141503-77d0")


def test_prune_keeps_the_recent_runs_and_gives_the_space_back(tmp_path):
    db = tmp_path / "h.db"
    day = 86400
    now = time.time()
    for i in range(30):  # a run a day for 30 days, 50 hosts
        report = nvme_report({f"node{h:02d}": 3.0 for h in range(50)}, now - (29 - i) * day)
        history.record_report(report, {}, db)
    proc = cli("history", "--history", str(db), "--prune", "--keep", "10d")
    assert proc.returncode == 0, proc.stderr
    assert re.match(r"pruned 20 runs older than 10d from .*h\.db \(\d+ bytes -> \d+ bytes\)$", proc.stdout.strip())
    before, after = (int(x) for x in re.findall(r"(\d+) bytes", proc.stdout))
    assert after < before * 0.6
    assert rows(db, "SELECT COUNT(*) FROM runs") == [(10,)]
    assert rows(db, "SELECT COUNT(*) FROM results WHERE run NOT IN (SELECT id FROM runs)") == [(0,)]
    assert rows(db, "SELECT COUNT(*) FROM metrics WHERE run NOT IN (SELECT id FROM runs)") == [(0,)]
    assert rows(db, "SELECT COUNT(*) FROM metrics") == [(10 * (50 * 2 + 1),)]  # + the coordinator row's


def test_the_size_the_docs_state_is_measured(tmp_path):
    """docs/history.md states the store's bytes per host per run for a real default-checks run of 4 namespace hosts
    (tests/fixtures/history/run-4hosts.json, every result and figure of it) recorded 200 times: measured again here."""
    data = json.loads((REPO / "tests" / "fixtures" / "history" / "run-4hosts.json").read_text())
    db = tmp_path / "size.db"
    t0 = time.time() - 200 * 60
    for i in range(200):
        report = Report.from_dict(json.loads(json.dumps(data)))
        report.started_at = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0 + 60 * i))
        assert history.record_report(report, {}, db, pytest.fail)
    con = sqlite3.connect(str(db))
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    measured = db.stat().st_size / 200 / len(data["hosts"])
    stated = re.search(r"about ([\d.]+) KB per host per run", (REPO / "docs" / "history.md").read_text())
    assert stated, "docs/history.md must state the bytes per host per run"
    assert abs(measured / (float(stated.group(1)) * 1000) - 1) < 0.25, measured


# ------------------------------------------------------------------------------------------- history and diff

def test_history_and_diff_read_back_what_was_recorded(tmp_path):
    db = tmp_path / "h.db"
    t0 = time.time() - 3600
    for i in range(6):
        history.record_report(nvme_report({"node01": 3.1, "node02": 3.0}, t0 + i), {}, db)
    history.record_report(nvme_report({"node01": 3.1, "node02": 1.0}, t0 + 10, {"node02": Status.FAIL}), {}, db)
    history.record_report(nvme_report({"node01": 2.0, "node02": 3.0}, t0 + 20), {}, db)
    proc = cli("history", "--history", str(db))
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1 + 8, proc.stdout
    proc = cli("history", "node02", "--check", "nvme", "--history", str(db))
    lines = proc.stdout.splitlines()
    assert lines[0] == "node02: 8 runs" and len(lines) == 9
    assert "FAIL" in lines[7] and "paths[/local_nvme].write_Bps 1 GB/s" in lines[7] and "- /local_nvme" in lines[7]
    assert cli("history", "node02", "--since", "1s", "--history", str(db)).stdout.startswith("no results of node02")
    proc = cli("diff", "--against", "last", "--history", str(db))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "new causes: 0" in out and "fixed hosts: 1 (node02)" in out and "node02::nvme FAIL -> PASS" in out
    assert re.search(r"node01::nvme paths\[/local_nvme\]\.write_Bps 3\.1 GB/s -> 2 GB/s \(-35%, worse; z -\d+", out)
    ids = [r[0] for r in rows(db, "SELECT run_id FROM runs ORDER BY id")]
    proc = cli("diff", ids[5], ids[6], "--history", str(db))
    assert "new causes: 1" in proc.stdout and "node02::nvme FAIL (was PASS)" in proc.stdout
    assert "fixed hosts: 0" in proc.stdout


@pytest.mark.parametrize("args,wanted", [
    (["history", "--since", "7 parsecs"], "--since '7 parsecs' is not an age"),
    (["history", "--prune"], "--prune and --keep go together"),
    (["history", "node01", "--prune", "--keep", "9d"], "leave out HOST"),
    (["diff"], "name two runs"),
    (["diff", "a", "b", "--against", "last"], "name at most one run"),
    (["diff", "--against", "first"], "--against takes 'last'"),
    (["diff", "nosuchrun", "last"], "no run 'nosuchrun'"),
])
def test_bad_history_input_is_one_line_and_exit_2(tmp_path, args, wanted):
    db = tmp_path / "h.db"
    history.record_report(nvme_report({"node01": 3.0}, time.time()), {}, db)
    proc = cli(*args, "--history", str(db))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and wanted in proc.stderr, proc.stderr


def test_reading_a_store_that_is_not_there_is_exit_2_and_creates_nothing(tmp_path):
    db = tmp_path / "none.db"
    for args in (["history"], ["diff", "--against", "last"]):
        proc = cli(*args, "--history", str(db))
        assert proc.returncode == 2 and "no history there yet" in proc.stderr
    assert not db.exists()


# -------------------------------------------------------------------------------- node-check: the real thing

def node_check(*args: str, env=None) -> subprocess.CompletedProcess:
    return cli("node-check", "--checks", "memlock,libaio", *args, env=env, timeout=180)


def test_eight_node_checks_writing_one_store_at_once_all_succeed_and_lose_nothing(tmp_path):
    reference = tmp_path / "one.db"
    proc = node_check("--history", str(reference), "--node-name", "ref")
    assert proc.returncode == 0 and history_warnings(proc.stderr) == [], proc.stdout + proc.stderr
    per_run = rows(reference, "SELECT COUNT(*) FROM metrics")[0][0]
    assert per_run > 0
    db = tmp_path / "shared.db"
    procs = [subprocess.Popen([sys.executable, "-m", "preflight", "node-check", "--checks", "memlock,libaio",
                               "--history", str(db), "--node-name", f"node{i:02d}"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for i in range(8)]
    done = [(p.wait(timeout=180), p.stdout.read(), p.stderr.read()) for p in procs]
    for rc, out, err in done:
        assert rc == 0 and out.startswith("preflight: ok (2 checks"), out + err
        assert history_warnings(err) == [], err
    assert rows(db, "SELECT COUNT(*) FROM runs") == [(8,)]
    assert rows(db, "SELECT COUNT(*) FROM results") == [(16,)]
    assert rows(db, "SELECT COUNT(*) FROM metrics") == [(8 * per_run,)]
    assert rows(db, "SELECT COUNT(DISTINCT host), MIN(kind), MAX(kind) FROM results JOIN runs ON runs.id = run") == \
        [(8, "node-check", "node-check")]
    assert rows(db, "SELECT COUNT(*) FROM runs WHERE exit_code = 0 AND version IS NOT NULL") == [(8,)]


def test_a_corrupt_or_unwritable_store_never_fails_the_gate(tmp_path):
    corrupt = tmp_path / "corrupt.db"
    garbage = b"this is no database " + os.urandom(4096)
    corrupt.write_bytes(garbage)
    unwritable = Path("/dev/null/history.db")
    for where, wanted in ((corrupt, "file is not a database"), (unwritable, "/dev/null is not a directory")):
        proc = node_check("--history", str(where))
        assert proc.returncode == 0 and proc.stdout.startswith("preflight: ok (2 checks"), proc.stdout + proc.stderr
        warned = history_warnings(proc.stderr)
        assert len(warned) == 1 and wanted in warned[0] and "goes on without history" in warned[0], proc.stderr
        assert warned[0].startswith(f"preflight: warning: history: {where}: ")
    assert corrupt.read_bytes() == garbage  # the user's file is never overwritten
    proc = cli("run", "--python", sys.executable, "--checks", "memlock", "--history", str(corrupt), "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(history_warnings(proc.stderr)) == 1 and "file is not a database" in proc.stderr


def test_a_locked_store_never_fails_the_gate(tmp_path):
    db = tmp_path / "h.db"
    config = tmp_path / "fast.toml"
    config.write_text("[history]\nbusy_timeout_s = 0.5\n")
    assert node_check("--history", str(db)).returncode == 0
    holder = sqlite3.connect(str(db), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another writer that holds the file past the busy timeout
    try:
        proc = node_check("--history", str(db), "--config", str(config))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert proc.returncode == 0 and proc.stdout.startswith("preflight: ok"), proc.stdout + proc.stderr
    warned = history_warnings(proc.stderr)
    assert len(warned) == 1 and "database is locked" in warned[0], proc.stderr
    assert rows(db, "SELECT COUNT(*) FROM runs") == [(1,)]
    assert node_check("--history", str(db)).returncode == 0
    assert rows(db, "SELECT COUNT(*) FROM runs") == [(2,)]


def test_the_default_store_and_turning_it_off(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != history.ENV}
    env["XDG_DATA_HOME"] = str(tmp_path / "data")
    default = tmp_path / "data" / "preflight" / "history.db"
    assert node_check(env=env).returncode == 0
    assert rows(default, "SELECT COUNT(*) FROM runs") == [(1,)]
    assert node_check("--no-history", env=env).returncode == 0
    assert node_check(env=dict(env, **{history.ENV: "off"})).returncode == 0
    assert rows(default, "SELECT COUNT(*) FROM runs") == [(1,)]
    other = tmp_path / "env.db"
    assert node_check(env=dict(env, **{history.ENV: str(other)})).returncode == 0
    assert rows(other, "SELECT COUNT(*) FROM runs") == [(1,)]
    assert history.choose_path(None, disabled=True) is None
    assert history.choose_path("~/x.db") == Path("~/x.db").expanduser()


def test_node_check_warns_against_its_own_past(tmp_path):
    """The node's own figures, no peers: a node-check's outcomes judged and changed in place."""
    db = tmp_path / "h.db"
    for _ in range(5):
        outcomes = [("nvme", Outcome(Status.PASS, "ok", metrics={"paths": [{"path": "/x", "write_Bps": 2e9}]}))]
        history.record_outcomes("node01", outcomes, {}, db, lambda: 0)
    slow = Outcome(Status.PASS, "ok", metrics={"paths": [{"path": "/x", "write_Bps": 1e9}]})
    history.record_outcomes("node01", [("nvme", slow)], {}, db, lambda: 0)
    assert slow.status == Status.WARN and slow.message.startswith("node01 nvme paths[/x].write_Bps 1 GB/s is 50% of")


# ------------------------------------------------------------------------------ end to end: namespace hosts

netcluster = pytest.importorskip("tests.netcluster")
NetCluster = netcluster.NetCluster
needs_cluster = pytest.mark.skipif(NetCluster.unavailable_reason() is not None,
                                   reason=str(NetCluster.unavailable_reason()))
RATE = 200  # Mbit/s on every host's link: every run measures the same shaped rate
# A site whose fleet comparison tolerates a host down to 50% of the others (and 1 s iperf3 tests, one extra round
# so that every pair of 4 hosts is measured): a host at 70% is within the fleet's spread, and only its own past
# names it.
CONFIG = """
[iperf3]
duration_s = 1
extra_rounds = 2
straggler_warn_fraction = 0.5
straggler_fail_fraction = 0.4
min_deficit = 0.5
"""


@pytest.fixture(scope="module")
def cluster4():
    if NetCluster.unavailable_reason():
        pytest.skip(NetCluster.unavailable_reason())
    with NetCluster(4) as c:
        for h in c.hosts:
            c.shape(h, RATE)
        yield c


def cluster_run(cluster, tmp_path, db, checks, n):
    out = tmp_path / f"run{n}.json"
    config = tmp_path / "site.toml"
    config.write_text(CONFIG)
    proc = cli("run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")), "--python", sys.executable,
               "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
               "--known-hosts", str(cluster.known_hosts), "--checks", checks, "--config", str(config),
               "--history", str(db), "--json", str(out), "-q")
    assert out.exists(), proc.stdout + proc.stderr
    assert history_warnings(proc.stderr) == [], proc.stderr
    return proc, json.loads(out.read_text())


@needs_cluster
def test_a_host_shaped_to_70_percent_is_named_against_its_own_past(cluster4, tmp_path):
    db = tmp_path / "h.db"
    for n in range(8):  # healthy: every run measures the same shaped links, and nobody is named
        proc, report = cluster_run(cluster4, tmp_path, db, "iperf3", n)
        assert proc.returncode == 0, proc.stdout
        iperf = [r for r in report["results"] if r["check"] == "iperf3"]
        assert len(iperf) == 5 and all(r["status"] == "pass" for r in iperf), [r["message"] for r in iperf]
        assert not [r for r in report["results"] if "baseline" in r["metrics"] or "its median of the" in r["message"]]
    cluster4.shape("node03", RATE * 0.7)
    try:
        proc, report = cluster_run(cluster4, tmp_path, db, "iperf3", 8)
    finally:
        cluster4.shape("node03", RATE)
    cells = {r["host"]: r for r in report["results"] if r["check"] == "iperf3"}
    node03 = cells["node03"]
    assert node03["status"] == "warn" and proc.returncode == 0, node03["message"]
    m = re.match(r"node03 iperf3 median_gbps (\S+) is (\d+)% of its median of the last 8 runs \((\S+)\); "
                 r"robust z (-\d+\.\d), p ", node03["message"])
    assert m, node03["message"]
    assert 60 <= int(m.group(2)) <= 80 and float(m.group(4)) < -5
    assert node03["metrics"].get("detected_by") is None  # the fleet's comparison did not name it: its past did
    for host in ("node01", "node02", "node04"):
        assert cells[host]["status"] == "pass" and "baseline" not in cells[host]["metrics"], cells[host]["message"]
    proc = cli("history", "node03", "--check", "iperf3", "--history", str(db))
    assert proc.stdout.splitlines()[0] == "node03: 9 runs" and "WARN" in proc.stdout.splitlines()[-1]
    proc = cli("diff", "--against", "last", "--history", str(db))
    assert re.search(r"node03::iperf3 median_gbps \S+ -> \S+ \(-\d+%, worse; z -\d", proc.stdout), proc.stdout


@needs_cluster
def test_diff_against_last_lists_a_fixed_host(cluster4, tmp_path):
    db = tmp_path / "h.db"
    cluster4.firewall("node04")  # inbound TCP above 1023 dropped: ports FAILs on node04
    try:
        proc, report = cluster_run(cluster4, tmp_path, db, "ports", 0)
    finally:
        cluster4.unfirewall("node04")
    assert proc.returncode == 1
    assert {r["host"]: r["status"] for r in report["results"] if r["check"] == "ports"}["node04"] == "fail"
    proc, report = cluster_run(cluster4, tmp_path, db, "ports", 1)
    assert proc.returncode == 0, proc.stdout
    proc = cli("diff", "--against", "last", "--history", str(db))
    assert proc.returncode == 0, proc.stderr
    assert "new causes: 0" in proc.stdout and "fixed hosts: 1 (node04)" in proc.stdout, proc.stdout
    assert "node04::ports FAIL -> PASS" in proc.stdout
