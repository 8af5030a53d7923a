"""The coordinator checks itself first: its neighbour table, open files and local ports against the run, on namespace
hosts; a connect that fails for a reason of this machine is one line naming how many hosts it hit.

The open-file limit (a process's own) and the ephemeral port range (a network namespace's own) are lowered for real,
for a coordinator process or namespace that the test owns. The neighbour table is not: its size (gc_thresh3) and
its overflow counter are the kernel's, one table for every namespace of the machine (a namespace other than the
first has no net/ipv4/neigh/default at all), so lowering it would break the tests that run beside this one. That
test gives the coordinator a kernel that reads a lowered table and counts overflows, and real connects that go
unanswered, on a bridge of real namespace hosts whose routes the coordinator looks up for real. Sample of the
warning that starts such a run:

    preflight: warning: coordinator: this machine's neighbour table holds at most 16 entries
        (net.ipv4.neigh.default.gc_thresh3) and this run needs 23 (23 hosts on-link, 0 gateways) ...;
        fix: sudo sysctl -w net.ipv4.neigh.default.gc_thresh3=1024
"""
from __future__ import annotations

import io
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from preflight.config import load_defaults
from preflight.hostfile import HostSpec
from preflight.render import Settings
from preflight.render import terminal
from preflight.results import CLUSTER
from preflight.runner import RunOptions, Runner
from preflight.selfcheck import COORDINATOR, Admission, Kernel, SelfCheck, _table_size, local_kind
from preflight.transport import SSHOptions, SSHTransport
from tests.netcluster import NetCluster

ROOT = Path(__file__).resolve().parents[2]
BLACKHOLES = ["dead1", "dead2", "dead3"]


@pytest.fixture(scope="module")
def bridge():
    """20 namespace hosts and 3 whose every packet is dropped, all on one bridge (on-link from here)."""
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(20) as c:
        for name in BLACKHOLES:
            c.add_blackhole(name)
        yield c


class SmallTable(Kernel):
    """This machine, except that its neighbour table holds 16 entries and the kernel counts 7 refused entries
    once the connects have begun (what a full table does to new connections, without filling the machine's)."""

    def __init__(self) -> None:
        self.reads = 0

    def gc_thresh3(self, family: int) -> Optional[int]:
        return 16

    def table_fulls(self, family: int) -> Optional[int]:
        self.reads += 1
        return 100 if self.reads <= 2 else 107  # before(): one read per family


def ssh(cluster, connect_timeout: float = 3) -> SSHOptions:
    return SSHOptions(config_path=str(cluster.ssh_config), key=str(cluster.user_key),
                      known_hosts=str(cluster.known_hosts), connect_timeout=connect_timeout)


def run_in_process(cluster, names: List[str], kernel: Optional[Kernel]):
    """(report, what the progress printed, the terminal report) of one run with --checks python."""
    options = RunOptions(hosts=[HostSpec(n, 1, i) for i, n in enumerate(names)], checks=["python"],
                         thresholds=load_defaults(), python=sys.executable, ssh=ssh(cluster), timeout=60,
                         parallel=32, kernel=kernel)
    err = io.StringIO()
    report = Runner(options, terminal.TerminalProgress(terminal.console(err, 240))).run()
    out = io.StringIO()
    terminal.write(report, out, Settings(False, False, 240))
    return report, err.getvalue(), out.getvalue()


def test_a_neighbour_table_below_the_on_link_hosts_warns_first_and_its_failed_connects_are_one_line(bridge):
    names = [h.name for h in bridge.hosts] + BLACKHOLES
    report, progress, text = run_in_process(bridge, names, SmallTable())
    # The run starts with one warning, before the first connect, with the sysctl that fixes it.
    lines = progress.splitlines()
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1, progress
    assert lines[0] == warnings[0], progress  # before the connecting phase's first line
    assert warnings[0].startswith("preflight: warning: coordinator: this machine's neighbour table holds at most 16 "
                                  "entries (net.ipv4.neigh.default.gc_thresh3) and this run needs 23 (23 hosts "
                                  "on-link, 0 gateways)"), warnings[0]
    assert warnings[0].endswith("fix: sudo sysctl -w net.ipv4.neigh.default.gc_thresh3=1024"), warnings[0]
    coordinator = [r for r in report.results if r.check == COORDINATOR]
    assert [(r.host, r.status.value) for r in coordinator] == [(CLUSTER, "warn")]
    assert coordinator[0].fix == "sudo sysctl -w net.ipv4.neigh.default.gc_thresh3=1024"
    # The three connects that went unanswered while the kernel refused entries: one line, naming how many.
    overflow = [line for line in text.splitlines() if "neighbour table overflowed" in line]
    assert len(overflow) == 1, text
    assert "3 of 23 hosts could not be connected" in overflow[0] and "refused 7 new entries" in overflow[0]
    assert "fix: sudo sysctl -w net.ipv4.neigh.default.gc_thresh3=1024" in overflow[0]
    assert not [line for line in text.splitlines() if "timed out" in line], text
    assert len([line for line in text.splitlines() if "neighbour table" in line]) == 2, text  # and the WARN
    # JSON keeps each host's result, with the host's own error beside the shared cause.
    cells = {(r["host"], r["check"]): r for r in report.to_dict()["results"]}
    for name in BLACKHOLES:
        cell = cells[(name, "ssh")]
        assert cell["status"] == "error" and "neighbour table overflowed" in cell["message"], cell
        assert "timed out after 3s" in cell["metrics"]["connect_error"], cell
    for h in bridge.hosts:
        assert cells[(h.name, "ssh")]["status"] == "pass" and cells[(h.name, "python")]["status"] == "pass"


def test_the_same_run_on_this_machines_table_warns_nothing_and_keeps_each_hosts_error(bridge):
    """The machine's own table (1024 entries by default) holds 23 hosts, and it refused no entry: no coordinator
    row, and each unanswered host keeps its own error."""
    names = [h.name for h in bridge.hosts] + BLACKHOLES
    kernel = Kernel()
    limit = kernel.gc_thresh3(4)
    if limit is not None and limit < 64:
        pytest.fail(f"this machine's neighbour table holds {limit} entries: too few for the namespace tests")
    report, progress, text = run_in_process(bridge, names, kernel)
    assert "warning" not in progress, progress
    assert not [r for r in report.results if r.check == COORDINATOR]
    cells = {(r.host, r.check): r for r in report.results}
    for name in BLACKHOLES:
        assert "timed out after 3s" in cells[(name, "ssh")].message
        assert "neighbour" not in cells[(name, "ssh")].message


def test_on_link_hosts_and_gateways_are_told_apart_by_the_kernels_routes(bridge):
    """Hosts on a bridge of this machine are on-link; an address routed through a gateway is one gateway entry;
    this machine's own address needs none."""
    check = SelfCheck([SSHTransport(h.name, ssh(bridge)) for h in bridge.hosts[:5]]
                      + [SSHTransport(name, SSHOptions(config_path=None)) for name in ("192.0.2.77", "127.0.0.1")],
                      SmallTable())
    found = check.before()
    assert check.on_link[4] == {h.addresses[0] for h in bridge.hosts[:5]} | (
        {"192.0.2.77"} if _on_link("192.0.2.77") else set())
    assert "127.0.0.1" not in check.on_link[4]
    assert not found  # 5 (or 6) entries fit in 16
    assert _table_size(23) == 1024 and _table_size(600) == 2048


def _on_link(address: str) -> bool:
    route = json.loads(subprocess.run(["ip", "-j", "route", "get", address], capture_output=True, text=True).stdout)
    return not route[0].get("gateway")


def test_local_errors_are_told_from_the_hosts():
    assert local_kind("cannot connect to 10.0.0.1:22: Too many open files") == "files"
    assert local_kind("connecting did not finish: [Errno 24] Too many open files") == "files"
    assert local_kind("cannot connect to 10.0.0.1:22: Cannot assign requested address") == "ports"
    assert local_kind("cannot connect to 10.0.0.1:22: No buffer space available") == "neighbours"
    assert local_kind("TCP connect to 10.0.0.1:22 timed out after 3s") is None
    assert local_kind("connection to 10.0.0.1:22 refused: no SSH server listening") is None


def test_connects_at_the_open_file_limit_are_admitted_while_descriptors_last():
    """Ten descriptors, three a host: three connect at once; a fourth waits until one fails and gives its share
    back; once the three hold theirs and none is in flight, the rest are refused at once, not after the wait."""
    admission = Admission(40, 10, lambda host: 3)
    assert admission.hosts_at_once() == 3
    assert all(admission.take(h, 1.0) for h in ("a", "b", "c"))
    got: List[bool] = []
    waiter = threading.Thread(target=lambda: got.append(admission.take("d", 30.0)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # d waits: a, b and c are in flight and only one descriptor is free
    admission.done("b", kept=False)  # b failed: its three descriptors are free again
    waiter.join(5)
    assert got == [True]
    for host in ("a", "c", "d"):
        admission.done(host, kept=True)
    started = time.monotonic()
    assert not admission.take("e", 30.0)
    assert time.monotonic() - started < 1.0
    assert admission.refusal().endswith("(RLIMIT_NOFILE 40): Too many open files")
    assert local_kind(admission.refusal()) == "files"


def test_a_waiting_host_gives_up_after_its_wait():
    admission = Admission(40, 3, lambda host: 3)
    assert admission.take("a", 1.0)
    started = time.monotonic()
    assert not admission.take("b", 0.3)
    assert 0.25 < time.monotonic() - started < 5


class FewFiles(Kernel):
    """This machine, except that this process may open `soft` files."""

    def __init__(self, soft: int) -> None:
        self.soft = soft

    def nofile(self):
        return self.soft, self.soft


def test_connects_are_admitted_by_descriptors_only_below_the_runs_need(tmp_path):
    transports = [SSHTransport(f"node{i:02d}", SSHOptions(config_path=None)) for i in range(20)]
    assert SelfCheck(transports, FewFiles(1 << 20)).admission() is None
    admission = SelfCheck(transports, FewFiles(40)).admission()
    assert admission is not None and admission.soft == 40
    assert admission.free == 40 - Kernel().open_files() - 8


# ------------------------------------------------------------------------------------------- real limits

def cli(cluster, hostfile: Path, tmp_path: Path, *args: str, ssh_config: Optional[Path] = None,
        netns: Optional[str] = None, nofile: Optional[int] = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable,
            "--ssh-config", str(ssh_config or cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--hostfile", str(hostfile), "--checks", "python",
            "--connect-timeout", "5", "--json", str(tmp_path / "r.json"), *args]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]

    def limit() -> None:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          preexec_fn=limit)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def ssh_cells(tmp_path: Path) -> Dict[str, Dict]:
    return {r["host"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"] if r["check"] == "ssh"}


def test_an_open_file_limit_below_the_run_warns_first_and_its_failed_connects_are_one_line(bridge, tmp_path):
    """A coordinator whose RLIMIT_NOFILE (soft and hard: it cannot raise it) holds a few hosts' connections."""
    hostfile = bridge.hostfile(tmp_path / "hf")
    # A hello late by the connect timeout (20 agents starting on a loaded CI machine) would need a second channel,
    # and the descriptors are taken: the time it needs here, so that the one cause is the limit.
    proc = cli(bridge, hostfile, tmp_path, "--connect-timeout", "30", nofile=40)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    first = proc.stderr.splitlines()[1]  # after the line that names the hostfile
    assert first.startswith("preflight: warning: coordinator: this process may open 40 files (RLIMIT_NOFILE; hard "
                            "limit 40) and a run over 20 hosts holds about"), proc.stderr
    assert first.endswith("fix: ulimit -n 1024 in the shell that runs preflight (above the hard limit 40: as root, "
                          "or a nofile line in /etc/security/limits.conf)"), first
    assert len([line for line in proc.stderr.splitlines() if "warning" in line]) == 1, proc.stderr
    cells = ssh_cells(tmp_path)
    failed = [h for h, c in cells.items() if c["status"] != "pass"]
    assert 3 <= len(failed) <= 18, cells  # some hosts fit, the rest did not
    for host in failed:
        assert cells[host]["message"].startswith("this machine ran out of open files (RLIMIT_NOFILE 40"), cells[host]
        assert f"{len(failed)} of 20 hosts could not be connected" in cells[host]["message"]
    # The report: the coordinator's WARN and one line for the failed connects, and no host's own EMFILE line.
    lines = [line for line in proc.stdout.splitlines() if "open files" in line]
    assert len(lines) == 2, proc.stdout
    assert [line for line in lines if line.startswith("cluster::coordinator WARNED - this process may open 40 files")]
    assert [line for line in lines if "ran out of open files" in line and f"{len(failed)} of 20 hosts" in line]


@pytest.fixture
def seat(bridge):
    """A network namespace of the test's own on the bridge, for a coordinator whose sysctls are its alone."""
    return bridge.add_seat(f"seat{len(bridge.fault_hosts)}")


def test_an_ephemeral_port_range_below_the_run_warns_first_and_its_failed_connects_are_one_line(bridge, seat,
                                                                                              tmp_path):
    """Four names of one address, from a namespace whose ip_local_port_range has two ports: two connects get none."""
    node = bridge.hosts[0]
    names = ["alias1", "alias2", "alias3", "alias4"]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {' '.join(names)}\n    HostName {node.addresses[0]}\n\n" + bridge.ssh_config.read_text())
    hostfile = bridge.hostfile(tmp_path / "hf", names=names)
    subprocess.run(["ip", "netns", "exec", seat.ns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=61000 61001"],
                   check=True)
    proc = cli(bridge, hostfile, tmp_path, ssh_config=config, netns=seat.ns)
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, proc.stderr
    assert warnings[0].startswith("preflight: warning: coordinator: this machine's ephemeral ports "
                                  "(net.ipv4.ip_local_port_range 61000-61001) allow 2 connections to one address and "
                                  f"port at once, and this run opens 4 to {node.addresses[0]}:22"), warnings[0]
    fix = 'sudo sysctl -w net.ipv4.ip_local_port_range="32768 60999"'
    assert warnings[0].endswith(f"fix: {fix}"), warnings[0]
    cells = ssh_cells(tmp_path)
    failed = sorted(h for h, c in cells.items() if "no free local port" in c["message"])
    assert len(failed) == 2, cells
    for host in failed:
        assert "2 of 4 hosts could not be connected" in cells[host]["message"]
        assert cells[host]["fix"] == fix
        assert "Cannot assign requested address" in cells[host]["metrics"]["connect_error"]
    assert len([line for line in proc.stdout.splitlines() if "no free local port" in line]) == 1, proc.stdout
    # The fix, run as printed (in the coordinator's namespace, where the range is): every name connects.
    subprocess.run(["ip", "netns", "exec", seat.ns, "sh", "-c", fix.replace("sudo ", "")], check=True,
                   capture_output=True)
    proc = cli(bridge, hostfile, tmp_path, ssh_config=config, netns=seat.ns)
    assert "warning: coordinator" not in proc.stderr, proc.stderr
    assert not [h for h, c in ssh_cells(tmp_path).items() if "no free local port" in c["message"]]
    assert all(c["metrics"].get("hostname") == node.name for c in ssh_cells(tmp_path).values()), ssh_cells(tmp_path)
