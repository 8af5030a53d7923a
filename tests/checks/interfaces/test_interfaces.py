"""interfaces: parsers on the recorded H100 host files, sysfs readers on trees built in the sysfs format,
evaluate on recorded and faulty facts, collect for real on this machine."""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from pathlib import Path

import pytest

from preflight.checks import interfaces as itf
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

REPO = Path(__file__).resolve().parents[3]
from tests.h100 import read as fixture
T = load_defaults()


def ctx(params=None, seconds=60.0) -> HostContext:
    return HostContext(dict(params or {}), time.monotonic() + seconds)


# --- sysfs trees in the kernel's format ------------------------------------------------------

def make_net_tree(root: Path, lines: str, physical=("eth0",)) -> Path:
    """A /sys/class/net from net-speed.txt lines 'NAME speed=S mtu=M oper=O' (empty speed = EINVAL on read)."""
    cls = root / "class" / "net"
    cls.mkdir(parents=True)
    for line in lines.splitlines():
        if not line.strip():
            continue
        name, *kv = line.split()
        vals = dict(x.split("=", 1) for x in kv)
        dev = (root / "devices" / "pci0000:00" / "0000:00:03.0" / "net" / name) if name in physical else \
            (root / "devices" / "virtual" / "net" / name)
        dev.mkdir(parents=True)
        if vals["speed"]:
            (dev / "speed").write_text(vals["speed"] + "\n")
        (dev / "mtu").write_text(vals["mtu"] + "\n")
        (dev / "operstate").write_text(vals["oper"] + "\n")
        (dev / "type").write_text("772\n" if name == "lo" else "1\n")
        (dev / "flags").write_text("0x9\n" if name == "lo" else "0x1003\n")
        (cls / name).symlink_to(os.path.relpath(dev, cls))
    return cls


def make_ib_port(root: Path, dev: str, port: int, state="4: ACTIVE", phys="5: LinkUp",
                 rate="400 Gb/sec (4X NDR)", layer="InfiniBand", gids=None, netdev=None):
    p = root / dev / "ports" / str(port)
    (p / "gids").mkdir(parents=True, exist_ok=True)
    (p / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
    (p / "gid_attrs" / "ndevs").mkdir(parents=True, exist_ok=True)
    (p / "state").write_text(state + "\n")
    (p / "phys_state").write_text(phys + "\n")
    (p / "rate").write_text(rate + "\n")
    (p / "link_layer").write_text(layer + "\n")
    table = gids if gids is not None else [("fe80:0000:0000:0000:a088:c203:0012:3456", "IB/RoCE v1", "")]
    for i in range(4):  # real tables are longer and mostly zero
        gid, typ, nd = table[i] if i < len(table) else (itf.ZERO_GID, "", "")
        (p / "gids" / str(i)).write_text(gid + "\n")
        if gid != itf.ZERO_GID:
            (p / "gid_attrs" / "types" / str(i)).write_text(typ + "\n")
            (p / "gid_attrs" / "ndevs" / str(i)).write_text(nd + "\n")
    if netdev:
        (root / dev / "device" / "net" / netdev).mkdir(parents=True, exist_ok=True)
    return p


def ib_facts(tmp_path, ports):
    root = tmp_path / "infiniband"
    root.mkdir(exist_ok=True)
    for kw in ports:
        make_ib_port(root, **kw)
    return itf.read_infiniband(str(root))


# --- parsers on the recorded host ------------------------------------------------------------

def test_modules_fixture_has_no_peermem():
    mods = itf.parse_modules(fixture("lsmod.txt"))
    assert mods == ["nvidia_uvm", "nvidia"]
    assert not any(m in mods for m in itf.PEERMEM_MODULES)


def test_proc_net_dev_fixture_names():
    assert itf.parse_proc_net_dev(fixture("proc-net-dev.txt")) == ["lo", "ifb0", "ifb1", "eth0"]


def test_proc_net_route_fixture_longest_prefix():
    table = fixture("proc-net-route.txt")
    assert itf.route_lookup_proc(table, "192.0.2.77") == {"dev": "eth0", "gateway": None}
    assert itf.route_lookup_proc(table, "8.8.8.8") == {"dev": "eth0", "gateway": "192.0.2.1"}
    assert itf.route_lookup_proc(table, "not-an-ip") is None
    assert itf.route_lookup_proc("Iface\tDestination\n", "8.8.8.8") is None


def test_infiniband_fixture_is_empty_listing(tmp_path):
    listing = fixture("infiniband.txt")
    entries = [ln.split()[-1] for ln in listing.splitlines() if ln.startswith(("d", "l", "-"))]
    assert entries == [".", ".."]  # nothing but . and ..: no IB device on the recorded host
    (tmp_path / "infiniband").mkdir()
    assert itf.read_infiniband(str(tmp_path / "infiniband")) == []
    assert itf.read_infiniband(str(tmp_path / "absent")) == []


def test_net_speed_fixture_through_sysfs_reader(tmp_path):
    cls = make_net_tree(tmp_path, fixture("net-speed.txt"))
    sysnet = itf.read_sys_net(str(cls))
    assert sorted(sysnet) == ["eth0", "ifb0", "ifb1", "lo"]
    assert sysnet["eth0"]["speed_mbps"] is None  # -1: speed unknown (virtio)
    assert sysnet["eth0"]["mtu"] == 1400 and sysnet["eth0"]["operstate"] == "up"
    assert sysnet["lo"]["mtu"] == 65536 and sysnet["lo"]["sys_virtual"] and not sysnet["eth0"]["sys_virtual"]
    assert sysnet["ifb0"]["speed_mbps"] is None and sysnet["ifb0"]["operstate"] == "down"


def test_ip_json_parsers():
    addr = json.dumps([
        {"ifname": "lo", "operstate": "UNKNOWN", "mtu": 65536, "link_type": "loopback", "flags": ["LOOPBACK"],
         "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8},
                       {"family": "inet6", "local": "::1", "prefixlen": 128}]},
        {"ifname": "ib0", "operstate": "UP", "mtu": 4092, "addr_info": [
            {"family": "inet", "local": "198.18.0.1", "prefixlen": 24}]}])
    parsed = itf.parse_ip_addr_json(addr)
    assert parsed["lo"]["ipv4"] == ["127.0.0.1/8"] and parsed["lo"]["ipv6"] == ["::1/128"]
    assert parsed["ib0"]["ipv4"] == ["198.18.0.1/24"] and parsed["ib0"]["mtu"] == 4092
    assert itf.parse_ip_addr_json("not json") == {}
    kinds = itf.parse_ip_link_kinds(json.dumps([{"ifname": "veth1", "linkinfo": {"info_kind": "veth"}},
                                                {"ifname": "eth0"}]))
    assert kinds == {"veth1": "veth", "eth0": None}
    route = itf.parse_ip_route_get('[{"dst":"192.0.2.1","dev":"eth0","prefsrc":"192.0.2.2","flags":[],"uid":0,'
                                   '"cache":[]}]')
    assert route == {"dev": "eth0", "src": "192.0.2.2", "gateway": None}
    assert itf.parse_ip_route_get("[]") is None


def test_if_inet6_hex_prefix():
    text = ("fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n"
            "00000000000000000000000000000001 01 80 10 80       lo\n")
    assert itf.parse_if_inet6(text) == {"eth0": ["fe80::fc:ff:fe00:1/64"], "lo": ["::1/128"]}


def test_ib_state_and_rate_parsers():
    assert itf.parse_ib_state("4: ACTIVE\n") == "ACTIVE" and itf.parse_ib_state("5: LinkUp") == "LinkUp"
    assert itf.parse_ib_state(None) is None
    assert itf.parse_ib_rate("400 Gb/sec (4X NDR)") == 400.0
    assert itf.parse_ib_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert itf.parse_ib_rate("garbage") is None


@pytest.mark.parametrize("name,info,info_kind,kind", [
    ("lo", {"type": 772, "sys_virtual": True}, None, "loopback"),
    ("docker0", {"bridge": True, "sys_virtual": True}, "bridge", "docker"),
    ("veth12ab", {"sys_virtual": True}, "veth", "veth"),
    ("eth0", {"sys_virtual": True}, "veth", "veth"),          # a container's end of a veth pair
    ("br-1234", {"bridge": True, "sys_virtual": True}, "bridge", "bridge"),
    ("ens1f0np0", {"sys_virtual": False}, None, "physical"),
    ("ib0", {"sys_virtual": False}, "ipoib", "physical"),
    ("bond0", {"sys_virtual": True}, "bond", "other"),
    ("ifb0", {"sys_virtual": True}, "ifb", "other"),
    ("eth9", {}, None, "other"),                               # no sysfs: unknown, not physical
])
def test_classify(name, info, info_kind, kind):
    assert itf.classify(name, info, info_kind) == kind


def test_read_infiniband_tree(tmp_path):
    roce_gids = [("fe80:0000:0000:0000:0e42:a1ff:fe00:0001", "IB/RoCE v1", "ens1f0np0"),
                 ("fe80:0000:0000:0000:0e42:a1ff:fe00:0001", "RoCE v2", "ens1f0np0"),
                 ("0000:0000:0000:0000:0000:ffff:c612:0001", "RoCE v2", "ens1f0np0")]
    ib = ib_facts(tmp_path, [
        dict(dev="mlx5_0", port=1),
        dict(dev="mlx5_1", port=1, state="1: DOWN", phys="2: Polling"),
        dict(dev="mlx5_2", port=1, layer="Ethernet", rate="200 Gb/sec (2X HDR)", gids=roce_gids,
             netdev="ens1f0np0"),
    ])
    assert [(p["device"], p["port"], p["active"]) for p in ib] == [("mlx5_0", 1, True), ("mlx5_1", 1, False),
                                                                   ("mlx5_2", 1, True)]
    assert ib[1]["state"] == "DOWN" and ib[1]["phys_state"] == "Polling"
    assert ib[2]["rate_gbps"] == 200.0 and ib[2]["link_layer"] == "Ethernet" and ib[2]["netdevs"] == ["ens1f0np0"]
    assert [g["index"] for g in ib[2]["gids"]] == [0, 1, 2]  # zero entries dropped
    assert ib[2]["gids"][2] == {"index": 2, "gid": "0000:0000:0000:0000:0000:ffff:c612:0001", "type": "RoCE v2",
                                "ndev": "ens1f0np0"}


# --- evaluate --------------------------------------------------------------------------------

def h100_facts(tmp_path):
    """The recorded H100 host: net-speed.txt interfaces, no IB, no peermem, master behind eth0's gateway."""
    sysnet = itf.read_sys_net(str(make_net_tree(tmp_path, fixture("net-speed.txt"))))
    names = itf.parse_proc_net_dev(fixture("proc-net-dev.txt"))
    addrs = {"eth0": {"ipv4": ["192.0.2.2/24"], "ipv6": []}, "lo": {"ipv4": ["127.0.0.1/8"], "ipv6": ["::1/128"]}}
    route = itf.route_lookup_proc(fixture("proc-net-route.txt"), "192.0.2.10")
    mods = itf.parse_modules(fixture("lsmod.txt"))
    return {"interfaces": itf.build_interfaces(sysnet, addrs, {"ifb0": "ifb", "ifb1": "ifb"}, names),
            "ib": [], "peermem": any(m in mods for m in itf.PEERMEM_MODULES), "peermem_module": None,
            "route_to_master": dict(route, src="192.0.2.2", ip="192.0.2.10"),
            "master": {"given": "192.0.2.10", "ip": "192.0.2.10", "addresses": ["192.0.2.10"], "error": None},
            "route_error": None}


def test_h100_fixture_host_without_ib_passes(tmp_path):
    facts = h100_facts(tmp_path)
    o = itf.evaluate(facts, T)
    assert o.status == Status.PASS, o.message
    assert "no IB/RoCE devices" in o.message and "eth0" in o.message and "MTU 1400" in o.message
    assert "route to master 192.0.2.10 via eth0" in o.message and "nvidia_peermem not loaded" in o.message
    by_name = {i["name"]: i for i in o.metrics["interfaces"]}
    assert by_name["lo"]["kind"] == "loopback" and by_name["lo"]["virtual"]
    assert by_name["eth0"]["kind"] == "physical" and not by_name["eth0"]["virtual"]
    assert by_name["ifb0"]["kind"] == "other" and by_name["ifb0"]["virtual"]
    assert o.metrics["route_to_master"]["dev"] == "eth0" and o.metrics["peermem"] is False


def test_ib_port_down_fails_and_names_active_ports(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev="mlx5_0", port=1), dict(dev="mlx5_1", port=1, state="1: DOWN",
                                                                        phys="2: Polling")])
    o = itf.evaluate(facts, T)
    assert o.status == Status.FAIL
    assert "mlx5_1:1 (InfiniBand) is DOWN / Polling (expected ACTIVE / LinkUp)" in o.message
    assert "NCCL_IB_HCA==mlx5_0:1" in o.fix and "ibstat mlx5_1" in o.fix


def test_all_ib_down_suggests_ib_disable(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev="mlx5_0", port=1, state="2: INIT", phys="5: LinkUp")])
    o = itf.evaluate(facts, T)
    assert o.status == Status.FAIL and "INIT / LinkUp" in o.message and "NCCL_IB_DISABLE=1" in o.fix


def test_roce_port_down_fix_brings_netdev_up(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev="mlx5_2", port=1, layer="Ethernet", state="1: DOWN",
                                           phys="3: Disabled", netdev="ens1f0np0")])
    o = itf.evaluate(facts, T)
    assert o.status == Status.FAIL and "ip link set ens1f0np0 up" in o.fix


def test_mixed_rates_warn(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev=f"mlx5_{i}", port=1) for i in range(3)]
                           + [dict(dev="mlx5_3", port=1, rate="200 Gb/sec (4X HDR)")])
    o = itf.evaluate(facts, T)
    assert o.status == Status.WARN
    assert "mlx5_3:1 runs at 200 Gb/s" in o.message and "400 Gb/s of mlx5_0:1, mlx5_1:1, mlx5_2:1" in o.message
    assert "ibstat mlx5_3" in o.fix
    # A host that mixes fabrics on purpose lowers the fraction.
    assert itf.evaluate(facts, {"interfaces": {"min_rate_fraction": 0.5}}).status == Status.PASS


def test_rates_compare_within_link_layer_only(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev="mlx5_0", port=1),
                                      dict(dev="mlx5_1", port=1, layer="Ethernet", rate="100 Gb/sec (4X EDR)",
                                           gids=[("0000:0000:0000:0000:0000:ffff:c612:0001", "RoCE v2", "eth1")])])
    assert itf.evaluate(facts, T).status == Status.PASS


def test_roce_without_gid_warns(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev="mlx5_0", port=1, layer="Ethernet", gids=[], netdev="eth1")])
    o = itf.evaluate(facts, T)
    assert o.status == Status.WARN and "empty GID table" in o.message and "dev eth1" in o.fix


def test_healthy_ib_passes_and_keeps_facts_in_metrics(tmp_path):
    facts = h100_facts(tmp_path)
    facts["ib"] = ib_facts(tmp_path, [dict(dev=f"mlx5_{i}", port=1) for i in range(4)])
    facts["peermem"], facts["peermem_module"] = True, "nvidia_peermem"
    o = itf.evaluate(facts, T)
    assert o.status == Status.PASS and "4/4 IB/RoCE ports active" in o.message and "nvidia_peermem loaded" in o.message
    assert o.metrics["ib"] == facts["ib"] and o.metrics["interfaces"] == facts["interfaces"]


def test_unresolvable_master_fails(tmp_path):
    facts = h100_facts(tmp_path)
    facts["route_to_master"] = None
    facts["master"] = {"given": "node00", "ip": None, "addresses": [],
                       "error": "does not resolve: [Errno -2] Name or service not known"}
    facts["route_error"] = "master node00 does not resolve: [Errno -2] Name or service not known"
    o = itf.evaluate(facts, T)
    assert o.status == Status.FAIL and "node00" in o.message and "/etc/hosts" in o.fix


def test_unreachable_master_fails_and_odd_error_is_error(tmp_path):
    facts = h100_facts(tmp_path)
    facts["route_to_master"] = None
    facts["route_error"] = "ip route get 10.9.9.9: RTNETLINK answers: Network is unreachable"
    facts["master"] = {"given": "10.9.9.9", "ip": "10.9.9.9", "addresses": ["10.9.9.9"], "error": None}
    assert itf.evaluate(facts, T).status == Status.FAIL
    facts["route_error"] = "ip route get 10.9.9.9: something odd"
    assert itf.evaluate(facts, T).status == Status.ERROR


def test_route_via_down_interface_fails(tmp_path):
    facts = h100_facts(tmp_path)
    for i in facts["interfaces"]:
        if i["name"] == "eth0":
            i["operstate"] = "down"
    o = itf.evaluate(facts, T)
    assert o.status == Status.FAIL and "via eth0, which is down" in o.message


# --- collect on this machine -----------------------------------------------------------------

def test_collect_here_lists_lo_and_the_real_nic():
    before = {n for _, n in socket.if_nameindex()}
    facts = itf.collect(ctx({"master": "127.0.0.1"}))
    after = {n for _, n in socket.if_nameindex()}
    json.loads(json.dumps(facts))
    by_name = {i["name"]: i for i in facts["interfaces"]}
    assert before & after <= set(by_name)  # interfaces others create or delete meanwhile may differ
    lo = by_name["lo"]
    assert lo["kind"] == "loopback" and lo["virtual"] and "127.0.0.1/8" in lo["ipv4"]
    physical = [n for n in os.listdir("/sys/class/net") if n in by_name
                and "/devices/virtual/" not in os.path.realpath(os.path.join("/sys/class/net", n))]
    if not physical:
        pytest.skip("no physical NIC visible here")
    for n in physical:
        assert by_name[n]["kind"] == "physical" and not by_name[n]["virtual"]
        assert by_name[n]["mtu"] == int(Path(f"/sys/class/net/{n}/mtu").read_text())
    # The NIC that carries the default route has the address the kernel picks as source for outside traffic.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.200", 9))
            src = s.getsockname()[0]
        except OSError:
            src = None
    if src:
        assert any(a.split("/")[0] == src for i in facts["interfaces"] for a in i["ipv4"])
    assert facts["route_to_master"]["dev"] == "lo" and facts["route_to_master"]["src"] == "127.0.0.1"
    assert itf.evaluate(facts, T).status in (Status.PASS, Status.WARN, Status.FAIL)  # IB state is the host's


def test_collect_route_to_master_by_name_and_outside():
    facts = itf.collect(ctx({"master": "localhost"}))
    assert facts["master"]["ip"] in ("127.0.0.1", "::1") and facts["route_to_master"]["dev"] == "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.200", 9))
            src = s.getsockname()[0]
        except OSError:
            pytest.skip("no IPv4 route off this host")
    facts = itf.collect(ctx({"master": "192.0.2.200"}))
    r = facts["route_to_master"]
    assert r["src"] == src and r["dev"] != "lo"
    assert any(a.split("/")[0] == src for i in facts["interfaces"] if i["name"] == r["dev"] for a in i["ipv4"])


def test_collect_unresolvable_master_fails():
    facts = itf.collect(ctx({"master": "preflight-no-such-host.invalid"}))  # .invalid never resolves (RFC 6761)
    assert facts["route_to_master"] is None and facts["master"]["error"]
    o = itf.evaluate(facts, T)
    assert o.status == Status.FAIL and "preflight-no-such-host.invalid" in o.message


def test_collect_without_master_has_no_route():
    facts = itf.collect(ctx())
    assert facts["master"] is None and facts["route_to_master"] is None
    assert {"interfaces", "ib", "peermem", "route_to_master"} <= set(facts)
    assert isinstance(facts["peermem"], bool)
    ib_dir = "/sys/class/infiniband"
    expected = sum(len(os.listdir(os.path.join(ib_dir, d, "ports"))) for d in os.listdir(ib_dir)) \
        if os.path.isdir(ib_dir) else 0
    assert len(facts["ib"]) == expected


def test_fallback_addresses_without_ip_command(monkeypatch):
    """With no iproute2 on PATH, addresses come from ioctl and /proc/net/if_inet6, routes from a UDP socket."""
    monkeypatch.setenv("PATH", "/nonexistent")
    facts = itf.collect(ctx({"master": "127.0.0.1"}))
    assert "ioctl + /proc/net/if_inet6" in facts["sources"]
    lo = {i["name"]: i for i in facts["interfaces"]}["lo"]
    assert "127.0.0.1/8" in lo["ipv4"]
    if os.path.exists("/proc/net/if_inet6") and "lo" in Path("/proc/net/if_inet6").read_text():
        assert "::1/128" in lo["ipv6"]
    assert facts["route_to_master"]["dev"] == "lo" and facts["route_to_master"]["via"] == "socket"
    ipaddress.ip_interface(lo["ipv4"][0])
