"""preflight rehearse: the job's real launch (DeepSpeed's launcher over pdsh) on namespace hosts, and its verdicts.

The cluster tests run the real thing: three namespace hosts with their own sshd, ``deepspeed --hostfile H --launcher
pdsh preflight_rehearse.py --deepspeed_config C`` started on node01 over preflight's SSH, pdsh's ssh from node01 to
every host, torch CPU and DeepSpeed's CPU accelerator over gloo, ZeRO-2 and ZeRO-3 with AdamW.

node02 has the stock Debian/Ubuntu /etc/hosts line ``127.0.1.1 node02``: its hostname resolves to a loopback address,
so a gloo rank there advertises 127.0.1.1 to the others unless GLOO_SOCKET_IFNAME names an interface, exactly the
failure of issue 24's measured example (there every rank advertised 127.0.0.1; on this machine's namespace hosts,
whose /etc/hosts maps every name to its cluster address, the launch works without the variable, so the test plants
the commonest real cause). preflight's own checks pass on such a cluster; `preflight run --env-file` writes the
GLOO_SOCKET_IFNAME that fixes the launch.

DeepSpeed JIT-builds two ops at a CPU rank's start (deepspeed_shm_comm at init, fused_adam for AdamW), 2-6 minutes
each on this 2-core machine. The hosts read this machine's home through an overlay, so the module first builds them
here once (a one-rank rehearsal of the same script), as a cluster has them after its first job; the rehearsal
reports each op's load time either way.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.hostfile import HostSpec
from preflight.hostside import rehearsal as host_side
from preflight.hostside.outcome import Status
from preflight.rehearse import EventLog, Outcomes, RehearseOptions, expected_ranks, pattern_of, script_source
from tests.netcluster import NetCluster
from tests.cli.test_cli_cluster import assert_nothing_left, leftovers

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(sys.executable).parent / "deepspeed"
INIT_TIMEOUT = 40
ZERO2 = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
ZERO3 = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}}
LOOPBACK_HOST = "node02"


# ------------------------------------------------------------------------------------ without a cluster

def test_the_event_line_stays_one_atomic_write_and_keeps_the_cause():
    trace = "Traceback (most recent call last):\n" + "  File \"x.py\", line 1, in f\n" * 400 + \
        "RuntimeError: the cause"
    line = host_side.event_line({"run": "r", "event": "error", "traceback": trace, "message": "m"})
    assert len(line) <= host_side.MAX_EVENT_BYTES and line.endswith(b"\n") and line.count(b"\n") == 1
    payload = json.loads(line[len(host_side.TAG) + 1:])
    assert payload["traceback"].startswith("Traceback") and payload["traceback"].endswith("RuntimeError: the cause")


def test_gloo_address_is_found_as_torch_finds_it():
    lo = host_side.gloo_address({"GLOO_SOCKET_IFNAME": "lo"}, "ignored")
    assert lo["address"] == "127.0.0.1" and lo["loopback"] and lo["source"] == "GLOO_SOCKET_IFNAME=lo"
    local = host_side.gloo_address({}, "localhost")  # resolves to 127.0.0.1 (or ::1), which binds
    assert local["loopback"] and local["address"] in ("127.0.0.1", "::1")
    unknown = host_side.gloo_address({}, "no-such-host.invalid")
    assert unknown["address"] == host_side.LOOPBACK_FALLBACK and unknown["loopback"]
    assert "falls back to the loopback address" in unknown["source"]


def test_ranks_follow_deepspeeds_layout_and_the_pattern_never_matches_its_shell():
    hosts = [HostSpec("a", 2, 0, [0, 1]), HostSpec("b", 1, 1, [3])]
    assert [(s.rank, s.host, s.local_rank) for s in expected_ranks(hosts)] == [(0, "a", 0), (1, "a", 1), (2, "b", 0)]
    import re
    token = "preflight-rehearse-0123456789ab"
    assert re.search(pattern_of(token), "python x.py --preflight-run " + token)
    assert not re.search(pattern_of(token), "pkill -KILL -f " + pattern_of(token))
    assert script_source() == Path(host_side.__file__).read_text()


def _options(hosts, config="/shared/ds.json"):
    return RehearseOptions(hostfile="hostfile", hosts=hosts, deepspeed_config=config)


def _log(token, hosts, lines):
    log = EventLog(token, hosts)
    log.feed("".join(line + "\n" for line in lines).encode())
    log.finish()
    return log


def test_a_launcher_without_pdsh_fails_on_the_launch_host_before_any_rank():
    # DeepSpeed 0.19.8's runner on a launch host without pdsh (runner.py: runner.backend_exists()).
    hosts = [HostSpec("node01", 1, 0, [0]), HostSpec("node02", 1, 1, [0])]
    log = _log("t", ["node01", "node02"], [
        '@@PF-REHEARSE {"run": "t", "event": "launcher", "role": "launcher", "argv": ["deepspeed"]}',
        "Traceback (most recent call last):",
        "RuntimeError: launcher 'pdsh' not installed.",
        '@@PF-REHEARSE {"run": "t", "event": "launcher_exit", "role": "launcher", "rc": 1}'])
    out = Outcomes(_options(hosts), "node01", log, "the launcher exited", 5.0, {"rc": 0})
    rows = out.host_rows()
    assert rows["node01"].status == Status.FAIL and "before any rank started (no pdsh)" in rows["node01"].message
    assert "install pdsh on node01" in rows["node01"].fix
    assert rows["node02"].status == Status.FAIL and "never started" in rows["node02"].message
    assert out.cluster_row(rows).status == Status.FAIL


def test_a_rank_that_never_started_is_named_with_pdshs_line_for_its_host():
    hosts = [HostSpec("node01", 1, 0, [0]), HostSpec("node02", 1, 1, [0])]
    start = '@@PF-REHEARSE {{"run": "t", "event": "{}", "rank": 0, "local_rank": 0, "host": "node01"}}'
    log = _log("t", ["node01", "node02"], [
        "node01: " + start.format("start"), "node01: " + start.format("imported"),
        "node01: " + start.format("init_begin"),
        "node02: sh: 1: /opt/venv/bin/python3: not found",
        "pdsh@node01: node02: ssh exited with exit code 127",
        '@@PF-REHEARSE {"run": "other-run", "event": "start", "rank": 1}'])  # another run's event: not ours
    out = Outcomes(_options(hosts), "node01", log, "--timeout 30 s passed", 30.0, {})
    rows = out.host_rows()
    assert rows["node02"].status == Status.FAIL and "rank(s) 1 never started (python)" in rows["node02"].message
    assert "/opt/venv/bin/python3: not found" in rows["node02"].message
    assert "same path on node02" in rows["node02"].fix
    assert "hung in init_process_group" in rows["node01"].message


def test_ranks_hung_at_init_get_firewall_lines_for_the_cluster_not_the_word_firewall():
    """Both ranks hung in init_process_group (a host drops the ranks' ports): before the follow-up to issue 30 the
    fix said "allow TCP 29500 and the ranks' ports between the hosts (firewall)". Now it is firewall_fix's lines
    for the ranks' advertised addresses, each a command to paste, with the tools a host may run."""
    hosts = [HostSpec("node01", 1, 0, [0]), HostSpec("node02", 1, 1, [0])]
    ev = '@@PF-REHEARSE {{"run": "t", "event": "{}", "rank": {}, "local_rank": 0{}}}'
    env = ', "env": {"MASTER_ADDR": "10.9.0.1", "MASTER_PORT": "29500"}'
    lines = []
    for rank, host in enumerate(("node01", "node02")):
        lines += [f"{host}: " + ev.format("start", rank, env), f"{host}: " + ev.format("imported", rank, ""),
                  f"{host}: " + ev.format("init_begin", rank, f', "advertise": {{"address": "10.9.0.{rank + 1}"}}')]
    rows = Outcomes(_options(hosts), "node01", _log("t", ["node01", "node02"], lines), "--timeout 30 s passed",
                    30.0, {}).host_rows()
    fix = rows["node02"].fix
    assert "hung in init_process_group" in rows["node02"].message and "(firewall)" not in fix, fix
    pasted = [line[2:] for line in fix.splitlines() if line.startswith("  ")]
    assert "iptables -I INPUT -p tcp -s 10.9.0.1,10.9.0.2 --dport 1024:65535 -j ACCEPT" in pasted, fix
    assert "firewall-cmd --add-port=1024-65535/tcp" in pasted and "ports,interfaces" in fix, fix


def test_a_config_missing_on_one_host_is_named_there():
    hosts = [HostSpec("node01", 1, 0, [0]), HostSpec("node02", 1, 1, [0])]
    event = '@@PF-REHEARSE {{"run": "t", "event": "{}", "rank": {}, "local_rank": 0{}}}'
    error = ', "phase": "config", "type": "FileNotFoundError", "message": "[Errno 2] No such file or directory: ' \
            '\'/shared/ds.json\'", "traceback": "Traceback ..."'
    log = _log("t", ["node01", "node02"], [
        "node01: " + event.format("start", 0, ""), "node02: " + event.format("start", 1, ""),
        "node02: " + event.format("error", 1, error), "node01: " + event.format("init_begin", 0, "")])
    rows = Outcomes(_options(hosts), "node01", log, "stopped 10 s after the first rank raised", 20.0, {}).host_rows()
    assert rows["node02"].status == Status.FAIL and "cannot open the DeepSpeed config /shared/ds.json on node02" \
        in rows["node02"].message
    assert "copy /shared/ds.json to the same path on node02" in rows["node02"].fix
    assert rows["node02"].metrics["cause"] == "config missing"


def test_a_supervisor_that_never_ran_names_python(tmp_path):
    hosts = [HostSpec("node01", 1, 0, [0])]
    log = _log("t", ["node01"], ["sh: 1: exec: /opt/py/bin/python3: not found"])  # sh's stderr, streamed
    out = Outcomes(_options(hosts), "node01", log, "the launcher exited", 1.0, {"rc": 127})
    row = out.host_rows()["node01"]
    assert row.status == Status.FAIL and "(no supervisor): sh: 1: exec: /opt/py/bin/python3: not found" in row.message
    assert row.fix.startswith("pass --python with an interpreter that exists on node01")


def test_every_output_renders_a_rehearsal(tmp_path):
    """The rehearsal's check ('launch') is not in the registry: every renderer still writes its report."""
    from preflight import render
    from preflight.results import CLUSTER, Report, Result
    hosts = [HostSpec("node01", 1, 0, [0]), HostSpec("node02", 1, 1, [0])]
    log = _log("t", ["node01", "node02"], [
        '@@PF-REHEARSE {"run": "t", "event": "launcher", "role": "launcher", "argv": ["deepspeed"]}',
        "RuntimeError: launcher 'pdsh' not installed."])
    out = Outcomes(_options(hosts), "node01", log, "the launcher exited", 5.0, {"rc": 1})
    rows = out.host_rows()
    results = [Result.from_outcome(h, "launch", o) for h, o in rows.items()]
    results.append(Result.from_outcome(CLUSTER, "launch", out.cluster_row(rows)))
    report = Report("2026-01-01T00:00:00+00:00", 5.0, [], results, ["launch"])
    assert report.exit_code == 1
    for output in render.RENDERERS:
        path = tmp_path / ("out-" + output.name)
        output.to_path(report, str(path))
        assert path.stat().st_size > 0 or output.name == "env_file", output.name
    assert "install pdsh on node01" in (tmp_path / "out-json").read_text()


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node01 slots=1\n")
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    for args, expected in (
            (["--deepspeed-config", str(bad)], "not JSON"),
            (["--deepspeed-config", str(tmp_path / "missing.json")], "no such file on this machine"),
            (["--deepspeed-config", str(bad), "--launch-from", "node09"], "not JSON"),
    ):
        proc = subprocess.run([sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(hostfile), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, env=_env())
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    good = tmp_path / "ok.json"
    good.write_text(json.dumps(ZERO2))
    proc = subprocess.run([sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(hostfile),
                           "--deepspeed-config", str(good), "--launch-from", "node09"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2 and "--launch-from node09: not 'first', 'local' or a host" in proc.stderr


def test_the_launch_check_is_opt_in_and_selected_by_rehearse(tmp_path):
    from preflight import cli
    from preflight.checks import launch
    from preflight.hostside.seams import CheckOptions
    from preflight.testing import check_options
    assert "launch" not in cli.select_checks(None, None, CheckOptions(deepspeed_config="c.json"))
    assert "launch" in cli.select_checks(None, None, check_options(deepspeed_config="c.json", rehearse=True))
    assert cli.select_checks("launch", None, CheckOptions()) == ["launch"]
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--rehearse"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=_env())
    assert proc.returncode == 2 and "--rehearse needs --deepspeed-config" in proc.stderr, proc.stderr
    # Where it cannot launch it says why; a process that survived the clean-up is an ERROR of its host.
    assert launch.evaluate({"skipped": "no config"}, {})["*"].status == Status.SKIP
    rows = {"node01": {"status": "pass", "message": "rank 0 (local 0): init 1 s", "fix": "", "metrics": {}}}
    out = launch.evaluate({"rows": rows, "survivors": {"node01": "123 python3 x"}, "token": "preflight-rehearse-1"}, {})
    assert out["node01"].status == Status.ERROR and "survived pkill -KILL on node01: 123 python3 x" in out["node01"].message
    assert "pkill -KILL -f preflight-rehearse-1" in out["node01"].fix
    # The run's -i/-e selection reaches the launcher as DeepSpeed's --include.
    hosts = [HostSpec("a", 2, 0, [0, 1]), HostSpec("b", 1, 1, [3])]
    assert launch.hostfile_text(hosts) == "a slots=2\nb slots=4\n" and launch.include_of(hosts) == "a:0,1@b:3"
    assert launch.include_of([HostSpec("a", 2, 0, [0, 1])]) == ""


# ----------------------------------------------------------------------------------- on namespace hosts

def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    env.pop("DS_ENV_FILE", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def debian_cluster(warm_ops):
    """Three hosts; node02's /etc/hosts starts with Debian's '127.0.1.1 node02' line."""
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    if not shutil.which("pdsh") or not LAUNCHER.exists():
        pytest.fail("the rehearsal needs pdsh and DeepSpeed's launcher (tests/install-deps.sh installs both)")
    with NetCluster(3, names=["node01", "node02", "node03"]) as cluster:
        hosts = cluster.dir / ("debian-hosts-" + LOOPBACK_HOST)
        hosts.write_text(f"127.0.1.1\t{LOOPBACK_HOST}\n" + cluster.exec(LOOPBACK_HOST, "cat /etc/hosts").stdout)
        cluster.exec(LOOPBACK_HOST, ["mount", "--bind", str(hosts), "/etc/hosts"], check=True)
        resolved = cluster.exec(LOOPBACK_HOST, ["getent", "hosts", LOOPBACK_HOST], check=True).stdout
        assert resolved.startswith("127.0.1.1"), resolved
        for name, config in (("zero2", ZERO2), ("zero3", ZERO3)):
            (cluster.dir / (f"ds_{name}.json")).write_text(json.dumps(config))  # /run: every host sees it
        yield cluster


def rehearse(cluster, workdir, config, *extra, timeout=400):
    report = workdir / "rehearse.json"
    if report.exists():
        report.unlink()
    argv = [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster.hostfile(workdir / "hostfile")),
            "--deepspeed-config", str(cluster.dir / (f"ds_{config}.json")), "--ssh-config", str(cluster.ssh_config),
            "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts),
            "--deepspeed", str(LAUNCHER), "--python", sys.executable, "--init-timeout", str(INIT_TIMEOUT),
            "--json", str(report), *map(str, extra)]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=_env())
    elapsed = time.monotonic() - started
    assert "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(report.read_text())
    return proc, {r["host"]: r for r in data["results"]}, elapsed


def _times(cells):
    """Per rank: (rank, host, init s, initialize s, step s...), and the cluster's launch-to-last-step."""
    ranks = [r for host, cell in cells.items() if host != "*" for r in cell["metrics"]["ranks"]]
    return sorted((r["rank"], r["host"], r.get("init_s"), r.get("initialize_s"), r.get("step_s")) for r in ranks)


def test_with_the_recommended_env_file_zero2_and_zero3_launch(debian_cluster, tmp_path):
    cluster = debian_cluster
    env_file = tmp_path / ".deepspeed_env"
    run = subprocess.run([sys.executable, "-m", "preflight", "run", "--hostfile",
                          str(cluster.hostfile(tmp_path / "hostfile")), "--python", sys.executable,
                          "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
                          "--known-hosts", str(cluster.known_hosts), "--checks", "interfaces",
                          "--env-file", ".deepspeed_env"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, stdin=subprocess.DEVNULL, env=_env())
    assert run.returncode == 0, run.stdout + run.stderr  # preflight's own gate passes on this cluster
    assert "GLOO_SOCKET_IFNAME=eth0" in env_file.read_text().splitlines(), env_file.read_text()

    for config, stage in (("zero2", 2), ("zero3", 3)):
        proc, cells, elapsed = rehearse(cluster, tmp_path, config)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert set(cells) == {"node01", "node02", "node03", "*"}
        for host in ("node01", "node02", "node03"):
            cell = cells[host]
            assert cell["check"] == "launch" and cell["status"] == "pass", cell
            (rank,) = cell["metrics"]["ranks"]
            assert rank["host"] == host and rank["hostname"] == host and rank["state"] == "done"
            assert rank["init_s"] > 0 and rank["initialize_s"] > 0 and len(rank["step_s"]) == 2
            assert all(s > 0 for s in rank["step_s"]) and rank["zero_stage"] == stage and rank["train_batch"] == 6
            assert rank["advertise"]["source"] == "GLOO_SOCKET_IFNAME=eth0" and not rank["advertise"]["loopback"]
            assert f"rank {rank['rank']} (local 0): init " in cell["message"] and "steps " in cell["message"]
        whole = cells["*"]
        assert whole["status"] == "pass" and f"ZeRO-{stage}" in whole["message"]
        assert "3 ranks on 3 hosts started by `deepspeed --launcher pdsh` from node01" in whole["message"]
        assert [f["keys"] for f in whole["metrics"]["env_files"]] == [
            [line.split("=")[0] for line in env_file.read_text().splitlines()]]
        assert str(env_file) in whole["message"]  # named as the file it was copied from
        print(f"\n{config}: exit {proc.returncode} in {elapsed:.1f} s (launch to last step "
              f"{whole['metrics']['launch_to_last_step_s']:.1f} s); per rank (rank, host, init_s, initialize_s, "
              f"step_s): {_times(cells)}")
        assert_nothing_left(cluster)


def test_without_the_env_file_it_names_the_rank_that_advertised_loopback(debian_cluster, tmp_path):
    cluster = debian_cluster
    assert not (tmp_path / ".deepspeed_env").exists()
    proc, cells, elapsed = rehearse(cluster, tmp_path, "zero2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # Bounded: rank 0 raises within seconds (connection refused on 127.0.1.1); the others would wait minutes in
    # gloo's connect, and are stopped GRACE_S after the first raise, then killed on every host.
    assert elapsed < INIT_TIMEOUT + 60, elapsed
    culprit = cells[LOOPBACK_HOST]
    assert culprit["status"] == "fail", culprit
    assert "rank 1 (local 0) advertised the loopback address 127.0.1.1" in culprit["message"]
    assert "hostname node02 resolves to 127.0.1.1" in culprit["message"]
    assert "GLOO_SOCKET_IFNAME" in culprit["fix"] and "NCCL_SOCKET_IFNAME" in culprit["fix"]
    assert "--env-file .deepspeed_env" in culprit["fix"]
    assert culprit["metrics"]["cause"] == "loopback"
    for host in ("node01", "node03"):  # the ranks that tried to reach it name it
        assert cells[host]["status"] == "fail" and "rank 1 (local 0) on node02" in cells[host]["message"], cells[host]
    whole = cells["*"]
    assert whole["status"] == "fail" and "rank 1 (local 0) on node02 (127.0.1.1)" in whole["message"]
    assert "GLOO_SOCKET_IFNAME" in whole["fix"] and "no .deepspeed_env" in whole["message"]
    assert "node02::launch FAILED - rank 1 (local 0) advertised the loopback address" in proc.stdout
    print(f"\nwithout .deepspeed_env: exit {proc.returncode} in {elapsed:.1f} s: {culprit['message']}")
    assert_nothing_left(cluster)


def test_the_timeout_stops_the_launch_and_kills_every_rank(debian_cluster, tmp_path):
    """A job that would outlive --timeout: every rank is still stepping when it passes; all are killed."""
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n")
    proc, cells, elapsed = rehearse(debian_cluster, tmp_path, "zero2", "--rehearse-steps", "100000",
                                    "--timeout", "45")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 45 + 60, elapsed
    for host in ("node01", "node02", "node03"):
        assert cells[host]["status"] == "fail" and "still in step" in cells[host]["message"], cells[host]
        assert "--timeout 45 s passed" in cells[host]["message"]
    assert_nothing_left(debian_cluster)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_an_interrupted_or_killed_coordinator_leaves_nothing_behind(debian_cluster, tmp_path, sig):
    """Ctrl-C: the coordinator stops the launch and reaps (exit 130). kill -9: nothing of the coordinator runs any
    more; the launch host's supervisor sees its SSH lifeline close, kills the launcher and reaps over pdsh."""
    cluster = debian_cluster
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n")
    argv = [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
            "--deepspeed-config", str(cluster.dir / "ds_zero2.json"), "--ssh-config", str(cluster.ssh_config),
            "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--deepspeed",
            str(LAUNCHER), "--python", sys.executable, "--rehearse-steps", "100000", "--timeout", "300"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=_env())
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # every rank stepping: ranks, launch.py, pdsh, ssh all alive
            found = leftovers(cluster)
            if sum(1 for h in found.values() for p in h["processes"] if "preflight_rehearse.py --local_rank" in p) >= 3:
                break
            time.sleep(1)
        else:
            pytest.fail(f"the ranks did not start: {leftovers(cluster)}")
        time.sleep(3)
        stopped = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGINT:
        assert proc.returncode == 130, out + err
        assert "interrupted; stopped the launch and cleaned up on the hosts" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 90
    while leftovers(cluster) and time.monotonic() < deadline:
        time.sleep(1)
    print(f"\n{signal.Signals(sig).name}: nothing left {time.monotonic() - stopped:.1f} s after the signal")
    assert leftovers(cluster) == {}


def test_launch_from_this_machine(debian_cluster, tmp_path):
    """--launch-from local: DeepSpeed's launcher runs here, and pdsh and its own `ssh FIRST hostname -I` use this
    machine's ssh (here a wrapper giving it the cluster's ssh config, as a user's ~/.ssh/config would)."""
    cluster = debian_cluster
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {cluster.ssh_config} \"$@\"\n")
    wrapper.chmod(0o755)
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n")
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
            "--deepspeed-config", str(cluster.dir / "ds_zero2.json"), "--ssh-config", str(cluster.ssh_config),
            "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--deepspeed",
            str(LAUNCHER), "--python", sys.executable, "--launch-from", "local", "--json", str(report)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
                          env=_env(PATH=f"{bindir}:{os.environ['PATH']}"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = {r["host"]: r for r in json.loads(report.read_text())["results"]}
    assert all(cells[h]["status"] == "pass" for h in ("node01", "node02", "node03", "*")), cells
    assert "from this machine" in cells["*"]["message"]
    token = cells["*"]["metrics"]["command"].split("--preflight-run ")[1].split()[0]
    assert token.startswith("preflight-rehearse-") and not (Path("/tmp") / token).exists()  # this machine's too
    assert_nothing_left(cluster)


def test_preflight_run_rehearses_the_launch_as_its_launch_check(debian_cluster, tmp_path):
    """The same launch as the `launch` check of `preflight run` (--checks launch), over the run's own connections:
    DeepSpeed's runner in --python's interpreter, from node01, with ./.deepspeed_env; a row per host and the cluster's,
    and nothing left on any host."""
    cluster = debian_cluster
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n")
    report = tmp_path / "run.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "launch",
            "--deepspeed-config", str(cluster.dir / "ds_zero2.json"), "--json", str(report)]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
                          env=_env())
    elapsed = time.monotonic() - started
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    for host in ("node01", "node02", "node03"):
        cell = cells[(host, "launch")]
        assert cell["status"] == "pass", cell
        (rank,) = cell["metrics"]["ranks"]
        assert rank["hostname"] == host and rank["state"] == "done" and len(rank["step_s"]) == 2
        assert rank["zero_stage"] == 2 and rank["train_batch"] == 6
        assert cell["metrics"]["cleanup"]  # reaped on every host
    whole = cells[("*", "launch")]
    assert whole["status"] == "pass" and "3 ranks on 3 hosts" in whole["message"] and "from node01" in whole["message"]
    assert "-m deepspeed.launcher.runner" in whole["metrics"]["command"]
    assert str(tmp_path / ".deepspeed_env") in whole["message"]
    print(f"\npreflight run --checks launch: exit {proc.returncode} in {elapsed:.1f} s: {whole['message']}")
    assert_nothing_left(cluster)
