"""Each launch fault of issue 24, planted on real namespace hosts and found the way a user would find it:
``preflight run --hostfile H --deepspeed-config C`` (the default gate, whose cheap launch-path checks run without
--checks), plus the launch rehearsal (``--rehearse``) where the fault is the launcher's own.

Each case: exit 1, the cause named on the right host with the right cause and its fix, within ``BOUND_S``, and
nothing of preflight left on any host (processes, or files in the hosts' private /tmp). The bound is stated in
docs/rehearse.md ("Launch faults") and the README: measured 2-4 times per fault on this repository's 2-core machine
under other sessions' load (17.9-46.2 s; a healthy default gate 39 s), three times the slowest for a loaded CI.

| fault | planted as | caught by |
|---|---|---|
| no pdsh on the launch host | /usr/bin/pdsh hidden under /dev/null in node01's mount namespace | launcher_ssh (and launch) on node01 |
| `hostname -I` starts with an unreachable address | 10.213.7.1/24 first on node01's eth0, on no other host | ports on node01 |
| the config missing on one host | the config in each host's private /tmp, but not node02's | ds_config on node02 |
| a bogus NCCL_SOCKET_IFNAME in the shell | NCCL_SOCKET_IFNAME=bogus0 in preflight's own environment | launcher_ssh, cluster row |
| a firewalled host | nft drops inbound TCP 1024-65535 in node03's namespace | ports on node03 |
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Tuple


from tests.cli.test_cli_cluster import assert_nothing_left

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["node01", "node02", "node03"]
BOUND_S = 150  # every fault's exit 1, from the command's start (docs/rehearse.md, "Launch faults")
CONFIG = {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
UNREACHABLE_NET = "10.213.7.1/24"  # only node01 has it: the others have no route there (test_launch_path's)


def gate(cluster, tmp_path: Path, config: Path, *extra: str, env: Dict[str, str] = None
         ) -> Tuple[subprocess.CompletedProcess, Dict[Tuple[str, str], Dict[str, Any]], float]:
    """`preflight run --hostfile H --deepspeed-config C` as a user runs it (the default checks), from tmp_path:
    (the process, {(host, check): result}, wall seconds)."""
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--deepspeed-config", str(config), "--python", sys.executable, "--ssh-config", str(cluster.ssh_config),
            "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--json", str(report),
            *extra]
    run_env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="240", **(env or {}))
    run_env.pop("DS_ENV_FILE", None)
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S + 120,
                          stdin=subprocess.DEVNULL, env=run_env)
    elapsed = time.monotonic() - started
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    cells = {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    print(f"\n{elapsed:.1f} s, exit {proc.returncode}\n{proc.stdout}")
    return proc, cells, elapsed


def shared_config(cluster) -> Path:
    """The config where every host sees it at the same path (/run: the cluster's state directory)."""
    path = cluster.dir / "ds.json"
    path.write_text(json.dumps(CONFIG))
    return path


def exits_1_in_bound(proc, elapsed: float) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < BOUND_S, f"{elapsed:.1f} s, over the stated bound of {BOUND_S} s"


def failed(cells, host: str, check: str) -> Dict[str, Any]:
    cell = cells[(host, check)]
    assert cell["status"] == "fail", cell
    return cell


def test_no_pdsh_on_the_launch_host(warm_ops, netcluster_factory, tmp_path):
    """pdsh is gone from node01 alone (the launch host: the hostfile's first host); the others keep theirs."""
    cluster = netcluster_factory(3, names=NAMES)
    pdsh = shutil.which("pdsh")
    assert pdsh, "tests/install-deps.sh installs pdsh"
    cluster.exec("node01", ["mount", "--bind", "/dev/null", pdsh], check=True)
    assert cluster.exec("node01", ["sh", "-c", "command -v pdsh"]).returncode != 0
    assert cluster.exec("node02", ["sh", "-c", "command -v pdsh"]).returncode == 0

    proc, cells, elapsed = gate(cluster, tmp_path, shared_config(cluster), "--rehearse")
    exits_1_in_bound(proc, elapsed)
    cell = failed(cells, "node01", "launcher_ssh")
    assert "pdsh launcher is not installed on node01" in cell["message"], cell["message"]
    assert "launcher 'pdsh' not installed." in cell["message"]
    assert "install pdsh on node01" in cell["fix"]
    for host in ("node02", "node03"):
        assert "pdsh" not in cells[(host, "launcher_ssh")]["message"], cells[(host, "launcher_ssh")]
    # The rehearsal meets it for real: DeepSpeed's runner raises on node01 before any rank starts.
    launch = failed(cells, "node01", "launch")
    assert "before any rank started (no pdsh)" in launch["message"] and "launcher 'pdsh' not installed" in \
        launch["message"], launch["message"]
    assert "install pdsh on node01" in launch["fix"]
    assert "node01::launcher_ssh FAILED" in proc.stdout or "node01" in proc.stdout.split("launcher_ssh")[0]
    assert_nothing_left(cluster)


def test_hostname_i_starts_with_an_address_the_others_cannot_reach(
        warm_ops, netcluster_factory, tmp_path):
    """node01's `hostname -I` starts with 10.213.7.1, on a network only node01 is on: DeepSpeed's launcher would
    give every rank that master address (runner.py:499-513, `ssh FIRST hostname -I`)."""
    first_extra = ("a=$(ip -4 -o addr show dev eth0 | awk '{print $4}'); ip addr flush dev eth0; "
                   f"ip addr add {UNREACHABLE_NET} dev eth0; ip addr add $a dev eth0")
    cluster = netcluster_factory(3, names=NAMES, setup={"node01": [first_extra]})
    good = cluster.hosts[0].addresses[0]
    assert cluster.exec("node01", ["hostname", "-I"], check=True).stdout.split()[:2] == ["10.213.7.1", good]

    proc, cells, elapsed = gate(cluster, tmp_path, shared_config(cluster))
    exits_1_in_bound(proc, elapsed)
    cell = failed(cells, "node01", "ports")
    assert "10.213.7.1" in cell["message"] and "hostname -I" in cell["message"], cell["message"]
    assert "node02" in cell["message"] and "node03" in cell["message"]
    assert f"--master_addr {good}" in cell["fix"] and f"--master-addr {good}" in cell["fix"]
    for host in ("node02", "node03"):
        assert cells[(host, "ports")]["status"] == "pass", cells[(host, "ports")]
    assert_nothing_left(cluster)


def test_the_config_missing_on_one_host(warm_ops, netcluster_factory, tmp_path):
    """The config at one path, which every rank opens on its own host: each host's private /tmp has it but
    node02's."""
    cluster = netcluster_factory(3, names=NAMES)
    work = Path(f"/tmp/pf-faults-{os.getpid()}")
    config = work / "ds.json"
    text = json.dumps(CONFIG)
    try:
        work.mkdir()
        config.write_text(text)
        for host in ("node01", "node03"):
            cluster.exec(host, ["sh", "-c", f"mkdir -p {work} && cat > {config}"], check=True, input=text)
        proc, cells, elapsed = gate(cluster, tmp_path, config)
        exits_1_in_bound(proc, elapsed)
        cell = failed(cells, "node02", "ds_config")
        star = cells[("*", "ds_config")]
        said = " | ".join(f["message"] for f in star["metrics"].get("findings", [])) or star["message"]
        assert f"{config} is missing on node02" in said, said
        assert ("node01", "ds_config") not in cells and ("node03", "ds_config") not in cells
        assert "node02" in cell["fix"] or "node02" in star["fix"], (cell, star)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for host in ("node01", "node03"):  # what the test planted; preflight's own leftovers are still looked for
            cluster.exec(host, ["rm", "-rf", str(work)])
    assert_nothing_left(cluster)


def test_the_config_missing_on_one_host_rehearsed_fails_that_host_and_blocks_the_two_that_waited(
        warm_ops, netcluster_factory, tmp_path):
    """`preflight rehearse` with the config missing on node02 (issue 30): node02's rank cannot open it and raises;
    node01's and node03's ranks only waited for it (in init_process_group, or in their comm op's JIT build, cut short
    when the launch stopped). Exactly 1 host FAILs as a cause; the other 2 are blocked by node02."""
    cluster = netcluster_factory(3, names=NAMES)
    work = Path(f"/tmp/pf-faults-r-{os.getpid()}")
    config = work / "ds.json"
    text = json.dumps(CONFIG)
    report = tmp_path / "rehearse.json"
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n")
    try:
        work.mkdir()
        config.write_text(text)
        for host in ("node01", "node03"):
            cluster.exec(host, ["sh", "-c", f"mkdir -p {work} && cat > {config}"], check=True, input=text)
        argv = [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
                "--deepspeed-config", str(config), "--python", sys.executable, "--ssh-config", str(cluster.ssh_config),
                "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--json", str(report)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="240")
        env.pop("DS_ENV_FILE", None)
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S + 120,
                              stdin=subprocess.DEVNULL, env=env)
        elapsed = time.monotonic() - started
        print(f"\n{elapsed:.1f} s, exit {proc.returncode}\n{proc.stdout}")
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        exits_1_in_bound(proc, elapsed)
        data = json.loads(report.read_text())
        cells = {r["host"]: r for r in data["results"]}
        cause = cells["node02"]
        assert cause["check"] == "launch" and cause["status"] == "fail" and "blocked_by" not in cause, cause
        assert f"cannot open the DeepSpeed config {config} on node02" in cause["message"], cause["message"]
        for host in ("node01", "node03"):
            assert cells[host]["blocked_by"] == "launch" and cells[host]["blocked_host"] == "node02", cells[host]
        assert cells["*"]["blocked_host"] == "node02", cells["*"]
        unblocked_failures = {r["host"] for r in data["results"] if r["status"] == "fail" and "blocked_by" not in r}
        assert unblocked_failures == {"node02"}, unblocked_failures
        bad = [c for c in data["causes"] if c["status"] in ("fail", "error")]
        assert [c["hosts"] for c in bad] == [["node02"]], data["causes"]
        assert data["summary"]["causes"] == 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for host in ("node01", "node03"):
            cluster.exec(host, ["rm", "-rf", str(work)])
    assert_nothing_left(cluster)


def test_a_bogus_nccl_socket_ifname_inherited_from_the_shell(warm_ops, netcluster_factory, tmp_path):
    """NCCL_SOCKET_IFNAME=bogus0 in the shell preflight (and later deepspeed) runs in: DeepSpeed's runner exports
    every NCCL* variable of the launch shell to every rank (runner.py:36, cuda_accelerator.py:411-412)."""
    cluster = netcluster_factory(3, names=NAMES)
    proc, cells, elapsed = gate(cluster, tmp_path, shared_config(cluster), env={"NCCL_SOCKET_IFNAME": "bogus0"})
    exits_1_in_bound(proc, elapsed)
    cell = failed(cells, "*", "launcher_ssh")
    assert "NCCL_SOCKET_IFNAME=bogus0" in cell["message"], cell["message"]
    assert "node01" in cell["message"] and "node02" in cell["message"] and "node03" in cell["message"]
    assert "NCCL_SOCKET_IFNAME" in cell["fix"]
    assert_nothing_left(cluster)


def test_a_firewalled_host(warm_ops, netcluster_factory, tmp_path):
    """node03 drops inbound TCP to 1024-65535 (sshd's 22 stays open): gloo/NCCL and the master port cannot reach
    it."""
    cluster = netcluster_factory(3, names=NAMES)
    cluster.firewall("node03")
    proc, cells, elapsed = gate(cluster, tmp_path, shared_config(cluster))
    exits_1_in_bound(proc, elapsed)
    cell = failed(cells, "node03", "ports")
    assert "inbound TCP to node03" in cell["message"] and "a firewall drops the packets" in cell["message"], cell
    assert "on node03 allow TCP 1024-65535 from the cluster" in cell["fix"], cell["fix"]
    for host in ("node01", "node02"):  # only node03 is named, by every check that sees it
        for check in ("ports", "iperf3"):
            assert cells[(host, check)]["status"] == "pass", cells[(host, check)]
    assert "left out node03" in failed(cells, "*", "allreduce")["message"]
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("NOT READY"))
    assert "node03" in verdict and "node01" not in verdict and "node02" not in verdict, verdict
    assert_nothing_left(cluster)


def test_a_failure_between_two_hosts_is_blamed_on_the_end_the_ports_check_proved_blocked():
    """iperf3's tests on 3 hosts with node03 firewalled (as test_a_firewalled_host measured them: each pair once):
    node01->node02 and node03->node01 passed, node02->node03 failed. The tests alone cannot tell node02's outbound
    from node03's inbound, and both stay suspects; the ports check's probes (node01 and node02 cannot open TCP to
    node03's high ports) break the tie, and only node03 is blamed."""
    from preflight.hostside.mesh import blame_failures, blocked_hosts
    timed_out = "unable to connect to server: Connection timed out"
    links = [{"src": "node01", "dst": "node02", "gbps": 14.0, "error": None},
             {"src": "node03", "dst": "node01", "gbps": 15.0, "error": None},
             {"src": "node02", "dst": "node03", "gbps": None, "error": timed_out}]
    assert set(blame_failures(links)) == {"node02", "node03"}
    addresses = {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"}
    probes = [{"src": s, "dst": d, "address": addresses[d], "port": 29500,
               "result": "timeout" if d == "node03" else "ok"}
              for s in addresses for d in addresses if s != d]
    blocked = blocked_hosts({"probes": probes}, addresses)
    assert set(blocked) == {"node03"}
    assert {h: len(v) for h, v in blame_failures(links, blocked).items()} == {"node03": 1}
    # Evidence against both ends (or against neither) leaves both as suspects.
    assert set(blame_failures(links, {"node02", "node03"})) == {"node02", "node03"}
    # A known culprit (no server there) still wins.
    assert set(blame_failures([dict(links[2], blame="node02")], blocked)) == {"node02"}
