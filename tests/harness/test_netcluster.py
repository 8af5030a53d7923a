"""Tests of the NetCluster fixture itself: real namespaces, real sshd, real packets."""

import errno
import json
import secrets
import socket
import subprocess
import sys
import time

import pytest

from tests import netcluster

LISTEN_FOREVER = "import socket, sys, time; s = socket.create_server(('0.0.0.0', int(sys.argv[1]))); time.sleep(600)"


def ssh(cluster, target, command, *options, timeout=20):
    """The system ssh client, driven the way preflight drives it."""
    argv = ["ssh", "-F", str(cluster.ssh_config), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            *options, target, command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def connect_outcome(address, port, timeout=1.0):
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return "connected"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"


def wait_for(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting {timeout}s for {what}")
        time.sleep(0.05)


def wait_until_listening(cluster, host, port):
    # Asking the host's socket table, not connecting, so one-shot servers are not consumed.
    wait_for(lambda: cluster.exec(host, ["ss", "-Hltn", f"sport = :{port}"], timeout=5).stdout.strip(),
             f"a listener on {cluster.host(host).name}:{port}")


def netns_pids(ns):
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    return [int(pid) for pid in out.split()]


def kernel_objects(cluster_id):
    """Namespaces and root-namespace links named after the cluster."""
    def names(argv):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
        return [line.split()[0].split("@")[0] for line in out.splitlines() if line.strip()]
    return [n for n in names(["ip", "netns", "list"]) + names(["ip", "-br", "link"])
            if n.startswith(f"pf{cluster_id}")]


def test_each_host_answers_ssh_with_its_own_hostname(cluster3):
    for host in cluster3.hosts:
        result = ssh(cluster3, host.name, "hostname")
        assert (result.returncode, result.stdout.strip()) == (0, host.name), result.stderr


def test_hosts_ssh_to_each_other_by_name_without_password(cluster3):
    result = cluster3.exec("node01", ["ssh", "-o", "ConnectTimeout=5", "node02", "hostname"], timeout=20)
    assert (result.returncode, result.stdout.strip()) == (0, "node02"), result.stderr


def test_tmp_is_private_per_host(cluster3):
    marker = f"/tmp/netcluster-{secrets.token_hex(4)}"
    cluster3.exec("node01", ["touch", marker], check=True)
    try:
        assert cluster3.exec("node01", ["test", "-e", marker]).returncode == 0
        assert cluster3.exec("node02", ["test", "-e", marker]).returncode == 1
        assert ssh(cluster3, "node03", f"test -e {marker}").returncode == 1
        assert subprocess.run(["test", "-e", marker], timeout=5).returncode == 1  # root namespace
    finally:
        cluster3.exec("node01", ["rm", "-f", marker])


def iperf3_mbit(address, reverse):
    argv = ["iperf3", "-c", address, "-t", "2", "-J", "--connect-timeout", "3000", *(["-R"] if reverse else [])]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    report = json.loads(result.stdout)
    assert "error" not in report, report["error"]
    return report["end"]["sum_received"]["bits_per_second"] / 1e6


def test_shaping_to_100_mbit_limits_both_directions(cluster3):
    host = cluster3.host("node03")
    server = cluster3.popen(host, ["iperf3", "-s", "-B", host.addresses[0]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster3.shape(host, 100)
    try:
        wait_until_listening(cluster3, host, 5201)
        to_host, from_host = (iperf3_mbit(host.addresses[0], reverse) for reverse in (False, True))
        assert 85 <= to_host <= 115 and 85 <= from_host <= 115, (to_host, from_host)
    finally:
        cluster3.unshape(host)
        server.kill()
        server.wait(timeout=10)


def test_firewall_drops_inbound_tcp_but_not_ssh(cluster3):
    host = cluster3.host("node02")
    listener = cluster3.popen(host, [sys.executable, "-c", LISTEN_FOREVER, "5201"])
    try:
        wait_until_listening(cluster3, host, 5201)
        assert connect_outcome(host.addresses[0], 5201) == "connected"
        cluster3.firewall(host)
        assert connect_outcome(host.addresses[0], 5201) == "timeout"
        assert ssh(cluster3, host.name, "hostname").stdout.strip() == host.name
        cluster3.unfirewall(host)
        assert connect_outcome(host.addresses[0], 5201) == "connected"
    finally:
        cluster3.unfirewall(host)
        listener.kill()
        listener.wait(timeout=10)


def test_blackhole_times_out_and_silent_host_never_sends_a_banner(netcluster_factory):
    cluster = netcluster_factory(1)
    assert connect_outcome(cluster.add_blackhole("blackhole"), 22) == "timeout"
    with socket.create_connection((cluster.add_silent("silent"), 22), timeout=2) as conn:
        conn.settimeout(2)
        with pytest.raises(TimeoutError):
            conn.recv(64)
    with socket.create_connection((cluster.hosts[0].addresses[0], 22), timeout=2) as conn:
        conn.settimeout(2)
        assert conn.recv(64).startswith(b"SSH-2.0-")  # the contrast: a real host speaks first


def test_setup_commands_and_second_network(netcluster_factory):
    cluster = netcluster_factory(2, networks=2, setup={
        "node02": ["echo from-setup > /tmp/setup-marker", ["mount", "--bind", "/dev/null", "/etc/issue"]],
    })
    assert cluster.exec("node02", ["cat", "/tmp/setup-marker"]).stdout == "from-setup\n"
    assert cluster.exec("node02", ["cat", "/etc/issue"]).stdout == ""
    assert cluster.exec("node01", ["cat", "/etc/issue"]).stdout != ""
    node01, node02 = cluster.hosts
    addresses = cluster.exec(node01, ["ip", "-br", "-4", "addr", "show", "eth1"]).stdout
    assert f"{node01.addresses[1]}/24" in addresses
    # known_hosts lists every address, so reaching a host over network 1 verifies too.
    result = ssh(cluster, "node02", "hostname", "-o", f"HostName={node02.addresses[1]}")
    assert (result.returncode, result.stdout.strip()) == (0, "node02"), result.stderr
    assert cluster.hostfile(slots=8).read_text() == "node01 slots=8\nnode02 slots=8\n"


def test_unknown_host_key_is_refused_with_empty_known_hosts(netcluster_factory):
    cluster = netcluster_factory(1)
    result = ssh(cluster, "node01", "true", "-o", f"UserKnownHostsFile={cluster.empty_known_hosts()}")
    assert result.returncode == 255 and "Host key verification failed" in result.stderr


def test_close_leaves_nothing_behind(netcluster_factory):
    cluster = netcluster_factory(2)
    cluster.add_blackhole("blackhole")
    cluster.add_silent("silent")
    cluster.popen("node01", ["sleep", "600"])
    assert ssh(cluster, "node02", "nohup sleep 600 >/dev/null 2>&1 &").returncode == 0
    pids = [pid for h in cluster.hosts + cluster.fault_hosts for pid in netns_pids(h.ns)]
    assert len(pids) >= 5  # 2 sshd, the listener, 2 sleeps
    assert kernel_objects(cluster.id)

    cluster.close()
    cluster.close()  # idempotent

    assert kernel_objects(cluster.id) == []
    assert [pid for pid in pids if netcluster._is_alive(pid)] == []
    assert not cluster.dir.exists()
    assert cluster.leftovers() == []


def test_leftovers_of_a_dead_owner_are_swept_but_live_clusters_kept(netcluster_factory):
    live = netcluster_factory(1)
    corpse = subprocess.Popen(["sleep", "600"])
    owner = f"{corpse.pid}-{netcluster._start_time(corpse.pid)}"
    corpse.kill()
    corpse.wait(timeout=10)
    stale_id = secrets.token_hex(3)
    state_dir = netcluster.STATE_ROOT / f"pfnc-{stale_id}-{owner}"
    state_dir.mkdir()
    subprocess.run(["ip", "netns", "add", f"pf{stale_id}h0"], check=True, timeout=10)
    subprocess.run(["ip", "link", "add", f"pf{stale_id}b0", "type", "bridge"], check=True, timeout=10)
    orphan = subprocess.Popen(["ip", "netns", "exec", f"pf{stale_id}h0", "sleep", "600"])
    try:
        wait_for(lambda: netns_pids(f"pf{stale_id}h0"), "the orphan to enter its namespace")
        netcluster_factory(1)

        assert kernel_objects(stale_id) == []
        assert not state_dir.exists()
        assert orphan.wait(timeout=10) == -9
        assert ssh(live, "node01", "hostname").stdout.strip() == "node01"
    finally:
        orphan.kill()
        orphan.wait(timeout=10)


def test_unrouted_network_is_reachable_only_from_its_hosts(netcluster_factory):
    cluster = netcluster_factory(2, networks=2)
    node01, node02 = cluster.hosts
    cluster.detach(node02, 0)
    cluster.unroute(1)
    # The coordinator: network 1 is refused at once by the unreachable route; node02 left network 0.
    with pytest.raises(OSError) as err:
        socket.create_connection((node02.addresses[1], 22), timeout=5).close()
    assert err.value.errno == errno.EHOSTUNREACH, err.value
    try:
        assert connect_outcome(node02.addresses[0], 22) != "connected"
    except OSError:  # no ARP answer: EHOSTUNREACH
        pass
    # node01 (on both networks) still reaches node02 on network 1: a jump host.
    result = cluster.exec(node01, ["ssh", "-o", "BatchMode=yes", node02.addresses[1], "hostname"])
    assert result.stdout.strip() == "node02", result.stderr
    subnet = cluster.subnets[1]
    cluster.close()
    routes = subprocess.run(["ip", "-o", "route", "show", "type", "unreachable"], capture_output=True,
                            text=True).stdout
    assert f"{subnet} " not in routes
    assert cluster.leftovers() == []


def test_unreachable_routes_of_a_dead_owner_are_swept(netcluster_factory):
    free = sorted(set(range(netcluster.SUBNETS)) - netcluster._routed_subnets())[-1]
    cidr = f"{netcluster._address(free, 0)}/24"
    corpse = subprocess.Popen(["sleep", "600"])
    owner = f"{corpse.pid}-{netcluster._start_time(corpse.pid)}"
    corpse.kill()
    corpse.wait(timeout=10)
    state_dir = netcluster.STATE_ROOT / f"pfnc-{secrets.token_hex(3)}-{owner}"
    state_dir.mkdir()
    (state_dir / netcluster._UNREACHABLE_FILE).write_text(cidr + "\n")
    subprocess.run(["ip", "route", "add", "unreachable", cidr], check=True, timeout=10)
    try:
        netcluster_factory(1)  # building a cluster sweeps what dead owners left
        assert free not in netcluster._routed_subnets()
        assert not state_dir.exists()
    finally:
        subprocess.run(["ip", "route", "del", "unreachable", cidr], capture_output=True, timeout=10)
