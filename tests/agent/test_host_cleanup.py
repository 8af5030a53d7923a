"""The agent removes its own temporary files when its lifeline closes, also after kill -9 of the coordinator (issue 26
item 7): the NVMe dd file (.preflight-dd-*), with the worker that wrote it running or frozen until its agent kills it,
and the checkpoint probes (.preflight-ckpt-*), which outlive the request that wrote them. On namespace hosts over
real SSH; the moment of the kill is made certain by SIGSTOP (dd) or by a coordinator that stops for good once the
probes are written (checkpoint), never by a sleep.

Unit tests of the registry (hostside/tempfiles.py) and the agent's ledger run without namespaces.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.hostside import tempfiles

from tests.netcluster import _processes_in

ROOT = Path(__file__).resolve().parents[2]


def _argv(cluster, hostfile, *args):
    return ["--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--hostfile", str(hostfile), "--connect-timeout", "5",
            *map(str, args)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _listing(cluster, host, directory: str):
    return cluster.exec(host, ["ls", "-A", directory], check=True).stdout.split()


def _run_processes(host):
    """The run's processes left in the host (its agent, workers, dd): everything but sshd."""
    found = []
    for pid in _processes_in([host.ns]):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if not comm.startswith("sshd"):
            found.append((pid, comm))
    return found


def _wait_until(predicate, timeout: float, describe) -> None:
    """Wait for predicate(); past timeout, fail with describe() (what is still there then)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:.0f}s: {describe()}")
        time.sleep(0.1)


@pytest.mark.parametrize("worker", ["frozen", "running"])
def test_kill_9_of_the_coordinator_during_dd_leaves_no_dd_file(netcluster_factory, tmp_path, worker):
    """frozen: the worker that runs dd is stopped (as one stuck in the kernel would be), so only its agent can remove
    the file, after it has killed the worker; running: the worker's own lifeline removes it."""
    cluster = netcluster_factory(n=1)
    host = cluster.hosts[0]
    # A filesystem of its own for the test file (the host's mount namespace is private): 1 GiB of dd.
    cluster.exec(host, "mkdir -p /tmp/nvme && mount -t tmpfs -o size=3g tmpfs /tmp/nvme", check=True)
    config = tmp_path / "nvme.toml"
    config.write_text("[nvme]\ntest_mib = 1024\nmax_free_fraction = 0.5\n")
    argv = [sys.executable, "-m", "preflight", "run", "--checks", "nvme", "--nvme-path", "/tmp/nvme",
            "--config", str(config), *_argv(cluster, cluster.hostfile(tmp_path / "hostfile"))]
    coordinator = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
    stopped = []
    try:
        dd = 0
        deadline = time.monotonic() + 120
        while not dd and time.monotonic() < deadline and coordinator.poll() is None:
            dd = next((pid for pid in _processes_in([host.ns]) if b".preflight-dd-" in _cmdline(pid)
                       and _cmdline(pid).startswith(b"dd\0")), 0)
        assert dd, "no dd of the nvme check seen"
        writer = _ppid(dd)  # the agent's worker running the check
        for pid in (writer, dd):  # mid-dd: it cannot finish now
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        assert b"preflight.hostside.agent" in _cmdline(writer)
        files = [n for n in _listing(cluster, host, "/tmp/nvme") if n.startswith(".preflight-dd-")]
        assert files, "the dd test file is not there"

        coordinator.kill()  # SIGKILL: no finally of the coordinator's runs
        coordinator.wait(10)
        if worker == "running":
            for pid in (dd, writer):
                os.kill(pid, signal.SIGCONT)
            stopped.clear()
        # A frozen worker gets its grace (14 s) before its agent kills it, then the agent removes what it left.
        _wait_until(lambda: not _listing(cluster, host, "/tmp/nvme"), 45,
                    lambda: f"the dd file is still there: {_listing(cluster, host, '/tmp/nvme')}")
        _wait_until(lambda: not _run_processes(host), 30, lambda: f"the run left processes: {_run_processes(host)}")
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


# The coordinator, with one hook: once every host's checkpoint probe is written, it stops for good (before look and
# cleanup), so the kill -9 comes while the probe files exist, whatever the machine's speed.
_PAUSED_COORDINATOR = r"""
import sys, time
sys.path.insert(0, sys.argv.pop(1))
from preflight.checks import checkpoint
real = checkpoint.coordinate


class Paused:
    def __init__(self, cluster):
        self._cluster = cluster

    def __getattr__(self, name):
        return getattr(self._cluster, name)

    def call_all(self, func, params, timeout):
        out = self._cluster.call_all(func, params, timeout)
        if func.endswith(".probe"):
            print("@@PROBED", file=sys.stderr, flush=True)
            time.sleep(3600)
        return out


import dataclasses
# The registry calls SPEC.coordinate (bound when the module was defined), so the hook replaces the SPEC's.
checkpoint.SPEC = dataclasses.replace(checkpoint.SPEC, coordinate=lambda cluster: real(Paused(cluster)))
from preflight.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_of_the_coordinator_between_probe_and_cleanup_leaves_no_checkpoint_probe(netcluster_factory,
                                                                                         tmp_path):
    cluster = netcluster_factory(n=2)
    for host in cluster.hosts:  # a directory of each host's own (private /tmp): each agent removes its own probe
        cluster.exec(host, "mkdir -p /tmp/ckpt", check=True)
    argv = [sys.executable, "-c", _PAUSED_COORDINATOR, str(ROOT), "run", "--checks", "checkpoint",
            "--checkpoint-dir", "/tmp/ckpt", *_argv(cluster, cluster.hostfile(tmp_path / "hostfile"))]
    coordinator = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 120
        for line in coordinator.stderr:
            seen.append(line)
            if line.startswith("@@PROBED") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith("@@PROBED"), "".join(seen)[-3000:]
        for host in cluster.hosts:  # the probe requests have ended; their files stay for look and cleanup
            probes = [n for n in _listing(cluster, host, "/tmp/ckpt") if n.startswith(".preflight-ckpt-")]
            assert len(probes) == 1 and probes[0].endswith("-" + host.name), probes
        coordinator.kill()
        coordinator.wait(10)
        for host in cluster.hosts:
            _wait_until(lambda h=host: not _listing(cluster, h, "/tmp/ckpt"), 30,
                        lambda h=host: f"{h.name}: the probe is still there: {_listing(cluster, h, '/tmp/ckpt')}")
            _wait_until(lambda h=host: not _run_processes(h), 30,
                        lambda h=host: f"{h.name}: the run left processes: {_run_processes(h)}")
    finally:
        if coordinator.poll() is None:
            coordinator.kill()


# --- the registry and the agent's ledger, without namespaces ---------------------------------------------------------

def _forked(fn) -> int:
    """Run fn() in a forked child and return its exit code (the child never returns into pytest)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_ledger_removes_what_a_killed_worker_registered_and_the_kept_files_at_the_end(tmp_path):
    ledger = tempfiles.Ledger()
    dd, probe, done = (tmp_path / ".preflight-dd-1", tmp_path / ".preflight-ckpt-t-node01",
                       tmp_path / ".preflight-dd-2")
    bystander = tmp_path / "data.bin"  # not a name of ours: never removed, whatever a worker says
    bystander.write_text("x")
    r, w = ledger.channel()

    def worker() -> None:
        tempfiles.attach(w)
        tempfiles.register(str(probe), keep=True)
        probe.write_text("probe")
        tempfiles.register(str(done))
        done.write_text("done")
        tempfiles.remove(str(done))  # removed by its own request: forgotten
        tempfiles.register(str(dd))
        dd.write_text("dd")
        os.write(w, b"+" + os.fsencode(bystander) + b"\0")  # a record of a name not ours
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-request: no finally

    assert _forked(worker) == -signal.SIGKILL
    os.close(w)
    assert ledger.close(r) == [str(dd)]
    assert not dd.exists() and probe.exists() and bystander.exists()
    assert ledger.close_all() == [str(probe)]  # the agent's lifeline closed: the kept files go too
    assert not probe.exists() and bystander.exists()


def test_a_kept_file_removed_by_a_later_request_is_forgotten_by_the_ledger(tmp_path):
    ledger = tempfiles.Ledger()
    probe = tmp_path / ".preflight-ckpt-t-node01"
    r1, w1 = ledger.channel()
    assert _forked(lambda: (tempfiles.attach(w1), tempfiles.register(str(probe), keep=True),
                            probe.write_text("p"))) == 0
    os.close(w1)
    ledger.close(r1)
    assert probe.exists()
    r2, w2 = ledger.channel()  # the cleanup request, in another worker
    assert _forked(lambda: (tempfiles.attach(w2), tempfiles.remove(str(probe)))) == 0
    os.close(w2)
    ledger.close(r2)
    probe.write_text("someone else's, later")  # a file of that name now is not the ledger's
    assert ledger.close_all() == [] and probe.exists()


def test_register_refuses_a_name_that_is_not_ours_and_a_fork_does_not_inherit_registrations(tmp_path):
    with pytest.raises(ValueError, match=".preflight-"):
        tempfiles.register(str(tmp_path / "model.ckpt"))
    mine = tmp_path / ".preflight-dd-parent"
    tempfiles.register(str(mine))
    try:
        # A forked child (a worker, a rank) never owns its parent's files: its lifeline closing removes none.
        assert _forked(lambda: (tempfiles.registered() == {} or os._exit(3),
                                tempfiles.unlink_registered(kept=True) == [] or os._exit(4))) == 0
        mine.write_text("x")
        assert tempfiles.unlink_registered(kept=False) == [str(mine)] and not mine.exists()
        assert str(mine) in tempfiles.registered()  # still registered: a file created after this still goes
    finally:
        tempfiles.remove(str(mine))
    assert str(mine) not in tempfiles.registered()
