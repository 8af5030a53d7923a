"""What a host sends back is complete, bounded and checked: real sshd hosts answering through a crafted --python.

Large results arrive whole (read to the channel's EOF, not just to the exit status), a flooding host costs
one ERROR and bounded coordinator memory, a result of the wrong shape is that host's ERROR, and a host whose
network is cut mid-request is found dead by SSH keepalives.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.hostile_agent import HostileHosts
from tests.netcluster import NetCluster
from tests.cli.test_cli_cluster import ROOT, preflight


@pytest.fixture(scope="module")
def cluster4():
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(4, names=["node01", "node02", "node03", "node04"]) as cluster:
        yield cluster


@pytest.fixture
def hostile():
    hosts = HostileHosts()
    yield hosts
    hosts.close()


def cells(path: Path):
    return {(r["host"], r["check"]): r for r in json.loads(path.read_text())["results"]}


def test_large_results_arrive_whole_at_1_10_and_50_mb(cluster4, hostile, tmp_path):
    sizes = {"node01": 2**20, "node02": 10 * 2**20, "node03": 50 * 2**20}
    hostile.set({name: f"big:{size}" for name, size in sizes.items()})
    out = tmp_path / "r.json"
    proc = preflight(cluster4, "--hostfile", cluster4.hostfile(tmp_path / "hf", names=list(sizes)),
                     "--python", hostile.python, "--checks", "python", "--json", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = cells(out)
    for name, size in sizes.items():
        cell = res[(name, "python")]
        assert cell["status"] == "pass", cell["message"][:300]
        expected = (b"0123456789abcdef" * (size // 16 + 1))[:size].decode()
        assert cell["metrics"]["executable"] == expected, (name, len(cell["metrics"]["executable"]))


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_flooding_host_is_an_error_and_coordinator_memory_stays_bounded(cluster4, hostile, tmp_path):
    hostile.set({"node02": "flood"})
    config = tmp_path / "t.toml"
    config.write_text("[agent]\nmax_output_mib = 8\n")
    out = tmp_path / "r.json"
    argv = [sys.executable, "-m", "preflight", "run", "--python", str(hostile.python),
            "--ssh-config", str(cluster4.ssh_config), "--ssh-key", str(cluster4.user_key),
            "--known-hosts", str(cluster4.known_hosts), "--hostfile", str(cluster4.hostfile(tmp_path / "hf")),
            "--checks", "python", "--config", str(config), "--timeout", "60", "--json", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    peak = [0.0]

    def watch() -> None:  # the coordinator's peak RSS, read until it exits
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], _peak_rss_mib(proc.pid))
            except (OSError, ValueError):
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.join()
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert proc.returncode == 1, stdout + stderr
    res = cells(out)
    flood = res[("node02", "python")]
    assert flood["status"] == "error" and "more than 8 MiB" in flood["message"], flood
    for name in ("node01", "node03", "node04"):
        assert res[(name, "python")]["status"] == "pass", res[(name, "python")]
    # Python, rich and paramiko take ~100 MiB; an unbounded buffer grows by GiBs within the timeout.
    assert 0 < peak[0] < 400, peak[0]


def test_results_of_the_wrong_shape_are_that_hosts_error(cluster4, hostile, tmp_path):
    modes = {"node01": "list", "node02": "noduration", "node03": "badjson", "node04": "factslist"}
    hostile.set(modes)
    out = tmp_path / "r.json"
    proc = preflight(cluster4, "--hostfile", cluster4.hostfile(tmp_path / "hf"), "--python", hostile.python,
                     "--checks", "python", "--json", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = cells(out)
    words = {"node01": "not an object of checks", "node02": "duration_s", "node03": "not valid JSON",
             "node04": "'facts' that are a list"}
    for name, word in words.items():
        cell = res[(name, "python")]
        assert cell["status"] == "error" and word in cell["message"], (name, cell["message"])
        assert res[(name, "ssh")]["status"] == "pass"


def test_a_host_cut_off_mid_request_is_found_dead_by_keepalives(netcluster_factory, hostile, tmp_path):
    cluster = netcluster_factory(n=2)
    hostile.set({"node02": "hang"})
    out = tmp_path / "r.json"
    argv = [sys.executable, "-m", "preflight", "run", "--python", str(hostile.python),
            "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--hostfile", str(cluster.hostfile(tmp_path / "hf")),
            "--checks", "python", "--connect-timeout", "3", "--timeout", "120", "--json", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        node02 = cluster.host("node02")
        seen = []
        deadline = time.monotonic() + 90
        for line in proc.stderr:  # progress lines: cut node02 once the host checks are under way
            seen.append(line)
            if "host checks" in line or time.monotonic() > deadline:
                break
        assert any("host checks" in line for line in seen), seen
        time.sleep(1)
        for veth in node02.veths:  # cut the cable: no FIN, no RST, just silence
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        stdout, stderr = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in stdout + stderr
    assert proc.returncode == 1, stdout + stderr
    res = cells(out)
    assert res[("node01", "python")]["status"] == "pass"
    dead = res[("node02", "python")]
    # Without keepalives this is "timed out after 150s", after the per-check timeout.
    assert dead["status"] == "error" and "keepalive" in dead["message"], dead["message"]


FD_RUNNER = r"""
import os, resource, sys
# Start as a default shell would (soft limit 1024) with most of it used up, as a big run's threads,
# sockets and pipes do; preflight must raise the limit and work with descriptors above 1023.
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1000)]
import preflight.transport as transport
original = transport.raise_fd_limit
def raise_then_fill():
    original()
    held.extend(os.open("/dev/null", os.O_RDONLY) for _ in range(200))  # everything after this is > 1200
transport.raise_fd_limit = raise_then_fill
import preflight.runner
preflight.runner.raise_fd_limit = raise_then_fill
from preflight.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_more_than_1100_descriptors_open(cluster4, tmp_path):
    out = tmp_path / "r.json"
    argv = [sys.executable, "-c", FD_RUNNER, "run", "--python", sys.executable,
            "--ssh-config", str(cluster4.ssh_config), "--ssh-key", str(cluster4.user_key),
            "--known-hosts", str(cluster4.known_hosts), "--hostfile", str(cluster4.hostfile(tmp_path / "hf")),
            "--checks", "python", "--json", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(c["status"] == "pass" for c in cells(out).values())


def test_a_command_that_exits_right_after_writing_is_read_to_eof(cluster4):
    """The transport itself, below the agent: a command that writes 1, 10 and 50 MB and exits at once, with
    its stdin still open (as a one-request agent), is read whole, not cut at its exit status."""
    from preflight.transport import SSHOptions, SSHTransport
    options = SSHOptions(key=str(cluster4.user_key), config_path=str(cluster4.ssh_config),
                         known_hosts=str(cluster4.known_hosts))
    transport = SSHTransport("node01", options)
    transport.connect()
    try:
        for size in (2**20, 10 * 2**20, 50 * 2**20):
            code = f"import os, sys; sys.stdout.buffer.write(b'z' * {size}); sys.stdout.flush(); os._exit(0)"
            cmd = transport.start([sys.executable, "-c", code], keep_stdin_open=True)
            res = cmd.wait(120)
            assert res.rc == 0 and not res.error, (size, res.rc, res.error, res.stderr[-300:])
            assert len(res.stdout) == size, (size, len(res.stdout))
    finally:
        transport.close()


def test_kill_9_of_the_coordinator_mid_run_leaves_nothing_on_the_hosts(cluster4, tmp_path):
    """No clean-up code runs on the coordinator: the hosts' agents see their channel close and stop all."""
    from tests.cli.test_cli_cluster import assert_nothing_left
    config = tmp_path / "t.toml"
    config.write_text("[iperf3]\nduration_s = 20.0\n")  # servers and clients busy when the coordinator dies
    argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable,
            "--ssh-config", str(cluster4.ssh_config), "--ssh-key", str(cluster4.user_key),
            "--known-hosts", str(cluster4.known_hosts), "--hostfile", str(cluster4.hostfile(tmp_path / "hf")),
            "--checks", "interfaces,iperf3", "--config", str(config)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        seen = []
        deadline = time.monotonic() + 90
        for line in proc.stderr:  # progress lines: wait until the iperf3 phase has started
            seen.append(line)
            if "iperf3" in line or time.monotonic() > deadline:
                break
        assert any("iperf3" in line for line in seen), seen
        time.sleep(3)
        running = [h.name for h in cluster4.hosts
                   if len(subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True,
                                         text=True).stdout.split()) > 1]
        assert running, "nothing ran on the hosts: the test would prove nothing"
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_nothing_left(cluster4)


def test_a_host_that_stops_reading_its_stdin_fails_the_send_instead_of_blocking_it(cluster4, monkeypatch):
    """Over SSH the channel's window is the pipe: a command that never reads (a frozen or stopped agent, while
    its sshd still answers keepalives) shuts it after ~2 MiB. send() must then fail within the stall limit."""
    from preflight import transport as tr
    from preflight.transport import base

    from tests.stdin_flood import flood_until_it_fails
    monkeypatch.setattr(base, "SEND_STALL_S", 1.0)
    options = tr.SSHOptions(key=str(cluster4.user_key), config_path=str(cluster4.ssh_config),
                            known_hosts=str(cluster4.known_hosts))
    transport = tr.SSHTransport("node01", options)
    transport.connect()
    try:
        # Ends by itself soon after the test: closing an SSH channel signals nothing to the remote command.
        cmd = transport.start(["sleep", "20"], keep_stdin_open=True)
        outcome = flood_until_it_fails(cmd.send)  # 64 MiB against a 2 MiB window and a 64 KiB pipe
        assert outcome and isinstance(outcome[0], tr.StdinStalled), outcome
        result = cmd.wait(10)
        assert result.timed_out and "stopped reading its stdin" in result.error, result
    finally:
        transport.close()
