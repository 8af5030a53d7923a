"""The pytest plugin (preflight/pytest_plugin.py), loaded from its entry point in real pytest subprocesses."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import junitparser
import pytest

from preflight.hostside.outcome import Status
from preflight.results import CLUSTER, HostRecord, Report, Result
from tests.cli.test_cli_cluster import assert_nothing_left

pytest_plugins = ["pytester"]

RUN_TIMEOUT = 180  # seconds for one inner pytest run (a loaded 2-core CI machine is slow)
IPERF3_STARTUP_S = 3  # after the iperf3 phase starts: servers up, clients measuring
# The plugin's first line on stderr when it starts a run (before preflight's own progress lines).
RUN_STARTED = "preflight: checking "


def ssh_args(cluster) -> list[str]:
    """The SSH options the namespace cluster needs, in the '=' form.

    pytest picks its rootdir before plugin options are known, so a separate path value ('--x /a/b') would
    be taken for a test path; '--x=/a/b' never is.
    """
    return [f"--preflight-python={sys.executable}", f"--preflight-ssh-config={cluster.ssh_config}",
            f"--preflight-ssh-key={cluster.user_key}", f"--preflight-known-hosts={cluster.known_hosts}"]


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest_subprocess(*args, timeout=RUN_TIMEOUT)
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output, output
    return result


def runs(result: pytest.RunResult) -> int:
    """How many preflight runs this pytest session made, xdist workers included (they share its stderr)."""
    return sum(line.startswith(RUN_STARTED) for line in result.stderr.lines)


@pytest.fixture
def calm_config(tmp_path: Path) -> Path:
    """Thresholds whose verdicts do not depend on the machine's load (a busy CI host has slow SSH)."""
    path = tmp_path / "calm.toml"
    path.write_text("[ssh]\nwarn_rtt_ms = 1e9\n")
    return path


def test_report_from_dict_inverts_to_dict():
    results = [Result("node01", "ssh", Status.PASS, "ok", metrics={"rtt_ms": 1.5}, duration_s=0.1234),
               Result("node01", "libaio", Status.FAIL, "libaio.so.1 not found", "apt-get install libaio-dev"),
               Result("node02", "ssh", Status.ERROR, "timed out", "check the host"),
               Result("node02", "libaio", Status.SKIP, "not run"),
               Result(CLUSTER, "versions", Status.WARN, "torch differs", metrics={"odd": ["node02"]})]
    report = Report("2026-01-01T00:00:00+00:00", 4.2, [HostRecord("node01", "198.18.0.1", 8, True),
                                                        HostRecord("node02", "198.18.0.2", 8, False)],
                    results, ["ssh", "libaio", "versions"], {"NCCL_DEBUG": "WARN"}, {"NCCL_DEBUG": "why"},
                    ["a note"], strict=True)
    again = Report.from_dict(json.loads(json.dumps(report.to_dict())), strict=True)
    assert again.to_dict() == report.to_dict()
    assert again.checks == report.checks and again.results[1].fix == "apt-get install libaio-dev"
    assert Report.from_dict(report.to_dict()).exit_code == 1  # a FAIL fails without strict too


def test_the_header_names_what_blocked_the_victims_not_an_unreachable_host():
    """Victims of a failed rehearsal on node02 (the ranks that waited for it) and of node03's unreachable ssh: the
    header says "blocked by node02::launch, node03::ssh". Before the follow-up to issue 30 it said "blocked by an
    unreachable host" whatever the fault."""
    from preflight.pytest_plugin import header
    results = [Result("node02", "launch", Status.FAIL, "cannot open the DeepSpeed config"),
               Result("node01", "launch", Status.FAIL, "hung in init", blocked_by="launch", blocked_host="node02"),
               Result("node03", "ssh", Status.ERROR, "timed out"),
               Result("node03", "libaio", Status.ERROR, "not run", blocked_by="ssh")]
    report = Report("2026-01-01T00:00:00+00:00", 4.2, [HostRecord(h, "198.18.0.1", 8, True)
                                                        for h in ("node01", "node02", "node03")],
                    results, ["ssh", "libaio", "launch"], {}, {}, [])
    line = header(report)
    assert "2 blocked by node02::launch, node03::ssh)" in line and "unreachable" not in line, line
    assert "(1 failed, 1 errors, 0 warned" in line, line


def test_without_preflight_options_the_plugin_adds_nothing(pytester: pytest.Pytester):
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = run(pytester, "-v")
    assert result.ret == 0
    assert any(line.startswith("plugins:") and "preflight-" in line for line in result.stdout.lines), \
        result.stdout.str()  # loaded from the entry point ...
    result.assert_outcomes(passed=1)  # ... and inert
    assert runs(result) == 0 and "preflight" not in result.stdout.str().split("collected", 1)[1]


@pytest.mark.parametrize("hostfile, args, words", [
    ("node01\n", [], "hostfile:1: bad entry 'node01'"),
    ("node01 slots=1\n", ["--preflight-checks=libaio,nope"], "unknown check 'nope'"),
    ("node01 slots=1\n", ["--preflight-timeout=-1"], "argument --preflight-timeout: '-1' is out of range; expected 0 < x <= 86400"),
    ("node01 slots=1\n", ["--preflight-config=missing.toml"], "missing.toml: no such file"),
    (None, ["--preflight-checks=libaio"], "--preflight-checks needs --preflight-hostfile"),
    ("node01 slots=1\n", ["--preflight-model-parallel-size=0"],
     "argument --preflight-model-parallel-size: '0' is out of range"),
    ("node01 slots=0\n", [], "hostfile:1: slots=0 for node01"),
    ("node01 slots=1\n", ["--preflight-deepspeed-config=ds.json"], "ds.json:2:2: DeepSpeed config does not parse"),
    # an output that cannot be written is found before the run, as in the CLI (issue 26)
    ("node01 slots=1\n", ["--preflight-html=/proc/x.html"],
     "--preflight-html /proc/x.html: cannot create a file in /proc"),
])
def test_bad_input_is_one_usage_error_and_nothing_runs(pytester: pytest.Pytester, hostfile, args, words):
    pytester.path.joinpath("ds.json").write_text('{"train_batch_size": 8\n}}\n')  # one brace too many
    if hostfile is not None:
        pytester.path.joinpath("hostfile").write_text(hostfile)
        args = ["--preflight-hostfile=hostfile", *args]
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: preflight: {words}" in result.stderr.str()
    assert runs(result) == 0


def test_cells_become_passes_failures_errors_skips_and_warnings(cluster3, pytester: pytest.Pytester,
                                                                 tmp_path: Path):
    """node02 lacks the nvme path (FAIL), deadhost drops every packet (ERROR), CPU hosts skip driver_cuda,
    and an SSH round trip above 0 ms WARNs everywhere."""
    path = "/tmp/preflight-plugin-nvme"
    cluster3.add_blackhole("deadhost")
    for host in ("node01", "node03"):  # each host has a private /tmp: node02 lacks the directory
        cluster3.exec(host, ["mkdir", "-p", path], check=True)
    config = tmp_path / "t.toml"
    # Near-zero speed thresholds: this test is about the missing path, not a busy CI disk's speed.
    config.write_text("[ssh]\nwarn_rtt_ms = 0.0\n[nvme]\ntest_mib = 16\nmin_test_mib = 8\n"
                      "min_write_gbps = 0.01\nmin_read_gbps = 0.01\n")
    hostfile = cluster3.hostfile(tmp_path / "hostfile", names=["node01", "node02", "node03", "deadhost"])
    junit, report, html = tmp_path / "junit.xml", tmp_path / "report.json", tmp_path / "report.html"
    try:
        result = run(pytester, *ssh_args(cluster3), f"--preflight-hostfile={hostfile}",
                     "--preflight-checks=nvme,driver_cuda,versions", f"--preflight-nvme-path={path}",
                     f"--preflight-config={config}", "--preflight-connect-timeout=5",
                     f"--preflight-json={report}", f"--preflight-html={html}", f"--junitxml={junit}", "-v", "-rs")
    finally:
        for host in ("node01", "node03"):
            cluster3.exec(host, ["rm", "-rf", path])
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out
    assert runs(result) == 1
    data = json.loads(report.read_text())
    ids = [f"{'cluster' if r['host'] == CLUSTER else r['host']}::{r['check']}" for r in data["results"]]
    assert "node01::ssh" in ids and "node02::nvme" in ids and "cluster::versions" in ids
    for nodeid in ids:  # one item per cell of the matrix, with its id
        assert any(line.startswith(nodeid + " ") for line in result.stdout.lines), (nodeid, out)
    result.assert_outcomes(passed=3 + 2 + 1, failed=1, errors=3, skipped=3, warnings=3)
    # FAIL: a failure whose text is the message (actual vs expected) and the fix, not a traceback.
    fail = next(r for r in data["results"] if (r["host"], r["check"]) == ("node02", "nvme"))
    assert fail["status"] == "fail" and path in fail["message"] and fail["fix"]
    result.stdout.fnmatch_lines(["*_ nvme on node02 _*"])
    assert f"\n{fail['message']}\nfix: {fail['fix']}\n" in out
    # ERROR: errors at setup, for the unreachable host's every check.
    result.stdout.fnmatch_lines(["*ERROR at setup of ssh on deadhost*", "*timed out after 5s*"])
    assert "deadhost::nvme ERROR" in out and "deadhost::driver_cuda ERROR" in out
    # SKIP: with the reason, located at the hostfile.
    result.stdout.fnmatch_lines(["SKIPPED [[]3[]] *hostfile: no NVIDIA driver on this host*"])
    # WARN: passes, and the warning (located at the host's hostfile line) says why.
    result.stdout.fnmatch_lines(["*warnings summary*", "node01::ssh", "*hostfile:1: PreflightWarning: "
                                 "connected to node01*(above 0 ms)*"])
    assert 'id="matrix"' in html.read_text() and "node02" in html.read_text()  # the CLI's --html, same run
    # The recommended environment closes the run.
    result.stdout.fnmatch_lines(["*preflight: recommended environment*", "export NCCL_DEBUG=WARN"])

    suite = next(iter(junitparser.JUnitXml.fromfile(str(junit))))
    cases = {(case.classname, case.name): case for case in suite}
    assert sorted(cases) == sorted(tuple(i.split("::")) for i in ids)
    failure = cases[("node02", "nvme")].result[0]
    assert isinstance(failure, junitparser.Failure) and f"fix: {fail['fix']}" in failure.text
    assert isinstance(cases[("deadhost", "ssh")].result[0], junitparser.Error)
    assert isinstance(cases[("node01", "driver_cuda")].result[0], junitparser.Skipped)
    props = {p.get("name"): p.get("value") for p in
             ET.parse(junit).findall(".//testcase[@classname='node01'][@name='ssh']/properties/property")}
    assert props["status"] == "warn" and json.loads(props["metrics.hostname"]) == "node01"
    assert_nothing_left(cluster3)


def test_keyword_selection_and_strict_warnings(cluster3, pytester: pytest.Pytester, tmp_path: Path):
    config = tmp_path / "warn.toml"
    config.write_text("[ssh]\nwarn_rtt_ms = 0.0\n")
    result = run(pytester, *ssh_args(cluster3), f"--preflight-hostfile={cluster3.hostfile(tmp_path / 'hf')}",
                 "--preflight-checks=driver_cuda", f"--preflight-config={config}", "--preflight-strict",
                 "-k", "ssh and not node03")
    assert runs(result) == 1
    # -k selects the checks that run (issue 26): driver_cuda, whose ids 'ssh' never matches, is not run at all,
    # so its three items are not there to deselect (before: deselected=4, driver_cuda run on every host).
    result.assert_outcomes(failed=2, deselected=1)
    result.stdout.fnmatch_lines(["FAILED node01::ssh - connected to node01*", "FAILED node02::ssh - *"])
    assert "(-k selected 0 of 1 checks)" in result.stderr.str() and "driver_cuda" not in result.stdout.str()
    assert_nothing_left(cluster3)


def options_for(hosts, checks):
    from preflight.hostfile import HostSpec
    from preflight.runner import RunOptions
    return RunOptions(hosts=[HostSpec(h, 1) for h in hosts], checks=list(checks), thresholds={})


@pytest.mark.parametrize("expression, kept", [
    ("", ["libaio", "memlock", "versions", "ports"]),
    ("libaio", ["libaio"]),
    ("LIBAIO or memlock", ["libaio", "memlock"]),
    ("not libaio", ["memlock", "versions", "ports"]),
    ("node02", ["libaio", "memlock", "versions", "ports"]),   # every check has a node02 item
    ("cluster", ["versions", "ports"]),                        # only cluster checks have cluster:: items
    ("cluster and not ports", ["versions"]),
    ("node01::mem", ["memlock"]),
    ("ssh", []),                                               # the connection runs anyway; no check is asked for
    ("preflight", ["libaio", "memlock", "versions", "ports"]),  # the collector's name, in every item's names
    ("skip and libaio", ["libaio"]),                           # a SKIP result's mark: not known before the run
    ("nosuchhost", []),
])
def test_keyword_checks_are_those_with_an_item_the_expression_keeps(expression, kept):
    from preflight.pytest_plugin import keyword_checks
    assert keyword_checks(expression, options_for(["node01", "node02"],
                                                  ["libaio", "memlock", "versions", "ports"])) == kept


def test_a_bad_keyword_expression_is_a_usage_error_before_anything_runs():
    from preflight.pytest_plugin import keyword_checks
    with pytest.raises(pytest.UsageError, match="Wrong expression passed to '-k'"):
        keyword_checks("libaio and (", options_for(["node01"], ["libaio"]))


def test_dash_k_runs_only_the_checks_it_selects(pytester: pytest.Pytester, tmp_path: Path):
    """`pytest -k 'libaio or versions'` runs libaio and versions (a cluster check) on the host, and the connection,
    nothing else: the JSON report, written by the same run, holds no other check (issue 26: -k ran every check)."""
    report = tmp_path / "report.json"
    result = run(pytester, "--preflight-local", f"--preflight-python={sys.executable}", f"--preflight-json={report}",
                 "-k", "libaio or versions", "-v")
    assert runs(result) == 1
    data = json.loads(report.read_text())
    assert sorted({(r["host"], r["check"]) for r in data["results"]}) == [
        (CLUSTER, "versions"), ("localhost", "libaio"), ("localhost", "ssh")]
    started = next(line for line in result.stderr.lines if line.startswith(RUN_STARTED))
    assert "this machine: ssh, libaio, versions (-k selected 2 of " in started, started
    outcomes = result.parseoutcomes()
    assert outcomes.get("deselected") == 1, outcomes  # localhost::ssh
    result.stdout.fnmatch_lines(["localhost::libaio *", "cluster::versions *"])


def test_xdist_workers_read_the_controllers_single_run(cluster3, pytester: pytest.Pytester, tmp_path: Path,
                                                      calm_config: Path):
    pytest.importorskip("xdist")
    result = run(pytester, *ssh_args(cluster3), f"--preflight-hostfile={cluster3.hostfile(tmp_path / 'hf')}",
                 "--preflight-checks=driver_cuda,versions", f"--preflight-config={calm_config}", "-n", "2",
                 "-v")
    assert runs(result) == 1
    result.assert_outcomes(passed=3 + 1, skipped=3)
    # Each line once, in no order: which worker reports first is the scheduler's business (gw1 ran cluster::versions
    # before gw0 reported node01::ssh on a loaded machine).
    for line in ("*PASSED node01::ssh*", "*PASSED cluster::versions*"):
        result.stdout.fnmatch_lines([line])
    assert sum("PreflightWarning" in line for line in result.stdout.lines) == 0
    assert_nothing_left(cluster3)


def test_local_run_through_dash_p_without_autoload(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """--preflight-local checks this machine without SSH; `-p preflight` loads the plugin when autoload is off."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = run(pytester, "-p", "preflight", "--preflight-local", "--preflight-checks=driver_cuda",
                 f"--preflight-python={sys.executable}", "-v")
    assert runs(result) == 1
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["localhost::ssh PASSED*", "localhost::driver_cuda SKIPPED*"])


def test_ctrl_c_during_the_run_cleans_up_every_host(cluster3, pytester: pytest.Pytester, tmp_path: Path):
    """SIGINT while iperf3 measures: pytest stops as interrupted and no process or file of the run remains."""
    config = tmp_path / "long.toml"
    config.write_text("[iperf3]\nduration_s = 20.0\n")  # long enough to be interrupted mid-measurement
    argv = [sys.executable, "-m", "pytest", *ssh_args(cluster3),
            f"--preflight-hostfile={cluster3.hostfile(tmp_path / 'hf')}", "--preflight-checks=iperf3",
            f"--preflight-config={config}"]
    proc = pytester.popen(argv, stdin=subprocess.DEVNULL, text=True)
    try:
        seen = []
        deadline = time.monotonic() + RUN_TIMEOUT
        for line in proc.stderr:  # progress lines: wait until the iperf3 phase has started
            seen.append(line)
            if "] iperf3" in line or time.monotonic() > deadline:
                break
        assert any("] iperf3" in line for line in seen), seen
        time.sleep(IPERF3_STARTUP_S)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out + err
    assert "preflight: interrupted; stopped the checks and cleaned up on the hosts" in err
    assert "Traceback" not in out + err
    assert_nothing_left(cluster3)
