"""The report grouped by cause and its verdict (issue 26 items 1 and 2): one line per cause naming its hosts as a
NodeSet, blocked cells instead of "not run" errors, skips once and after the failures, and a last-but-one line
READY / READY with N warnings / NOT READY: ... before the count line; -q prints those two lines alone.

Unit tests on hand-made reports, then the broken 6-host scenario on namespace hosts over real sshd: a firewalled
host, a dead sshd, a hung (SIGSTOPped) sshd, a host whose libaio cannot be loaded and one without the NVMe path.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import List, Optional

import pytest

from preflight.causes import causes, nodeset, verdict
from preflight.hostside.outcome import Status
from preflight.render.json import to_json
from preflight.render.junit import to_junit
from preflight.render.terminal import console, matrix_tables, print_report
from preflight.results import CLUSTER, HostRecord, Report, Result

ROOT = Path(__file__).resolve().parents[2]
HOST_CHECKS = ["python", "driver_cuda", "gpu", "libaio", "nvme"]
CHECKS = ["ssh"] + HOST_CHECKS + ["ports", "launcher_ssh", "allreduce"]


def text(report: Report, width: int = 240, **kwargs) -> List[str]:
    out = io.StringIO()
    print_report(report, console(out, width), **kwargs)
    return out.getvalue().splitlines()


def blocked(host: str, check: str) -> Result:
    """A cell as the runner writes it for a host whose connection failed."""
    return Result(host, check, Status.ERROR, f"blocked: {check} was left out, as the ssh check of {host} did not "
                  "pass", blocked_by="ssh")


def cluster_report(n: int = 6, down=(), key_unknown=(), strict: bool = False, extra=()) -> Report:
    """n healthy hosts node01.. with every check passing, except: hosts in ``down`` refused the connection and
    hosts in ``key_unknown`` have an unknown host key (both: every other cell blocked, launcher_ssh FAILs there)."""
    hosts = [f"node{i:02d}" for i in range(1, n + 1)]
    address = {h: f"198.18.0.{i}" for i, h in enumerate(hosts, 1)}
    results: List[Result] = []
    for h in hosts:
        if h in down:
            results.append(Result(h, "ssh", Status.ERROR, f"connection to {address[h]}:22 refused: no SSH server "
                                  "listening", "start sshd on the host or pass the right --ssh-port",
                                  {"address": address[h]}))
        elif h in key_unknown:
            fingerprint = "SHA256:" + (h * 8)[:43].replace("e", "Q")
            results.append(Result(h, "ssh", Status.FAIL, f"unknown SSH host key for {address[h]} (ssh-ed25519 "
                                  f"{fingerprint}); refusing to connect", "pass --accept-new-host-keys to record it "
                                  f"(or: ssh-keyscan -p 22 {address[h]} >> /root/.ssh/known_hosts)",
                                  {"address": address[h]}))
        else:
            results.append(Result(h, "ssh", Status.PASS, f"connected to {h}", metrics={"hostname": h}))
        for check in HOST_CHECKS + ["ports"]:
            results.append(blocked(h, check) if h in down or h in key_unknown else Result(h, check, Status.PASS, "ok"))
        if h in down or h in key_unknown:
            results.append(Result(h, "launcher_ssh", Status.FAIL, f"passwordless SSH from node01 to {h} fails",
                                  f"start sshd on {h}"))
        else:
            results.append(Result(h, "launcher_ssh", Status.PASS, "ok"))
    results.append(Result(CLUSTER, "allreduce", Status.PASS, "busbw 1 GB/s"))
    unreachable = set(down) | set(key_unknown)
    report = Report("2026-11-23T10:00:00+00:00", 12.5,
                    [HostRecord(h, address[h], 8, h not in unreachable) for h in hosts], results, CHECKS,
                    strict=strict)
    for r in extra:
        cell = next((i for i, x in enumerate(report.results) if (x.host, x.check) == (r.host, r.check)), None)
        if cell is None:
            report.results.append(r)
        else:
            report.results[cell] = r
    return report


# --------------------------------------------------------------------------------------- one line per cause

def test_an_unreachable_host_is_one_line_and_its_cells_are_blocked():
    report = cluster_report(down=["node03"])
    lines = text(report)
    problems = [ln for ln in lines if "::" in ln]
    assert problems == ["node03::ssh ERROR - connection to 198.18.0.3:22 refused: no SSH server listening "
                        "(blocks 6 other checks; also launcher_ssh FAILED); fix: start sshd on the host or pass the "
                        "right --ssh-port"]
    assert not any("not run" in ln or "blocked:" in ln for ln in lines)
    row = next(ln for ln in lines if ln.lstrip().startswith("python "))
    # Checks as rows (more checks than hosts); node03's python is blocked, and the cluster column has none.
    assert row.split()[1:] == ["PASS", "PASS", "\u00b7", "PASS", "PASS", "PASS", "\u00b7"]
    assert lines[-2] == "NOT READY: 1 host needs fixing (node03 unreachable)"
    assert lines[-1] == "41 passed, 1 failed, 0 warned, 1 error, 6 blocked in 12.5s"
    assert report.counts()["blocked"] == 6 and report.counts()["error"] == 1 and report.exit_code == 1

    # The JSON keeps every (host, check) entry, the blocked ones with blocked_by, and adds the causes.
    data = json.loads(to_json(report))
    cells = {(r["host"], r["check"]): r for r in data["results"]}
    assert len(cells) == len(report.results)
    assert cells[("node03", "libaio")]["status"] == "error" and cells[("node03", "libaio")]["blocked_by"] == "ssh"
    assert "blocked_by" not in cells[("node03", "ssh")] and "blocked_by" not in cells[("node01", "libaio")]
    assert data["summary"]["blocked"] == 6 and data["summary"]["error"] == 1
    (cause,) = data["causes"]
    assert cause == {"id": "ssh:1", "status": "error", "check": "ssh", "checks": ["ssh", "launcher_ssh"],
                     "hosts": ["node03"], "nodeset": "node03",
                     "message": "connection to 198.18.0.3:22 refused: no SSH server listening",
                     "fix": "start sshd on the host or pass the right --ssh-port", "blocked": 6}
    assert Report.from_dict(data).results == report.results  # blocked_by is read back

    # JUnit: still an error for every parser (not a pass), typed "blocked" and naming what blocked it.
    root = ET.fromstring(to_junit(report).split("\n", 1)[1])
    suite = root.find("testsuite")
    assert suite.get("errors") == "7" and suite.get("tests") == str(len(report.results))
    case = root.find(".//testcase[@classname='node03'][@name='libaio']")
    assert case.find("error").get("type") == "blocked"
    assert case.find("properties/property").attrib == {"name": "blocked_by", "value": "ssh"}
    assert root.find(".//testcase[@classname='node03'][@name='ssh']/error").get("type") == "error"


def test_the_html_page_shows_blocked_cells_as_dots_and_says_the_verdict():
    from preflight.render.html import to_html
    page = to_html(cluster_report(down=["node03"]))
    row = re.search(r'<tr class="host" data-host="node03">.*?</tr>', page).group(0)
    assert row.count('<td class="blocked"') == 6 and 'class="st st-error"' in row  # its ssh is the one ERROR
    assert "exit code 1: NOT READY: 1 host needs fixing (node03 unreachable)" in page
    assert '<details class="group" data-status="blocked">' in page


def test_verbose_still_prints_every_host_and_check_line():
    report = cluster_report(down=["node03"])
    lines = text(report, verbose=True)
    for r in report.results:
        host = "cluster" if r.host == CLUSTER else r.host
        assert any(ln.startswith(f"{host}::{r.check} ") for ln in lines), (r.host, r.check)
    assert "node03::libaio BLOCKED - blocked: libaio was left out, as the ssh check of node03 did not pass" in lines
    assert not any("not run" in ln for ln in lines)
    assert lines[-2].startswith("NOT READY: ")


def test_unknown_host_keys_on_several_hosts_are_one_line_that_does_not_call_them_unreachable():
    report = cluster_report(n=8, key_unknown=["node03", "node04", "node05"])
    lines = text(report)
    problems = [ln for ln in lines if "::" in ln]
    # Issue 30: no placeholder where a fact belongs: each host's address and fingerprint on a line of its own.
    assert problems == [
        "node[03-05]::ssh FAILED - unknown SSH host key for <address> (ssh-ed25519 <fingerprint>); refusing to "
        "connect (blocks 6 other checks on each; also launcher_ssh FAILED); fix: pass --accept-new-host-keys to "
        "record it (or: ssh-keyscan -p 22 <address> >> /root/.ssh/known_hosts)"]
    at = lines.index(problems[0])
    assert lines[at + 1:at + 4] == [
        f"    node0{i}: address 198.18.0.{i}, fingerprint SHA256:" + (f"node0{i}" * 8)[:43].replace("e", "Q")
        for i in (3, 4, 5)]
    assert "unreachable" not in "\n".join(lines)
    assert lines[-2] == "NOT READY: 3 hosts need fixing (node[03-05] ssh)"
    assert lines[-1] == "41 passed, 6 failed, 0 warned, 18 blocked in 12.5s"


def test_several_dead_hosts_with_one_cause_and_a_second_cause():
    report = cluster_report(n=20, down=["node03", "node04", "node05", "node17"], key_unknown=["node09"])
    problems = [ln for ln in text(report) if "::" in ln]
    assert len(problems) == 2
    assert problems[0].startswith("node[03-05,17]::ssh ERROR - connection to <address>:22 refused: no SSH server "
                                  "listening (blocks 6 other checks on each; also launcher_ssh FAILED)")
    assert problems[1].startswith("node09::ssh FAILED - unknown SSH host key for 198.18.0.9 (ssh-ed25519 SHA256:")
    assert verdict(report) == "NOT READY: 5 hosts need fixing (node[03-05,17] unreachable, node09 ssh)"


def test_the_same_skip_on_several_hosts_is_one_line_after_the_failures():
    skips = [Result(h, "gpu", Status.SKIP, f"no NVIDIA driver on this host ({h} has no /proc/driver/nvidia); GPU "
                    "health does not apply") for h in ("node01", "node02", "node04", "node05", "node06")]
    report = cluster_report(extra=skips + [Result("node02", "nvme", Status.FAIL, "nvme path /scratch: does not exist",
                                                  "mkdir -p -- /scratch")])
    lines = text(report)
    problems = [ln for ln in lines if "::" in ln]
    assert problems == [
        "node02::nvme FAILED - nvme path /scratch: does not exist; fix: mkdir -p -- /scratch",
        "node[01-02,04-06]::gpu SKIPPED - no NVIDIA driver on this host (node[01-02,04-06] has no /proc/driver/nvidia); "
        "GPU health does not apply"]  # issue 30: the hosts' names, not HOST
    assert lines[-1] == "43 passed, 1 failed, 0 warned, 5 skipped in 12.5s"
    assert lines[-2] == "NOT READY: 1 host needs fixing (node02 nvme)"
    assert verdict(cluster_report(extra=skips)) == "READY"  # skips are no verdict on the hosts


def test_the_same_message_from_one_check_on_several_hosts_is_one_line():
    missing = [Result(h, "nvme", Status.FAIL, "nvme path /local/nvme: does not exist", "mkdir -p -- /local/nvme")
               for h in ("node01", "node02", "node03", "node06")]
    other = Result("node05", "nvme", Status.FAIL, "nvme path /local/nvme: write 0.1 GB/s < 1.0 GB/s", "check the disk")
    problems = [ln for ln in text(cluster_report(extra=missing + [other])) if "::" in ln]
    assert problems == ["node[01-03,06]::nvme FAILED - nvme path /local/nvme: does not exist; fix: mkdir -p -- "
                        "/local/nvme",
                        "node05::nvme FAILED - nvme path /local/nvme: write 0.1 GB/s < 1.0 GB/s; fix: check the disk"]


def test_a_name_is_taken_out_only_as_a_whole_name():
    """node1's own name is not inside node10's: the two messages differ, and are two causes."""
    hosts = [HostRecord(h, h, 1, True) for h in ("node1", "node10")]
    results = [Result("node1", "ports", Status.FAIL, "node1 cannot reach node10"),
               Result("node10", "ports", Status.FAIL, "node10 cannot reach node10")]
    found = causes(Report("t", 1.0, hosts, results, ["ports"]))
    assert [(c.hosts, c.message) for c in found] == [(["node1"], "node1 cannot reach node10"),
                                                     (["node10"], "node10 cannot reach node10")]


def test_one_failure_that_several_checks_report_on_one_host_is_one_line():
    dead_agent = [Result("node04", c, Status.ERROR, "not run: host checks exited with rc=-1 without a result",
                         "rerun with -v to see the host-side error") for c in ("python", "gpu", "libaio")]
    problems = [ln for ln in text(cluster_report(extra=dead_agent)) if "::" in ln]
    assert problems == ["node04::python,gpu,libaio ERROR - not run: host checks exited with rc=-1 without a result; "
                        "fix: rerun with -v to see the host-side error"]


def test_a_check_that_reads_a_failed_check_on_the_same_host_joins_its_cause():
    """allreduce reads ports (SPEC.reads): a host that ports found firewalled, and the all-reduce left out."""
    extra = [Result("node02", "ports", Status.FAIL, "inbound TCP to node02:40000 blocked from node01",
                    "on node02 allow TCP from the cluster"),
             Result("node02", "allreduce", Status.FAIL, "all-reduce: left out, already found unreachable: ports",
                    "allow inbound TCP on node02"),
             Result("node05", "allreduce", Status.WARN, "all-reduce: straggler at 68% (z -2.3, p = 0.01)",
                    "check node05's link")]
    report = cluster_report(extra=extra)
    problems = [ln for ln in text(report) if "::" in ln]
    assert problems == ["node02::ports FAILED - inbound TCP to node02:40000 blocked from node01 (also allreduce "
                        "FAILED); fix: on node02 allow TCP from the cluster",
                        "node05::allreduce WARNED - all-reduce: straggler at 68% (z -2.3, p = 0.01); fix: check "
                        "node05's link"]
    assert verdict(report) == "NOT READY: 1 host needs fixing (node02 ports)"


def test_a_reached_host_that_its_connection_check_fails_keeps_its_other_causes():
    """Two names of one machine: ssh FAILs a host it reached; that host's libaio FAIL is a cause of its own."""
    report = cluster_report(extra=[
        Result("node02", "ssh", Status.FAIL, "node02 and node01 are the same machine: 16 slots on 8 GPUs"),
        Result("node02", "libaio", Status.FAIL, "libaio.so.1 not found", "apt-get install libaio1")])
    assert [(c.check, c.hosts) for c in causes(report)] == [("ssh", ["node02"]), ("libaio", ["node02"])]
    assert verdict(report) == "NOT READY: 1 host needs fixing (node02 ssh, node02 libaio)"


def test_nodeset_folds_names_and_keeps_what_it_cannot_fold():
    assert nodeset(["node03", "node04", "node05", "node17"]) == "node[03-05,17]"
    assert nodeset(["127.0.0.1", "127.0.0.2", CLUSTER]) == "127.0.0.[1-2],cluster"
    assert nodeset(["gpu-a", "gpu-b"]) in ("gpu-a,gpu-b", "gpu-[a,b]") and nodeset(["x"]) == "x"


# --------------------------------------------------------------------------------------- the verdict

def test_the_verdict_counts_hosts_scattered_over_a_large_cluster():
    """1,000 hosts, every third refusing: the verdict stays one short line; the cause's line names every host."""
    report = cluster_report(n=999, down=[f"node{i:02d}" for i in range(1, 1000, 3)])
    assert verdict(report) == "NOT READY: 333 hosts need fixing (333 hosts unreachable)"
    (cause,) = causes(report)
    assert cause.where.startswith("node[01,04,07,10,") and len(cause.hosts) == 333


def test_verdict_words():
    assert verdict(cluster_report()) == "READY"
    warn = [Result("node05", "allreduce", Status.WARN, "straggler", "check the link"),
            Result(CLUSTER, "allreduce", Status.WARN, "straggler: node05")]
    assert verdict(cluster_report(extra=warn)) == "READY with 2 warnings (node05 allreduce, cluster allreduce)"
    strict = cluster_report(extra=warn, strict=True)
    assert strict.exit_code == 1
    assert verdict(strict) == ("NOT READY: 2 warnings, and --strict fails on warnings (node05 allreduce, "
                               "cluster allreduce)")
    both = cluster_report(down=["node02"], extra=warn, strict=True)
    assert verdict(both) == ("NOT READY: 1 host needs fixing (node02 unreachable); and 2 warnings, which --strict "
                             "fails on")
    failed = cluster_report(extra=[Result(CLUSTER, "allreduce", Status.FAIL, "busbw 0.01 GB/s < 1 GB/s")])
    assert verdict(failed) == "NOT READY: cluster-wide: allreduce"


def test_quiet_prints_exactly_the_verdict_and_the_count_line():
    """Before, `--strict -q` exited 1 and printed only `8 passed, 0 failed, 1 warned`."""
    report = cluster_report(n=2, strict=True, extra=[Result("node01", "ssh", Status.WARN, "slow: 40 ms round trip")])
    assert text(report, quiet=True) == ["NOT READY: 1 warning, and --strict fails on warnings (node01 ssh)",
                                        "16 passed, 0 failed, 1 warned in 12.5s"]
    report.strict = False
    assert text(report, quiet=True) == ["READY with 1 warning (node01 ssh)", "16 passed, 0 failed, 1 warned in 12.5s"]


# --------------------------------------------------------------------------------------- the matrix at 80 columns

@pytest.mark.parametrize("hosts", [[f"127.0.0.{i}" for i in range(1, 21)], ["127.0.0.1", "127.0.0.2"],
                                   [f"gpu-node-{i:02d}.rack7.example.com" for i in range(1, 9)]])
def test_matrix_at_80_columns_never_splits_a_name(hosts):
    results = [Result(h, c, Status.PASS, "ok") for h in hosts for c in CHECKS]
    report = Report("t", 1.0, [HostRecord(h, h, 1, True) for h in hosts], results, CHECKS)
    con = console(io.StringIO(), 80)
    lines = []
    for table in matrix_tables(report, con):
        con.print(table)
    lines = con.file.getvalue().splitlines()
    assert max(len(ln) for ln in lines) <= 80, "\n".join(lines)
    words = set(" ".join(lines).split())
    assert set(hosts) | set(CHECKS) <= words, "\n".join(lines)  # every name whole, none in pieces


def test_a_name_wider_than_the_terminal_is_a_key_with_a_legend():
    long = "a-host-name-that-is-far-too-wide-for-any-column-of-an-80-column-terminal.rack42.example.com"
    results = [Result(h, c, Status.PASS, "ok") for h in (long, "node02") for c in CHECKS[:3]]
    report = Report("t", 1.0, [HostRecord(h, h, 1, True) for h in (long, "node02")], results, CHECKS[:3])
    lines = text(report, width=80)
    matrix = lines[:lines.index(f"#1 = {long}")]
    assert max(len(ln) for ln in matrix) <= 80 and "#1" in " ".join(matrix).split(), "\n".join(lines)
    assert not any(long[:20] in ln for ln in matrix)


# --------------------------------------------------------------------------------------- on namespace hosts

NVME = "/tmp/preflight-verdict-nvme"  # each host's /tmp is its own: the path exists where it is made
FAST = ("[iperf3]\nduration_s = 1.0\n"
        "[allreduce]\nmin_bytes = 65536\nmax_bytes = 1048576\niters = 2\n"
        "[nvme]\ntest_mib = 16\nmin_test_mib = 8\nmin_write_gbps = 0.01\nmin_read_gbps = 0.01\n")


def run(cluster, tmp_path: Path, tag: str, names: Optional[List[str]], *args: str,
        thresholds: str = FAST) -> subprocess.CompletedProcess:
    """`preflight run` over the cluster, its stdout piped (the width CI logs get)."""
    config = tmp_path / f"{tag}.toml"
    config.write_text(thresholds)
    argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable,
            "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--hostfile", str(cluster.hostfile(tmp_path / tag, names)),
            "--config", str(config), "--connect-timeout", "5", "--json", str(tmp_path / f"{tag}.json"), *args]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
                          env=env)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def test_broken_six_host_cluster_prints_one_line_per_cause_and_not_ready(netcluster_factory, tmp_path, request):
    """The issue's scenario, which printed 112 lines (28 of them "not run"): at most 60 lines, no "not run" line,
    a skip reason shared by several hosts once, and NOT READY last but one. Then a healthy run says READY."""
    from tests.runner.test_host_checks_cluster import libaio_runtime
    lib = libaio_runtime()
    # Not under /tmp: each host mounts a private tmpfs there before the setup commands run.
    empty = Path(tempfile.mkstemp(prefix="preflight-empty-", dir="/dev/shm")[1])
    request.addfinalizer(empty.unlink)
    cluster = netcluster_factory(n=6, setup={"node05": [["mount", "--bind", str(empty), lib]]})
    for h in cluster.hosts:
        if h.name != "node06":  # node06 lacks the NVMe path
            cluster.exec(h, ["mkdir", "-p", NVME], check=True)
    cluster.firewall("node02")  # inbound TCP to the high ports dropped: NCCL would hang at init
    os.kill(cluster.host("node03").pid, signal.SIGTERM)  # a dead sshd: connection refused
    hung = cluster.host("node04").pid
    os.kill(hung, signal.SIGSTOP)  # a hung sshd: TCP is accepted by the kernel, no banner ever comes
    request.addfinalizer(lambda: os.kill(hung, signal.SIGCONT))
    proc = run(cluster, tmp_path, "broken", None, "--nvme-path", NVME)
    os.kill(hung, signal.SIGCONT)
    (tmp_path / "broken.txt").write_text(proc.stdout)  # what a person reads (kept for the record)
    lines = proc.stdout.splitlines()
    shown = proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 1, shown
    assert len(lines) <= 60, shown
    assert not any("not run" in ln for ln in lines), shown
    assert lines[-2].startswith("NOT READY: "), shown
    assert re.fullmatch(r"\d+ passed, \d+ failed, \d+ warned, .*\d+ blocked in [\d.]+s", lines[-1]), shown
    for needed in ("node02 ports", "node[03-04] unreachable"):
        assert needed in lines[-2], shown
    # Each cause once: the dead and the hung host one line each, the others' faults named on their hosts.
    causes_shown = [ln for ln in lines if "::" in ln]
    assert [ln.split(" ")[0] for ln in causes_shown if ln.split(" ")[0].endswith("::ssh")] == \
        ["node03::ssh", "node04::ssh"], shown
    assert any(ln.startswith("node05::libaio FAILED") for ln in causes_shown), shown
    assert any(ln.startswith("node06::nvme FAILED") and NVME in ln for ln in causes_shown), shown
    assert any(ln.startswith("node02::ports FAILED") for ln in causes_shown), shown
    # The CPU-only hosts' skip reasons: each printed once, for all four reachable hosts, after every FAIL and ERROR.
    skipped = [ln for ln in causes_shown if " SKIPPED - " in ln]
    assert skipped and len(set(skipped)) == len(skipped), shown
    for ln in skipped:
        reason = ln.split(" SKIPPED - ", 1)[1]
        assert proc.stdout.count(reason) == 1, (reason, shown)
    assert any(ln.startswith("node[01-02,05-06]::") and "no NVIDIA driver" in ln for ln in skipped), shown
    first_skip = causes_shown.index(skipped[0])
    assert not any(re.search(r" (FAILED|ERROR) - ", ln) for ln in causes_shown[first_skip:]), shown

    data = json.loads((tmp_path / "broken.json").read_text())
    cells = {(r["host"], r["check"]): r for r in data["results"]}
    for dead in ("node03", "node04"):
        assert cells[(dead, "ssh")]["status"] == "error" and "blocked_by" not in cells[(dead, "ssh")]
        assert cells[(dead, "libaio")]["status"] == "error" and cells[(dead, "libaio")]["blocked_by"] == "ssh"
        assert any(c["check"] == "ssh" and c["hosts"] == [dead] and c["blocked"] > 0 for c in data["causes"])
    assert data["summary"]["blocked"] == sum(1 for r in data["results"] if r.get("blocked_by"))

    # The healthy hosts alone (node02 without its firewall): READY, and with -q those two lines only.
    cluster.unfirewall("node02")
    healthy = run(cluster, tmp_path, "healthy", ["node01", "node02"], "--checks", "python,libaio,ports,launcher_ssh")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert healthy.stdout.splitlines()[-2] == "READY", healthy.stdout
    quiet = run(cluster, tmp_path, "quiet", ["node01", "node02"], "--checks", "python,libaio", "-q")
    assert quiet.returncode == 0 and quiet.stdout.splitlines()[0] == "READY", quiet.stdout
    assert re.fullmatch(r"READY\n6 passed, 0 failed, 0 warned in [\d.]+s\n", quiet.stdout), quiet.stdout
    # --strict -q with a warning (every round trip above 0 ms): exit 1, and the verdict says why.
    strict = run(cluster, tmp_path, "strict", ["node01", "node02"], "--checks", "python", "--strict", "-q",
                 thresholds=FAST + "[ssh]\nwarn_rtt_ms = 0.0\n")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    # The verdict counts causes: two hosts whose warnings read the same (the same round trip and connect time,
    # to the digits shown) are one cause on node[01-02], otherwise two.
    warned = [c for c in json.loads((tmp_path / "strict.json").read_text())["causes"] if c["status"] == "warn"]
    assert sorted(h for c in warned for h in c["hosts"]) == ["node01", "node02"], warned
    count = "1 warning" if len(warned) == 1 else "2 warnings"
    assert strict.stdout.splitlines() == [
        f"NOT READY: {count}, and --strict fails on warnings (node[01-02] ssh)",
        strict.stdout.splitlines()[1]] and strict.stdout.splitlines()[1].startswith("2 passed, 0 failed, 2 warned")


def test_a_shared_fix_lists_each_hosts_own_commands_never_a_placeholder():
    """Grouped, three unknown keys share a line; their fix is still pasteable: each host's own keyscan line."""
    report = cluster_report(n=12, key_unknown=["node03", "node04", "node05"])
    for r in report.results:
        if r.check == "ssh" and r.status == Status.FAIL:
            address = r.metrics["address"]
            r.fix = ("verify the key, then rerun with --accept-new-host-keys, or record it with:\n"
                     f"  ssh-keygen -F {address} -f /k >/dev/null || ssh-keyscan {address} >> /k")
    (cause,) = [c for c in causes(report) if c.check == "ssh"]
    assert cause.hosts == ["node03", "node04", "node05"] and "<address>" in cause.message
    assert cause.details[0].startswith("node03: address 198.18.0.3, fingerprint SHA256:")
    prose, *commands = cause.fix.split("\n")
    assert prose.startswith("verify the key") and "<address>" not in cause.fix
    assert [c.split()[-3] for c in commands] == ["198.18.0.3", "198.18.0.4", "198.18.0.5"]
    many = cluster_report(n=12, key_unknown=[f"node{i:02d}" for i in range(2, 12)])
    for r in many.results:
        if r.check == "ssh" and r.status == Status.FAIL:
            r.fix = f"record it with:\n  ssh-keyscan {r.metrics['address']} >> /k"
    (cause,) = [c for c in causes(many) if c.check == "ssh"]
    assert len(cause.fix.split("\n")) == 1 + 8 + 1 and "2 more hosts: -v prints" in cause.fix
