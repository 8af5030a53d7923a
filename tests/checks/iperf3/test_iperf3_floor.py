"""iperf3: the link-rate floor (a fraction of what the NICs report), on real measurements recorded on the namespace
cluster (tests/fixtures/iperf3: links shaped by tc to 50 and 400 Mbit/s) with the link rates a physical NIC would
report, on synthetic link rates, and through coordinate's confirm rounds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight.checks import iperf3
from preflight.config import load_defaults
from preflight.hostside.outcome import Status
from preflight.testing import FakeCluster, FakeService
from tests.netcluster import NetCluster
from tests.checks.iperf3.test_iperf3 import host_interfaces, itf, with_iperf3

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "iperf3"


@pytest.fixture(scope="module")
def thresholds():
    return load_defaults()


def recorded_two_networks(link_mbps=None):
    """3 namespace hosts, eth0 shaped to 50 Mbit/s, eth1 (chosen) to 400: real iperf3 medians 47.9 and 383 Mbit/s.
    link_mbps: {host: Mb/s} to give the chosen network's NICs (as a physical NIC's sysfs speed would)."""
    facts = json.loads((FIXTURES / "facts-3hosts-2networks.json").read_text())
    if link_mbps is not None:
        for net in facts["networks"]:
            if net["network"] == facts["chosen"]["network"]:
                net["link_mbps"] = dict(link_mbps)
    return facts


def test_only_a_physical_nics_reported_rate_counts():
    phys = {"interfaces": [itf("eno1", ["10.0.0.1/24"], kind="physical", speed_mbps=10000, virtual=False,
                               arp_type=1)]}
    assert iperf3.link_rate_mbps(phys, "eno1") == 10000
    assert iperf3.link_rate_mbps(phys, "eno2") is None
    veth = {"interfaces": [itf("eth0", ["10.0.0.1/24"], speed_mbps=10000)]}  # veth reports 10000 whatever it carries
    assert iperf3.link_rate_mbps(veth, "eth0") is None
    ipoib = {"interfaces": [itf("ib0", ["10.2.0.1/24"], kind="other", speed_mbps=200000, virtual=False,
                                arp_type=iperf3.ARPHRD_INFINIBAND)]}
    assert iperf3.link_rate_mbps(ipoib, "ib0") is None
    unknown = {"interfaces": [itf("eth0", ["10.0.0.1/24"], kind="physical", speed_mbps=None, virtual=False)]}
    assert iperf3.link_rate_mbps(unknown, "eth0") is None  # virtio: -1, recorded as None


def test_shared_networks_record_each_hosts_link_rate():
    facts = {h: host_interfaces(i, [itf("eno1", [f"10.5.0.{i + 1}/24"], kind="physical", virtual=False,
                                        speed_mbps=25000 if h != "c" else 10000)])
             for i, h in enumerate("abc")}
    nets, _ = iperf3.shared_networks(facts, ["a", "b", "c"], 4)
    by = {n["network"]: n for n in nets}
    assert by["10.5.0.0/24"]["link_mbps"] == {"a": 25000, "b": 25000, "c": 10000}
    assert by["10.0.0.0/24"]["link_mbps"] == {"a": None, "b": None, "c": None}  # the veth eth0


def test_recorded_measurement_below_half_the_reported_rate_warns(thresholds):
    facts = recorded_two_networks({"node01": 1000, "node02": 1000, "node03": 1000})
    out = iperf3.evaluate(facts, thresholds)
    for h in ("node01", "node02", "node03"):
        assert out[h].status == Status.WARN, out[h].message
        assert out[h].message.startswith(f"{h}: median 3")
        assert "below the floor 500.0 Mbit/s: 50% of the 1.00 Gbit/s link rate node01 eth1 reports" in out[h].message
        assert f"on {h}: ethtool eth1" in out[h].fix
        assert out[h].metrics["floor_gbps"] == pytest.approx(0.5)
    cluster = out["*"]
    assert cluster.status == Status.WARN
    assert "the best network's median 383.1 Mbit/s is below its link-rate floor 500.0 Mbit/s" in cluster.message
    assert "ethtool" in cluster.fix


def test_recorded_measurement_above_the_floor_passes_and_says_the_floor(thresholds):
    out = iperf3.evaluate(recorded_two_networks({"node01": 600, "node02": 1000, "node03": 1000}), thresholds)
    assert all(o.status == Status.PASS for o in out.values()), {h: o.message for h, o in out.items()}
    assert "floor 300.0 Mbit/s: 50% of the 600.0 Mbit/s link rate node01 eth1 reports" in out["*"].message
    assert out["*"].metrics["floor_gbps"] == pytest.approx(0.3)


def test_unknown_link_rate_keeps_no_floor_and_says_so(thresholds):
    # As recorded on the namespace cluster: veth NICs, no link rate (and facts from before link_mbps existed).
    out = iperf3.evaluate(recorded_two_networks(), thresholds)
    assert all(o.status == Status.PASS for o in out.values())
    assert "no link-rate floor: the link rates were not recorded" in out["*"].message
    assert out["*"].metrics["floor_gbps"] is None
    out = iperf3.evaluate(recorded_two_networks({"node01": 1000, "node02": None, "node03": 1000}), thresholds)
    assert all(o.status == Status.PASS for o in out.values())
    assert "no link-rate floor: link rate unknown on node02 (a virtual NIC, IPoIB, or speed -1)" in out["*"].message


def test_the_floor_is_capped_by_what_the_streams_carry(thresholds):
    net = {"link_mbps": {"a": 100000, "b": 100000}, "devices": {"a": "ens1", "b": "ens1"}}
    floor, basis = iperf3.link_floor(net, thresholds["iperf3"])
    assert floor == pytest.approx(10.0)
    assert "1 TCP stream(s) x 20.00 Gbit/s (below the 100.00 Gbit/s link of a)" in basis
    floor, _ = iperf3.link_floor(net, dict(thresholds["iperf3"], streams=8))
    assert floor == pytest.approx(50.0)  # 8 x 20 = 160 > 100: the link rate
    assert iperf3.link_floor(net, dict(thresholds["iperf3"], link_rate_fraction=0)) == \
        (None, "no link-rate floor (link_rate_fraction = 0)")


def test_an_explicit_minimum_fails_instead_of_a_second_warning(thresholds):
    facts = recorded_two_networks({"node01": 1000, "node02": 1000, "node03": 1000})
    out = iperf3.evaluate(facts, with_iperf3(thresholds, min_gbps=0.45))
    assert out["node01"].status == Status.FAIL and "below the minimum" in out["node01"].message
    assert "link-rate" not in out["node01"].message.split("below the minimum")[0]
    assert out["node01"].message.count("below the") == 1
    assert iperf3.evaluate(facts, with_iperf3(thresholds, link_rate_fraction=0))["node01"].status == Status.PASS


def test_a_host_below_the_floor_is_measured_again_before_it_is_named(thresholds):
    """4 hosts with 10 GbE NICs (physical, 10000 Mb/s): every first test runs at 3 Gbit/s (contention), every later
    one at 9.4: confirmed, nobody named. Slow every time: every host WARNs, with the floor in the line."""
    def run(later):
        tests = {}

        def client(src, p, timeout):
            pair = tuple(sorted((src, p["dst"])))
            tests[pair] = tests.get(pair, 0) + 1
            return {"gbps": 3.0 if tests[pair] == 1 else later, "retransmits": 0, "error": None}

        cluster = FakeCluster(4, thresholds=thresholds, handlers={
            "iperf3.serve": lambda h, p, t: FakeService(ready={"port": 5201}, host=h, func="iperf3.serve"),
            "iperf3.client": client})
        cluster.facts.update({h.name: {"interfaces": {"interfaces": [
            itf("eno1", [f"10.0.0.{i + 1}/24"], kind="physical", virtual=False, speed_mbps=10000)]}}
            for i, h in enumerate(cluster.all_hosts)})
        facts = iperf3.coordinate(cluster)
        return facts, tests

    facts, tests = run(9.4)
    # measured again, the ring's links (each at its best) agree and clear every host: the diagonals are not measured
    # again (orchestrate.ring_agrees)
    ring = {("node01", "node02"), ("node02", "node03"), ("node03", "node04"), ("node01", "node04")}
    assert {p for p, n in tests.items() if n == 2} == ring and facts["networks"][0]["remeasured"] == 1, tests
    assert facts["networks"][0]["link_mbps"] == dict.fromkeys(facts["hosts"], 10000)
    out = iperf3.evaluate(facts, thresholds)
    assert all(o.status == Status.PASS for o in out.values()), {h: o.message for h, o in out.items()}
    assert "floor 5.00 Gbit/s: 50% of the 10.00 Gbit/s link rate node01 eno1 reports" in out["*"].message
    facts, tests = run(3.0)
    out = iperf3.evaluate(facts, thresholds)
    assert {h for h, o in out.items() if o.status == Status.WARN} == {"node01", "node02", "node03", "node04", "*"}
    assert "below the floor 5.00 Gbit/s" in out["node02"].message


def test_floor_thresholds_are_in_the_defaults(thresholds):
    t = thresholds["iperf3"]
    assert t["link_rate_fraction"] == 0.5 and t["stream_cap_gbps"] == 20.0 and t["min_gbps"] == 0.0
    assert t["link_type_min_gbps"] == {"ethernet": 1.0, "infiniband": 10.0} and t["virtual_link_type"] == "none"


# --- the default floor by link type (no min_gbps, no reported link rate) -------------------------------------------

def with_types(facts, types):
    for net in facts["networks"]:
        if net["network"] == facts["chosen"]["network"]:
            net["link_types"] = dict(types)
    return facts


def test_ipoib_and_virtio_get_the_default_floor_of_their_link_type(thresholds):
    # IPoIB reports the IB port's rate (no TCP floor from it) and virtio -1: the type floor applies instead.
    ipoib = with_types(recorded_two_networks({"node01": None, "node02": None, "node03": None}),
                       dict.fromkeys(("node01", "node02", "node03"), "infiniband"))
    out = iperf3.evaluate(ipoib, thresholds)
    assert {h for h, o in out.items() if o.status == Status.WARN} == {"node01", "node02", "node03", "*"}
    assert ("below the floor 5.00 Gbit/s: 50% of 10.00 Gbit/s, the slowest InfiniBand (IPoIB) link (the default "
            "floor by link type)") in out["node01"].message
    assert thresholds["iperf3"]["min_gbps"] == 0.0
    # 383 Mbit/s on Ethernet NICs of unknown rate (virtio): below half of 1 Gbit/s
    eth = with_types(recorded_two_networks(), dict.fromkeys(("node01", "node02", "node03"), "ethernet"))
    out = iperf3.evaluate(eth, thresholds)
    assert out["node02"].status == Status.WARN and "floor 500.0 Mbit/s: 50% of 1.00 Gbit/s, the slowest Ethernet " \
        "link" in out["node02"].message
    # a port that negotiated 100 Mbit/s reports it: the reported-rate floor (50 Mbit/s) would pass 90 Mbit/s; the
    # type floor does not
    slow_port = iperf3.link_floor({"link_mbps": {"a": 100, "b": 1000}, "link_types": {"a": "ethernet", "b": "ethernet"},
                                   "devices": {"a": "eno1", "b": "eno1"}}, thresholds["iperf3"])
    assert slow_port[0] == pytest.approx(0.5) and "above the floor 50.0 Mbit/s" in slow_port[1]
    # veth: none by default (a virtual NIC says nothing of the path), Ethernet when told
    veth = with_types(recorded_two_networks(), dict.fromkeys(("node01", "node02", "node03"), "virtual"))
    assert all(o.status == Status.PASS for o in iperf3.evaluate(veth, thresholds).values())
    told = iperf3.evaluate(veth, with_iperf3(thresholds, virtual_link_type="ethernet"))
    assert told["node03"].status == Status.WARN


def test_link_types_are_read_from_the_interfaces_facts():
    facts = {"interfaces": [itf("eno1", ["10.0.0.1/24"], kind="physical", virtual=False, arp_type=1),
                            itf("ib0", ["10.2.0.1/24"], kind="other", virtual=False,
                                arp_type=iperf3.ARPHRD_INFINIBAND),
                            itf("eth0", ["10.1.0.1/24"])]}
    assert [iperf3.link_type(facts, d) for d in ("eno1", "ib0", "eth0", "nope")] == \
        ["ethernet", "infiniband", "virtual", "unknown"]


needs_cluster = pytest.mark.skipif(NetCluster.unavailable_reason() is not None,
                                   reason=str(NetCluster.unavailable_reason()))


@needs_cluster
def test_a_namespace_link_shaped_below_the_default_floor_warns(netcluster_factory, tmp_path):
    """3 namespace hosts (veth, counted as Ethernet: virtual_link_type), no min_gbps: every link shaped to 300
    Mbit/s is below half of 1 Gbit/s, a WARN on every host; at 700 Mbit/s they pass."""
    import subprocess
    import sys
    cluster = netcluster_factory(3)
    config = tmp_path / "config.toml"
    config.write_text('[iperf3]\nduration_s = 1.0\nvirtual_link_type = "ethernet"\n')

    def run(mbit, name):
        for h in cluster.hosts:
            cluster.shape(h, mbit)
        out = tmp_path / f"{name}.json"
        argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hosts")),
                "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key",
                str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--checks", "interfaces,iperf3",
                "--config", str(config), "--json", str(out)]
        proc = subprocess.run(argv, cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)
        assert out.exists(), proc.stderr[-3000:]
        return {r["host"]: r for r in json.loads(out.read_text())["results"] if r["check"] == "iperf3"}

    try:
        slow = run(300, "slow")
        fast = run(700, "fast")
    finally:
        for h in cluster.hosts:
            cluster.unshape(h)
    for h in ("node01", "node02", "node03"):
        assert slow[h]["status"] == "warn", slow[h]["message"]
        assert "below the floor 500.0 Mbit/s: 50% of 1.00 Gbit/s, the slowest Ethernet link" in slow[h]["message"]
        assert fast[h]["status"] == "pass", fast[h]["message"]
    assert slow["*"]["status"] == "warn" and fast["*"]["status"] == "pass"
