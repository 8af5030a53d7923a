"""The test tiers (tests/conftest.py, docs/testing.md): each test gets one tier marker from what it uses, and a test
marked unit that builds namespace hosts anyway fails instead of slowing the fast loop down or needing root."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest
from tests.netcluster import NetClusterError, NetCluster

REPO = Path(__file__).resolve().parents[2]


def test_a_unit_test_may_not_build_namespace_hosts(request):
    assert request.node.get_closest_marker("unit")
    assert os.environ[conftest.NO_NAMESPACES] == request.node.nodeid
    build = NetCluster  # called through a name the tiering does not read, as a helper in another module would
    with pytest.raises(NetClusterError, match=r"test_tiers\.py::.* is marked unit .* builds namespace hosts"):
        build(1)


def _collected(marker: str, *files: str) -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marker, *(f"tests/{f}" for f in files)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]  # 5: nothing selected
    return {line.split("::")[1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_each_test_gets_its_tier_from_what_it_uses():
    files = ("slurm/test_slurm.py", "checks/memlock/test_memlock.py", "cli/test_cli_cluster.py",
             "checks/iperf3/test_iperf3.py", "cli/test_inputs.py", "cli/test_node_check.py")
    tiers = {marker: _collected(marker, *files) for marker in conftest.TIERS}
    # A Slurm fixture, the shared cluster3 fixture, a module's own fixture that builds a NetCluster, and a test that
    # builds one in its body.
    assert "test_salloc_run_over_srun_without_ssh_keys_passes_with_the_full_matrix" in tiers["slurm"]
    assert "test_testbed_runs_one_step_per_node_under_its_own_hostname_and_leaves_nothing" in tiers["slurm"]
    assert "test_healthy_cluster_json_junit_and_clean_hosts" in tiers["cluster"]  # cluster3
    assert "test_namespace_host_with_a_lowered_limit_is_named" in tiers["cluster"]  # netcluster_factory
    assert "test_equal_links_measure_the_shaped_rate_and_flag_nobody" in tiers["cluster"]  # the module's cluster4
    assert "test_local_run_without_hostfile_needs_no_ssh" in tiers["slow"]
    # Listed: root for mknod; seconds each; the rest is unit.
    assert "test_the_null_device_reads_as_empty_as_openssh_reads_dash_F_dev_null" in tiers["cluster"]
    assert "test_the_checks_node_check_and_run_run_come_from_the_same_config" in tiers["slow"]
    assert {"test_parse_real_client_output", "test_rate_formatting"} <= tiers["unit"]
    assert "test_tasks_per_node_and_nodelist_expansion_without_scontrol" in tiers["unit"]
    every = [name for marker in conftest.TIERS for name in tiers[marker]]
    assert len(every) == len(set(every)), "a test in two tiers"


def test_test_file_names_are_unique_and_the_tier_tables_name_real_files():
    """SLOW, NEEDS_ROOT and MEASURING are keyed by a test file's name without its folder (tests/<what>/test_x.py): two files
    of one name in two folders would share an entry, and an entry whose file moved or was renamed would silently
    put its tests back in the unit tier."""
    names = [p.stem for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    assert sorted((set(conftest.SLOW) | set(conftest.NEEDS_ROOT) | conftest.MEASURING | conftest.TORCH_EXTENSIONS)
                  - set(names)) == []
