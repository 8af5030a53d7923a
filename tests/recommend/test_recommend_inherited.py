"""The recommendation against what DeepSpeed's launcher passes the ranks today (preflight/recommend.py: env_diff,
contradictions, add_to_inherited_row): unit tests on facts, the renderers, and real runs on namespace hosts whose
working directory holds a .deepspeed_env that contradicts the measured network."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.hostside.outcome import Status
from preflight.recommend import add_to_inherited_row, advise, contradictions, env_diff, inherited_env
from preflight.results import Report, Result
from preflight.testing import FakeCluster
from tests.netcluster import NetCluster

ROOT = Path(__file__).resolve().parents[2]
DS_ENV = "/job/.deepspeed_env"


def test_inherited_env_is_what_the_launcher_exports(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nNCCL_IB_DISABLE=0\n")
    (work / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n")
    shell = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "HOME": str(home)}
    got = inherited_env(shell, str(work), str(home))
    # NCCL* from the shell, every .deepspeed_env line (the working directory's last); GLOO_* in the shell is
    # not passed by pdsh (runner.py:36), so the ranks do not inherit it.
    assert got == {"NCCL_SOCKET_IFNAME": ["eth0", "the launch shell"],
                   "NCCL_DEBUG": ["INFO", str(home / ".deepspeed_env")],
                   "NCCL_IB_DISABLE": ["1", str(work / ".deepspeed_env")]}


def test_each_variable_gets_its_state():
    env = {"NCCL_SOCKET_IFNAME": "=eth1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
    inherited = {"NCCL_SOCKET_IFNAME": ["eth0", DS_ENV], "NCCL_DEBUG": ["WARN", DS_ENV],
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING": ["1", DS_ENV], "PYTHONPATH": ["/x", "the launch shell"]}
    diff = env_diff(env, inherited, ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE"])
    assert {k: d["state"] for k, d in diff.items()} == {
        "NCCL_SOCKET_IFNAME": "changed", "GLOO_SOCKET_IFNAME": "set", "NCCL_IB_DISABLE": "set",
        "NCCL_DEBUG": "unchanged", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "not set"}  # PYTHONPATH: not preflight's
    assert diff["NCCL_SOCKET_IFNAME"] == {"state": "changed", "recommended": "=eth1", "inherited": "eth0",
                                          "source": DS_ENV, "measured": True}
    assert diff["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["recommended"] is None
    assert diff["NCCL_DEBUG"]["measured"] is False
    # Nothing inherited: every variable is "set".
    assert {d["state"] for d in env_diff(env, {}).values()} == {"set"}


def test_only_a_measured_value_that_differs_contradicts():
    reasons = {"NCCL_SOCKET_IFNAME": "network 10.1.0.0/24 reaches all hosts with the best measured bandwidth"}
    env = {"NCCL_SOCKET_IFNAME": "=eth1", "NCCL_IB_HCA": "=mlx5_0:1", "NCCL_DEBUG": "WARN"}
    measured = ["NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"]
    inherited = {"NCCL_SOCKET_IFNAME": ["eth0", DS_ENV], "NCCL_IB_HCA": ["mlx5_0", "the launch shell"],
                 "NCCL_DEBUG": ["INFO", "the launch shell"]}
    (f,) = contradictions(env_diff(env, inherited, measured), reasons)
    # NCCL_IB_HCA names the same device (no '=', no port): no contradiction; NCCL_DEBUG is the user's choice.
    assert f.status == Status.WARN
    assert f.message == (f"NCCL_SOCKET_IFNAME=eth0 ({DS_ENV}) contradicts preflight's measured recommendation "
                         f"NCCL_SOCKET_IFNAME==eth1 ({reasons['NCCL_SOCKET_IFNAME']}): every rank of the job would "
                         f"use the inherited value")
    assert f.fix.startswith(f"sed -i 's|^NCCL_SOCKET_IFNAME=.*|NCCL_SOCKET_IFNAME==eth1|' {DS_ENV}")
    # From the shell: the export line to paste.
    (g,) = contradictions(env_diff(env, {"NCCL_SOCKET_IFNAME": ["eth0", "the launch shell"]}, measured), reasons)
    assert g.fix.startswith("export NCCL_SOCKET_IFNAME==eth1 in the shell that runs deepspeed")
    # Same names with the exact '=' form, or an unmeasured variable: nothing.
    assert contradictions(env_diff(env, {"NCCL_SOCKET_IFNAME": ["eth1", DS_ENV]}, measured), reasons) == []
    assert contradictions(env_diff(env, inherited, []), reasons) == []


def test_the_fix_works_when_pasted(tmp_path):
    """The sed line of the WARN's fix, run in a shell, makes the file give the ranks the recommended value."""
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("DS_SKIP_CUDA_CHECK=1\nNCCL_SOCKET_IFNAME=eth0\nNCCL_DEBUG=INFO\n")
    (f,) = contradictions(env_diff({"NCCL_SOCKET_IFNAME": "=eth1,ens5"},
                                   {"NCCL_SOCKET_IFNAME": ["eth0", str(env_file)]}, ["NCCL_SOCKET_IFNAME"]), {})
    command = f.fix.split(" (the line")[0]
    subprocess.run(["sh", "-c", command], check=True)
    assert env_file.read_text() == "DS_SKIP_CUDA_CHECK=1\nNCCL_SOCKET_IFNAME==eth1,ens5\nNCCL_DEBUG=INFO\n"
    after = inherited_env({}, str(tmp_path), str(tmp_path / "nohome"))
    assert env_diff({"NCCL_SOCKET_IFNAME": "=eth1,ens5"}, after)["NCCL_SOCKET_IFNAME"]["state"] == "unchanged"


def test_contradictions_join_the_inherited_environments_row():
    from preflight.hostside.outcome import Finding
    warn = Finding(Status.WARN, "NCCL_SOCKET_IFNAME=eth0 (x) contradicts ...", "sed ...")
    # No row yet: the WARN is the row of the check that marked its results with what the ranks inherit.
    results = [Result("node01", "launcher_ssh", Status.PASS, "ok", metrics={"launch_env": {"exported": []}}),
               Result("node01", "iperf3", Status.PASS, "ok")]
    add_to_inherited_row(results, [warn])
    assert (results[-1].host, results[-1].check, results[-1].status) == ("*", "launcher_ssh", Status.WARN)
    assert results[-1].where == "launch shell"  # an inherited value: fixed where deepspeed runs, on no host
    # A FAIL row already there: it stays a FAIL, and lists both findings.
    fail = {"status": "fail", "message": "NCCL_SOCKET_IFNAME=bogus0 matches no interface", "fix": "set it"}
    results = [Result("*", "launcher_ssh", Status.FAIL, fail["message"], "set it",
                      {"launch_env": {"exported": ["NCCL_SOCKET_IFNAME"]}, "findings": [fail]}, 1.5)]
    add_to_inherited_row(results, [warn])
    (row,) = results
    assert row.status == Status.FAIL and row.message == fail["message"] + "; " + warn.message
    assert row.fix == "set it; sed ..." and row.duration_s == 1.5 and row.metrics["launch_env"]
    assert [f["status"] for f in row.metrics["findings"]] == ["fail", "warn"]
    assert row.where == "launch shell"
    # No check looked at the inherited environment (not run, one host, srun): nowhere to put it.
    results = [Result("node01", "iperf3", Status.PASS, "ok")]
    add_to_inherited_row(results, [warn])
    assert len(results) == 1


def _measured_cluster():
    hosts = ["n1", "n2"]
    itf = {"interfaces": [{"name": "eth0", "kind": "physical", "ipv4": []}, {"name": "eth1", "kind": "physical",
                                                                              "ipv4": []}], "ib": [], "peermem": False}
    facts = {h: {"interfaces": itf} for h in hosts}
    facts["*"] = {"iperf3": {"hosts": hosts, "networks": [], "chosen": {
        "network": "10.1.0.0/24", "devices": ["eth1", "eth1"], "hosts": hosts, "median_gbps": 9.4,
        "addresses": {"n1": "10.1.0.1", "n2": "10.1.0.2"}}}}
    return FakeCluster(hosts, facts=facts, addresses={h: h for h in hosts})


def test_advise_and_the_renderers_show_the_diff():
    from preflight.render.terminal import console, print_report
    inherited = {"NCCL_SOCKET_IFNAME": ["eth0", DS_ENV], "NCCL_DEBUG": ["WARN", DS_ENV],
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING": ["1", "the launch shell"]}
    advice = advise(_measured_cluster(), [], inherited=inherited)
    assert advice.env["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert [f.message.split(" contradicts")[0] for f in advice.findings] == [f"NCCL_SOCKET_IFNAME=eth0 ({DS_ENV})"]
    report = Report("2026-01-01T00:00:00+00:00", 1.0, [], [], ["iperf3"], advice.env, advice.reasons, advice.notes,
                    False, advice.diff)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["recommendations"]["diff"]["NCCL_SOCKET_IFNAME"]["state"] == "changed"
    assert data["recommendations"]["diff"]["GLOO_SOCKET_IFNAME"]["state"] == "set"
    assert set(data["recommendations"]) >= {"env", "reasons", "notes", "diff"}  # the old keys stay
    assert Report.from_dict(data).env_diff == advice.diff

    import io
    out = io.StringIO()
    print_report(report, console(out, 200))
    lines = out.getvalue().splitlines()
    at = lines.index("export NCCL_SOCKET_IFNAME==eth1")
    assert lines[at + 1] == f"    # changed from eth0 ({DS_ENV})"
    assert lines[lines.index("export GLOO_SOCKET_IFNAME=eth1") + 1] == "    # set: not inherited today"
    assert lines[lines.index("export NCCL_DEBUG=WARN") + 1] == f"    # unchanged: already WARN ({DS_ENV})"
    assert ("# TORCH_NCCL_ASYNC_ERROR_HANDLING: not set by preflight: 1 (the launch shell) stays") in lines
    # Nothing inherited: the export lines alone, and one line saying so.
    quiet = advise(_measured_cluster(), [], inherited={})
    out = io.StringIO()
    print_report(Report("t", 1.0, [], [], ["iperf3"], quiet.env, quiet.reasons, quiet.notes, False, quiet.diff),
                 console(out, 200))
    text = out.getvalue()
    assert "# none of these is set today in the shell that runs deepspeed or a .deepspeed_env" in text
    assert "# set:" not in text


# --- real runs on namespace hosts ---------------------------------------------------------------------------------

needs_cluster = pytest.mark.skipif(NetCluster.unavailable_reason() is not None,
                                   reason=str(NetCluster.unavailable_reason()))


def run(cluster, tmp_path, work, checks="interfaces,launcher_ssh,iperf3"):
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_", "DS_"))}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"))
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", checks, "--json", str(report)]
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc, json.loads(report.read_text())


@needs_cluster
def test_real_deepspeed_env_contradicting_the_measured_network(netcluster_factory, tmp_path):
    """Two networks, eth1 the faster; the working directory's .deepspeed_env says eth0 (from an earlier run, say)
    and turns error handling off. The run WARNs on both on launcher_ssh's cluster row, the report shows each
    variable's state, and after the WARN's own fix is pasted the rerun has no contradiction and 'unchanged'."""
    from tests.cli.test_cli_cluster import leftovers
    c = netcluster_factory(3, networks=2)
    for h in c.hosts:
        c.shape(h, 50, network=0)
        c.shape(h, 400, network=1)
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "home").mkdir()
    ds_env = work / ".deepspeed_env"
    ds_env.write_text("NCCL_SOCKET_IFNAME=eth0\nNCCL_DEBUG=WARN\nTORCH_NCCL_ASYNC_ERROR_HANDLING=0\n")
    proc, data = run(c, tmp_path, work)
    diff = data["recommendations"]["diff"]
    assert diff["NCCL_SOCKET_IFNAME"] == {"state": "changed", "recommended": "=eth1", "inherited": "eth0",
                                          "source": str(ds_env), "measured": True}, diff
    assert diff["NCCL_DEBUG"]["state"] == "unchanged" and diff["GLOO_SOCKET_IFNAME"]["state"] == "set"
    assert diff["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == {"state": "not set", "recommended": None, "inherited": "0",
                                                       "source": str(ds_env), "measured": False}
    (star,) = [r for r in data["results"] if (r["host"], r["check"]) == ("*", "launcher_ssh")]
    assert star["status"] == "warn", star
    messages = [f["message"] for f in star["metrics"]["findings"]]
    assert any(m.startswith(f"NCCL_SOCKET_IFNAME=eth0 ({ds_env}) contradicts preflight's measured recommendation "
                            f"NCCL_SOCKET_IFNAME==eth1 (network ") for m in messages), messages
    assert any(m.startswith(f"TORCH_NCCL_ASYNC_ERROR_HANDLING=0 ({ds_env}) means no handling") for m in messages)
    assert f"export NCCL_SOCKET_IFNAME==eth1\n    # changed from eth0 ({ds_env})\n" in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout  # WARNs only

    # Paste both fixes as printed, then rerun: nothing contradicts, and the file's value is "unchanged".
    for finding in star["metrics"]["findings"]:
        if "contradicts" in finding["message"]:
            subprocess.run(["sh", "-c", finding["fix"].split(" (the line")[0]], check=True)
    ds_env.write_text(ds_env.read_text().replace("TORCH_NCCL_ASYNC_ERROR_HANDLING=0\n", ""))
    proc, data = run(c, tmp_path, work)
    assert data["recommendations"]["diff"]["NCCL_SOCKET_IFNAME"]["state"] == "unchanged"
    assert not [r for r in data["results"] if r["check"] == "launcher_ssh" and r["status"] != "pass"], data["results"]
    assert proc.returncode == 0, proc.stdout
    assert leftovers(c) == {}
