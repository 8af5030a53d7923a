"""ports: parsers and evaluate on facts recorded from the namespace cluster; listen/probe on loopback; and the
real thing on namespace hosts (healthy, one firewalled host, a busy master port, a blocked second network)."""
from __future__ import annotations

import copy
import ipaddress
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


from preflight.checks import ports
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_thresholds

ROOT = Path(__file__).resolve().parents[3]
THRESHOLDS = load_thresholds()
LIMITS = THRESHOLDS["ports"]

# Facts of ports.coordinate, recorded on a 3-host namespace cluster: healthy; node03 with
# `firewall(drop_tcp_dports="1024-65535")`; a python listener on 0.0.0.0:29500 inside node01.
RECORDED = json.loads(r"""
{
 "healthy": {
  "master": "node01",
  "master_port": 29500,
  "hosts": ["node01", "node02", "node03"],
  "addresses": {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"},
  "unreachable": [],
  "networks": [{"name": "ssh", "addresses": {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"}}],
  "listener_errors": {},
  "probe_errors": {},
  "listeners": {
   "node01": {"ports": [35809, 49361, 50988], "master_port": {"port": 29500, "free": true, "listening": [], "holders": [], "error": null}, "range": [32768, 60999], "accepted": {"35809": 2, "49361": 2, "50988": 2, "29500": 2}},
   "node02": {"ports": [35487, 46171, 60348], "master_port": null, "range": [32768, 60999], "accepted": {"35487": 2, "46171": 2, "60348": 2}},
   "node03": {"ports": [41486, 45237, 51338], "master_port": null, "range": [32768, 60999], "accepted": {"41486": 2, "45237": 2, "51338": 2}}
  },
  "probes": [
   {"dst": "node02", "address": "198.18.1.2", "port": 35487, "network": "ssh", "src": "node01", "result": "ok", "ms": 2.52, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 46171, "network": "ssh", "src": "node01", "result": "ok", "ms": 1.56, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 60348, "network": "ssh", "src": "node01", "result": "ok", "ms": 1.72, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 41486, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.05, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 45237, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 51338, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 35809, "network": "ssh", "src": "node02", "result": "ok", "ms": 3.02, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 49361, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.16, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 50988, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.08, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 29500, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.06, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 41486, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.06, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 45237, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 51338, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 35809, "network": "ssh", "src": "node03", "result": "ok", "ms": 1.54, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 49361, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.05, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 50988, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 29500, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 35487, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 46171, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 60348, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""}
  ]
 },
 "firewalled": {
  "master": "node01",
  "master_port": 29500,
  "hosts": ["node01", "node02", "node03"],
  "addresses": {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"},
  "unreachable": [],
  "networks": [{"name": "ssh", "addresses": {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"}}],
  "listener_errors": {},
  "probe_errors": {},
  "listeners": {
   "node01": {"ports": [41971, 42913, 42971], "master_port": {"port": 29500, "free": true, "listening": [], "holders": [], "error": null}, "range": [32768, 60999], "accepted": {"41971": 2, "42913": 2, "42971": 2, "29500": 2}},
   "node02": {"ports": [47974, 52062, 58596], "master_port": null, "range": [32768, 60999], "accepted": {"47974": 2, "52062": 2, "58596": 2}},
   "node03": {"ports": [36884, 40688, 52354], "master_port": null, "range": [32768, 60999], "accepted": {}}
  },
  "probes": [
   {"dst": "node02", "address": "198.18.1.2", "port": 47974, "network": "ssh", "src": "node01", "result": "ok", "ms": 6.55, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 52062, "network": "ssh", "src": "node01", "result": "ok", "ms": 5.88, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 58596, "network": "ssh", "src": "node01", "result": "ok", "ms": 2.38, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 36884, "network": "ssh", "src": "node01", "result": "timeout", "ms": 3003.82, "error": "no answer within 3.0s"},
   {"dst": "node03", "address": "198.18.1.3", "port": 40688, "network": "ssh", "src": "node01", "result": "timeout", "ms": 3003.29, "error": "no answer within 3.0s"},
   {"dst": "node03", "address": "198.18.1.3", "port": 52354, "network": "ssh", "src": "node01", "result": "timeout", "ms": 3002.96, "error": "no answer within 3.0s"},
   {"dst": "node01", "address": "198.18.1.1", "port": 41971, "network": "ssh", "src": "node02", "result": "ok", "ms": 2.77, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 42913, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.12, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 42971, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.07, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 29500, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.06, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 36884, "network": "ssh", "src": "node02", "result": "timeout", "ms": 3001.88, "error": "no answer within 3.0s"},
   {"dst": "node03", "address": "198.18.1.3", "port": 40688, "network": "ssh", "src": "node02", "result": "timeout", "ms": 3001.96, "error": "no answer within 3.0s"},
   {"dst": "node03", "address": "198.18.1.3", "port": 52354, "network": "ssh", "src": "node02", "result": "timeout", "ms": 3001.57, "error": "no answer within 3.0s"},
   {"dst": "node01", "address": "198.18.1.1", "port": 41971, "network": "ssh", "src": "node03", "result": "ok", "ms": 1.64, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 42913, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.06, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 42971, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 29500, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 47974, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 52062, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 58596, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.03, "error": ""}
  ]
 },
 "busy": {
  "master": "node01",
  "master_port": 29500,
  "hosts": ["node01", "node02", "node03"],
  "addresses": {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"},
  "unreachable": [],
  "networks": [{"name": "ssh", "addresses": {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"}}],
  "listener_errors": {},
  "probe_errors": {},
  "listeners": {
   "node01": {"ports": [47614, 50741, 58000], "master_port": {"port": 29500, "free": false, "listening": ["0.0.0.0:29500"], "holders": [{"pid": 17384, "cmdline": "/root/.pyenv/versions/3.11.7/bin/python3 -c import socket,time; s=socket.create_server(('0.0.0.0',29500)); time.sleep(60)"}], "error": "bind: Address already in use (while attempting to bind on address ('', 29500))"}, "range": [32768, 60999], "accepted": {"47614": 2, "58000": 2, "50741": 2}},
   "node02": {"ports": [43386, 49310, 59780], "master_port": null, "range": [32768, 60999], "accepted": {"49310": 2, "59780": 2, "43386": 2}},
   "node03": {"ports": [33200, 33983, 43253], "master_port": null, "range": [32768, 60999], "accepted": {"33200": 2, "33983": 2, "43253": 2}}
  },
  "probes": [
   {"dst": "node02", "address": "198.18.1.2", "port": 43386, "network": "ssh", "src": "node01", "result": "ok", "ms": 12.87, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 49310, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.43, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 59780, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.15, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 33200, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.07, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 33983, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.05, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 43253, "network": "ssh", "src": "node01", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 47614, "network": "ssh", "src": "node02", "result": "ok", "ms": 2.04, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 50741, "network": "ssh", "src": "node02", "result": "ok", "ms": 2.42, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 58000, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.07, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 33200, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.05, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 33983, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node03", "address": "198.18.1.3", "port": 43253, "network": "ssh", "src": "node02", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 47614, "network": "ssh", "src": "node03", "result": "ok", "ms": 2.61, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 50741, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.08, "error": ""},
   {"dst": "node01", "address": "198.18.1.1", "port": 58000, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.05, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 43386, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.06, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 49310, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.04, "error": ""},
   {"dst": "node02", "address": "198.18.1.2", "port": 59780, "network": "ssh", "src": "node03", "result": "ok", "ms": 0.04, "error": ""}
  ]
 }
}
""")

# /proc/net/tcp and tcp6 of a host with sshd on 0.0.0.0:22, a listener on 127.0.0.1:29500 and [::]:29500,
# and one established SSH connection.
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1161 1 00000000dfee31a7 100 0 0 10 0
   1: 0100007F:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 48213 1 0000000011111111 100 0 0 10 0
   2: 010012C6:0016 FE0012C6:948E 01 00000000:00000000 02:000A3D6B 00000000     0        0 52011 2 000000005f36a264 20 4 30 10 -1
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:733C 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 48214 1 0000000022222222 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 48300 1 0000000033333333 100 0 0 10 0
"""


# What ports.firewall (hostside/fixes.read_firewall) read on node03 of the "firewalled" cluster, as root.
RECORDED["firewalled"]["firewalls"] = json.loads(r"""
{"node03": {"root": true, "firewalld": {"running": false, "error": null}, "ufw": {"active": false, "error": null},
 "nft": {"read": true, "installed": true, "error": null,
         "drops": [{"family": "inet", "table": "pf_firewall", "chain": "input", "priority": 0, "compat": false}],
         "drops6": [{"family": "inet", "table": "pf_firewall", "chain": "input", "priority": 0, "compat": false}]}}}
""")


def facts(name):
    return copy.deepcopy(RECORDED[name])


# --- pure --------------------------------------------------------------------------------------

def test_parse_proc_net_tcp_v4_and_v6():
    v4 = ports.parse_proc_net_tcp(PROC_NET_TCP)
    assert [(s["address"], s["port"], s["state"], s["inode"]) for s in v4] == [
        ("0.0.0.0", 22, "0A", 1161), ("127.0.0.1", 29500, "0A", 48213), ("198.18.0.1", 22, "01", 52011)]
    assert v4[1]["uid"] == 1000
    v6 = ports.parse_proc_net_tcp(PROC_NET_TCP6)
    assert [(s["address"], s["port"], s["inode"]) for s in v6] == [("::", 29500, 48214),
                                                                    ("::ffff:127.0.0.1", 8080, 48300)]
    assert ports.parse_proc_net_tcp("") == [] and ports.parse_proc_net_tcp("header\ngarbage line\n") == []


def test_parse_port_range_falls_back_to_the_kernel_default():
    assert ports.parse_port_range("32768\t60999\n") == (32768, 60999)
    assert ports.parse_port_range("1024 65000") == (1024, 65000)
    for bad in (None, "", "x y", "60999 32768", "80 90"):
        assert ports.parse_port_range(bad) == (32768, 60999)


def _ifaces(*entries):
    return {"interfaces": [{"name": n, "ipv4": v4, "kind": kind, "virtual": kind != "physical",
                            "operstate": state} for n, v4, kind, state in entries]}


def test_shared_subnets_skip_docker_loopback_link_local_and_partial_networks():
    primary = {"a": "10.0.0.1", "b": "10.0.0.2"}
    iface = {
        "a": _ifaces(("lo", ["127.0.0.1/8"], "loopback", "unknown"), ("eth0", ["10.0.0.1/24"], "physical", "up"),
                     ("ib0", ["192.168.10.1/24"], "physical", "up"), ("docker0", ["172.17.0.1/16"], "docker", "down"),
                     ("br0", ["172.30.0.1/24"], "bridge", "up"), ("eth9", ["169.254.3.1/16"], "physical", "up"),
                     ("eth2", ["10.9.0.1/24"], "physical", "up")),
        "b": _ifaces(("lo", ["127.0.0.1/8"], "loopback", "unknown"), ("eth0", ["10.0.0.2/24"], "physical", "up"),
                     ("ib0", ["192.168.10.2/24"], "physical", "up"), ("docker0", ["172.17.0.1/16"], "docker", "up"),
                     ("br0", ["172.30.0.1/24"], "bridge", "up"), ("eth9", ["169.254.7.1/16"], "physical", "up")),
    }
    nets = ports.shared_subnets(iface, primary, limit=2)
    assert nets[0] == {"cidr": "10.0.0.0/24", "addresses": primary, "primary": True}
    # br0 has the same address on both hosts (a local bridge, not a network between them); eth2 is on one host.
    assert nets[1:] == [{"cidr": "192.168.10.0/24", "addresses": {"a": "192.168.10.1", "b": "192.168.10.2"}}]
    assert ports.shared_subnets(iface, primary, limit=0) == nets[:1]
    assert ports.shared_subnets({"a": iface["a"]}, primary, limit=2) == []  # a host without interface facts


def test_plan_probes_every_sampled_port_and_the_master_port_and_one_port_per_extra_network():
    f = facts("healthy")
    f["networks"].append({"name": "10.9.0.0/24", "cidr": "10.9.0.0/24",
                          "addresses": {"node01": "10.9.0.1", "node02": "10.9.0.2", "node03": "10.9.0.3"}})
    plan = ports._plan(f, [(1, 0), (0, 2)])
    to_master = [(t["address"], t["port"]) for t in plan["node02"]]
    assert to_master == [("198.18.1.1", p) for p in f["listeners"]["node01"]["ports"] + [29500]] + \
        [("10.9.0.1", f["listeners"]["node01"]["ports"][0]), ("10.9.0.1", 29500)]
    assert [t["port"] for t in plan["node01"] if t["network"] == "ssh"] == f["listeners"]["node03"]["ports"]
    # A master port that is taken is not probed: nothing of ours listens there.
    f["listeners"]["node01"]["master_port"]["free"] = False
    assert 29500 not in [t["port"] for t in ports._plan(f, [(1, 0)])["node02"]]


# --- evaluate on recorded facts ------------------------------------------------------------------

def test_healthy_cluster_passes_with_the_numbers():
    out = ports.evaluate(facts("healthy"), THRESHOLDS)
    assert set(out) == {"node01", "node02", "node03"}
    assert all(o.status == Status.PASS for o in out.values()), {h: o.message for h, o in out.items()}
    assert out["node01"].metrics["master_port_free"] is True and "master port 29500 free" in out["node01"].message
    assert out["node01"].metrics["probes_in"] == 8 and out["node01"].metrics["probes_in_ok"] == 8
    assert out["node03"].metrics["sources"] == ["node01", "node02"]
    assert out["node03"].metrics["listen_ports"] == RECORDED["healthy"]["listeners"]["node03"]["ports"]


def test_firewalled_host_fails_as_the_destination_and_names_port_and_sources():
    f = facts("firewalled")
    out = ports.evaluate(f, THRESHOLDS)
    assert out["node01"].status == Status.PASS and out["node02"].status == Status.PASS
    bad = out["node03"]
    assert bad.status == Status.FAIL
    for port in f["listeners"]["node03"]["ports"]:
        assert str(port) in bad.message
    assert "inbound TCP to node03:" in bad.message and "from node01, node02" in bad.message
    assert "timed out" in bad.message and "NCCL will hang" in bad.message
    # node03's firewall as ports.firewall read it there (netcluster's pf_firewall table): the rule goes in that
    # table's chain, the one that drops; no alternatives for tools the host does not run (issue 30).
    assert bad.fix.splitlines()[1:] == [
        "  nft insert rule inet pf_firewall input ip saddr { 198.18.1.1, 198.18.1.2 } tcp dport 1024-65535 accept"]
    assert "iptables" not in bad.fix and "ufw" not in bad.fix and "firewall-cmd" not in bad.fix
    assert bad.metrics["probes_in_ok"] == 0 and bad.metrics["probes_out_ok"] == bad.metrics["probes_out"] > 0


def test_reject_rule_is_reported_as_refused_and_a_subnet_in_the_fix():
    f = facts("firewalled")
    f["networks"][0]["cidr"] = "198.18.1.0/24"
    for p in f["probes"]:
        if p["result"] == "timeout":
            p.update(result="refused", ms=0.2)
    bad = ports.evaluate(f, THRESHOLDS)["node03"]
    assert bad.status == Status.FAIL and "refused" in bad.message
    assert "ip saddr 198.18.1.0/24 tcp dport 1024-65535" in bad.fix


def test_busy_master_port_fails_on_the_master_naming_port_and_process():
    f = facts("busy")
    holder = f["listeners"]["node01"]["master_port"]["holders"][0]
    out = ports.evaluate(f, THRESHOLDS)
    bad = out["node01"]
    assert bad.status == Status.FAIL
    assert "master port 29500 is already in use on node01" in bad.message
    assert f"pid {holder['pid']}" in bad.message and "create_server" in bad.message
    assert "--master_port" in bad.fix and f"pid {holder['pid']}" in bad.fix
    assert out["node02"].status == Status.PASS and out["node03"].status == Status.PASS


def test_unreachable_master_port_fails_the_master_only():
    f = facts("healthy")
    for p in f["probes"]:
        if p["dst"] == "node01" and p["port"] == 29500 and p["src"] == "node03":
            p.update(result="timeout", ms=3000.0)
    out = ports.evaluate(f, THRESHOLDS)
    assert out["node01"].status == Status.FAIL
    assert "node01:29500 (master port)" in out["node01"].message and "from node03" in out["node01"].message
    assert "--dport 29500 -j ACCEPT" in out["node01"].fix  # its firewall was not read: every tool's line
    assert out["node02"].status == out["node03"].status == Status.PASS


def test_a_source_that_reaches_nobody_is_blamed_for_egress_not_its_destinations():
    f = facts("healthy")
    for p in f["probes"]:
        if p["src"] == "node02":
            p.update(result="timeout", ms=3000.0)
    out = ports.evaluate(f, THRESHOLDS)
    assert out["node02"].status == Status.FAIL and "outbound TCP from node02" in out["node02"].message
    assert out["node01"].status == out["node03"].status == Status.PASS


def test_blocked_extra_network_warns_and_suggests_pinning_nccl():
    f = facts("healthy")
    addrs = {"node01": "10.9.0.1", "node02": "10.9.0.2", "node03": "10.9.0.3"}
    f["networks"].append({"name": "10.9.0.0/24", "cidr": "10.9.0.0/24", "addresses": addrs})
    for src in ("node01", "node02"):
        f["probes"].append({"dst": "node03", "address": "10.9.0.3", "port": 41486, "network": "10.9.0.0/24",
                            "src": src, "result": "timeout", "ms": 3000.0, "error": ""})
    out = ports.evaluate(f, THRESHOLDS)
    assert out["node03"].status == Status.WARN
    assert "on network 10.9.0.0/24" in out["node03"].message and "NCCL_SOCKET_IFNAME" in out["node03"].fix
    assert out["node01"].status == Status.PASS


def test_agent_failures_are_errors_not_verdicts():
    f = facts("healthy")
    f["listener_errors"] = {"node02": "ports.listen did not become ready within 30s"}
    f["probe_errors"] = {"node03": "ports.probe timed out after 20s"}
    f["unreachable"] = ["node04"]
    f["probes"] = [p for p in f["probes"] if p["src"] != "node03" and p["dst"] != "node02"]
    out = ports.evaluate(f, THRESHOLDS)
    assert out["node02"].status == Status.ERROR and "did not become ready" in out["node02"].message
    assert out["node03"].status == Status.ERROR and "could not run the probes from node03" in out["node03"].message
    assert out["node04"].status == Status.ERROR and "unreachable" in out["node04"].message
    assert out["node01"].status == Status.PASS


def test_single_host_checks_only_the_master_port():
    f = {"master": "solo", "master_port": 29500, "hosts": ["solo"], "addresses": {"solo": "127.0.0.1"},
         "unreachable": [], "networks": [], "listener_errors": {}, "probe_errors": {}, "probes": [],
         "listeners": {"solo": {"ports": [40001, 40002, 40003], "range": [32768, 60999],
                                "master_port": {"port": 29500, "free": True, "listening": [], "holders": []}}}}
    out = ports.evaluate(f, THRESHOLDS)
    assert out["solo"].status == Status.PASS and "single host" in out["solo"].message


# --- host side on loopback -----------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_listener(params, timeout=20.0):
    """Run ports.listen in a thread as the agent would; returns (ready info, stop event, thread, result box)."""
    ready, stop, box = {}, threading.Event(), {}
    got = threading.Event()

    def on_ready(info):
        ready.update(info)
        got.set()

    ctx = HostContext(params=params, deadline=time.monotonic() + timeout, ready=on_ready, wait_stop=stop.wait)
    t = threading.Thread(target=lambda: box.update(value=ports.listen(params, ctx)), daemon=True)
    t.start()
    assert got.wait(10), "listen never became ready"
    return ready, stop, t, box


def test_listen_and_probe_on_loopback_then_everything_is_closed():
    mport = _free_port()
    ready, stop, t, box = _start_listener({"count": 3, "master_port": mport})
    try:
        assert len(ready["ports"]) == 3 and ready["master_port"]["free"] is True
        lo, hi = ready["range"]
        assert all(lo <= p <= hi for p in ready["ports"])
        closed = _free_port()
        targets = [["127.0.0.1", p] for p in ready["ports"] + [mport]] + [["127.0.0.1", closed]]
        ctx = HostContext(params={}, deadline=time.monotonic() + 20)
        res = ports.probe({"targets": targets, "connect_timeout": 2.0, "threads": 4}, ctx)["results"]
        assert [r["result"] for r in res] == ["ok"] * 4 + ["refused"]
        assert all(r["ms"] < 2000 for r in res)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert sum(box["value"]["accepted"].values()) == 4 and box["value"]["stopped_by"] == "coordinator"
    for p in ready["ports"] + [mport]:  # closed: no LISTEN socket left on them
        assert ports._listening(p) == []


def test_busy_master_port_is_found_with_its_process():
    holder = socket.create_server(("127.0.0.1", 0))
    try:
        port = holder.getsockname()[1]
        ready, stop, t, box = _start_listener({"count": 1, "master_port": port})
        stop.set()
        t.join(10)
        mp = ready["master_port"]
        assert mp["free"] is False and mp["listening"] == [f"127.0.0.1:{port}"]
        assert [h["pid"] for h in mp["holders"]] == [__import__("os").getpid()]
        out = ports.evaluate({"master": "me", "master_port": port, "hosts": ["me"], "probes": [],
                              "listeners": {"me": box["value"]}}, THRESHOLDS)["me"]
        assert out.status == Status.FAIL and f"master port {port}" in out.message
    finally:
        holder.close()


def test_probe_times_out_and_stays_within_its_budget_against_a_silent_port():
    # A loopback listener with a full accept queue drops further SYNs, as a DROP firewall rule would.
    silent = socket.socket()
    filler = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        filler.connect(silent.getsockname())
        ctx = HostContext(params={}, deadline=time.monotonic() + 30)
        start = time.monotonic()
        res = ports.probe({"targets": [list(silent.getsockname())] * 6, "connect_timeout": 1.0, "threads": 2,
                           "budget_s": 1.6}, ctx)["results"]
        elapsed = time.monotonic() - start
    finally:
        filler.close()
        silent.close()
    assert elapsed < 4
    kinds = [r["result"] for r in res]
    assert kinds[:2] == ["timeout", "timeout"] and set(kinds[2:]) <= {"timeout", "skipped"} and "skipped" in kinds


# --- real hosts: namespace cluster over real SSH ------------------------------------------------



def run_cli(cluster, tmp_path, checks, *args, timeout=120):
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", checks, "--json", str(report), *args]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    return proc, {(r["host"], r["check"]): r for r in data["results"]}


def listening(cluster, host):
    """TCP ports with a LISTEN socket inside the host."""
    out = cluster.exec(host, ["ss", "-Hltn"], check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def foreign_processes(cluster, host, spare=()):
    """Processes in the host's network namespace other than its sshd (and `spare`): agents, listeners, ssh."""
    h = cluster.host(host)
    pids = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True, timeout=10).stdout.split()
    found = []
    for pid in map(int, pids):
        if pid == h.pid or pid in spare:
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
        if args and not args.startswith("sshd"):  # sshd's per-session processes linger a moment
            found.append(args)
    return found


def assert_nothing_left(cluster, ports_by_host, spare=()):
    deadline = time.monotonic() + 10
    while True:
        left = {h.name: (sorted(listening(cluster, h) & set(ports_by_host.get(h.name, ()))),
                         foreign_processes(cluster, h, spare)) for h in cluster.hosts}
        left = {h: v for h, v in left.items() if v != ([], [])}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left == {}, left


def sampled(cells, cluster, extra=()):
    return {h.name: set(cells[(h.name, "ports")]["metrics"]["listen_ports"]) | set(extra) for h in cluster.hosts}


def test_real_healthy_cluster_passes_and_leaves_nothing(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3)
    proc, cells = run_cli(cluster, tmp_path, "ports")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for h in cluster.hosts:
        cell = cells[(h.name, "ports")]
        assert cell["status"] == "pass", cell
        assert len(cell["metrics"]["listen_ports"]) == LIMITS["sample_ports"]
        assert cell["metrics"]["probes_in"] == cell["metrics"]["probes_in_ok"] > 0
    assert cells[("node01", "ports")]["metrics"]["master_port_free"] is True
    assert cells[("node01", "ports")]["metrics"]["probes_in"] == 2 * (LIMITS["sample_ports"] + 1)
    assert_nothing_left(cluster, sampled(cells, cluster, extra=[29500]))


def test_real_firewalled_host_fails_as_destination(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3)
    cluster.firewall("node03", drop_tcp_dports="1024-65535")
    start = time.monotonic()
    proc, cells = run_cli(cluster, tmp_path, "ports")
    assert time.monotonic() - start < 60
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = cells[("node03", "ports")]
    assert bad["status"] == "fail"
    assert "inbound TCP to node03:" in bad["message"] and "from node01, node02" in bad["message"]
    assert "timed out" in bad["message"]
    for port in bad["metrics"]["listen_ports"]:
        assert str(port) in bad["message"]
    assert cells[("node01", "ports")]["status"] == "pass" and cells[("node02", "ports")]["status"] == "pass"
    assert_nothing_left(cluster, sampled(cells, cluster, extra=[29500]))


HOLDER = "import socket, time; s = socket.create_server(('0.0.0.0', 29500)); print('up', flush=True); time.sleep(120)"


def test_real_busy_master_port_fails_naming_port_and_process(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3)
    holder = cluster.popen("node01", [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"up"
        proc, cells = run_cli(cluster, tmp_path, "ports")
        bad = cells[("node01", "ports")]
        assert proc.returncode == 1 and bad["status"] == "fail", proc.stdout + proc.stderr
        assert "master port 29500 is already in use on node01" in bad["message"]
        # nsenter execs the interpreter, so the holder's pid is the Popen's pid.
        assert f"pid {holder.pid}" in bad["message"] and "create_server" in bad["message"]
        assert "--master_port" in bad["fix"]
        assert cells[("node02", "ports")]["status"] == cells[("node03", "ports")]["status"] == "pass"
        assert 29500 in listening(cluster, "node01")  # the holder was left alone
        assert_nothing_left(cluster, sampled(cells, cluster), spare=[holder.pid])
    finally:
        holder.kill()
        holder.wait(10)


def test_real_blocked_second_network_warns(netcluster_factory, tmp_path):
    """Two networks; the interfaces facts (normally from the interfaces check) name both; node03 drops high
    ports on its second network only: the second network WARNs on node03, the SSH network passes."""
    from preflight.hostfile import load_hostfile
    from preflight.hostside.seams import CheckOptions
    from preflight.runner import RunOptions, Runner
    from preflight.transport import SSHOptions

    cluster = netcluster_factory(3, networks=2)
    cluster.exec("node03", ["nft", "-f", "-"], check=True, input=(
        "table inet pf_test {\n chain input {\n  type filter hook input priority 0; policy accept;\n"
        "  ct state established,related accept\n  iifname \"eth1\" tcp dport 1024-65535 drop\n }\n}\n"))

    class WithInterfaceFacts(Runner):
        def _host_checks(self, modules):
            super()._host_checks(modules)
            for h in cluster.hosts:
                self.facts[h.name]["interfaces"] = {"interfaces": [
                    {"name": "lo", "ipv4": ["127.0.0.1/8"], "kind": "loopback", "virtual": True, "operstate": "unknown"},
                    *({"name": f"eth{k}", "ipv4": [f"{a}/24"], "kind": "veth", "virtual": True, "operstate": "up"}
                      for k, a in enumerate(h.addresses))]}

    options = RunOptions(hosts=load_hostfile(str(cluster.hostfile(tmp_path / "hostfile"))), checks=["ports"],
                         thresholds=THRESHOLDS, python=sys.executable,
                         ssh=SSHOptions(key=str(cluster.user_key), config_path=str(cluster.ssh_config),
                                        known_hosts=str(cluster.known_hosts)),
                         check_options=CheckOptions(master_port=29500, python=sys.executable), host_params={})
    report = WithInterfaceFacts(options).run()
    cells = {(r.host, r.check): r for r in report.results}
    second = str(ipaddress.ip_interface(cluster.hosts[0].addresses[1] + "/24").network)  # networks are /24s
    warn = cells[("node03", "ports")]
    assert warn.status == Status.WARN, warn.message
    assert f"on network {second}" in warn.message and "from node01, node02" in warn.message
    assert "NCCL_SOCKET_IFNAME" in warn.fix
    for name in ("node01", "node02"):
        assert cells[(name, "ports")].status == Status.PASS, cells[(name, "ports")].message
        assert second in cells[(name, "ports")].metrics["networks"]
    assert_nothing_left(cluster, {h.name: set(cells[(h.name, "ports")].metrics["listen_ports"]) | {29500}
                                  for h in cluster.hosts})


def test_fix_is_for_the_firewall_the_host_runs_and_every_command_line_pastes():
    """issue 30: the commands come from the firewall read on the host (firewalld here), and a host blocked on two
    networks gets each fix's command lines on lines of their own (combine() used to join them with '; ', which
    put the next fix's prose on the last command line), the NCCL alternative in the prose."""
    f = facts("firewalled")
    f["firewalls"]["node03"] = {"root": True, "firewalld": {"running": True, "zone": "trusted"}}
    addrs = {"node01": "10.9.0.1", "node02": "10.9.0.2", "node03": "10.9.0.3"}
    f["networks"].append({"name": "10.9.0.0/24", "cidr": "10.9.0.0/24", "addresses": addrs})
    for src in ("node01", "node02"):
        f["probes"].append({"dst": "node03", "address": "10.9.0.3", "port": 41486, "network": "10.9.0.0/24",
                            "src": src, "result": "timeout", "ms": 3000.0, "error": ""})
    bad = ports.evaluate(f, THRESHOLDS)["node03"]
    assert bad.status == Status.FAIL
    lines = bad.fix.splitlines()
    commands = [ln[2:] for ln in lines if ln.startswith("  ")]
    assert commands == ["firewall-cmd --zone=trusted --add-port=1024-65535/tcp",
                        "firewall-cmd --zone=trusted --permanent --add-port=1024-65535/tcp"] * 2, bad.fix
    prose = [ln for ln in lines if not ln.startswith("  ")]
    assert len(prose) == 2 and all(p.endswith(":") for p in prose), bad.fix
    assert [("NCCL_SOCKET_IFNAME" in p) for p in prose] == [True, False]  # the extra network's (sorted first)
    assert not [c for c in commands if ";" in c or "NCCL" in c]
