"""The checkpoint check: the verdict on recorded probes, and real directories on the namespace cluster."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.checks import checkpoint
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from tests.netcluster import NetCluster

REPO = Path(__file__).resolve().parents[3]
TH = load_defaults()
GiB = 1 << 30


def probe(free_gib=500.0, dev=41, fsid=7, **more):
    p = {"exists": True, "writable": True, "error": None, "free_bytes": int(free_gib * GiB), "size_bytes": 2 << 40,
         "st_dev": dev, "fsid": fsid, "fstype": "nfs4", "source": "nas:/ckpt", "target": "/ckpt",
         "test_file": "/ckpt/.preflight-ckpt-ab12cd34-x"}
    p.update(more)
    return p


# Shaped like the facts of a run on 3 hosts sharing an NFS export (each sees all three test files).
SHARED = {"path": "/ckpt", "hosts": ["node01", "node02", "node03"], "model_params": 7e9, "world_size": 24,
          "slots": {"node01": 8, "node02": 8, "node03": 8}, "unreachable": [], "errors": {},
          "probes": {"node01": probe(), "node02": probe(), "node03": probe()},
          "seen": {h: ["node01", "node02", "node03"] for h in ("node01", "node02", "node03")}}


def test_shared_directory_with_room_passes_and_says_the_size():
    out = checkpoint.evaluate(copy.deepcopy(SHARED), TH)
    assert all(o.status == Status.PASS for o in out.values()), {h: o.message for h, o in out.items()}
    assert out["*"].message == ("/ckpt is one shared filesystem on all 3 hosts; a checkpoint of 7e+09 params takes "
                                "117.3 GiB")
    assert out["node01"].metrics["needed_bytes"] == int(7e9 * 18)


def test_local_directories_warn_that_rank0_files_are_invisible_and_size_is_per_host():
    facts = copy.deepcopy(SHARED)
    facts["probes"] = {h: probe(free_gib=50.0, dev=i, fsid=i) for i, h in enumerate(facts["hosts"])}
    facts["seen"] = {h: [h] for h in facts["hosts"]}
    out = checkpoint.evaluate(facts, TH)
    star = out["*"]
    assert star.status == Status.WARN and "is not one shared filesystem" in star.message
    assert "sees only its own test file" not in star.message and "see only its own test file" in star.message
    assert "not visible to the other ranks" in star.message and "use_node_local_storage" in star.fix
    # each host keeps only its 8 of 24 ranks' shards: 7e9 * 18 / 3 = 39.1 GiB < 50 GiB free
    assert out["node01"].status == Status.PASS
    relaxed = dict(TH, checkpoint=dict(TH["checkpoint"], require_shared=False))
    assert checkpoint.evaluate(facts, relaxed)["*"].status == Status.PASS


def test_missing_readonly_and_full_directories_fail_with_a_fix():
    facts = copy.deepcopy(SHARED)
    facts["probes"]["node02"] = {"exists": False, "writable": False, "error": "no such directory", "test_file": None}
    facts["probes"]["node03"] = probe(writable=False, error="cannot write a file there: Read-only file system",
                                      test_file=None)
    facts["probes"]["node01"] = probe(free_gib=100.0)
    facts["seen"] = {"node01": ["node01"]}
    out = checkpoint.evaluate(facts, TH)
    assert out["node02"].status == Status.FAIL and "no such directory" in out["node02"].message
    assert "mkdir -p /ckpt" in out["node02"].fix
    assert out["node03"].status == Status.FAIL and "Read-only file system" in out["node03"].message
    bad = out["node01"]
    assert bad.status == Status.FAIL and "has 100.0 GiB free, a checkpoint of 7e+09 params needs 117.3 GiB" \
        in bad.message


def test_without_the_option_it_skips():
    out = checkpoint.evaluate({"skipped": "no --checkpoint-dir given", "unreachable": []}, TH)
    assert out["*"].status == Status.SKIP and "--checkpoint-dir" in out["*"].message


needs_cluster = pytest.mark.skipif(NetCluster.unavailable_reason() is not None,
                                   reason=str(NetCluster.unavailable_reason()))


def run(cluster, tmp_path, path):
    out = tmp_path / (f"out-{len(list(tmp_path.glob('out-*.json')))}.json")
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "checkpoint", "--checkpoint-dir", str(path),
            "--model-params", "1e6", "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.exists(), proc.stderr[-2000:]
    return {r["host"]: r for r in json.loads(out.read_text())["results"] if r["check"] == "checkpoint"}


@needs_cluster
def test_namespace_hosts_shared_and_private_directories(netcluster_factory, tmp_path):
    cluster = netcluster_factory(3, names=["node01", "node02", "node03"])
    shared = cluster.dir / "ckpt"  # one directory every host sees: a shared filesystem
    shared.mkdir()
    cells = run(cluster, tmp_path, shared)
    assert cells["*"]["status"] == "pass" and "one shared filesystem on all 3 hosts" in cells["*"]["message"]
    assert all(cells[h]["status"] == "pass" for h in ("node01", "node02", "node03"))
    assert os.listdir(shared) == []  # every test file removed
    # /tmp is each namespace host's own tmpfs: rank 0's files would not reach the others.
    cells = run(cluster, tmp_path, "/tmp")
    assert cells["*"]["status"] == "warn" and "is not one shared filesystem" in cells["*"]["message"], cells["*"]
    cells = run(cluster, tmp_path, cluster.dir / "missing")
    assert all(cells[h]["status"] == "fail" for h in ("node01", "node02", "node03"))
