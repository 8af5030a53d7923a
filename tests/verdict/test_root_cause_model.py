"""Root cause, once (issue 30 item 1): a result that only follows from another (host, check)'s fault (``blocked_by``,
``blocked_host``) is in that one's cause, on any host or the cluster row, counted as blocked, never named in the
verdict; a cause fixed in no host (``where``) is one line, and the verdict says where to fix it and names no host.

Unit tests on hand-made reports (no hosts): the model the checks and the rehearsal judge feed, read by the terminal,
the JSON, JUnit, the launch still possible and the verdict.
"""
from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from typing import List

from preflight import launchable
from preflight.causes import causes, verdict
from preflight.hostside.outcome import BlockedBy, Outcome, Status
from preflight.render.json import report_dict, to_json
from preflight.render.junit import to_junit
from preflight.render.terminal import console, print_report
from preflight.results import CLUSTER, HostRecord, Report, Result
from tests.placeholders import assert_no_placeholder
from tests.verdict.test_verdict import cluster_report

HOSTS = ["node01", "node02", "node03"]


def report_of(results: List[Result], hosts=HOSTS, strict: bool = False) -> Report:
    """Every host reachable with its ssh PASS, then ``results``."""
    cells = [Result(h, "ssh", Status.PASS, f"connected to {h}", metrics={"hostname": h}) for h in hosts]
    return Report("2026-11-29T00:00:00+00:00", 3.0, [HostRecord(h, f"198.18.0.{i}", 8, True)
                                                     for i, h in enumerate(hosts, 1)],
                  cells + list(results), ["ssh"] + list(dict.fromkeys(r.check for r in results)), strict=strict)


def lines(report: Report, context=None) -> List[str]:
    out = io.StringIO()
    print_report(report, console(out, 400), relaunch=context)
    return out.getvalue().splitlines()


def config_missing_on_node02() -> Report:
    """The rehearsal's judge: node02 cannot open the config; node01 and node03 waited for it in init."""
    waited = "hung in init_process_group waiting for rank 1 of node02 (allow TCP 29500 ... firewall)"
    return report_of([
        Result.from_outcome("node01", "rehearse", Outcome(Status.FAIL, waited, "allow TCP 29500",
                                                          blocked_by=BlockedBy("node02", "rehearse"))),
        Result("node02", "rehearse", Status.FAIL, "cannot open the DeepSpeed config /job/ds.json",
               "copy /job/ds.json to node02"),
        Result.from_outcome("node03", "rehearse", Outcome(Status.FAIL, waited, "allow TCP 29500",
                                                          blocked_by=BlockedBy("node02", "rehearse")))])


# ----------------------------------------------------------------------------- blocked_by: one cause

def test_ranks_that_waited_for_another_hosts_rank_are_its_victims():
    report = config_missing_on_node02()
    assert report.results[3].blocker == ("node02", "rehearse") and report.results[3].blocked_host == "node02"
    (cause,) = causes(report)
    assert cause.hosts == ["node02"] and cause.blocked == 2
    assert cause.line() == ("node02::rehearse FAILED - cannot open the DeepSpeed config /job/ds.json (blocks rehearse "
                            "on node[01,03]); fix: copy /job/ds.json to node02")
    assert verdict(report) == "NOT READY: 1 host needs fixing (node02 rehearse)"
    counts = report.counts()
    assert counts["fail"] == 1 and counts["blocked"] == 2 and report.exit_code == 1
    shown = lines(report)
    assert [ln for ln in shown if "::" in ln] == [cause.line()]
    assert shown[-1] == "3 passed, 1 failed, 0 warned, 2 blocked in 3.0s"
    # JSON: the victims keep their status and say whose fault they follow from; one cause, counted.
    data = json.loads(to_json(report))
    assert data["summary"]["causes"] == 1 and data["summary"]["blocked"] == 2 and data["summary"]["exit_code"] == 1
    cells = {(r["host"], r["check"]): r for r in data["results"]}
    assert cells[("node01", "rehearse")]["blocked_by"] == "rehearse"
    assert cells[("node01", "rehearse")]["blocked_host"] == "node02"
    assert data["causes"] == [{"id": "rehearse:1", "status": "fail", "check": "rehearse", "checks": ["rehearse"],
                               "hosts": ["node02"], "nodeset": "node02", "message": cause.message, "fix": cause.fix,
                               "blocked": 2, "blocked_hosts": ["node01", "node03"]}]
    assert Report.from_dict(data).results == report.results
    # JUnit: a victim is an error typed "blocked", with the check and the host that blocked it.
    suite = ET.fromstring(to_junit(report)).find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("1", "2")
    case = next(c for c in suite.iter("testcase") if (c.get("classname"), c.get("name")) == ("node01", "rehearse"))
    assert case.find("error").get("type") == "blocked"
    assert {p.get("name"): p.get("value") for p in case.iter("property")} == {"blocked_by": "rehearse",
                                                                               "blocked_host": "node02"}


def test_a_cluster_wide_fail_that_one_hosts_fault_explains_is_that_hosts_and_a_launch_is_printed(tmp_path):
    """The 6-host case: iperf3's and the all-reduce's cluster FAILs follow from node02's blocked ports."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i:02d} slots=8\n" for i in range(1, 7)))
    by_node02 = BlockedBy("node02", "ports")
    report = cluster_report(extra=[
        Result("node02", "ports", Status.FAIL, "inbound TCP to node02:40000 blocked from node01",
               "on node02 allow TCP from the cluster"),
        Result.from_outcome(CLUSTER, "iperf3", Outcome(Status.FAIL, "no IPv4 network reaches all hosts",
                                                       "put every host on one common subnet", blocked_by=by_node02)),
        Result.from_outcome(CLUSTER, "allreduce", Outcome(Status.FAIL, "all-reduce failed: rank 1 timed out",
                                                          blocked_by=by_node02))])
    (cause,) = [c for c in causes(report) if c.status == Status.FAIL]
    assert cause.hosts == ["node02"] and "blocks allreduce, iperf3 on cluster" in cause.line()
    assert verdict(report) == "NOT READY: 1 host needs fixing (node02 ports)"  # no "cluster-wide"
    line = lines(report, launchable.Context(str(hostfile)))[-2]
    assert line.endswith(f"; launch now: deepspeed --hostfile {hostfile} -e node02 ..."), line
    assert "subnet" not in "\n".join(lines(report))


def test_the_cluster_row_as_the_blocker():
    """A config every rank rejects: the cluster row's ds_config FAIL is the cause of each host's rehearsal FAIL."""
    by_config = BlockedBy(CLUSTER, "ds_config")
    report = report_of([Result.from_outcome(h, "rehearse", Outcome(Status.FAIL, f"rank on {h} raised ValueError",
                                                                   blocked_by=by_config)) for h in HOSTS] +
                       [Result(CLUSTER, "ds_config", Status.FAIL, "train_batch_size 66 != 4 * 4 * 3",
                               "train_batch_size: 48")])
    (cause,) = causes(report)
    assert cause.hosts == [CLUSTER] and cause.blocked == 3
    assert verdict(report) == "NOT READY: cluster-wide: ds_config"
    assert report.counts()["blocked"] == 3 and report.counts()["fail"] == 1


def test_a_victim_of_a_victim_is_in_the_first_ones_cause():
    report = report_of([
        Result("node01", "ports", Status.FAIL, "inbound TCP to node01 blocked", "allow TCP"),
        Result.from_outcome("node02", "allreduce", Outcome(Status.ERROR, "rank timed out",
                                                           blocked_by=BlockedBy("node01", "ports"))),
        Result.from_outcome(CLUSTER, "allreduce", Outcome(Status.FAIL, "no all-reduce",
                                                          blocked_by=BlockedBy("node02", "allreduce")))])
    (cause,) = causes(report)
    assert cause.hosts == ["node01"] and cause.blocked == 2
    assert report.victims() == {4: 3, 5: 3}


def test_a_victim_whose_blocker_passed_or_is_missing_or_milder_is_a_cause_of_its_own():
    """Never hide a failure: the blocker must be in the report and at least as bad."""
    report = report_of([
        Result("node01", "ports", Status.PASS, "ok"),
        Result.from_outcome("node01", "allreduce", Outcome(Status.FAIL, "rank timed out",
                                                           blocked_by=BlockedBy("node01", "ports"))),
        Result.from_outcome("node02", "allreduce", Outcome(Status.FAIL, "rank raised",
                                                           blocked_by=BlockedBy("node09", "ports"))),
        Result("node03", "ports", Status.WARN, "slow", "check the link"),
        Result.from_outcome("node03", "allreduce", Outcome(Status.FAIL, "rank hung",
                                                           blocked_by=BlockedBy("node03", "ports")))])
    assert report.victims() == {}
    assert report.counts()["blocked"] == 0 and report.counts()["fail"] == 3 and report.exit_code == 1
    bad = [c for c in causes(report) if c.status == Status.FAIL]
    assert sorted(h for c in bad for h in c.hosts) == ["node01", "node02", "node03"]
    assert verdict(report).startswith("NOT READY: 3 hosts need fixing")


def test_a_loop_of_blockers_hides_nothing():
    report = report_of([
        Result.from_outcome("node01", "allreduce", Outcome(Status.FAIL, "a", blocked_by=BlockedBy("node02",
                                                                                                  "allreduce"))),
        Result.from_outcome("node02", "allreduce", Outcome(Status.FAIL, "b", blocked_by=BlockedBy("node01",
                                                                                                  "allreduce")))])
    assert report.victims() == {} and report.exit_code == 1
    assert len([c for c in causes(report) if c.status == Status.FAIL]) == 2


def test_a_skip_that_follows_from_a_pass_does_not_fail_the_run():
    report = report_of([Result("node01", "gpu", Status.PASS, "ok"),
                        Result.from_outcome("node01", "gpu_burn", Outcome(Status.SKIP, "no GPU to burn",
                                                                          blocked_by=BlockedBy("node01", "gpu")))])
    assert report.exit_code == 0 and verdict(report) == "READY"


# ----------------------------------------------------------------------------- where: fixed in no host

def inherited_ifname() -> Report:
    """NCCL_SOCKET_IFNAME=bogus0 inherited from the launch shell: every host's launcher_ssh and the cluster row."""
    message = "NCCL_SOCKET_IFNAME=bogus0 (inherited from the launch shell) matches no interface of the hosts"
    fix = "unset NCCL_SOCKET_IFNAME in the shell that runs deepspeed, or export NCCL_SOCKET_IFNAME==eth1"
    return report_of([Result(h, "launcher_ssh", Status.FAIL, message, fix, where="launch shell")
                      for h in HOSTS + [CLUSTER]])


def test_a_cause_of_the_launch_shell_is_one_line_and_the_verdict_names_no_host(tmp_path):
    report = inherited_ifname()
    (cause,) = causes(report)
    assert cause.fixed_in == "launch shell" and cause.hosts == HOSTS + [CLUSTER]
    assert cause.line().startswith("launch shell::launcher_ssh FAILED - NCCL_SOCKET_IFNAME=bogus0 (inherited from "
                                   "the launch shell) matches no interface of the hosts (seen on node[01-03],cluster)")
    text = verdict(report)
    assert text == ("NOT READY: fix in the launch shell (launcher_ssh: NCCL_SOCKET_IFNAME=bogus0 (inherited from the "
                    "launch shell) ...)")
    assert "host" not in text.replace("launch shell", "") and "cluster-wide" not in text
    shown = lines(report, launchable.Context(str(tmp_path / "hostfile")))
    assert [ln for ln in shown if "::" in ln] == [cause.line()]
    assert "launch now" not in shown[-2]  # no host to leave out: a smaller launch would inherit it too
    assert report_dict(report)["causes"][0]["where"] == "launch shell"
    assert report_dict(report)["summary"]["causes"] == 1


def test_a_cause_on_every_host_is_one_line_even_when_each_host_says_its_own_name():
    """--python missing everywhere: each host's message names itself; one line, nobody's host to fix."""
    report = report_of([Result(h, "python", Status.FAIL, f"/opt/venv/bin/python: no such file on {h}",
                               "create the venv on every host, or pass --python", where="every host")
                        for h in HOSTS])
    (cause,) = causes(report)
    assert cause.line() == ("every host::python FAILED - /opt/venv/bin/python: no such file on node[01-03] (seen on "
                            "node[01-03]); fix: create the venv on every host, or pass --python")
    assert verdict(report) == "NOT READY: fix on every host (python: /opt/venv/bin/python: no such file on node[01-03])"
    assert_no_placeholder(cause.line())


def test_a_where_cause_beside_a_hosts_cause_and_a_warning():
    report = inherited_ifname()
    report.results += [Result("node02", "libaio", Status.FAIL, "libaio.so.1 not found", "apt-get install libaio1"),
                       Result("node03", "nvme", Status.WARN, "write 0.8 GB/s < 1.0 GB/s", "use a faster disk")]
    assert verdict(report) == ("NOT READY: fix in the launch shell (launcher_ssh: NCCL_SOCKET_IFNAME=bogus0 (inherited "
                               "from the launch shell) ...); 1 host needs fixing (node02 libaio)")
    report.strict = True
    assert verdict(report).endswith("; and 1 warning, which --strict fails on")


def test_the_html_page_lists_the_one_cause_and_shows_its_victims_as_blocked():
    from preflight.render.html import to_html
    page = to_html(config_missing_on_node02())
    assert "1 cause to fix" in page and page.count('<li class="cause') == 1
    assert "node02::rehearse FAILED - cannot open the DeepSpeed config /job/ds.json (blocks rehearse on " \
           "node[01,03])" in page
    row = page[page.index('data-host="node01"'):page.index('data-host="node02"')]
    assert '<td class="blocked" data-check="rehearse"' in row
    assert '<details class="group" data-status="blocked">' in page


def test_a_victim_on_a_host_with_a_failed_gpu_still_leaves_only_that_gpu_out():
    """node05's GPU 3 failed, and its rank waited for node02's: node02 out, node05 without GPU 3."""
    report = cluster_report(6, extra=[
        Result("node05", "gpu", Status.FAIL, "GPU 3: Xid 79", "drain the host", {"failed_gpus": [3]}),
        Result("node02", "libaio", Status.FAIL, "libaio.so.1 not found", "apt-get install libaio1"),
        Result.from_outcome("node05", "allreduce", Outcome(Status.FAIL, "rank 40 waited for node02",
                                                           blocked_by=BlockedBy("node02", "libaio")))])
    launch = launchable.launchable(report)
    assert launch.exclude_spec() == "node02@node05:3", launch


def test_prometheus_counts_causes_and_marks_victims():
    from preflight.render import prometheus
    text = prometheus.render(config_missing_on_node02(), now=0.0)
    assert 'preflight_causes{command="run"} 1' in text
    assert 'preflight_check_blocked{host="node01",check="rehearse"} 1' in text
    assert 'preflight_check_blocked{host="node02"' not in text


def test_the_written_hostfile_says_a_where_cause_is_no_hosts():
    out = io.StringIO()
    launchable.write(inherited_ifname(), out)
    assert out.getvalue().splitlines()[0] == ("# preflight left out: nothing; to fix in no host, whichever hosts run: "
                                              "launcher_ssh (launch shell)")
