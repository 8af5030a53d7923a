"""A fault of the launch shell is one cause fixed there, on no host (issue 30, "Root cause, once"): the planted
NCCL_SOCKET_IFNAME=bogus0 of tests/checks/launch/test_launch_faults.py, judged on the verdict a user reads.

DeepSpeed's runner exports every NCCL* variable of the shell that runs `deepspeed` to every rank (runner.py:36,
cuda_accelerator.py:411-412); preflight reads that shell (its own) as the launch shell. The value matches no
interface on any of the 3 hosts: one cause (the cluster row of launcher_ssh, where "launch shell"), the hosts'
rows blocked by it, and a verdict that says where to fix it and names no host to fix.
"""
from __future__ import annotations

import re

from tests.cli.test_cli_cluster import assert_nothing_left
from tests.checks.launch.test_launch_faults import NAMES, exits_1_in_bound, gate, shared_config


def verdict_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(("NOT READY", "READY")))


def cause_lines(stdout: str):
    """The lines above the matrix that start a cause (``hosts::check STATUS - ...``, ``launch shell::check ...``)."""
    head = stdout.split("preflight matrix", 1)[0]
    return [line for line in head.splitlines() if re.match(r"^[^:]+::\w+ (FAILED|ERROR|WARNED|SKIPPED) - ", line)]


def test_an_inherited_bogus_socket_ifname_is_one_cause_in_the_launch_shell(
        warm_ops, netcluster_factory, tmp_path):
    cluster = netcluster_factory(3, names=NAMES)
    proc, cells, elapsed = gate(cluster, tmp_path, shared_config(cluster), env={"NCCL_SOCKET_IFNAME": "bogus0"})
    exits_1_in_bound(proc, elapsed)
    star = cells[("*", "launcher_ssh")]
    assert star["status"] == "fail" and star.get("where") == "launch shell", star
    for host in NAMES:
        cell = cells[(host, "launcher_ssh")]
        assert (cell.get("blocked_by"), cell.get("blocked_host")) == ("launcher_ssh", "*"), cell
    bad = [line for line in cause_lines(proc.stdout) if " FAILED" in line or " ERROR" in line]
    assert len(bad) == 1 and "NCCL_SOCKET_IFNAME=bogus0" in bad[0], bad
    assert bad[0].startswith("launch shell::launcher_ssh FAILED"), bad[0]
    verdict = verdict_line(proc.stdout)
    assert verdict.startswith("NOT READY") and "in the launch shell" in verdict, verdict
    assert not any(host in verdict for host in NAMES), verdict
    assert "host needs fixing" not in verdict and "hosts need fixing" not in verdict, verdict
    assert_nothing_left(cluster)


def test_the_launch_faults_table_says_the_shell_fault_is_fixed_in_the_launch_shell():
    """docs/rehearse.md's "Launch faults" row for the inherited variable: before the follow-up to issue 30 its host
    column said "every host it matches no interface on"; the cause names no host (the test above)."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "rehearse.md").read_text()
    (row,) = [line for line in doc.splitlines() if line.startswith("| a bogus `NCCL_SOCKET_IFNAME`")]
    named = row.split(" | ")[2]
    assert "in the launch shell" in named and "every host" not in named, row
