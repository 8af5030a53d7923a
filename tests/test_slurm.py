"""preflight on a real Slurm cluster (tests/slurmcluster.py): srun transport, allocation awareness, node-check."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

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


def _broken_libaio_setup(request) -> list[list[str]]:
    """Setup commands that make libaio unloadable inside one host's own mount namespace."""
    from .test_host_checks_cluster import libaio_runtime
    lib = libaio_runtime()
    # Not under /tmp: each host mounts a private tmpfs there before the setup commands run.
    empty = Path(tempfile.mkstemp(prefix="preflight-empty-", dir="/dev/shm")[1])
    request.addfinalizer(empty.unlink)
    return [["mount", "--bind", str(empty), lib]]


def _node_check(cluster: SlurmCluster, node: str, *args: str):
    proc = cluster.node_exec(node, [sys.executable, "-m", "preflight", "node-check", "--python", sys.executable,
                                    *args], timeout=120)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def test_node_check_drain_drains_exactly_the_broken_node_and_resumes_only_its_own_drains(request):
    if reason := slurm_unavailable_reason():
        pytest.skip(reason)
    with SlurmCluster(3, setup={"slm2": _broken_libaio_setup(request)}) as cluster:
        procs = {n: _node_check(cluster, n, "--drain", "--checks", "libaio") for n in cluster.names}
        assert {n: p.returncode for n, p in procs.items()} == {"slm1": 0, "slm2": 1, "slm3": 0}, \
            {n: p.stdout + p.stderr for n, p in procs.items()}
        line = procs["slm2"].stdout.strip().splitlines()[-1]
        assert line.startswith("preflight: libaio: ") and "load" in line and "\n" not in line
        assert procs["slm1"].stdout.strip().startswith("preflight: ok")
        # Exactly the broken node is drained, with the printed line as its reason.
        assert cluster.drain_reasons() == {"slm2": line}
        assert "slm2" in cluster.client(["sinfo", "-R"]).stdout

        # A node an admin drained for another reason stays drained when it passes.
        cluster.client(["scontrol", "update", "nodename=slm1", "state=drain", "reason=admin: fan noise"])
        proc = _node_check(cluster, "slm1", "--drain", "--checks", "libaio")
        assert proc.returncode == 0 and "not drained by preflight" in proc.stderr
        assert cluster.drain_reasons()["slm1"] == "admin: fan noise"

        # Once repaired, the node preflight drained is resumed by the next passing health check.
        from .test_host_checks_cluster import libaio_runtime
        cluster.net.exec("slm2", ["umount", libaio_runtime()], check=True)
        proc = _node_check(cluster, "slm2", "--drain", "--checks", "libaio")
        assert proc.returncode == 0 and "resumed" in proc.stderr, proc.stdout + proc.stderr
        assert set(cluster.drain_reasons()) == {"slm1"}
