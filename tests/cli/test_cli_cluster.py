"""The real CLI against real hosts: namespace hosts with their own OpenSSH servers, over real SSH."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import junitparser
import pytest

ROOT = Path(__file__).resolve().parents[2]


def preflight(cluster, *args, known_hosts=None, timeout=180):
    """Run `python -m preflight run` against the cluster; returns CompletedProcess (text)."""
    argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable,
            "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(known_hosts or cluster.known_hosts), *map(str, args)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def leftovers(cluster):
    """Processes in the hosts' namespaces other than their sshd, and files in their private /tmp."""
    found = {}
    for h in cluster.hosts:
        pids = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True).stdout.split()
        extra = []
        for pid in pids:
            if int(pid) == h.pid:
                continue
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                continue
            # sshd's per-connection processes linger a moment after a session closes.
            if not args.startswith("sshd"):
                extra.append(args)
        tmp = [n for n in cluster.exec(h, ["ls", "-A", "/tmp"]).stdout.split() if n not in cluster.tmp_entries]
        if extra or tmp:
            found[h.name] = {"processes": extra, "tmp": tmp}
    return found


def assert_nothing_left(cluster):
    deadline = time.monotonic() + 10
    while leftovers(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(cluster) == {}


def test_healthy_cluster_json_junit_and_clean_hosts(cluster3, tmp_path):
    known = cluster3.empty_known_hosts(tmp_path / "known_hosts")
    hostfile = cluster3.hostfile(tmp_path / "hostfile", slots=2)
    report, junit, env = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "env"
    proc = preflight(cluster3, "--hostfile", hostfile, "--accept-new-host-keys", "--checks", "python",
                     "--json", report, "--junit-xml", junit, "--env-file", env, known_hosts=known)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    names = [h.name for h in cluster3.hosts]
    assert [h["name"] for h in data["hosts"]] == names
    assert all(h["reachable"] and h["slots"] == 2 for h in data["hosts"])
    cells = {(r["host"], r["check"]): r for r in data["results"]}
    assert set(cells) == {(n, c) for n in names for c in ("ssh", "python")}
    for name in names:
        assert cells[(name, "ssh")]["status"] == "pass"
        assert cells[(name, "ssh")]["metrics"]["hostname"] == name  # each host has its own UTS namespace
        assert cells[(name, "python")]["metrics"]["torch"]
    assert data["summary"]["exit_code"] == 0 and data["summary"]["fail"] == 0
    suite = next(iter(junitparser.JUnitXml.fromfile(str(junit))))
    assert sorted((c.classname, c.name) for c in suite) == sorted(cells)
    assert "\n\n" not in env.read_text() and "NCCL_DEBUG=WARN" in env.read_text()
    # --accept-new-host-keys recorded each host's key (by the address ssh_config maps the name to).
    recorded = known.read_text()
    assert all(h.addresses[0] in recorded for h in cluster3.hosts)
    assert "3 passed" not in proc.stdout and "6 passed, 0 failed" in proc.stdout
    assert_nothing_left(cluster3)


def test_unknown_host_key_is_refused_then_accepted_with_the_flag(cluster3, tmp_path):
    known = cluster3.empty_known_hosts(tmp_path / "kh")
    hostfile = cluster3.hostfile(tmp_path / "hf", names=["node01"])
    proc = preflight(cluster3, "--hostfile", hostfile, "--checks", "python", "--json", tmp_path / "a.json",
                     known_hosts=known)
    assert proc.returncode == 1
    ssh = next(r for r in json.loads((tmp_path / "a.json").read_text())["results"] if r["check"] == "ssh")
    assert ssh["status"] == "fail" and "unknown SSH host key" in ssh["message"]
    assert "--accept-new-host-keys" in ssh["fix"]
    assert known.read_text() == ""  # refused means nothing recorded

    assert preflight(cluster3, "--hostfile", hostfile, "--checks", "python", "--accept-new-host-keys",
                     known_hosts=known).returncode == 0
    # Recorded: the next run needs no flag.
    assert preflight(cluster3, "--hostfile", hostfile, "--checks", "python", known_hosts=known).returncode == 0


def test_changed_host_key_is_always_refused(cluster3, tmp_path):
    node01, node02 = cluster3.hosts[0], cluster3.hosts[1]
    # node01's address with node02's key: what a reinstalled host or a man in the middle looks like.
    known = tmp_path / "kh"
    key = node02.host_key_line.split()[-2:]
    known.write_text(f"{node01.addresses[0]} {' '.join(key)}\n")
    hostfile = cluster3.hostfile(tmp_path / "hf", names=["node01"])
    proc = preflight(cluster3, "--hostfile", hostfile, "--checks", "python", "--accept-new-host-keys",
                     "--json", tmp_path / "r.json", known_hosts=known)
    assert proc.returncode == 1
    ssh = next(r for r in json.loads((tmp_path / "r.json").read_text())["results"] if r["check"] == "ssh")
    assert ssh["status"] == "fail" and "CHANGED" in ssh["message"] and "ssh-keygen -R" in ssh["fix"]


def test_unreachable_and_silent_hosts_are_marked_and_the_run_stays_bounded(netcluster_factory, tmp_path):
    cluster = netcluster_factory(n=2)
    cluster.add_blackhole("deadhost")
    cluster.add_silent("mutehost")
    hostfile = cluster.hostfile(tmp_path / "hf", names=["node01", "deadhost", "mutehost", "node02"])
    start = time.monotonic()
    proc = preflight(cluster, "--hostfile", hostfile, "--checks", "python", "--connect-timeout", "3",
                     "--json", tmp_path / "r.json")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    # Bounded by the connect timeout (plus interpreter start-up and the healthy hosts' checks), not hung.
    assert elapsed < 3 + 20, elapsed
    data = json.loads((tmp_path / "r.json").read_text())
    cells = {(r["host"], r["check"]): r for r in data["results"]}
    for healthy in ("node01", "node02"):
        assert cells[(healthy, "ssh")]["status"] == "pass" and cells[(healthy, "python")]["status"] == "pass"
    assert cells[("deadhost", "ssh")]["status"] == "error"
    assert "timed out after 3s" in cells[("deadhost", "ssh")]["message"]
    assert cells[("mutehost", "ssh")]["status"] == "error"
    assert "no SSH banner" in cells[("mutehost", "ssh")]["message"]
    assert cells[("deadhost", "python")]["status"] == "error"  # not run: shown as ERROR, never FAIL
    assert {h["name"]: h["reachable"] for h in data["hosts"]} == \
        {"node01": True, "deadhost": False, "mutehost": False, "node02": True}
    assert "deadhost::ssh ERROR" in proc.stdout


@pytest.mark.parametrize("text, words", [
    ("node01\n", "hostfile:1: bad entry"),
    ("node01 slots=1\n# x\nnode01 slots=1\n", "hostfile:3: duplicate host 'node01'"),
    ("\n# empty\n", "no hosts found"),
    ("node[3-1] slots=1\n", "hostfile:1: range"),
])
def test_bad_hostfile_is_one_clear_error_and_exit_2(tmp_path, text, words):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing ran


def test_local_run_without_hostfile_needs_no_ssh(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--checks", "python", "--python",
                           sys.executable, "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert [h["name"] for h in data["hosts"]] == ["localhost"]
    assert {r["check"]: r["status"] for r in data["results"]} == {"ssh": "pass", "python": "pass"}


def test_ctrl_c_mid_run_cleans_up_every_host(cluster3, tmp_path):
    """SIGINT while iperf3 servers and clients run: exit 130, and no process or file of the run remains."""
    config = tmp_path / "t.toml"
    config.write_text("[iperf3]\nduration_s = 20.0\n")  # long enough to be interrupted mid-measurement
    argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable,
            "--ssh-config", str(cluster3.ssh_config), "--ssh-key", str(cluster3.user_key),
            "--known-hosts", str(cluster3.known_hosts), "--hostfile", str(cluster3.hostfile(tmp_path / "hf")),
            "--checks", "interfaces,iperf3", "--config", str(config)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        seen = []
        deadline = time.monotonic() + 60
        for line in proc.stderr:  # progress lines: wait until the iperf3 phase has started
            seen.append(line)
            if "iperf3" in line or time.monotonic() > deadline:
                break
        assert any("iperf3" in line for line in seen), seen
        time.sleep(3)  # servers up, clients measuring
        proc.send_signal(2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and "Traceback" not in out + err
    assert_nothing_left(cluster3)


def test_an_interpreter_that_hangs_before_it_reads_is_named_and_killed_on_every_host(cluster3, tmp_path):
    """--python hangs before it reads the agent (a stuck NFS site-packages, a blocking sitecustomize). The agent's
    lifeline is its stdin, which it never read, and closing an SSH channel signals nothing: the run must name
    the cause and kill the interpreter on every host itself."""
    import tempfile
    where = Path(tempfile.mkdtemp(prefix="preflight-hung-", dir="/dev/shm"))  # the hosts' /tmp is private
    try:
        hung = where / "python"
        # The interpreter's own argv keeps the agent's (and its token) after the code to run: as a real one's.
        hung.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import time; time.sleep(600); \"{where.name}\"' "
                        "\"$@\"\n")
        hung.chmod(0o755)
        argv = [sys.executable, "-m", "preflight", "run", "--python", str(hung),
                "--ssh-config", str(cluster3.ssh_config), "--ssh-key", str(cluster3.user_key),
                "--known-hosts", str(cluster3.known_hosts), "--hostfile", str(cluster3.hostfile(tmp_path / "hf")),
                "--checks", "libaio", "--timeout", "3", "--connect-timeout", "3", "--json", str(tmp_path / "r.json")]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        cells = {(r["host"], r["check"]): r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
        for host in cluster3.hosts:
            # Issue 26: the host is one ERROR on its connection result, and its checks are blocked by it.
            cell = cells[(host.name, "ssh")]
            assert cell["status"] == "error" and "the agent never started" in cell["message"], cell
            assert cells[(host.name, "libaio")]["blocked_by"] == "ssh", cells[(host.name, "libaio")]
        assert_nothing_left(cluster3)
    finally:
        for h in cluster3.hosts:  # on failure: what the run left
            cluster3.exec(h, ["pkill", "-KILL", "-f", "--", f"[{where.name[0]}]{where.name[1:]}"])
        shutil.rmtree(where, ignore_errors=True)
