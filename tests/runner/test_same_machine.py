"""Hostfile names that are one machine: the agent's hello says which machine it runs on (machine-id, boot id, the
network namespace's addresses, the NVIDIA GPUs), the runner groups the names whose hellos agree, and the ssh
(connection) check names them: FAIL when their ranks need more GPUs than the machine has or would share a GPU,
WARN otherwise (a machine without GPUs included: DeepSpeed would start every name's ranks on the one box).

Before issue 26 one machine under two names passed silently: six names of one machine, or two addresses of one
namespace host.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.checks import ssh
from preflight.config import load_thresholds
from preflight.hostfile import HostSpec
from preflight.hostside.agent import machine_identity
from preflight.hostside.outcome import Status
from preflight.runner import Node, mark_same_machines
from tests.netcluster import NetCluster

ROOT = Path(__file__).resolve().parents[2]
THRESHOLDS = load_thresholds()
CONNECTED = {"connected": True, "hostname": "gpu01", "address": "10.0.0.1", "connect_s": 0.1, "rtt_ms": 0.2,
             "user": "root"}


def same(hosts, slots, gpu_ids, gpus):
    return {"hosts": hosts, "slots": slots, "gpu_ids": gpu_ids, "gpus": gpus,
            "machine_id": "3d1219c7c4c5404aaa1f6d2a48adfda4", "boot_id": "ddb49c75-0e4a-43dc-b84e-5ed6580bc9a3"}


# --- the connection check's verdict ------------------------------------------------------------------------

def test_no_gpus_is_a_warning_naming_every_name_of_the_machine():
    group = same(["gpu01", "10.0.1.1", "gpu01-ib"], [1, 1, 1], [[0], [0], [0]], None)
    out = ssh.evaluate(dict(CONNECTED, same_machine=group), THRESHOLDS)
    assert out.status == Status.WARN
    assert out.message.startswith("gpu01, 10.0.1.1 and gpu01-ib are one machine (machine-id 3d1219c7, boot id "
                                  "ddb49c75)"), out.message
    assert "3 ranks on this one box" in out.message and "keep gpu01, without 10.0.1.1 and gpu01-ib" in out.fix
    assert out.metrics["same_machine"] == group and out.metrics["rtt_ms"] == 0.2
    # The same text on every name of the machine: one cause in the report.
    other = ssh.evaluate(dict(CONNECTED, hostname="gpu01", address="10.0.1.1", same_machine=group), THRESHOLDS)
    assert (other.status, other.message, other.fix) == (out.status, out.message, out.fix)


def test_more_ranks_than_gpus_fails():
    out = ssh.evaluate(dict(CONNECTED, same_machine=same(["gpu01", "gpu01-alias"], [8, 8],
                                                          [list(range(8)), list(range(8))], 8)), THRESHOLDS)
    assert out.status == Status.FAIL
    assert "16 ranks on it (gpu01 slots=8, gpu01-alias slots=8) and it has 8 GPU(s)" in out.message, out.message
    assert out.fix == "list the machine once in the hostfile: gpu01 slots=8, without gpu01-alias"


def test_ranks_of_two_names_on_the_same_gpu_fail_even_within_the_gpu_count():
    """4 + 4 slots on 8 GPUs: each name's ranks get CUDA_VISIBLE_DEVICES=0,1,2,3 (DeepSpeed's default ids)."""
    out = ssh.evaluate(dict(CONNECTED, same_machine=same(["gpu01", "gpu01-alias"], [4, 4],
                                                          [[0, 1, 2, 3], [0, 1, 2, 3]], 8)), THRESHOLDS)
    assert out.status == Status.FAIL and "would use GPU 0,1,2,3" in out.message, out.message
    assert "gpu01 slots=8" in out.fix


def test_disjoint_gpus_within_the_count_warn():
    """--include gpu01:0,1,2,3@gpu01-alias:4,5,6,7: no GPU shared, but two launchers on one machine."""
    out = ssh.evaluate(dict(CONNECTED, same_machine=same(["gpu01", "gpu01-alias"], [4, 4],
                                                          [[0, 1, 2, 3], [4, 5, 6, 7]], 8)), THRESHOLDS)
    assert out.status == Status.WARN and "no GPU shared" in out.message, out.message


def test_a_machine_of_its_own_is_only_its_connection():
    assert ssh.evaluate(CONNECTED, THRESHOLDS).status == Status.PASS
    alone = same(["gpu01"], [8], [list(range(8))], 8)
    assert ssh.evaluate(dict(CONNECTED, same_machine=alone), THRESHOLDS).status == Status.PASS
    failed = ssh.evaluate({"connected": False, "error": "refused", "status": "error",
                           "same_machine": same(["a", "b"], [1, 1], [[0], [0]], None)}, THRESHOLDS)
    assert failed.status == Status.ERROR and failed.message == "refused"


# --- the runner's grouping ---------------------------------------------------------------------------------

def node(name, machine_id="m1", boot_id="b1", addresses=("10.0.0.1",), gpus=None, slots=1, connected=True):
    machine = {"machine_id": machine_id, "boot_id": boot_id, "addresses": list(addresses)}
    if gpus is not None:
        machine["gpus"] = gpus
    return Node(HostSpec(name, slots, gpus=list(range(slots))), None, None,  # type: ignore[arg-type]
                {"connected": connected, "machine": machine})


def groups(nodes):
    mark_same_machines(nodes)
    return {n.name: n.ssh_facts["same_machine"]["hosts"] for n in nodes if "same_machine" in n.ssh_facts}


def test_names_with_the_same_machine_and_a_shared_address_are_grouped_in_hostfile_order():
    nodes = [node("a", addresses=["10.0.0.1", "10.1.0.1"]), node("b", machine_id="m2", boot_id="b2"),
             node("a-ib", addresses=["10.1.0.1", "10.0.0.1"], gpus=8, slots=4), node("10.0.0.1", slots=2)]
    assert groups(nodes) == {name: ["a", "a-ib", "10.0.0.1"] for name in ("a", "a-ib", "10.0.0.1")}
    facts = nodes[0].ssh_facts["same_machine"]
    assert facts["slots"] == [1, 4, 2] and facts["gpu_ids"] == [[0], [0, 1, 2, 3], [0, 1]]
    assert facts["machine_id"] == "m1" and facts["boot_id"] == "b1"


def test_containers_on_one_kernel_and_unreachable_or_unknown_hosts_are_not_grouped():
    # Same boot id and image machine-id, but each its own network namespace: separate hosts to DeepSpeed.
    assert groups([node("pod1", addresses=["10.0.0.1"]), node("pod2", addresses=["10.0.0.2"])]) == {}
    # Another boot of another machine with a cloned machine-id.
    assert groups([node("a"), node("b", boot_id="b2")]) == {}
    assert groups([node("a"), node("b", connected=False)]) == {}
    assert groups([node("a", machine_id="", boot_id=""), node("b", machine_id="", boot_id="")]) == {}
    # No addresses readable on either: the ids alone decide.
    assert groups([node("a", addresses=[]), node("b", addresses=[])]) == {"a": ["a", "b"], "b": ["a", "b"]}


def test_groups_join_through_a_shared_address():
    """a shares an address with c, b with c: one machine, although a and b share none (listed before c)."""
    nodes = [node("a", addresses=["10.0.0.1"]), node("b", addresses=["10.2.0.1"]),
             node("c", addresses=["10.0.0.1", "10.2.0.1"])]
    assert groups(nodes) == {name: ["a", "b", "c"] for name in "abc"}


# --- the hello -----------------------------------------------------------------------------------------------

def test_machine_identity_of_this_machine():
    ident = machine_identity()
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        if Path(path).exists() and Path(path).read_text().strip():
            assert ident["machine_id"] == Path(path).read_text().strip()
            break
    assert ident["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    shown = subprocess.run(["ip", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    for address in ident["addresses"]:
        assert f" {address}/" in shown, (address, shown)
    assert not any(a.startswith("127.") or a == "::1" for a in ident["addresses"])
    assert len(json.dumps(ident)) < 1500  # rides on the hello, which the coordinator reads up to 4 KiB of
    assert ("gpus" in ident) == Path("/proc/driver/nvidia/gpus").is_dir()


# --- on namespace hosts --------------------------------------------------------------------------------------

@pytest.fixture
def cluster():
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(3, networks=2) as built:
        yield built


def run(cluster, tmp_path, names, ssh_config=None):
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile",
            str(cluster.hostfile(tmp_path / "hf", names=names)), "--python", sys.executable,
            "--ssh-config", str(ssh_config or cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "memlock", "--json", str(report)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    cells = {r["host"]: r for r in json.loads(report.read_text())["results"] if r["check"] == "ssh"}
    return proc, cells


def test_one_namespace_host_under_two_addresses_and_an_alias_is_named_as_one_machine(cluster, tmp_path):
    node01 = cluster.host("node01")
    second = node01.addresses[1]  # node01 on the second network
    config = tmp_path / "ssh_config"  # an alias of node01 in the coordinator's ssh config, first match wins
    config.write_text(f"Host alias01\n    HostName {node01.addresses[0]}\n\n" + cluster.ssh_config.read_text())
    proc, cells = run(cluster, tmp_path, ["node01", "node02", "node03", second, "alias01"], config)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a WARN: the namespace hosts have no GPUs
    names = ["node01", second, "alias01"]
    for name in names:
        cell = cells[name]
        assert cell["status"] == "warn", cell
        assert cell["message"].startswith(f"node01, {second} and alias01 are one machine (machine-id "
                                          f"{node01.machine_id[:8]}, boot id {node01.boot_id[:8]})"), cell["message"]
        assert "3 ranks on this one box" in cell["message"]
        assert cell["metrics"]["same_machine"]["hosts"] == names
    assert len({cells[name]["message"] for name in names}) == 1  # one cause
    for name in ("node02", "node03"):
        assert cells[name]["status"] == "pass" and "one machine" not in cells[name]["message"], cells[name]
    assert "one machine" in proc.stdout


def test_a_normal_cluster_is_not_flagged(cluster, tmp_path):
    """Namespace hosts are machines of their own (each its own machine-id and boot id, and addresses)."""
    proc, cells = run(cluster, tmp_path, ["node01", "node02", "node03"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(cells) == {"node01", "node02", "node03"}
    for cell in cells.values():
        assert cell["status"] == "pass" and "same_machine" not in cell["metrics"], cell
    assert "one machine" not in proc.stdout


# --- one cause, and the launch keeps the name the fix keeps (issue 30) ---------------------------------------

def two_names_report(strict: bool = True):
    """node1 and 10.77.0.1 are one machine (the connection check's WARN on both, the same words), node2 apart."""
    from preflight.results import HostRecord, Report, Result
    group = same(["node1", "10.77.0.1"], [1, 1], [[0], [0]], None)
    results = []
    for name, address in (("node1", "10.77.0.1"), ("10.77.0.1", "10.77.0.1"), ("node2", "10.77.0.2")):
        facts = dict(CONNECTED, hostname=name if name != "10.77.0.1" else "node1", address=address)
        if name != "node2":
            facts["same_machine"] = group
        results.append(Result.from_outcome(name, "ssh", ssh.evaluate(facts, THRESHOLDS)))
        results.append(Result(name, "memlock", Status.PASS, "unlimited"))
    hosts = [HostRecord("node1", "10.77.0.1", 1, True), HostRecord("10.77.0.1", "10.77.0.1", 1, True),
             HostRecord("node2", "10.77.0.2", 1, True)]
    return Report("t", 1.0, hosts, results, ["ssh", "memlock"], strict=strict)


def test_two_names_are_one_cause_and_the_launch_keeps_the_name_the_fix_keeps(tmp_path):
    import io

    from preflight import launchable
    from preflight.causes import causes, verdict
    report = two_names_report()
    (cause,) = causes(report)
    assert cause.hosts == ["node1", "10.77.0.1"] and "keep node1, without 10.77.0.1" in cause.fix
    assert verdict(report) == "NOT READY: 1 warning, and --strict fails on warnings (10.77.0.1,node1 ssh)"
    launch = launchable.launchable(report)
    assert launch.exclude_spec() == "10.77.0.1" and [h for h, _ in launch.hosts] == ["node1", "node2"]
    hostfile = str(tmp_path / "hostfile")
    assert launchable.ready_command(report, launchable.Context(hostfile)) == \
        f"deepspeed --hostfile {hostfile} -e 10.77.0.1 ..."
    out = io.StringIO()
    launchable.write(report, out)
    assert out.getvalue().splitlines()[1:] == ["node1 slots=1", "node2 slots=1"]


def test_strict_run_of_one_machine_under_three_names_keeps_one(cluster, tmp_path):
    """On namespace hosts, as a user runs it: --strict makes the WARN NOT READY; the cause is one line, the printed
    -e leaves out the two other names, and --write-hostfile keeps node01 (the name the fix keeps)."""
    node01 = cluster.host("node01")
    second = node01.addresses[1]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host alias01\n    HostName {node01.addresses[0]}\n\n" + cluster.ssh_config.read_text())
    hostfile = cluster.hostfile(tmp_path / "hf", names=["node01", "node02", "node03", second, "alias01"])
    healthy = tmp_path / "healthy.txt"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--python", sys.executable,
            "--ssh-config", str(config), "--ssh-key", str(cluster.user_key), "--known-hosts",
            str(cluster.known_hosts), "--checks", "memlock", "--strict", "--write-hostfile", str(healthy)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                          env={k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"})
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    causes = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert len(causes) == 1 and "are one machine" in causes[0], proc.stdout
    verdict = proc.stdout.splitlines()[-2]
    assert verdict.endswith(f"; launch now: deepspeed --hostfile {healthy} ..."), verdict
    names = [ln.split()[0] for ln in healthy.read_text().splitlines() if not ln.startswith("#")]
    assert names == ["node01", "node02", "node03"], healthy.read_text()
    proc = subprocess.run([a for a in argv if a not in ("--write-hostfile", str(healthy))], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    verdict = proc.stdout.splitlines()[-2]
    assert verdict.endswith(f"; launch now: deepspeed --hostfile {hostfile} -e {second}@alias01 ..."), verdict
