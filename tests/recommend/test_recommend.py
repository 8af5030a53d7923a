"""The NCCL/Gloo environment recommendation, on facts dicts (the recorded H100 host, differing names, IB, RoCE)."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from preflight.hostside.outcome import Status
from preflight.hostside.ncclenv import roce_gid_index, socket_ifname
from preflight.recommend import NEVER, NOTED, NOT_NEEDED, advise, recommend
from preflight.testing import FakeCluster

H100 = Path(__file__).resolve().parents[1] / "fixtures" / "h100-host"


def make_cluster(facts, hosts=None, addresses=None):
    """The hosts (default: those in facts), each reached at its own name unless addresses says otherwise."""
    names = hosts or [h for h in facts if h != "*"]
    return FakeCluster(names, facts=facts, addresses={n: (addresses or {}).get(n, n) for n in names})


def itf(name, ipv4=(), kind="physical", **extra):
    d = {"name": name, "ipv4": list(ipv4), "ipv6": [], "operstate": "up", "speed_mbps": None, "mtu": 1500,
         "virtual": kind != "physical", "kind": kind}
    d.update(extra)
    return d


def iface_facts(interfaces, ib=(), peermem=False, route_dev=None):
    return {"interfaces": list(interfaces), "ib": list(ib), "peermem": peermem,
            "route_to_master": {"dev": route_dev, "src": None} if route_dev else None}


def chosen(network, devices, hosts, median=9.4):
    return {"network": network, "devices": list(devices), "hosts": list(hosts), "median_gbps": median,
            "addresses": {h: f"10.0.0.{i + 1}" for i, h in enumerate(hosts)}}


def iperf3_facts(ch, networks=()):
    return {"hosts": list(ch["hosts"]) if ch else [], "chosen": ch, "networks": list(networks)}


def h100_interfaces(host_octet):
    """The recorded H100 host's interfaces (net-speed.txt, proc-net-route.txt, infiniband.txt, lsmod.txt).

    Its IPv4 address was not recorded: the route table gives the subnet (192.0.2.0/24 via eth0), the host
    octet is made up.
    """
    out = []
    for line in (H100 / "net-speed.txt").read_text().splitlines():
        name, *fields = line.split()
        f = dict(x.split("=", 1) for x in fields)
        kind = "loopback" if name == "lo" else "other" if name.startswith("ifb") else "physical"
        speed = int(f["speed"]) if f["speed"].lstrip("-").isdigit() and int(f["speed"]) >= 0 else None
        out.append(itf(name, kind=kind, operstate=f["oper"], mtu=int(f["mtu"]), speed_mbps=speed))
    routes = [ln.split() for ln in (H100 / "proc-net-route.txt").read_text().splitlines()[1:] if ln.strip()]
    subnet = next(r for r in routes if r[1] != "00000000")
    net = ".".join(str(b) for b in reversed(bytes.fromhex(subnet[1])))
    for i in out:
        if i["name"] == subnet[0]:
            i["ipv4"] = [f"{net.rsplit('.', 1)[0]}.{host_octet}/24"]
    ib_listing = (H100 / "infiniband.txt").read_text()
    assert "mlx" not in ib_listing  # the recorded host has no IB devices
    peermem = "nvidia_peermem" in (H100 / "lsmod.txt").read_text()
    return iface_facts(out, ib=[], peermem=peermem, route_dev=next(r[0] for r in routes if r[1] == "00000000"))


def assert_never_folklore(env, notes):
    assert not set(env) & set(NEVER)
    assert env["NCCL_DEBUG"] == "WARN"
    # torch's default (3, SkipCleanUp) already tears a failed rank down: preflight does not restate it, and says why.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    # Nothing inherited here: no note about a variable nobody set (issue 30).
    assert not [n for n in notes if any(name in n for name in NOTED)], notes


def test_h100_host_eth0_only_no_ib():
    hosts = ["gpu01", "gpu02"]
    facts = {h: {"interfaces": h100_interfaces(2 + i)} for i, h in enumerate(hosts)}
    facts["*"] = {"iperf3": iperf3_facts(chosen("192.0.2.0/24", ["eth0", "eth0"], hosts))}
    env, reasons, notes = recommend(make_cluster(facts, hosts), [])
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0"
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_IB_HCA" not in env and "NCCL_NET_GDR_LEVEL" not in env and "NCCL_IB_GID_INDEX" not in env
    assert "192.0.2.0/24" in reasons["NCCL_SOCKET_IFNAME"]
    assert set(reasons) == set(env)
    assert_never_folklore(env, notes)


def test_without_iperf3_falls_back_to_the_route_to_the_master():
    hosts = ["gpu01", "gpu02"]
    facts = {h: {"interfaces": h100_interfaces(2 + i)} for i, h in enumerate(hosts)}
    env, reasons, _ = recommend(make_cluster(facts, hosts), [])
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0"
    assert "no bandwidth measured" in reasons["NCCL_SOCKET_IFNAME"]


def test_fallback_on_the_master_itself_uses_the_interface_holding_its_address():
    hosts = ["m", "w"]
    facts = {"m": {"interfaces": iface_facts([itf("lo", ["127.0.0.1/8"], kind="loopback"),
                                              itf("ens5", ["10.0.0.1/24"])])},
             "w": {"interfaces": iface_facts([itf("ens5", ["10.0.0.2/24"])], route_dev="ens5")}}
    facts["m"]["interfaces"]["route_to_master"] = {"dev": "lo", "src": "10.0.0.1", "ip": "10.0.0.1"}
    env, _, _ = recommend(make_cluster(facts, hosts), [])
    assert env["NCCL_SOCKET_IFNAME"] == "=ens5"


def test_measured_network_wins_over_the_one_the_names_resolve_to():
    hosts = ["n1", "n2"]
    facts = {h: {"interfaces": iface_facts([itf("eth0", [f"10.0.0.{i + 1}/24"], kind="veth"),
                                            itf("eth1", [f"10.1.0.{i + 1}/24"], kind="veth")],
                                           route_dev="eth0")} for i, h in enumerate(hosts)}
    ch = chosen("10.1.0.0/24", ["eth1", "eth1"], hosts, median=0.38)
    ch["addresses"] = {"n1": "10.1.0.1", "n2": "10.1.0.2"}
    facts["*"] = {"iperf3": iperf3_facts(ch, [{"network": "10.0.0.0/24", "median_gbps": 0.048},
                                              {"network": "10.1.0.0/24", "median_gbps": 0.38}])}
    env, reasons, notes = recommend(make_cluster(facts, hosts, {"n1": "10.0.0.1", "n2": "10.0.0.2"}), [])
    assert env["NCCL_SOCKET_IFNAME"] == "=eth1"  # a veth is a real NIC in a container
    assert env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "10.0.0.0/24" in reasons["NCCL_SOCKET_IFNAME"]  # the slower network is named in the reason
    assert any("--master_addr=10.1.0.1" in n for n in notes)


def test_names_differ_across_hosts():
    hosts = ["a", "b", "c"]
    facts = {"a": {"interfaces": iface_facts([itf("eth1", ["10.1.0.1/24"])])},
             "b": {"interfaces": iface_facts([itf("ens5", ["10.1.0.2/24"])])},
             "c": {"interfaces": iface_facts([itf("ens5", ["10.1.0.3/24"])])}}
    facts["*"] = {"iperf3": iperf3_facts(chosen("10.1.0.0/24", ["eth1", "ens5", "ens5"], hosts))}
    env, reasons, notes = recommend(make_cluster(facts, hosts), [])
    assert env["NCCL_SOCKET_IFNAME"] == "=ens5,eth1"
    # gloo creates a device for every listed name and fails where one is missing: no single value works
    assert "GLOO_SOCKET_IFNAME" not in env
    assert any("GLOO_SOCKET_IFNAME" in n and "per host" in n and "10.1.0.0/24" in n for n in notes)
    assert "differ" in reasons["NCCL_SOCKET_IFNAME"]


def test_names_differ_and_one_host_also_has_the_other_name():
    hosts = ["a", "b"]
    facts = {"a": {"interfaces": iface_facts([itf("eth1", ["10.1.0.1/24"]), itf("ens5", ["10.9.0.1/24"])])},
             "b": {"interfaces": iface_facts([itf("ens5", ["10.1.0.2/24"])])}}
    facts["*"] = {"iperf3": iperf3_facts(chosen("10.1.0.0/24", ["eth1", "ens5"], hosts))}
    env, _, notes = recommend(make_cluster(facts, hosts), [])
    assert env["NCCL_SOCKET_IFNAME"] == "=ens5,eth1"
    assert any("also matches ens5 on a" in n for n in notes)


@pytest.mark.parametrize("bad", [("docker0", "docker"), ("br0", "bridge"), ("lo", "loopback")])
def test_never_lo_docker_or_bridges(bad):
    name, kind = bad
    hosts = ["a", "b"]
    facts = {h: {"interfaces": iface_facts([itf(name, [f"172.17.0.{i + 2}/16"], kind=kind)], route_dev=name)}
             for i, h in enumerate(hosts)}
    env, _, notes = recommend(make_cluster(facts, hosts), [])
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env
    assert any("loopback, docker or a bridge" in n for n in notes)


def test_iperf3_without_a_network_reaching_all_hosts():
    hosts = ["a", "b"]
    facts = {h: {"interfaces": h100_interfaces(2 + i)} for i, h in enumerate(hosts)}
    facts["*"] = {"iperf3": {"hosts": hosts, "chosen": None, "networks": []}}
    results = [SimpleNamespace(host="*", check="iperf3", status=Status.FAIL)]
    env, _, notes = recommend(make_cluster(facts, hosts), results)
    assert "NCCL_SOCKET_IFNAME" not in env
    assert any("no network that reaches all hosts" in n for n in notes)
    assert any("network checks failed" in n for n in notes)


def ib_port(device, port=1, active=True, link_layer="InfiniBand", gids=()):
    return {"device": device, "port": port, "state": "ACTIVE" if active else "DOWN",
            "phys_state": "LinkUp" if active else "Polling", "rate_gbps": 400.0, "link_layer": link_layer,
            "active": active, "gids": list(gids)}


def test_infiniband_present():
    hosts = ["a", "b"]
    ports = [ib_port("mlx5_0"), ib_port("mlx5_1", active=False), ib_port("mlx5_10")]
    facts = {h: {"interfaces": iface_facts([itf("eth0", [f"10.0.0.{i + 1}/24"])], ib=ports, peermem=True)}
             for i, h in enumerate(hosts)}
    env, reasons, notes = recommend(make_cluster(facts, hosts), [])
    assert "NCCL_IB_DISABLE" not in env
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_10:1"  # exact: the down mlx5_1 must not match mlx5_10
    assert env["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert "NCCL_IB_GID_INDEX" not in env  # InfiniBand, not RoCE
    assert_never_folklore(env, notes)


def test_gdr_only_when_peermem_is_loaded_everywhere():
    hosts = ["a", "b"]
    facts = {h: {"interfaces": iface_facts([], ib=[ib_port("mlx5_0")], peermem=(h == "a"))} for h in hosts}
    env, _, _ = recommend(make_cluster(facts, hosts), [])
    assert "NCCL_NET_GDR_LEVEL" not in env
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1"


def test_ib_on_some_hosts_only_is_reported():
    hosts = ["a", "b"]
    facts = {"a": {"interfaces": iface_facts([], ib=[ib_port("mlx5_0")], peermem=True)},
             "b": {"interfaces": iface_facts([], ib=[ib_port("mlx5_0", active=False)], peermem=True)}}
    env, _, notes = recommend(make_cluster(facts, hosts), [])
    assert any(n.startswith("b has no active IB/RoCE port") for n in notes)
    assert "NCCL_NET_GDR_LEVEL" not in env


V2_GID = {"index": 3, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0001", "type": "RoCE v2", "ndev": "eth2"}
V1_GID = {"index": 2, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0001", "type": "IB/RoCE v1", "ndev": "eth2"}
LINK_LOCAL = {"index": 1, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "type": "RoCE v2", "ndev": "eth2"}


def roce_cluster(gids_by_host, nccl=None):
    hosts = sorted(gids_by_host)
    facts = {}
    for h in hosts:
        facts[h] = {"interfaces": iface_facts([], ib=[ib_port("mlx5_0", link_layer="Ethernet",
                                                              gids=gids_by_host[h])])}
        if nccl:
            facts[h]["python"] = {"nccl": nccl}
    return make_cluster(facts, hosts)


def test_roce_gid_index_recommended_for_old_or_unknown_nccl():
    env, reasons, _ = recommend(roce_cluster({"a": [LINK_LOCAL, V1_GID, V2_GID], "b": [LINK_LOCAL, V2_GID]}), [])
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert env["NCCL_IB_GID_INDEX"] == "3"
    assert "RoCE v2" in reasons["NCCL_IB_GID_INDEX"]
    env, _, _ = recommend(roce_cluster({"a": [V2_GID], "b": [V2_GID]}, nccl="2.18.5"), [])
    assert env["NCCL_IB_GID_INDEX"] == "3"


def test_roce_gid_index_not_needed_with_nccl_2_21():
    env, _, notes = recommend(roce_cluster({"a": [V2_GID], "b": [V2_GID]}, nccl="2.28.9"), [])
    assert "NCCL_IB_GID_INDEX" not in env
    assert any("picks the GID index itself" in n for n in notes)


def test_roce_gid_index_inconsistent_or_missing():
    other = dict(V2_GID, index=5)
    env, _, notes = recommend(roce_cluster({"a": [V2_GID], "b": [other]}), [])
    assert "NCCL_IB_GID_INDEX" not in env
    assert any("different indexes" in n for n in notes)
    assert roce_gid_index([ib_port("mlx5_0", link_layer="Ethernet", gids=[LINK_LOCAL, V1_GID])])[0] is None


def test_socket_ifname_syntax():
    assert socket_ifname(["eth1", "eth1"]) == "=eth1"
    assert socket_ifname(["eth1", "ens5", "eth1"]) == "=ens5,eth1"


def test_never_recommends_folklore_even_if_asked():
    # The guard inside put(): NEVER names can't be emitted. Every key here is from the known-good list.
    env, reasons, notes = recommend(make_cluster({}, ["solo"]), [])
    assert set(env) <= {"NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert_never_folklore(env, notes)


# --- the gatherer: every check's contribution, seen through its declared reads ----------------------------------

def _spec(name, recommend_fn, reads=()):
    from preflight.hostside.seams import CheckSpec
    return CheckSpec(name, "x", "cluster", True, lambda facts, t: None, coordinate=lambda c: {}, reads=reads,
                     recommend=recommend_fn)


def test_a_contribution_sees_only_its_own_and_its_reads_facts():
    from preflight.hostside.seams import Recommendation
    seen = []

    def part(given):
        seen.append(given)
        return Recommendation()

    hosts = ["a", "b"]
    facts = {"a": {"interfaces": {"x": 1}, "gpu": {"y": 2}, "mine": {"z": 3}}, "b": {"gpu": {}},
             "*": {"mine": {"chosen": None}, "ports": {"p": 1}}}
    results = [SimpleNamespace(host="b", check="interfaces", status=Status.FAIL),
               SimpleNamespace(host="a", check="gpu", status=Status.FAIL),
               SimpleNamespace(host="*", check="mine", status=Status.WARN)]
    recommend(make_cluster(facts, hosts, {"a": "10.0.0.1"}), results, [_spec("mine", part, ("interfaces",))])
    given = seen[0]
    assert given.hosts == hosts and given.master_address == "10.0.0.1"
    assert given.facts == {"a": {"interfaces": {"x": 1}, "mine": {"z": 3}}, "*": {"mine": {"chosen": None}}}
    assert given.failed == {"interfaces": ["b"]}


def test_a_broken_contribution_costs_its_part_only_and_the_gate_still_holds():
    from preflight.hostside.seams import EnvVar, Recommendation

    def folklore(given):
        return Recommendation((EnvVar("NCCL_SOCKET_IFNAME", "=eth9", "x"), EnvVar("NCCL_TIMEOUT", "30", "no")))

    def crashes(given):
        raise KeyError("chosen")

    def fine(given):
        return Recommendation(("first note", EnvVar("NCCL_IB_HCA", "=mlx5_0:1", "because"),
                               EnvVar("NCCL_IB_DISABLE", "$(reboot)", "a host said so")), ("trust this less",))

    env, reasons, notes = recommend(make_cluster({}, ["solo"]), [],
                                    [_spec("folk", folklore), _spec("crash", crashes), _spec("ok", fine)])
    assert "NCCL_SOCKET_IFNAME" not in env and "NCCL_TIMEOUT" not in env
    assert notes[0] == "no recommendation from the folk check (ValueError: 'refusing to recommend NCCL_TIMEOUT')"
    assert notes[1].startswith("no recommendation from the crash check (KeyError: ")
    assert notes[2] == "first note"
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1" and reasons["NCCL_IB_HCA"] == "because"
    assert "NCCL_IB_DISABLE" not in env and "holds characters a shell would interpret" in notes[3]
    assert list(env) == ["NCCL_IB_HCA", "NCCL_DEBUG"]
    assert notes[4:] == ["trust this less"]  # no folklore note: nothing was inherited


def test_the_network_part_is_iperf3s_pure_contribution():
    from preflight.checks import iperf3
    from preflight.recommend import contribution_input
    hosts = ["gpu01", "gpu02"]
    facts = {h: {"interfaces": h100_interfaces(2 + i)} for i, h in enumerate(hosts)}
    facts["*"] = {"iperf3": iperf3_facts(chosen("192.0.2.0/24", ["eth0", "eth0"], hosts))}
    cluster = make_cluster(facts, hosts)
    part = iperf3.SPEC.recommend(contribution_input(iperf3.SPEC, cluster, []))
    assert [(s.name, s.value) for s in part.steps if not isinstance(s, str)] == [
        ("NCCL_SOCKET_IFNAME", "=eth0"), ("GLOO_SOCKET_IFNAME", "eth0"), ("NCCL_IB_DISABLE", "1")]
    env, _, _ = recommend(cluster, [])
    assert [k for k in env if k not in ("NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING")] == [
        "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE"]


# --- notes only about variables that are set, never contradicting the recommendation (issue 30) ------------------

def _verbose_report(inherited):
    """What `preflight run -v` prints of the recommendation and its notes, with ``inherited`` what the ranks get."""
    import io

    from preflight.render.terminal import console, print_report
    from preflight.results import Report
    advice = advise(make_cluster({}, ["solo"]), [], inherited=inherited)
    out = io.StringIO()
    print_report(Report("t", 1.0, [], [], [], advice.env, advice.reasons, advice.notes, False, advice.diff),
                 console(out, 400), verbose=True)
    return advice, out.getvalue()


def test_no_note_about_a_variable_nobody_set():
    """Before: every -v run printed notes on NCCL_TIMEOUT, NCCL_MIN_NRINGS and both ASYNC_ERROR_HANDLING names."""
    advice, text = _verbose_report({})
    notes = [line for line in text.splitlines() if line.startswith("note: ")]
    for name in ("NCCL_TIMEOUT", "NCCL_MIN_NRINGS", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert not [n for n in notes if name in n], (name, notes)
    assert not set(advice.notes) & set(NOTED.values())


@pytest.mark.parametrize("name", sorted(NOTED))
def test_a_set_variable_gets_its_note_and_only_it(name):
    advice, text = _verbose_report({name: ["1", "the launch shell"]})
    assert [n for n in advice.notes if n in NOTED.values()] == [NOTED[name]]
    assert f"note: {NOTED[name]}" in text


def test_notes_never_contradict_the_recommendation():
    """Before: "TORCH_NCCL_ASYNC_ERROR_HANDLING is not recommended" next to "use TORCH_NCCL_ASYNC_ERROR_HANDLING
    (recommended above)". Every variable a note tells the user to use or calls recommended is in the env."""
    import re
    every = {name: ["1", "the launch shell"] for name in NOTED}
    advice, text = _verbose_report(every)
    assert NOT_NEEDED in advice.notes and NOTED["NCCL_ASYNC_ERROR_HANDLING"] in advice.notes
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in advice.env
    for note in advice.notes:
        for var in re.findall(r"\buse ([A-Z][A-Z0-9_]+)", note) + re.findall(r"([A-Z][A-Z0-9_]+) \(recommended", note):
            assert var in advice.env, (var, note)
        assert "recommended above" not in note, note
