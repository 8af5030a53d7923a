"""A single multi-GPU node is the most common first run: its slots are its visible GPUs (or --slots), and the
all-reduce runs across its local ranks. Here for real on a CPU-only namespace host: --slots 4 gives a 4-rank gloo
all-reduce on one host, with its bus bandwidth."""
from __future__ import annotations

import json

from preflight.hostfile import local_cluster, visible_gpus, with_slots
from tests.cli.test_cli_cluster import assert_nothing_left, preflight


def test_visible_gpus_follow_cuda_visible_devices_as_deepspeed_does():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ([2, 3], "CUDA_VISIBLE_DEVICES='2,3'")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""})[0] == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"})[0] == [0]  # CUDA stops at the first invalid id
    notes: list = []
    (host,) = local_cluster(4, notes)
    assert (host.slots, host.gpus) == (4, [0, 1, 2, 3]) and notes == ["this machine: 4 slot(s), from --slots 4"]
    assert [(h.slots, h.gpus) for h in with_slots(local_cluster(1), 2)] == [(2, [0, 1])]


def test_slots_4_on_one_cpu_host_is_a_real_4_rank_gloo_allreduce(netcluster_factory, tmp_path):
    cluster = netcluster_factory(1, names=["node01"])
    hostfile = cluster.hostfile(tmp_path / "hostfile", slots=1)
    report = tmp_path / "r.json"
    proc = preflight(cluster, "--hostfile", hostfile, "--slots", "4", "--checks", "allreduce",
                     "--json", report, timeout=300)
    data = json.loads(report.read_text())
    assert [h["slots"] for h in data["hosts"]] == [4]
    (result,) = [r for r in data["results"] if r["check"] == "allreduce"]
    assert result["status"] == "pass", (result["message"], proc.stderr[-2000:])
    m = result["metrics"]
    assert m["backend"] == "gloo" and m["world_size"] == 4
    assert {r["host"] for r in m["ranks"]} == {"node01"} and len({r["pid"] for r in m["ranks"]}) == 4
    assert "busbw" in result["message"] and "4 ranks on 1 host" in result["message"]
    assert_nothing_left(cluster)
