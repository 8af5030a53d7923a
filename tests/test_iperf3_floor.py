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
from tests.test_iperf3 import host_interfaces, itf, with_iperf3

FIXTURES = Path(__file__).parent / "fixtures" / "iperf3"


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
    assert set(tests.values()) == {2} and facts["networks"][0]["remeasured"] == 1
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
