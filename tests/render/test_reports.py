"""Reporters read only structured results: JSON contract, JUnit (loaded with junitparser), env file, lines."""
import json

import junitparser

from preflight.hostside.outcome import Status
from preflight.results import HostRecord, Report, Result
from preflight.render.env_file import to_env_file
from preflight.render.json import report_dict, to_json
from preflight.render.junit import to_junit
from preflight.render.terminal import matrix, result_line, summary_line


def sample(strict=False):
    results = [
        Result("node01", "ssh", Status.PASS, "connected", duration_s=0.2),
        Result("node01", "libaio", Status.FAIL, "libaio.so.1 not found", "apt-get install libaio-dev"),
        Result("node02", "ssh", Status.ERROR, "TCP connect timed out", "check the host"),
        Result("node02", "libaio", Status.ERROR, "not run: the host is unreachable"),
        Result("node01", "gpu", Status.SKIP, "no NVIDIA driver on this host"),
        Result("node01", "nvme", Status.WARN, "write 0.8 GB/s < 1.0 GB/s", "use a faster disk"),
        Result("*", "versions", Status.PASS, "all hosts agree", metrics={"torch": "2.13.0"}),
    ]
    return Report("2026-11-23T10:00:00+00:00", 4.25, [HostRecord("node01", "198.18.0.1", 8, True),
                                                     HostRecord("node02", "198.18.0.2", 8, False)],
                  results, ["ssh", "libaio", "gpu", "nvme", "versions"],
                  env={"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "=eth1"},
                  reasons={"NCCL_DEBUG": "why", "NCCL_SOCKET_IFNAME": "fastest"}, strict=strict)


def test_json_contract():
    data = json.loads(to_json(sample()))
    assert data["version"] == 1 and data["started_at"].startswith("2026-11-23")
    assert data["hosts"][1] == {"name": "node02", "address": "198.18.0.2", "slots": 8, "reachable": False}
    first = data["results"][1]
    assert set(first) == {"host", "check", "status", "message", "fix", "metrics", "duration_s"}
    assert first["status"] == "fail" and first["fix"] == "apt-get install libaio-dev"
    assert data["results"][-1]["host"] == "*"
    assert data["recommendations"]["env"]["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert data["recommendations"]["reasons"]["NCCL_SOCKET_IFNAME"] == "fastest"
    # Issue 26: the summary gained "blocked" (0 here: the runner's blocked cells carry blocked_by, below).
    # Issue 30: and the causes: FAIL/ERROR causes (node01's libaio, node02 unreachable) and WARN causes apart.
    assert data["summary"] == {"pass": 2, "warn": 1, "fail": 1, "skip": 1, "error": 2, "blocked": 0, "exit_code": 1,
                               "causes": 2, "warning_causes": 1}


def test_json_is_one_result_per_line():
    """Readable and diffable without indent= (json's slow pure-Python encoder): each host and each result is
    one line that is a JSON object of its own, in the report's order, and the whole is the same document."""
    report = sample()
    report.results[0].message = 'a "quoted" message, with {braces}, [brackets],\nnewline and \u00e9'
    report.results[0].metrics = {"nested": {"list": [1, 2.5, None, True]}, "odd": object()}
    text = to_json(report)
    data = json.loads(text)
    assert data == json.loads(json.dumps(report_dict(report), default=str))
    lines = text.splitlines()
    result_lines = [json.loads(line.strip().rstrip(",")) for line in lines if line.startswith('  {"host"')]
    assert result_lines == data["results"] and len(result_lines) == len(report.results) == 7
    host_lines = [json.loads(line.strip().rstrip(",")) for line in lines if line.startswith('  {"name"')]
    assert host_lines == data["hosts"]
    cause_lines = [json.loads(line.strip().rstrip(",")) for line in lines if line.startswith('  {"id"')]
    # node02's libaio ERROR is part of its unreachable host's cause: node01's libaio, node02's ssh, nvme and gpu.
    assert cause_lines == data["causes"] and len(cause_lines) == 4
    # Issue 26: "causes" added one line per cause (and its brackets) to the hosts' and results'.
    assert text.endswith("}\n") and len(lines) == 1 + 3 + (2 + 2) + (2 + 7) + (2 + 4) + 2 + 1


def test_exit_codes():
    ok = Report("t", 1.0, [], [Result("a", "x", Status.PASS, ""), Result("a", "y", Status.WARN, ""),
                               Result("a", "z", Status.SKIP, "why")], ["x", "y", "z"])
    assert ok.exit_code == 0
    ok.strict = True
    assert ok.exit_code == 1
    assert sample().exit_code == 1


def test_junit_loads_with_a_junit_parser(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(to_junit(sample()))
    xml = junitparser.JUnitXml.fromfile(str(path))
    suite = next(iter(xml))
    cases = {(c.classname, c.name): c for c in suite}
    assert len(cases) == 7
    assert suite.tests == 7 and suite.failures == 1 and suite.errors == 2 and suite.skipped == 1
    fail = cases[("node01", "libaio")].result[0]
    assert isinstance(fail, junitparser.Failure) and fail.message == "libaio.so.1 not found"
    assert "apt-get install libaio-dev" in fail.text
    assert isinstance(cases[("node02", "ssh")].result[0], junitparser.Error)
    assert isinstance(cases[("node01", "gpu")].result[0], junitparser.Skipped)
    assert cases[("node01", "nvme")].result == []  # a warning passes unless --strict


def test_junit_strict_turns_warnings_into_failures(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(to_junit(sample(strict=True)))
    suite = next(iter(junitparser.JUnitXml.fromfile(str(path))))
    assert suite.failures == 2


def test_env_file_is_deepspeed_env_format():
    text = to_env_file(sample())
    assert text == "NCCL_DEBUG=WARN\nNCCL_SOCKET_IFNAME==eth1\n"
    assert "\n\n" not in text and not text.startswith("\n")


def test_lines_and_summary_in_pytest_form():
    report = sample()
    assert result_line(report.results[1]) == \
        "node01::libaio FAILED - libaio.so.1 not found; fix: apt-get install libaio-dev"
    assert summary_line(report) == "2 passed, 1 failed, 1 warned, 1 skipped, 2 errors in 4.2s"


def test_matrix_is_transposed_when_there_are_more_checks_than_hosts():
    """2 hosts + the cluster row against 5 checks: checks become rows, so a few-host run stays narrow."""
    table = matrix(sample())
    assert table.columns[0].header == "check"
    assert [str(c.header) for c in table.columns[1:]] == ["node01", "node02", "cluster"]
    assert table.row_count == 5
    wide = sample()
    wide.checks = ["ssh", "libaio"]
    wide.results = [r for r in wide.results if r.check in wide.checks]
    table = matrix(wide)  # more hosts than checks: hosts are the rows
    assert table.columns[0].header == "host" and [str(c.header) for c in table.columns[1:]] == ["ssh", "libaio"]
