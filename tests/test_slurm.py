"""preflight on a real Slurm cluster (tests/slurmcluster.py): srun transport, allocation awareness, node-check."""
from __future__ import annotations

import os

import pytest

from .slurmcluster import SlurmCluster, slurm_unavailable_reason


@pytest.fixture(scope="module")
def slurm3():
    """Three healthy Slurm nodes slm1..slm3 shared by the module; tests must undo what they change."""
    if reason := slurm_unavailable_reason():
        pytest.skip(reason)
    with SlurmCluster(3) as cluster:
        yield cluster


def test_testbed_runs_one_step_per_node_under_its_own_hostname_and_leaves_nothing():
    if reason := slurm_unavailable_reason():
        pytest.skip(reason)
    cluster = SlurmCluster(2)
    try:
        proc = cluster.client(["salloc", "-N2", "srun", "--label", "hostname"])
        assert sorted(proc.stdout.split()) == ["0:", "1:", "slm1", "slm2"]
        net_dir, namespaces = cluster.net.dir, [h.ns for h in cluster.net.hosts]
    finally:
        cluster.close()
    assert not net_dir.exists()
    assert not [ns for ns in namespaces if os.path.exists(f"/run/netns/{ns}")]
    assert cluster._munged is not None and cluster._munged.poll() is not None
