"""Listeners bind to the address the check chose, not the wildcard, and are gone when the check is done.

ports.listen and iperf3.serve run in-process as the agent runs them, inside a namespace host with two networks:
/proc/net/tcp shows where each one listens."""
from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Runs inside the host: start the service, report where its ports listen (from /proc), stop it, report again.
_SCRIPT = textwrap.dedent('''
    import json, sys, threading, time
    sys.path.insert(0, %(root)r)
    from preflight.checks import ports, iperf3
    from preflight.hostside.seams import HostContext
    which, params = sys.argv[1], json.loads(sys.argv[2])
    ready, stop, box, got = {}, threading.Event(), {}, threading.Event()
    def on_ready(info):
        ready.update(info); got.set()
    ctx = HostContext(params=params, deadline=time.monotonic() + 30, ready=on_ready, wait_stop=stop.wait)
    fn = ports.listen if which == "ports" else iperf3.serve
    t = threading.Thread(target=lambda: box.update(value=fn(params, ctx)), daemon=True)
    t.start()
    assert got.wait(15), "not ready"
    mine = set(ready.get("ports") or [ready.get("port")])
    if (ready.get("master_port") or {}).get("port"):
        mine.add(ready["master_port"]["port"])
    def listening():
        socks = []
        for path in ("/proc/net/tcp", "/proc/net/tcp6"):
            socks += ports.parse_proc_net_tcp(open(path).read())
        return sorted({(s["address"], s["port"]) for s in socks if s["state"] == ports.LISTEN_STATE
                       and s["port"] in mine})
    during = listening()
    stop.set(); t.join(10)
    print(json.dumps({"during": during, "after": listening(), "ports": sorted(mine)}))
''')


def run_in(cluster, host, which, params):
    out = cluster.exec(host, [sys.executable, "-c", _SCRIPT % {"root": cluster.test_code}, which,
                              json.dumps(params)], timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_net(request):
    from tests.conftest import _skip_without_netcluster
    from tests.netcluster import NetCluster, code_in_run
    _skip_without_netcluster()
    with code_in_run() as code, NetCluster(1, networks=2, names=["node01"]) as cluster:
        cluster.test_code = str(code)
        yield cluster


def test_ports_listeners_bind_only_the_probed_address(two_net):
    h = two_net.hosts[0]
    chosen = h.addresses[1]
    res = run_in(two_net, h, "ports", {"count": 3, "master_port": 29555, "addresses": [chosen]})
    assert len(res["ports"]) == 4
    assert res["during"] and {a for a, _ in res["during"]} == {chosen}, res
    assert res["after"] == []


def test_ports_listener_falls_back_to_the_wildcard_for_a_foreign_address(two_net):
    res = run_in(two_net, two_net.hosts[0], "ports", {"count": 1, "addresses": ["203.0.113.9"]})
    assert {a for a, _ in res["during"]} <= {"0.0.0.0", "::"} and res["after"] == []


def test_ports_listener_binds_everything_when_a_probed_address_is_a_name(two_net):
    h = two_net.hosts[0]
    res = run_in(two_net, h, "ports", {"count": 1, "addresses": [h.addresses[1], "node01"]})
    assert {a for a, _ in res["during"]} <= {"0.0.0.0", "::"} and res["after"] == []


def test_iperf3_server_binds_only_the_network_under_test(two_net):
    if not shutil.which("iperf3"):
        pytest.skip("iperf3 is not installed")
    h = two_net.hosts[0]
    chosen = h.addresses[0]
    res = run_in(two_net, h, "iperf3", {"port": 0, "bind": chosen})
    assert res["during"] and {a for a, _ in res["during"]} == {chosen}, res
    assert res["after"] == []
