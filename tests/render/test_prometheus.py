"""Prometheus metrics (--prom-textfile): the text format read back by prometheus_client's parser from a report with
hostile host names and messages, the atomic replace, the CLI's options, and the real parts: Debian's node_exporter
(textfile collector) scraped every second by Debian's Prometheus, queried over its HTTP API after
``preflight node-check --prom-textfile``. Both daemons listen on 127.0.0.1 only, and the test stops them itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from preflight import render
from preflight.hostside.outcome import Status
from preflight.hostside.seams import PromSample
from preflight.render import prometheus
from preflight.results import CLUSTER, HostRecord, Report, Result

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "prometheus.md"
STATUS = {"pass": 0, "warn": 1, "fail": 2, "error": 3, "skip": 4}
WORDS = {"PASSED": 0, "WARNED": 1, "FAILED": 2, "ERROR": 3, "SKIPPED": 4}
# Host names a hostfile never yields, but a report read back from JSON or a lying host may carry; each is written
# as itself except what the format cannot carry (a lone surrogate, a tab), which becomes U+FFFD.
HOSTILE = {'node"01': 'node"01', "back\\slash": "back\\slash", "new\nline": "new\nline",
           "bad\udcffbyte": "bad\ufffdbyte", "tab\there": "tab\ufffdhere", "nöde-ü": "nöde-ü",
           'a,b="c"}{': 'a,b="c"}{', "# TYPE x counter": "# TYPE x counter"}
EVIL_MESSAGE = 'ok"}\npreflight_check_status{host="x",check="y"} 99\n# TYPE preflight_check_status counter\\'
EVIL_PATH = '/mnt/"x"\\\ny'


def _hostile_report() -> Report:
    hosts = list(HOSTILE)
    results: List[Result] = []
    for i, h in enumerate(hosts):
        results.append(Result(h, "ssh", Status.PASS, EVIL_MESSAGE, metrics={"connect_s": 0.25, "rtt_ms": 1.5 + i},
                              duration_s=0.25))
        results.append(Result(h, "nvme", Status.WARN, EVIL_MESSAGE, "fix\n\"it\"", duration_s=3.5, metrics={
            "paths": [{"path": EVIL_PATH, "write_Bps": 1.5e9 + i, "read_Bps": 2.5e9, "direct": True},
                      {"path": "/unmeasured", "write_Bps": None}]}))
        results.append(Result(h, "compute", Status.FAIL if i == 0 else Status.PASS, EVIL_MESSAGE, metrics={
            "devices": [{"device": "gpu", "index": g, "gemm_tflops": 700.0 + g, "hbm_gbps": 3000.0,
                         "h2d_gbps": 50.0, "d2h_gbps": 49.5} for g in range(2)]}))
        results.append(Result(h, "libaio", Status.ERROR, "blocked: " + EVIL_MESSAGE, blocked_by="ssh"))
        results.append(Result(h, "gpu", Status.SKIP, EVIL_MESSAGE))
        results.append(Result(h, "clock", Status.PASS, EVIL_MESSAGE,
                              metrics={"offset_s": -0.002 * i, "uncertainty_s": 0.0005}))
    links = [{"src": hosts[0], "dst": hosts[1], "gbps": 9.4, "retransmits": 0, "error": None},
             {"src": hosts[1], "dst": hosts[0], "gbps": 9.1, "retransmits": 3, "error": None},
             {"src": hosts[2], "dst": hosts[0], "gbps": None, "error": "connection refused"}]
    results.append(Result(hosts[0], "iperf3", Status.PASS, EVIL_MESSAGE, metrics={"links": links[:3]}))
    results.append(Result(hosts[1], "iperf3", Status.WARN, EVIL_MESSAGE, metrics={"links": links[:2]}))
    results.append(Result(CLUSTER, "iperf3", Status.PASS, EVIL_MESSAGE, metrics={"median_gbps": 9.25}))
    results.append(Result(CLUSTER, "allreduce", Status.PASS, EVIL_MESSAGE, metrics={
        "busbw_GBps": 11.5, "algbw_GBps": 6.75,
        "stragglers": {"hosts": {hosts[0]: {"busbw_GBps": 10.0}, hosts[1]: {"busbw_GBps": 4.5}}}}))
    results.append(Result(CLUSTER, "clock", Status.PASS, EVIL_MESSAGE, metrics={"spread_s": 0.014}))
    return Report("2026-11-23T10:00:00+00:00", 42.5, [HostRecord(h, h, 8, True) for h in hosts], results,
                  ["ssh", "nvme", "compute", "libaio", "gpu", "clock", "iperf3", "allreduce"])


def _samples(text: str) -> Dict[Tuple[str, frozenset], float]:
    """{(metric, labels): value} as prometheus_client's parser reads the text; every family a documented gauge."""
    out: Dict[Tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge" and family.documentation, family
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, key  # one series once
            out[key] = s.value
    return out


def _key(name: str, **labels: str) -> Tuple[str, frozenset]:
    return name, frozenset(labels.items())


def test_a_hostile_report_parses_back_to_exactly_its_results_and_figures():
    report = _hostile_report()
    text = prometheus.render(report)
    samples = _samples(text)
    # One status per result, no more: the messages, fixes and paths inject no sample, HELP or TYPE line.
    status = {k: v for k, v in samples.items() if k[0] == "preflight_check_status"}
    assert len(status) == len(report.results)
    assert sum(line.startswith("preflight_check_status{") for line in text.splitlines()) == len(report.results)
    assert [line for line in text.splitlines() if line.startswith("# TYPE preflight_check_status")] == \
        ["# TYPE preflight_check_status gauge"]
    assert 99 not in status.values() and all(line.startswith(("# ", "preflight_")) for line in text.splitlines())
    for r in report.results:
        host = "cluster" if r.host == CLUSTER else HOSTILE[r.host]
        assert status[_key("preflight_check_status", host=host, check=r.check)] == STATUS[r.status.value], r
    # A blocked cell is an error, and has no duration; the measured ones do.
    first = HOSTILE[next(iter(HOSTILE))]
    assert status[_key("preflight_check_status", host=first, check="libaio")] == 3
    assert samples[_key("preflight_check_duration_seconds", host=first, check="nvme")] == 3.5
    assert _key("preflight_check_duration_seconds", host=first, check="libaio") not in samples
    assert samples[_key("preflight_last_run_timestamp_seconds", command="run")] == 1795428000.0 + 42.5
    # Each check's figures, units in the names; the path is itself after the round trip.
    for i, host in enumerate(HOSTILE.values()):
        assert samples[_key("preflight_nvme_write_bytes_per_second", host=host, path=EVIL_PATH)] == 1.5e9 + i
        assert samples[_key("preflight_nvme_read_bytes_per_second", host=host, path=EVIL_PATH)] == 2.5e9
        assert samples[_key("preflight_ssh_rtt_seconds", host=host)] == pytest.approx((1.5 + i) / 1000)
        assert samples[_key("preflight_ssh_connect_seconds", host=host)] == 0.25
        assert samples[_key("preflight_compute_tflops", host=host, gpu="1")] == 701.0
        assert samples[_key("preflight_compute_hbm_bytes_per_second", host=host, gpu="0")] == 3e12
        assert samples[_key("preflight_clock_offset_seconds", host=host)] == pytest.approx(-0.002 * i)
    assert not [k for k in samples if k[0].startswith("preflight_nvme") and ("path", "/unmeasured") in k[1]]
    hosts = list(HOSTILE.values())
    iperf3 = {k: v for k, v in samples.items() if k[0] == "preflight_iperf3_bits_per_second"}
    assert iperf3 == {_key("preflight_iperf3_bits_per_second", src=hosts[0], dst=hosts[1]): 9.4e9,
                      _key("preflight_iperf3_bits_per_second", src=hosts[1], dst=hosts[0]): 9.1e9}
    assert samples[_key("preflight_allreduce_busbw_gigabytes_per_second")] == 11.5
    assert samples[_key("preflight_allreduce_algbw_gigabytes_per_second")] == 6.75
    assert samples[_key("preflight_allreduce_pair_busbw_gigabytes_per_second", host=hosts[1])] == 4.5
    assert samples[_key("preflight_clock_spread_seconds")] == 0.014


def test_a_checks_bad_samples_and_a_checks_exception_cost_only_those_figures(monkeypatch):
    from preflight.checks import clock, nvme

    def bad(results):
        return [PromSample("not a name", "h", "gauge", {}, 1.0),
                PromSample("preflight_x", "h", "gauge", {"__reserved": "v"}, 1.0),
                PromSample("preflight_x", "h", "gauge", {"bad-label": "v"}, 1.0),
                PromSample("preflight_x", "h", "gauge", {}, "12"),
                PromSample("preflight_x", "h", "summary", {}, 1.0),
                PromSample("node_load1", "h", "gauge", {}, 1.0),  # not preflight's to write
                PromSample("preflight_x", "first", "gauge", {"host": "a"}, 1.0),
                PromSample("preflight_x", "second", "gauge", {"host": "a"}, 2.0),  # the same series again
                PromSample("preflight_x", "h", "counter", {"host": "b"}, 3.0),  # another type for the family
                PromSample("preflight_y", "h", "gauge", {}, float("nan")),
                PromSample("preflight_z", "h", "gauge", {}, float("-inf"))]

    def boom(results):
        raise KeyError("metrics\nfield")

    monkeypatch.setattr(nvme, "SPEC", dataclasses.replace(nvme.SPEC, prom_metrics=bad))
    monkeypatch.setattr(clock, "SPEC", dataclasses.replace(clock.SPEC, prom_metrics=boom))
    text = prometheus.render(_hostile_report())
    samples = _samples(text)
    assert samples[_key("preflight_x", host="a")] == 1.0 and len([k for k in samples if k[0] == "preflight_x"]) == 1
    nan = samples[_key("preflight_y")]
    assert samples[_key("preflight_z")] == float("-inf") and nan != nan
    assert "# HELP preflight_x first" in text.splitlines()
    assert not [k for k in samples if k[0].startswith(("preflight_clock", "node_"))]
    comments = [line for line in text.splitlines() if line.startswith("# preflight: ")]
    assert len(comments) == 9, comments  # 7 bad or repeated samples, 1 type clash, clock's exception
    assert any("clock: its metrics were left out: KeyError" in c for c in comments)
    assert all(c.isascii() and c.isprintable() for c in comments)
    assert len([k for k in samples if k[0] == "preflight_check_status"]) == len(_hostile_report().results)


def _writer(text: str):
    return lambda fh: fh.write(text)


def test_the_file_is_replaced_by_a_rename_with_the_old_mode_and_no_temporary_file_left(tmp_path):
    target = tmp_path / "preflight.prom"
    old_mask = os.umask(0o027)
    try:
        render.write_atomic(str(target), _writer("first\n"))
    finally:
        os.umask(old_mask)
    assert target.read_text() == "first\n" and stat.S_IMODE(target.stat().st_mode) == 0o640  # 0666 less the umask
    target.chmod(0o604)
    with open(target) as reader:  # a collector in the middle of reading the old file
        render.write_atomic(str(target), _writer("second\n"))
        assert reader.read() == "first\n"  # renamed over, not truncated in place
    assert target.read_text() == "second\n" and stat.S_IMODE(target.stat().st_mode) == 0o604
    assert os.listdir(tmp_path) == ["preflight.prom"]
    # The registry's renderer (run's --prom-textfile, the plugin's) writes the same way.
    with open(target) as reader:
        render.get("prometheus").to_path(_hostile_report(), str(target))
        assert reader.read() == "second\n"
    assert target.read_text() == prometheus.render(_hostile_report()) and os.listdir(tmp_path) == ["preflight.prom"]
    target.write_text("second\n")

    def fails(fh):
        fh.write("half")
        raise RuntimeError("the renderer broke")

    with pytest.raises(RuntimeError):
        render.write_atomic(str(target), fails)
    assert target.read_text() == "second\n" and os.listdir(tmp_path) == ["preflight.prom"]
    # A link keeps pointing at the file it named, which is replaced.
    link = tmp_path / "link.prom"
    link.symlink_to(target)
    render.write_atomic(str(link), _writer("third\n"))
    assert link.is_symlink() and target.read_text() == "third\n"
    # A device is written in place, never renamed over.
    render.write_atomic(os.devnull, _writer("nothing\n"))
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_run_writes_the_metrics_of_its_report(tmp_path):
    prom, report = tmp_path / "run.prom", tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--checks", "memlock", "--python", sys.executable,
                           "--prom-textfile", str(prom), "--json", str(report)], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    results = json.loads(report.read_text())["results"]
    samples = _samples(prom.read_text())
    assert {k: v for k, v in samples.items() if k[0] == "preflight_check_status"} == {
        _key("preflight_check_status", host=r["host"], check=r["check"]): STATUS[r["status"]] for r in results}
    assert [r["check"] for r in results] == ["ssh", "memlock"]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


@pytest.mark.parametrize("path, wanted", [
    ("-", "--prom-textfile -: node-check prints its verdict on stdout; name a file"),
    ("{tmp}/no/such/preflight.prom", "--prom-textfile {tmp}/no/such/preflight.prom: directory {tmp}/no/such does "
                                     "not exist"),
])
def test_node_check_refuses_a_path_it_cannot_write_before_it_runs(tmp_path, path, wanted):
    proc = subprocess.run([sys.executable, "-m", "preflight", "node-check", "--checks", "memlock", "--prom-textfile",
                           path.replace("{tmp}", str(tmp_path))], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["preflight: error: " + wanted.replace("{tmp}", str(tmp_path))]


# --- the real parts -------------------------------------------------------------------------------------------

NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
PROMETHEUS = shutil.which("prometheus")
WAIT_S = 60.0
# Straight to 127.0.0.1: an http_proxy in the environment must not see (or break) the queries.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Tuple[int, str]:
    try:
        with HTTP.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except OSError as exc:  # refused while it starts; urllib.error.HTTPError is an OSError too
        return getattr(exc, "code", 0) or 0, str(exc)


@contextlib.contextmanager
def _daemon(argv: List[str], log: Path, ready_url: str) -> Iterator[subprocess.Popen]:
    """The daemon in a process group of its own, up when ``ready_url`` answers 200; stopped (TERM, then KILL) and
    reaped on the way out, whatever happened in between."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while _get(ready_url)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{argv[0]} did not come up at {ready_url} (exit {proc.poll()}):\n"
                            f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def _query(port: int, promql: str) -> List[Dict[str, Any]]:
    code, body = _get(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert code == 200, body
    data = json.loads(body)
    assert data["status"] == "success", data
    return list(data["data"]["result"])


def _poll(what: str, probe, wait_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + wait_s
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus did not show {what} within {wait_s:.0f}s")
        time.sleep(0.5)


def _alert_rules() -> str:
    """The alert rules docs/prometheus.md gives: its one yaml block."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) == 1 and "alert: PreflightCheckFailing" in blocks[0]
    return blocks[0]


def _pids_with(marker: str) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
    return found


def test_prometheus_scraping_node_exporter_returns_the_status_node_check_wrote(tmp_path):
    if not (NODE_EXPORTER and PROMETHEUS):
        pytest.skip("prometheus and prometheus-node-exporter are not installed (tests/install-deps.sh installs them)")
    textfiles, data, scratch = tmp_path / "textfile", tmp_path / "tsdb", tmp_path / "nvme"
    for folder in (textfiles, data, scratch):
        folder.mkdir()
    node = f"prom-{os.getpid()}"
    # A second file, from a `run` with hostile names: node_exporter's own (Go) parser must take its escapes too.
    prometheus.write_file(_hostile_report(), str(textfiles / "preflight-run.prom"))
    ne_port, prom_port = _free_port(), _free_port()
    rules = tmp_path / "rules.yml"
    rules.write_text(_alert_rules())
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\n"
                      f"scrape_configs:\n  - job_name: node\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{ne_port}']\n")
    thresholds = tmp_path / "thresholds.toml"
    thresholds.write_text("[nvme]\nmin_write_gbps = 999\ntest_mib = 64\n")  # a figure, and a WARN...
    try:
        with _daemon([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{ne_port}", "--collector.disable-defaults",
                      "--collector.textfile", f"--collector.textfile.directory={textfiles}"],
                     tmp_path / "node_exporter.log", f"http://127.0.0.1:{ne_port}/metrics"), \
             _daemon([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
                      f"--web.listen-address=127.0.0.1:{prom_port}"],
                     tmp_path / "prometheus.log", f"http://127.0.0.1:{prom_port}/-/ready"):
            check = subprocess.run(
                [sys.executable, "-m", "preflight", "node-check", "--checks", "libaio,memlock,nvme", "--node-name",
                 node, "--nvme-path", str(scratch), "--nvme-path", str(tmp_path / "missing"),  # ...and a FAIL
                 "--config", str(thresholds), "-v", "--prom-textfile", str(textfiles / "preflight.prom")],
                cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
            assert check.returncode == 1 and "Traceback" not in check.stderr, check.stdout + check.stderr
            said = {m[1]: WORDS[m[2]] for m in re.finditer(rf"^{node}::(\w+) (\w+) - ", check.stdout, re.M)}
            assert said == {"libaio": said["libaio"], "memlock": said["memlock"], "nvme": 2}, check.stdout
            assert sorted(os.listdir(textfiles)) == ["preflight-run.prom", "preflight.prom"]  # no temporary file

            mine = f'preflight_check_status{{host="{node}"}}'
            found = _poll(f"{mine}, 3 series", lambda: (lambda got: got if len(got) == 3 else None)(
                _query(prom_port, mine)))
            assert {s["metric"]["check"]: float(s["value"][1]) for s in found} == said
            assert all(s["metric"]["job"] == "node" and s["metric"]["instance"] == f"127.0.0.1:{ne_port}"
                       for s in found)
            written = _samples((textfiles / "preflight.prom").read_text())
            write = _query(prom_port, f'preflight_nvme_write_bytes_per_second{{host="{node}"}}')
            assert [(s["metric"]["path"], float(s["value"][1])) for s in write] == [
                (str(scratch), written[_key("preflight_nvme_write_bytes_per_second", host=node, path=str(scratch))])]
            assert [s["metric"]["command"] for s in _query(prom_port, "preflight_last_run_timestamp_seconds")] in \
                (["node-check", "run"], ["run", "node-check"])
            # The hostile file: every name as itself (U+FFFD for what the format cannot carry), nothing dropped.
            assert [float(s["value"][1]) for s in _query(prom_port, "node_textfile_scrape_error")] == [0.0]
            hosts = {s["metric"]["host"] for s in _query(prom_port, 'preflight_check_status{check="ssh"}')}
            assert hosts == set(HOSTILE.values())
            # The documented alert: pending for the failing check (for: 15m), and every rule evaluates cleanly.
            alerts = _poll("the PreflightCheckFailing alert", lambda: [
                a for a in json.loads(_get(f"http://127.0.0.1:{prom_port}/api/v1/alerts")[1])["data"]["alerts"]
                if a["labels"]["alertname"] == "PreflightCheckFailing" and a["labels"].get("host") == node])
            assert [(a["labels"]["check"], a["state"]) for a in alerts] == [("nvme", "pending")]
            groups = json.loads(_get(f"http://127.0.0.1:{prom_port}/api/v1/rules")[1])["data"]["groups"]
            assert [(r["name"], r["health"]) for g in groups for r in g["rules"]] == [
                ("PreflightCheckFailing", "ok"), ("PreflightNotRunning", "ok")]
    finally:
        leftovers = _pids_with(str(tmp_path))
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert leftovers == []
