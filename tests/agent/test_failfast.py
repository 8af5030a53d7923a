"""A host whose interpreter never starts the agent costs the gate its start-up deadline, not the checks' budget.

On namespace hosts, one host's --python hangs before it reads stdin (a hung NFS site-packages, a blocking
sitecustomize): the agent's hello never comes. That host is one ERROR "the agent never started: ... within Ns"
once the connect timeout plus [agent] start_s have passed (its other cells blocked by it), while the other hosts'
checks run as in a healthy run, and nothing of the run is left on any host. Before, the host held the gate for the
host checks' whole budget (--timeout x checks + 30 s: 270 s at the defaults with two host checks). Sample:

    node02::ssh ERROR - authenticated, but the agent never started: /dev/shm/preflight-hung-x/python gave no hello
        within 40s of its start (a hung interpreter, import hook or login script) (blocks 2 other checks); fix: ...
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Tuple

import pytest

from preflight.config import load_defaults
from preflight.remote import collect_budget
from tests.netcluster import NetCluster
from tests.cli.test_cli_cluster import assert_nothing_left

ROOT = Path(__file__).resolve().parents[2]
HUNG = "node02"


@pytest.fixture(scope="module")
def cluster():
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(3, names=["node01", "node02", "node03"]) as c:
        yield c


@pytest.fixture
def python(cluster):
    """An interpreter wrapper in /dev/shm (the hosts' /tmp is private): the real Python, except on a host whose
    flag file exists, where it sleeps before reading anything, with the agent's argv (and the run's token) kept as a
    real interpreter's, so that the run's cleanup can find it."""
    where = Path(tempfile.mkdtemp(prefix="preflight-hung-", dir="/dev/shm"))
    wrapper = where / "python"
    wrapper.write_text(f"""#!/bin/sh
if [ -e {where}/hang-"$(hostname)" ]; then
    exec {sys.executable} -c 'import time; time.sleep(600); "{where.name}"' "$@"
fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    try:
        yield wrapper
    finally:
        for h in cluster.hosts:  # on failure: what the run left
            cluster.exec(h, ["pkill", "-KILL", "-f", "--", f"[{where.name[0]}]{where.name[1:]}"])
        shutil.rmtree(where, ignore_errors=True)


def run(cluster, python: Path, tmp_path: Path, tag: str, *args: str) -> Tuple[float, Dict, subprocess.CompletedProcess]:
    """(seconds, {(host, check): result}, process) of one `preflight run` over the cluster."""
    report = tmp_path / f"{tag}.json"
    argv = [sys.executable, "-m", "preflight", "run", "--python", str(python), "--ssh-config", str(cluster.ssh_config),
            "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts),
            "--hostfile", str(cluster.hostfile(tmp_path / f"{tag}.hf")), "--json", str(report), *args]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    cells = {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    return took, cells, proc


def hang(python: Path, host: str) -> None:
    (python.parent / f"hang-{host}").touch()


def test_a_hung_interpreter_costs_at_most_its_start_deadline_at_the_defaults(cluster, python, tmp_path):
    checks = ["python", "libaio"]
    defaults = load_defaults()
    deadline = 10.0 + defaults["agent"]["start_s"]  # --connect-timeout's default plus the start-up budget
    assert deadline <= 45
    healthy_s, healthy, proc = run(cluster, python, tmp_path, "healthy", "--checks", ",".join(checks))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hang(python, HUNG)
    hung_s, cells, proc = run(cluster, python, tmp_path, "hung", "--checks", ",".join(checks))
    print(f"healthy run {healthy_s:.1f}s, with {HUNG}'s interpreter hung {hung_s:.1f}s (deadline {deadline:.0f}s; "
          f"the host checks' budget is {collect_budget(checks, 120.0):.0f}s)")
    assert proc.returncode == 1
    # The hung host: one ERROR, the agent never started within its start-up deadline (not the checks' budget), and
    # its checks blocked by it; one line of the report.
    cell = cells[(HUNG, "ssh")]
    assert cell["status"] == "error", cell
    assert f"authenticated, but the agent never started: {python} gave no hello within {deadline:.0f}s" \
        in cell["message"], cell
    assert "sitecustomize" in cell["fix"], cell
    for check in checks:
        assert cells[(HUNG, check)]["blocked_by"] == "ssh", cells[(HUNG, check)]
    assert len([line for line in proc.stdout.splitlines() if "never started" in line]) == 1, proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.startswith(f"{HUNG}::")]) == 1, proc.stdout
    # The other hosts' cells are those of the healthy run.
    for host in ("node01", "node03"):
        for check in ["ssh"] + checks:
            assert cells[(host, check)]["status"] == healthy[(host, check)]["status"], cells[(host, check)]
    # Its cost: at most its start-up deadline over the healthy run (and far below the checks' budget).
    assert hung_s <= healthy_s + deadline + 3, (healthy_s, hung_s)
    assert hung_s < collect_budget(checks, 120.0)
    assert_nothing_left(cluster)


def test_start_s_sets_the_deadline_and_the_cluster_checks_go_on_without_the_host(cluster, python, tmp_path):
    config = tmp_path / "t.toml"
    config.write_text("[agent]\nstart_s = 4\n")
    args = ["--checks", "python,clock", "--connect-timeout", "3", "--timeout", "30", "--config", str(config)]
    healthy_s, healthy, proc = run(cluster, python, tmp_path, "healthy", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hang(python, HUNG)
    hung_s, cells, proc = run(cluster, python, tmp_path, "hung", *args)
    print(f"healthy run {healthy_s:.1f}s, with {HUNG}'s interpreter hung {hung_s:.1f}s (deadline 7s)")
    assert proc.returncode == 1
    assert cells[(HUNG, "ssh")]["status"] == "error"
    assert "gave no hello within 7s" in cells[(HUNG, "ssh")]["message"]
    assert hung_s <= healthy_s + 7 + 3, (healthy_s, hung_s)
    # The cluster check ran on the two hosts whose agents started, and left the hung one out (blocked, as an
    # unreachable host's) instead of waiting on it.
    clock = cells[("*", "clock")]
    assert clock["status"] in ("pass", "warn"), clock
    assert cells[(HUNG, "clock")]["blocked_by"] == "ssh", cells[(HUNG, "clock")]
    for host in ("node01", "node03"):
        assert cells[(host, "python")]["status"] == healthy[(host, "python")]["status"]
    assert_nothing_left(cluster)
