"""preflight/hostside/validate.py: the one gate for host-reported names, and its use by interfaces and the recommendation."""
import pytest

from preflight.checks import interfaces
from preflight.hostside import validate
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from preflight.recommend import recommend
from tests.recommend.test_recommend import chosen, iface_facts, iperf3_facts, itf, make_cluster

HOSTILE = ["$(touch${IFS}x)", "a\nLD_PRELOAD=/tmp/x.so", "-Eadvlog", "", "x" * 16, "eth0;id", "a b", "é", "`id`",
           'a"b', "a\\b", "..", ".", "\x1b]0;t\x07", "a\x00b", 7, None, ["eth0"]]


@pytest.mark.parametrize("name", ["eth0", "ens1f0np0", "ib0", "eth0.100", "eth0:1", "veth1@if2", "a-b_c", "x" * 15])
def test_real_interface_names_pass(name):
    assert validate.ifname(name)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_interface_names_fail(name):
    assert not validate.ifname(name)


@pytest.mark.parametrize("value", ["=eth0,ib0", "^docker,lo", "1", "WARN", "PHB", "=mlx5_0:1,mlx5_1:1", "3"])
def test_nccl_values_are_env_safe(value):
    assert validate.env_value(value)


@pytest.mark.parametrize("value", ["=$(touch${IFS}x)", "a`id`", 'a"b', "a\\b", "a\nB=c", "a b", "", "a'b", "x" * 2000])
def test_shell_meaningful_values_are_not_env_safe(value):
    assert not validate.env_value(value)


def test_ip_address_rule():
    # What iperf3 -B/-c and the ports check's listeners accept from a host's facts: literals only.
    for good in ("198.18.0.1", "::1", "fe80::1", "0.0.0.0", "fe80::1%eth0"):
        assert validate.ip_address(good)
    for bad in ("node01", "-B", "198.18.0.1; id", "[::1]", "198.18.0.256", "", None, 7, "fe80::1%eth0\nx", "fe80::1%$(id)"):
        assert not validate.ip_address(bad), bad


def test_quote_escapes_controls_and_caps_length():
    assert validate.quote("a\x1b[2Jb\n") == repr("a\x1b[2Jb\n")
    assert "\x1b" not in validate.quote("\x1b]0;t\x07") and "\n" not in validate.quote("a\nb")
    big = validate.quote("y" * 10_000_000)
    assert len(big) < 200 and "10000000 chars" in big


def test_path_rule():
    assert validate.path("/local_nvme/a b") and not validate.path("rel/x") and not validate.path("/a/../etc")
    assert not validate.path("/a\nb")


@pytest.mark.parametrize("name", [n for n in HOSTILE if isinstance(n, str) and n])
def test_interfaces_fails_naming_the_odd_name_quoted(name):
    facts = iface_facts([itf("eth0", ["10.0.0.1/24"]), itf(name, ["10.1.0.1/24"])])
    out = interfaces.evaluate(facts, load_defaults())
    assert out.status == Status.FAIL
    assert validate.quote(name) in out.message
    # the raw name (with its controls or shell syntax) appears nowhere but inside the repr quote
    for text in (out.message.replace(validate.quote(name), ""), out.fix):
        assert name not in text or name in ("..", ".")


def test_interfaces_fails_odd_hca_and_netdev():
    port = {"device": "mlx5_0;reboot", "port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "active": True,
            "link_layer": "InfiniBand", "rate_gbps": 400.0, "gids": [], "netdevs": ["ib0\n"]}
    out = interfaces.evaluate(iface_facts([itf("eth0", ["10.0.0.1/24"])], ib=[port]), load_defaults())
    assert out.status == Status.FAIL and "'mlx5_0;reboot'" in out.message and "'ib0\\n'" in out.message


def test_valid_names_still_pass():
    out = interfaces.evaluate(iface_facts([itf("eth0", ["10.0.0.1/24"])]), load_defaults())
    assert out.status == Status.PASS


@pytest.mark.parametrize("name", ["$(touch${IFS}x)", "e\nLD_PRELOAD=/x.so", "-x", "a\"b"])
def test_recommendation_never_uses_an_odd_name(name):
    hosts = ["n1", "n2"]
    facts = {"n1": {"interfaces": iface_facts([itf(name, ["10.0.0.1/24"])], route_dev=name)},
             "n2": {"interfaces": iface_facts([itf("eth0", ["10.0.0.2/24"])], route_dev="eth0")},
             "*": {"iperf3": iperf3_facts(chosen("10.0.0.0/24", [name, "eth0"], hosts))}}
    env, reasons, notes = recommend(make_cluster(facts, hosts), [])
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env
    assert all(validate.env_value(v) for v in env.values())
    assert not any(name in note.replace(validate.quote(name), "") for note in notes)
    # without the iperf3 facts (route-based choice) too
    del facts["*"]
    env, _, notes = recommend(make_cluster(facts, hosts), [])
    assert "NCCL_SOCKET_IFNAME" not in env
    assert not any(name in note.replace(validate.quote(name), "") for note in notes)


def test_recommendation_never_uses_odd_hca_or_gid_index():
    def port(dev, idx):
        return {"device": dev, "port": 1, "active": True, "link_layer": "Ethernet", "rate_gbps": 100.0,
                "gids": [{"index": idx, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0001", "type": "RoCE v2"}]}
    hosts = ["n1", "n2"]
    facts = {"n1": {"interfaces": iface_facts([itf("eth0")], ib=[port("mlx5_0", "$(id)")])},
             "n2": {"interfaces": iface_facts([itf("eth0")], ib=[port("mlx5_0`id`", 3)])}}
    env, _, notes = recommend(make_cluster(facts, hosts), [])
    assert all(validate.env_value(v) for v in env.values()), env
    assert "NCCL_IB_GID_INDEX" not in env
    assert "`" not in env.get("NCCL_IB_HCA", "")


MALFORMED = ["not a dict", [1, 2], {"interfaces": "eth0"}, {"interfaces": [None, "eth0", {"name": 7}]},
             {"interfaces": [{"name": "eth0", "ipv4": "10.0.0.1/24"}], "route_to_master": "eth0"},
             {"ib": {"device": "mlx5_0"}},
             {"ib": [{"device": "mlx5_0", "port": 1, "active": True, "gids": "x", "link_layer": 5}]}]


@pytest.mark.parametrize("bad", MALFORMED)
def test_recommendation_survives_malformed_interface_facts(bad):
    hosts = ["n1", "n2"]
    facts = {"n1": {"interfaces": iface_facts([itf("eth0", ["10.0.0.1/24"])], route_dev="eth0")},
             "n2": {"interfaces": bad}}
    env, _, notes = recommend(make_cluster(facts, hosts), [])
    assert env["NCCL_DEBUG"] == "WARN" and all(validate.env_value(v) for v in env.values())
    if isinstance(bad, dict):
        assert interfaces.evaluate(bad, load_defaults()).status in (Status.FAIL, Status.PASS, Status.WARN)
    else:
        assert interfaces.evaluate(bad, load_defaults()).status == Status.ERROR
