"""What the coordinator costs per host stays flat as hosts are added (issue 11): threads, request bytes, wake-ups.

An in-process run over a namespace cluster of real sshd hosts counts the coordinator's threads while it works
(each host's connection has paramiko's reader and the agent channel's reader; nothing else per host may wait
in a thread of its own), the host checks request sent to each host must not carry every host's address
(O(N^2) bytes over a run), and connections are watched by SSH keepalives sent from a few shared prober
threads, not a thread per host. Sample of what the thread test prints (-s):

    16 hosts: 2.06 threads/host at the peak (baseline 3, peak 36), 2.00 in the host checks
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Dict, List

import pytest

from preflight.hostside.proc import parallel_map
from preflight.config import load_defaults
from preflight.hostfile import HostSpec
from preflight.runner import Progress, RunOptions, Runner
from preflight.transport import SSHOptions, SSHTransport
from preflight.transport.liveness import LIVENESS
from preflight.transport.ssh import _SSHCommand
from tests.netcluster import NetCluster

N = 16
# Per host: paramiko's reader and the agent channel's reader. The bound leaves room for the constant
# threads (connect workers, the sampler's neighbours) over 16 hosts; 3 per host (a waiting thread per host
# besides those two) fails it.
MAX_THREADS_PER_HOST = 2.5


@pytest.fixture(scope="module")
def cluster():
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(N) as c:
        yield c


def options(cluster, names: List[str], **kw) -> RunOptions:
    return RunOptions(hosts=[HostSpec(name, 1, i) for i, name in enumerate(names)], checks=["nvme"],
                      thresholds=load_defaults(), python=sys.executable,
                      ssh=SSHOptions(config_path=str(cluster.ssh_config), key=str(cluster.user_key),
                                     known_hosts=str(cluster.known_hosts), connect_timeout=10),
                      timeout=60, parallel=4, **kw)


class PhaseThreads(Progress):
    """Counts the process's threads when each phase starts."""

    def __init__(self) -> None:
        self.at: Dict[str, int] = {}

    def phase(self, name: str, total: int) -> None:
        self.at[name] = threading.active_count()


def run_sampled(cluster, names: List[str]):
    """(report, baseline threads, peak threads, PhaseThreads) of one in-process run, sampled every 5 ms."""
    stop = threading.Event()
    peak = [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(0.05)
    baseline = threading.active_count()
    progress = PhaseThreads()
    try:
        report = Runner(options(cluster, names), progress).run()
    finally:
        stop.set()
        sampler.join()
    return report, baseline, peak[0], progress


def test_threads_per_host_stay_below_a_bound(cluster):
    names = [h.name for h in cluster.hosts]
    run_sampled(cluster, names[:2])  # paramiko's and cryptography's one-time set-up is not per host
    report, baseline, peak, progress = run_sampled(cluster, names)
    counts = report.counts()
    assert counts["error"] == 0 and counts["fail"] == 0, [r.message for r in report.results]
    per_host = (peak - baseline) / N
    steady = (progress.at["host checks"] - baseline) / N
    print(f"{N} hosts: {per_host:.2f} threads/host at the peak (baseline {baseline}, peak {peak}), "
          f"{steady:.2f} in the host checks")
    assert per_host <= MAX_THREADS_PER_HOST, (baseline, peak)
    assert steady <= MAX_THREADS_PER_HOST, progress.at


def test_host_checks_request_does_not_grow_with_the_number_of_hosts(cluster, monkeypatch):
    sent: Dict[int, List[int]] = {}
    size = [0]
    original = _SSHCommand.send

    def send(self, data: bytes) -> None:  # the bytes of each host checks request, as they go out
        if b'"op": "collect"' in data:
            sent.setdefault(size[0], []).append(len(data))
        original(self, data)

    monkeypatch.setattr(_SSHCommand, "send", send)
    names = [h.name for h in cluster.hosts]
    for n in (2, N):
        size[0] = n
        report = Runner(options(cluster, names[:n])).run()
        assert report.counts()["error"] == 0
    assert len(sent[2]) == 2 and len(sent[N]) == N, sent
    # node01 and node16 have names of the same length: every request is the same size, whatever N.
    assert max(sent[N]) == max(sent[2]), sent

    # Without hosts: 1,000 hosts in the options, each host's params stay those of a 2-host run.
    def params_bytes(n: int) -> int:
        runner = Runner(options(cluster, [f"host{i:04d}" for i in range(n)]))
        runner.nodes = [runner._make_node(spec) for spec in runner.o.hosts]
        return len(json.dumps(runner._host_params(runner.nodes[1], [])))

    assert params_bytes(1000) == params_bytes(2)


def test_direct_connections_are_watched_by_ssh_keepalives_not_the_kernels(cluster):
    # Kernel TCP keepalives (one probe each, never retransmitted, plus TCP_USER_TIMEOUT) were tried for direct
    # connections: at 1,000 namespace hosts on this overloaded 2-core machine one run lost 124 healthy hosts'
    # connections ("no reply to 3 TCP keepalives in 16s", bench/results/scale-flat.txt). SSH keepalives are data
    # that TCP retransmits, judged against the kernel's last receive time, so they stay for every connection until
    # that is understood; they cost the coordinator ~1 ms/host at 256 hosts (bench/results/scale-flat-ab256.txt).
    conn = SSHTransport(cluster.hosts[0].name, SSHOptions(config_path=str(cluster.ssh_config),
                                                          key=str(cluster.user_key),
                                                          known_hosts=str(cluster.known_hosts),
                                                          connect_timeout=6))
    conn.connect()
    try:
        sock = conn._client.get_transport().sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
        with LIVENESS._lock:
            assert id(conn) in LIVENESS._conns
        assert conn.run(["true"], timeout=20).rc == 0
    finally:
        conn.close()


def test_parallel_map_runs_at_most_limit_threads_in_order():
    running, most, idents = [0], [0], set()
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            idents.add(threading.get_ident())
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        if i == 7:
            raise ValueError("seven")
        return i * i

    out = parallel_map(work, list(range(200)), 4, 30)
    assert out[:7] == [i * i for i in range(7)] and isinstance(out[7], ValueError)
    assert out[8:] == [i * i for i in range(8, 200)]
    assert most[0] <= 4 and len(idents) <= 4
    assert not [t for t in threading.enumerate() if t.ident in idents], "a worker outlived parallel_map"
    # Past the deadline nothing more starts: the items left are TimeoutErrors.
    out = parallel_map(lambda i: time.sleep(0.3), list(range(20)), 2, 0.5)
    assert sum(isinstance(r, TimeoutError) for r in out) >= 14, out
