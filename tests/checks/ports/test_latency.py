"""The small-message latency figure between hosts (preflight/hostside/latency.py), per host pair, from the ports
check's TCP handshakes: pure on recorded probes, and on namespace hosts with a netem delay on one host's link."""
from __future__ import annotations

import json

from preflight.hostside import latency
from preflight.hostside.outcome import Outcome, Status
from tests.cli.test_cli_cluster import preflight


def probe(src, dst, ms, result="ok", network="ssh"):
    return {"src": src, "dst": dst, "network": network, "port": 40000, "result": result, "ms": ms}


PROBES = [probe("n1", "n2", 0.08), probe("n2", "n1", 9.5), probe("n1", "n2", 0.31),  # one slow sample: not the RTT
          probe("n1", "n3", 41.0), probe("n3", "n1", 40.2), probe("n2", "n3", 40.6), probe("n3", "n2", 44.0),
          probe("n1", "n3", 0.01, result="timeout"), probe("n2", "n1", 0.01, network="10.1.0.0/24")]


def test_each_pair_is_its_fastest_handshake_either_way():
    pairs = latency.pair_rtt(PROBES)
    assert pairs == {("n1", "n2"): {"ms": 0.08, "samples": 3}, ("n1", "n3"): {"ms": 40.2, "samples": 2},
                     ("n2", "n3"): {"ms": 40.6, "samples": 2}}


def test_the_slow_host_alone_is_named_with_its_figures():
    pairs = latency.pair_rtt(PROBES)
    named = {h: latency.judge(h, pairs, 5.0) for h in ("n1", "n2", "n3")}
    assert named["n1"][0] is None and named["n2"][0] is None
    assert named["n1"][1] == {"rtt_ms": {"n2": 0.08, "n3": 40.2}, "rtt_ms_typical": 0.08}
    finding, figures = named["n3"]
    assert finding.status == Status.WARN and figures["rtt_ms_typical"] == 40.2
    assert finding.message.startswith("TCP round trip between n3 and its peers 40.20 ms (n2 40.60 ms, n1 40.20 ms;")
    assert "above 5 ms" in finding.message and "tc qdisc show" in finding.fix
    assert "ip route get $(getent hosts n2 | cut -d' ' -f1) (the path to n2" in finding.fix
    with_address = latency.judge("n3", pairs, 5.0, {"n2": "10.1.0.2"})[0]
    assert "ip route get 10.1.0.2 (the path to n2" in with_address.fix
    # Two hosts: one pair, both ends named.
    two = latency.pair_rtt([probe("a", "b", 12.0)])
    assert latency.judge("a", two, 5.0)[0] and latency.judge("b", two, 5.0)[0]


def test_annotate_keeps_the_rows_own_verdict():
    pairs = latency.pair_rtt(PROBES)
    ok = latency.annotate(Outcome(Status.PASS, "inbound TCP open"), *latency.judge("n1", pairs, 5.0))
    assert ok.status == Status.PASS and ok.message == "inbound TCP open; TCP round trip 0.08 ms (median of 2 peers)"
    slow = latency.annotate(Outcome(Status.PASS, "inbound TCP open"), *latency.judge("n3", pairs, 5.0))
    assert slow.status == Status.WARN and slow.message.endswith("; inbound TCP open")
    failed = latency.annotate(Outcome(Status.FAIL, "blocked", "open it"), *latency.judge("n3", pairs, 5.0))
    assert failed.status == Status.FAIL and failed.message.startswith("blocked; TCP round trip")


# A constant-rate UDP sender (11 Mbit/s, five times the shaped rate): unlike a TCP flow, which backs off after
# each loss and lets the queue drain now and then, it keeps the shaper's queue full the whole time.
_UDP_FLOOD = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
payload = bytes(1400)
while True:
    for _ in range(10):
        try:
            s.sendto(payload, (sys.argv[1], 9))
        except OSError:  # ENOBUFS or a refused port: the queue is full, which is the point
            pass
    time.sleep(0.01)
"""


def _backlog(cluster, host: str) -> int:
    """Bytes waiting in the root qdisc of the host's own end of its link (``tc -s``: "backlog 131070b 2p")."""
    import re
    import subprocess
    out = subprocess.run(["tc", "-n", cluster.host(host).ns, "-s", "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    found = re.search(r"backlog (\d+)b", out)
    return int(found.group(1)) if found else 0


def test_real_hosts_one_behind_a_full_queue_is_named_alone(netcluster_factory, tmp_path):
    """node03's link is shaped to 2 Mbit/s and kept full by a constant-rate UDP flow to node01: every packet of
    node03's waits in the 200 ms queue of its shaper, so its handshakes take tens of milliseconds or more (this
    kernel has no netem to add a plain delay). node01 <-> node02 stays fast: ports WARNs node03 alone, with the
    figures of each pair, and the healthy pairs stay far below the threshold."""
    import subprocess
    import sys
    import time
    cluster = netcluster_factory(3)
    node01 = cluster.host("node01").addresses[0]
    flood = None
    try:
        cluster.shape("node03", 2)
        flood = cluster.popen("node03", [sys.executable, "-c", _UDP_FLOOD, node01], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while _backlog(cluster, "node03") < 20_000:
            assert flood.poll() is None and time.monotonic() < deadline, "node03's shaper queue did not fill"
            time.sleep(0.2)
        report = tmp_path / "report.json"
        proc = preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hostfile"), "--checks", "ports",
                         "--json", report, timeout=300)
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(10)
        cluster.unshape("node03")
    cells = {r["host"]: r for r in json.loads(report.read_text())["results"] if r["check"] == "ports"}
    print({h: c["metrics"].get("rtt_ms") for h, c in cells.items()})
    assert cells["node03"]["status"] == "warn", cells["node03"]
    assert cells["node03"]["metrics"]["rtt_ms_typical"] > 5.0, cells["node03"]["metrics"]
    assert "TCP round trip between node03 and its peers" in cells["node03"]["message"]
    assert "ip route get 198." in cells["node03"]["fix"], cells["node03"]["fix"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for h in ("node01", "node02"):
        assert cells[h]["status"] == "pass", cells[h]
        assert cells[h]["metrics"]["rtt_ms"]["node03"] > 5.0
        assert cells[h]["metrics"]["rtt_ms_typical"] < 5.0, cells[h]["metrics"]
    assert cells["node01"]["metrics"]["rtt_ms"]["node02"] < 5.0


def test_real_healthy_hosts_have_figures_far_below_the_threshold(cluster3, tmp_path):
    report = tmp_path / "report.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hostfile"), "--checks", "ports",
                     "--json", report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = {r["host"]: r for r in json.loads(report.read_text())["results"] if r["check"] == "ports"}
    print({h: c["metrics"].get("rtt_ms") for h, c in cells.items()})
    for h, c in cells.items():
        assert c["status"] == "pass" and set(c["metrics"]["rtt_ms"]) == {"node01", "node02", "node03"} - {h}, c
        assert c["metrics"]["rtt_ms_typical"] < 5.0 and "TCP round trip" in c["message"], c
