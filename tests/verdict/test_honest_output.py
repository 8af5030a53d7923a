"""Output that tells the truth about itself (issue 30 items 5 and 8): a closed stdout (`| head -1`) ends quietly
with the verdict's exit code, `--min-hosts` above the hosts is NOT READY in one line, and no launch suggestion goes
below `--min-hosts`. The pipes are real: bash -o pipefail runs `preflight ... | head -1`, so the exit status is
preflight's, and `head` closes the read end after its line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from preflight import launchable
from preflight.hostside.outcome import Status
from preflight.results import Result
from tests.verdict.test_verdict import cluster_report

ROOT = Path(__file__).resolve().parents[2]


def piped(command: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``command | head -1`` under pipefail: the status is preflight's (head's is 0)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("SLURM_")}
    return subprocess.run(["bash", "-o", "pipefail", "-c", f"{command} | head -1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def test_list_into_head_ends_quietly_with_0():
    proc = piped(f"{sys.executable} -m preflight list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ssh ") and len(proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_a_ready_run_into_head_exits_0_and_a_failed_one_1(tmp_path):
    """This machine as the cluster (no hostfile): READY is 0 through a closed pipe, and stderr too can be the pipe."""
    base = f"{sys.executable} -m preflight run --python {sys.executable} --checks python"
    for command in (base, f"{base} 2>&1", f"{base} --json -"):
        proc = piped(command)
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
        assert len(proc.stdout.splitlines()) == 1
    # The same through the pipe, but NOT READY: the verdict's 1, not a 0 because the reader left.
    missing = tmp_path / "no-such-dir"
    proc = piped(f"{base},nvme --nvme-path {missing} 2>/dev/null")
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout.startswith("localhost::nvme FAILED - ") and "Traceback" not in proc.stdout + proc.stderr


def test_a_ready_cluster_into_head_exits_0(cluster3, tmp_path):
    hostfile = cluster3.hostfile(tmp_path / "hf")
    proc = piped(f"{sys.executable} -m preflight run --hostfile {hostfile} --python {sys.executable} --ssh-config "
                 f"{cluster3.ssh_config} --ssh-key {cluster3.user_key} --known-hosts {cluster3.known_hosts} "
                 "--checks python")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_min_hosts_above_the_hosts_is_not_ready_in_one_line(tmp_path):
    """`--min-hosts 10` on 3 hosts: exit 1, one line, before any host is contacted (these names resolve nowhere)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node01 slots=8\nnode02 slots=8\nnode03 slots=8\n")
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--min-hosts", "10"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["NOT READY: --min-hosts 10 asks for 10 healthy hosts, and the run has 3 hosts; "
                                        "nothing was checked"]
    assert proc.stderr == ""
    # A fraction can always be met; a count the hosts reach is no early stop either.
    assert launchable.short_of_min_hosts("0.9", 3) == "" and launchable.short_of_min_hosts("3", 3) == ""


def test_no_launch_suggestion_below_min_hosts(tmp_path):
    """3 of 4 hosts healthy and --min-hosts 4: no "launch now" on 3; with --min-hosts 3 it is READY on 3."""
    report = cluster_report(4, extra=[Result("node02", "libaio", Status.FAIL, "libaio.so.1 not found", "apt-get "
                                             "install libaio1")])
    hostfile = str(tmp_path / "hostfile")
    line = launchable.verdict_line(report, launchable.Context(hostfile, min_hosts="4"), "NOT READY: 1 host needs "
                                   "fixing (node02 libaio)")
    assert "launch now" not in line and "3 of 4 hosts healthy, fewer than --min-hosts 4" in line
    assert launchable.ready_command(report, launchable.Context(hostfile, min_hosts="4")) == ""
    line = launchable.verdict_line(report, launchable.Context(hostfile, min_hosts="3"), "NOT READY: 1 host needs "
                                   "fixing (node02 libaio)")
    assert line.startswith("READY on 3 of 4 hosts (--min-hosts 3)") and "-e node02" in line
    # Without --min-hosts the healthy subset is printed whenever it exists.
    assert launchable.ready_command(report, launchable.Context(hostfile)) == \
        f"deepspeed --hostfile {hostfile} -e node02 ..."


def test_hostfile_into_head_ends_quietly_with_0(tmp_path):
    hostfile = tmp_path / "big.txt"
    hostfile.write_text("".join(f"node{i} slots=8\n" for i in range(1, 5001)))
    for command in ("hostfile", "hostfile --expand"):
        proc = piped(f"{sys.executable} -m preflight {command} {hostfile}")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (command, proc.stderr)
        assert len(proc.stdout.splitlines()) == 1
