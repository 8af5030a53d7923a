"""The allreduce check: evaluate on recorded facts, and real gloo all-reduces across the namespace cluster."""
from __future__ import annotations

import copy
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.checks import allreduce
from preflight.checks.allreduce import common, orchestrate, stragglers, supervisor
from preflight.hostside.outcome import Status
from preflight.hostside.seams import CheckOptions
from preflight.config import load_defaults

REPO = Path(__file__).resolve().parents[3]
THRESHOLDS = load_defaults()

# Facts recorded from a gloo run on the namespace cluster: 3 hosts, 1 slot each, links shaped to 200 Mbit/s.
HEALTHY = {
    "hosts": ["node01", "node02", "node03"], "slots": {"node01": 1, "node02": 1, "node03": 1}, "world_size": 3,
    "master_port": 29500, "unreachable": [], "master": "node01", "master_addr": "198.18.0.1",
    "network": None, "iperf3_median_gbps": None, "init_timeout_s": 10.0, "torch": {"node01": "2.13.0+cpu"},
    "interfaces": {h: {"ifname": "eth0", "address": a, "source": "route to MASTER_ADDR"}
                   for h, a in (("node01", "198.18.0.1"), ("node02", "198.18.0.2"), ("node03", "198.18.0.3"))},
    "backend": "gloo",
    "ranks": [{"rank": 0, "local_rank": 0, "host": "node01", "pid": 18212, "device": None},
              {"rank": 1, "local_rank": 0, "host": "node02", "pid": 18206, "device": None},
              {"rank": 2, "local_rank": 0, "host": "node03", "pid": 18213, "device": None}],
    "sizes": [{"bytes": 1048576, "time_s": 0.05810407, "iters": 3, "warmup_s": 0.061},
              {"bytes": 2097152, "time_s": 0.11882970, "iters": 3, "warmup_s": 0.12},
              {"bytes": 4194304, "time_s": 0.23343059, "iters": 3, "warmup_s": 0.24},
              {"bytes": 8388608, "time_s": 0.48054336, "iters": 3, "warmup_s": 0.49}],
    "stopped_early": None, "errors": [], "error_count": 0, "localization": {"suspects": []},
    "status": "ok", "duration_s": 11.6,
}

# Recorded from a run where node01 (the master) and node03 drop inbound TCP to 1024-65535.
FAILED = {
    **{k: copy.deepcopy(v) for k, v in HEALTHY.items() if k not in ("sizes", "ranks", "localization", "status")},
    "sizes": [], "status": "failed",
    "errors": [
        {"rank": 1, "host": "node02", "kind": "rendezvous", "phase": "rendezvous",
         "error": "could not connect to MASTER_ADDR 198.18.0.1:29500 within 10s (connection timed out: packets "
                  "dropped, inbound TCP to port 29500 blocked by a firewall?)",
         "targets": [{"address": "198.18.0.1", "host": "node01"}]},
        {"rank": 2, "host": "node03", "kind": "rendezvous", "phase": "rendezvous",
         "error": "could not connect to MASTER_ADDR 198.18.0.1:29500 within 10s (connection timed out: packets "
                  "dropped, inbound TCP to port 29500 blocked by a firewall?)",
         "targets": [{"address": "198.18.0.1", "host": "node01"}]},
        {"rank": 0, "host": "node01", "kind": "rendezvous", "phase": "init",
         "error": "DistNetworkError: The client socket has timed out after 10000ms while trying to connect to "
                  "(198.18.0.1, 29500).", "targets": [{"address": "198.18.0.1", "host": "node01"}]}],
    "failure": {"kind": "rendezvous",
                "message": "ranks 1, 2 on node02, node03 could not connect to MASTER_ADDR 198.18.0.1:29500 within "
                           "10s (connection timed out: packets dropped, inbound TCP to port 29500 blocked by a "
                           "firewall?); so did rank 0 on node01 itself"},
    "localization": {"suspects": [
        {"host": "node01", "kind": "rendezvous", "source": "errors",
         "reason": "connections from ranks 1, 2 on node02, node03 to its port 29500 timed out in the full run"},
        {"host": "node03", "kind": "rendezvous", "source": "pairwise",
         "reason": "connections from rank 1 on node01 to its port 29500 timed out in the pair node03+node01"}]},
}


# --- pure parts ------------------------------------------------------------------------------------------------------

def test_busbw_formula_is_nccl_tests():
    assert common.bus_factor(2) == 1.0
    assert common.bus_factor(8) == 1.75
    assert common.bus_factor(3) == pytest.approx(4 / 3)
    row = common.bandwidth_table([{"bytes": 8 << 20, "time_s": 0.5, "iters": 3}], 3)[0]
    assert row["algbw_GBps"] == pytest.approx(8388608 / 0.5 / 1e9)  # GB/s with 1e9, as nccl-tests
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 2 / 3)


def test_sweep_sizes_double_and_stay_float32_aligned():
    assert common.sweep_sizes(1 << 20, 64 << 20) == [(1 << 20) << i for i in range(7)]
    assert common.sweep_sizes(1001, 4000) == [1000, 2000, 4000]
    assert common.sweep_sizes(8 << 20, 1 << 20) == [8 << 20]  # min > max: one size, never none


def test_healthy_table_passes_with_per_size_metrics():
    out = allreduce.evaluate(HEALTHY, THRESHOLDS)
    assert set(out) == {"*"}
    res = out["*"]
    assert res.status == Status.PASS, res.message
    assert "busbw 0.0233 GB/s" in res.message and "8 MiB" in res.message and "gloo over eth0" in res.message
    table = res.metrics["sizes"]
    assert [r["bytes"] for r in table] == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert set(table[0]) >= {"bytes", "time_s", "algbw_GBps", "busbw_GBps"}
    assert res.metrics["busbw_GBps"] == pytest.approx(8388608 / 0.48054336 / 1e9 * 4 / 3)
    assert res.metrics["backend"] == "gloo" and res.metrics["world_size"] == 3
    assert res.metrics["interfaces"] == {"node01": "eth0", "node02": "eth0", "node03": "eth0"}


def _floor(gbps: float) -> dict:
    """The thresholds with [allreduce] min_busbw set, as --min-busbw sets it (the floor is read through limits())."""
    thresholds = copy.deepcopy(THRESHOLDS)
    thresholds["allreduce"]["min_busbw"] = gbps
    return thresholds


def test_low_busbw_below_min_busbw_fails_and_names_the_suspect():
    facts = dict(HEALTHY, localization={"suspects": [
        {"host": "node02", "kind": "slow", "source": "pairwise",
         "reason": "its best pairwise all-reduce reaches 0.006 GB/s busbw, the median host's 0.024 GB/s"}]})
    out = allreduce.evaluate(facts, _floor(0.05))
    assert out["*"].status == Status.FAIL
    assert "< --min-busbw 0.05 GB/s" in out["*"].message and "node02" in out["*"].message
    assert out["node02"].status == Status.FAIL and "0.006 GB/s" in out["node02"].message
    assert "node02" in out["node02"].fix
    # Above the bar: PASS, and no per-host cells.
    out = allreduce.evaluate(HEALTHY, _floor(0.02))
    assert set(out) == {"*"} and out["*"].status == Status.PASS


def test_worker_failure_says_what_happened_and_localizes():
    out = allreduce.evaluate(FAILED, THRESHOLDS)
    star = out["*"]
    assert star.status == Status.FAIL
    assert "ranks 1, 2 on node02, node03 could not connect to MASTER_ADDR 198.18.0.1:29500 within 10s" in star.message
    assert "suspects: node01" in star.message and "node03" in star.message
    assert "29500" in star.fix
    assert out["node03"].status == Status.FAIL and "pair node03+node01" in out["node03"].message
    assert "inbound TCP" in out["node03"].fix and "node03" in out["node03"].fix
    assert "node02" not in out  # the bystander is not blamed


def test_world_size_one_skips_without_touching_the_hosts():
    class OneHost:
        hosts = all_hosts = [type("H", (), {"name": "node01", "slots": 1, "gpus": [0], "index": 0})()]
        master = hosts[0]
        facts: dict = {}
        options = CheckOptions(master_port=29500)
        thresholds = THRESHOLDS

        def address(self, name):
            return "198.18.0.1"

        def call_all(self, *a, **k):
            raise AssertionError("a 1-rank run must not start anything")

        start = call = call_all

    facts = allreduce.coordinate(OneHost())
    out = allreduce.evaluate(facts, THRESHOLDS)
    assert out["*"].status == Status.SKIP
    assert "no-op" in out["*"].message and "world size 1" in out["*"].message


def test_torch_missing_fails_when_the_job_needs_torch_else_skips():
    facts = dict(HEALTHY, status="no_torch", hosts_without_torch=["node02"],
                 reason="ModuleNotFoundError: No module named 'torch'")
    out = allreduce.evaluate(facts, THRESHOLDS)["*"]
    assert out.status == Status.FAIL and "node02" in out.message and "No module named 'torch'" in out.message
    relaxed = dict(THRESHOLDS, python={"require_torch": False})
    assert allreduce.evaluate(facts, relaxed)["*"].status == Status.SKIP


def _h100(busbw: float, nbytes: int = 1 << 30, hosts=("gpu01",), world: int = 8):
    n = world
    t = nbytes / (busbw / common.bus_factor(n) * 1e9)
    return dict(HEALTHY, backend="nccl", hosts=list(hosts), world_size=n,
                gpu_names={h: ["NVIDIA H100 80GB HBM3"] * (n // len(hosts)) for h in hosts},
                sizes=[{"bytes": nbytes, "time_s": t, "iters": 5}])


def test_single_node_gpu_baseline_applies_only_to_one_8_gpu_node_at_large_sizes():
    assert allreduce.evaluate(_h100(470), THRESHOLDS)["*"].status == Status.PASS
    warn = allreduce.evaluate(_h100(400), THRESHOLDS)["*"]
    assert warn.status == Status.WARN and "460 GB/s" in warn.message
    fail = allreduce.evaluate(_h100(200), THRESHOLDS)["*"]
    assert fail.status == Status.FAIL and "H100 80GB HBM3" in fail.message
    # Two nodes: a single-node NVLink number means nothing for the network.
    two = allreduce.evaluate(_h100(200, hosts=("gpu01", "gpu02"), world=16), THRESHOLDS)["*"]
    assert two.status == Status.PASS and "do not apply" in two.metrics["baseline_note"]
    # 64 MiB has not reached the plateau the baseline was measured at.
    small = allreduce.evaluate(_h100(200, nbytes=64 << 20), THRESHOLDS)["*"]
    assert small.status == Status.PASS and "not compared" in small.metrics["baseline_note"]


def test_classify_recorded_torch_and_gloo_errors():
    c = common.classify
    assert c("DistNetworkError: The client socket has timed out after 8000ms while trying to connect to "
             "(198.18.3.1, 29500).", "init") == "rendezvous"
    assert c("RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
             "tcp/pair.h:311] Connect timeout [none]", "init") == "mesh"
    assert c("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
             "waiting 8000ms for recv operation to complete", "sweep") == "collective_timeout"
    assert c("DistNetworkError: The server socket has failed to listen on any local network address. port: 29500, "
             "useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use", "init") == "port_in_use"
    assert c("ModuleNotFoundError: No module named 'torch'", "import") == "torch_missing"
    assert c("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB", "sweep") == "oom"


def test_errors_from_ranks_name_the_unreachable_master():
    owner = {"198.18.0.1": "node01", "198.18.0.2": "node02", "198.18.0.3": "node03"}
    ranks = [
        {"tag": "main", "rank": 0, "host": "node01", "ok": False, "phase": "init",
         "error": "DistNetworkError: The client socket has timed out after 10000ms while trying to connect to "
                  "(198.18.0.1, 29500)."},
        {"tag": "main", "rank": 1, "host": "node02", "ok": False, "phase": "rendezvous", "kind": "rendezvous",
         "target": "198.18.0.1", "error": "could not connect to MASTER_ADDR 198.18.0.1:29500 within 10s "
                                          "(connection timed out: packets dropped, ...)"},
        {"tag": "main", "rank": 2, "host": "node03", "ok": False, "phase": "init", "kind": "stopped",
         "phase_s": 3.0, "error": "stopped by preflight after another rank failed"},
    ]
    errors = orchestrate._rank_errors(ranks, owner, 10.0)
    assert [e["rank"] for e in errors] == [1, 0, 2]  # a peer's precise error first, the bystander last
    suspects = orchestrate._failure_suspects(errors, 29500)
    assert [s["host"] for s in suspects] == ["node01"]
    assert "rank 1 on node02" in suspects[0]["reason"]
    msg = orchestrate._failure_message(errors, HEALTHY, {})
    assert msg.startswith("rank 1 on node02 could not connect to MASTER_ADDR 198.18.0.1:29500")
    # A rank stopped while still connecting after the whole init timeout was stuck, not a bystander.
    stuck = dict(ranks[2], phase_s=12.0)
    assert orchestrate._rank_errors([stuck], owner, 10.0)[0]["kind"] == "mesh"


def test_pairwise_bandwidth_names_the_host_whose_best_pair_is_slow():
    pairs = [{"hosts": ["node01", "node02"], "ok": True, "busbw_GBps": 0.006},
             {"hosts": ["node02", "node03"], "ok": True, "busbw_GBps": 0.0061},
             {"hosts": ["node03", "node01"], "ok": True, "busbw_GBps": 0.024}]
    suspects = orchestrate._pair_suspects(pairs, "bandwidth", 0.75)
    assert [s["host"] for s in suspects] == ["node02"]
    failing = [{"hosts": ["node01", "node02"], "ok": False}, {"hosts": ["node02", "node03"], "ok": False},
               {"hosts": ["node03", "node01"], "ok": True, "busbw_GBps": 0.02}]
    assert [s["host"] for s in orchestrate._pair_suspects(failing, "failure", 0.75)] == ["node02"]


def test_pairwise_names_a_host_10_percent_slow_by_statistics_not_by_noise():
    def ring(best):
        hosts = list(best)
        return [{"hosts": [a, b], "ok": True, "busbw_GBps": min(best[a], best[b])}
                for a, b in zip(hosts, hosts[1:] + hosts[:1])]
    cfg = THRESHOLDS["allreduce"]
    even = {"n1": 0.100, "n2": 0.101, "n3": 0.0995, "n4": 0.1005, "n5": 0.100, "n6": 0.0998}
    # node n4's best pair is its better neighbour's rate; make n4 itself 10% slow on both of its pairs
    slow = dict(even, n4=0.090)
    pairs = ring(slow)
    for p in pairs:
        if "n4" in p["hosts"]:
            p["busbw_GBps"] = 0.090
    named = orchestrate._pair_suspects(pairs, "bandwidth", 0.75, cfg)
    assert [s["host"] for s in named] == ["n4"] and "90% of the median" in named[0]["reason"]
    assert orchestrate._pair_suspects(pairs, "bandwidth", 0.75) == []  # the fixed fraction alone misses it
    assert orchestrate._pair_suspects(ring(even), "bandwidth", 0.75, cfg) == []
    noisy = {"n1": 0.100, "n2": 0.080, "n3": 0.120, "n4": 0.090, "n5": 0.110, "n6": 0.095}
    assert orchestrate._pair_suspects(ring(noisy), "bandwidth", 0.75, cfg) == []


def test_iperf3_straggler_map():
    iperf = {"chosen": {"network": 1}, "networks": [
        {"network": 0, "links": [{"src": "a", "dst": "b", "gbps": 0.1}]},
        {"network": 1, "links": [{"src": "a", "dst": "b", "gbps": 9.4}, {"src": "b", "dst": "c", "gbps": 2.0},
                                 {"src": "c", "dst": "d", "gbps": 2.1}, {"src": "d", "dst": "a", "gbps": 9.3}]}]}
    suspects = orchestrate._iperf3_stragglers(iperf, ["a", "b", "c", "d"], 0.75)
    assert [s["host"] for s in suspects] == ["c"]


# --- straggler rounds: ring pairs after the sweep, judged by stragglers.find ------------------------------------------

# Recorded: `preflight run --checks allreduce` on 4 namespace hosts, every link shaped to 1000 Mbit; in the second run
# node02 shaped to 900 Mbit (the metrics.stragglers of the report, see the file's _source).
ROUNDS = json.loads((REPO / "tests" / "fixtures" / "allreduce" / "straggler-rounds.json").read_text())
CFG = THRESHOLDS["allreduce"]


def _slowed(rounds: dict, host: str, fraction: float) -> dict:
    """The recorded rounds with every pair of `host` taking 1/fraction as long: a planted straggler."""
    out = copy.deepcopy(rounds)
    for p in out["pairs"]:
        if host in p["hosts"]:
            p["iter_s"] = [t / fraction for t in p["iter_s"]]
    return out


def test_recorded_clean_rounds_name_nobody():
    assert stragglers.find(ROUNDS["clean"], CFG) == {}
    rates = stragglers.host_rates(ROUNDS["clean"])
    assert set(rates) == {"node01", "node02", "node03", "node04"} and all(r["pairs"] == 2 for r in rates.values())
    # 16 MiB per iteration at 1000 Mbit, TCP/IP overhead included: ~0.119 GB/s on every host's best pair
    assert all(r["busbw_GBps"] == pytest.approx(0.119, rel=0.02) for r in rates.values())


def test_recorded_host_at_90_percent_is_named_with_ratio_and_confidence():
    # 3 peers of a fleet that may be 3% apart (the prior bench/calibration.py calibrates to): 10% slower is evidence
    # at the 5% level of the run, not at the default 1% (adjusted p 0.019)
    assert stragglers.find(ROUNDS["node02-at-0.9"], CFG) == {}
    cfg = dict(CFG, max_p=0.05)
    named = stragglers.find(ROUNDS["node02-at-0.9"], cfg)
    assert list(named) == ["node02"]
    s = named["node02"]
    assert s["status"] == "warn" and s["by"] == "statistics"
    assert s["ratio"] == pytest.approx(0.9, abs=0.01) and 0.01 < s["p_adj"] < 0.05 and s["family"] == 4
    text = stragglers.describe("node02", s, ROUNDS["node02-at-0.9"], cfg)
    assert "90% of the median of 3 peers" in text and "16 MiB x 8 iterations" in text
    assert re.search(r"confidence: t -\d+\.\d, \d+ df; adjusted p = [0-9.e-]+ over 4 hosts \(moderated t prediction "
                     r"test, Holm-adjusted\)", text), text


def test_a_host_left_unnamed_on_weak_evidence_is_said_on_the_cluster_line():
    # The recorded 90% host is not named at the default max_p 0.01 (adjusted p 0.019): the PASS line says so, with its
    # ratio and confidence, as iperf3's does, instead of nothing.
    rounds = ROUNDS["node02-at-0.9"]
    unsure: dict = {}
    assert stragglers.find(rounds, CFG, unsure) == {} and list(unsure) == ["node02"]
    assert unsure["node02"]["ratio"] == pytest.approx(0.9, abs=0.01) and unsure["node02"]["p_adj"] >= 0.01
    out = allreduce.evaluate(dict(HEALTHY, hosts=["node01", "node02", "node03", "node04"], stragglers=rounds),
                             THRESHOLDS)
    assert out["*"].status == Status.PASS and "node02" not in out
    assert re.search(r"; not named, the evidence is weak \(adjusted p >= 0\.01\): node02 at 90% of the median of 3 "
                     r"peers \(t -\d+\.\d, adjusted p = 0\.0\d+\)$", out["*"].message), out["*"].message
    assert list(out["*"].metrics["stragglers"]["unsure"]) == ["node02"]
    # A host 8% slower among noisy pairs (every iteration 85-100% of the rate) is no evidence even alone: not said.
    import random
    rng = random.Random(3)
    noisy = copy.deepcopy(ROUNDS["clean"])
    for p in noisy["pairs"]:
        p["iter_s"] = [t / rng.uniform(0.85, 1.0) for t in p["iter_s"]]
    noisy = _slowed(noisy, "node03", 0.92)
    unsure = {}
    assert stragglers.find(noisy, CFG, unsure) == {} and unsure == {}, unsure
    # (more than min_deficit below its peers' median, but not even its own p is below max_p)
    rates = {h: r["busbw_GBps"] for h, r in stragglers.host_rates(noisy).items()}
    assert rates.pop("node03") < (1 - CFG["min_deficit"]) * statistics.median(rates.values()), rates
    out = allreduce.evaluate(dict(HEALTHY, hosts=["node01", "node02", "node03", "node04"], stragglers=noisy),
                             THRESHOLDS)
    assert "evidence is weak" not in out["*"].message and out["*"].metrics["stragglers"]["unsure"] == {}
    # A clean ring, and a host 3% slower (below min_deficit), leave nothing to say.
    for quiet in (ROUNDS["clean"], _slowed(ROUNDS["clean"], "node03", 0.97)):
        unsure = {}
        stragglers.find(quiet, CFG, unsure)
        out = allreduce.evaluate(dict(HEALTHY, hosts=["node01", "node02", "node03", "node04"], stragglers=quiet),
                                 THRESHOLDS)
        assert unsure == {} and "evidence is weak" not in out["*"].message


def test_planted_stragglers_by_statistics_fraction_and_hard_floor():
    clean = ROUNDS["clean"]
    assert list(stragglers.find(_slowed(clean, "node03", 0.85), CFG)) == ["node03"]
    assert stragglers.find(_slowed(clean, "node03", 0.97), CFG) == {}  # 3% slower: below min_deficit
    warn = stragglers.find(_slowed(clean, "node01", 0.7), CFG)["node01"]
    assert (warn["status"], warn["by"]) == ("warn", "statistics")
    fail = stragglers.find(_slowed(clean, "node04", 0.4), CFG)["node04"]
    assert (fail["status"], fail["by"]) == ("fail", "fail_fraction")
    # No finding without the run's significance: at max_p 1e-12 even 70% is not named, and with max_p = 1 the effect
    # floor alone decides.
    assert stragglers.find(_slowed(clean, "node01", 0.7), dict(CFG, max_p=1e-12)) == {}
    assert list(stragglers.find(_slowed(clean, "node01", 0.94), dict(CFG, max_p=1.0))) == ["node01"]


def test_noisy_iterations_widen_sigma_so_noise_alone_names_nobody():
    import random
    rng = random.Random(3)
    noisy = copy.deepcopy(ROUNDS["clean"])
    for p in noisy["pairs"]:  # every iteration re-drawn from 85-100% of the rate, as bench/straggler.py's noise row
        p["iter_s"] = [t / rng.uniform(0.85, 1.0) for t in p["iter_s"]]
    assert stragglers.find(noisy, CFG) == {}
    # ... and a pair's own noise shows: sigma is at least its spread, not only noise_floor
    assert max(r["noise"] for r in stragglers.host_rates(noisy).values()) > float(CFG["noise_floor"])


def test_too_few_hosts_or_failed_pairs_name_nobody():
    two = {"bytes": 1 << 24, "pairs": [{"hosts": ["a", "b"], "ok": True, "iter_s": [0.1, 0.1, 0.1]}]}
    assert stragglers.find(two, CFG) == {} and stragglers.find(None, CFG) == {}
    failed = copy.deepcopy(ROUNDS["node02-at-0.9"])
    for p in failed["pairs"]:
        p["ok"] = False
    assert stragglers.find(failed, CFG) == {}


def _failing(rounds, host=None):
    out = copy.deepcopy(rounds)
    for p in out["pairs"]:
        if host is None or host in p["hosts"]:
            p.update(ok=False, error="Gloo connectFullMesh failed: timed out")
            p.pop("iter_s", None)
    return out


def test_every_failed_pair_of_one_host_names_that_host():
    rounds = _failing(ROUNDS["clean"], "node03")
    named = stragglers.find(rounds, CFG)
    assert list(named) == ["node03"] and (named["node03"]["status"], named["node03"]["by"]) == ("fail", "failed_pairs")
    out = allreduce.evaluate(dict(HEALTHY, hosts=["node01", "node02", "node03", "node04"], stragglers=rounds),
                             THRESHOLDS)
    assert out["node03"].status == Status.FAIL and "every pair with this host failed" in out["node03"].message
    assert "connectFullMesh" in out["node03"].message
    assert out["*"].status == Status.FAIL and "node03: all 2 of its pairs failed" in out["*"].message


def test_straggler_pairs_that_all_failed_are_a_warning_not_a_pass():
    rounds = _failing(ROUNDS["clean"])
    out = allreduce.evaluate(dict(HEALTHY, hosts=["node01", "node02", "node03", "node04"], stragglers=rounds),
                             THRESHOLDS)
    n = len(rounds["pairs"])
    assert out["*"].status == Status.WARN and f"straggler rounds: {n} of {n} pairs failed" in out["*"].message
    assert set(out) == {"*"}  # no pair succeeded: nothing points at one host


def test_evaluate_names_the_straggler_on_its_own_row_and_the_cluster_row():
    # the recorded 90% host, at the run's 5% level (at the default 1% its 3 peers are too few: see above)
    loose = copy.deepcopy(THRESHOLDS)
    loose["allreduce"]["max_p"] = 0.05
    out = allreduce.evaluate(dict(HEALTHY, hosts=["node01", "node02", "node03", "node04"],
                                  stragglers=ROUNDS["node02-at-0.9"]), loose)
    assert set(out) == {"*", "node02"}
    assert out["node02"].status == Status.WARN
    assert out["node02"].message.startswith("all-reduce: straggler: its best ring pair (with node01)")
    assert "90%" in out["node02"].message and "node02" in out["node02"].fix
    # "of the median of the other hosts" (was "of the others"): one name per number (issue 26)
    assert out["*"].status == Status.WARN and "straggler: node02 at 90% of the median of 3 peers (t -" \
        in out["*"].message and "adjusted p = " in out["*"].message
    assert out["*"].metrics["stragglers"]["named"]["node02"]["by"] == "statistics"
    clean = allreduce.evaluate(dict(HEALTHY, stragglers=ROUNDS["clean"]), THRESHOLDS)
    assert set(clean) == {"*"} and clean["*"].status == Status.PASS
    assert clean["*"].metrics["stragglers"]["named"] == {}
    failing = allreduce.evaluate(dict(HEALTHY, stragglers=_slowed(ROUNDS["clean"], "node03", 0.4)), THRESHOLDS)
    assert failing["node03"].status == Status.FAIL and failing["*"].status == Status.FAIL


def test_straggler_plan_pairs_each_hosts_first_rank_around_the_ring():
    hosts = [type("H", (), {"name": n, "slots": k})() for n, k in (("a", 2), ("b", 1), ("c", 1), ("d", 1))]
    plan = orchestrate._straggler_plan(hosts, CFG)
    assert plan["bytes"] == 16 << 20 and plan["iters"] == 16
    # first global ranks 0, 2, 3, 4; ring a-b, b-c, c-d, d-a in 2 rounds of disjoint pairs
    assert plan["rounds"] == [[[0, 2], [3, 4]], [[2, 3], [4, 0]]]
    assert orchestrate._straggler_plan(hosts[:2], CFG) is None
    assert orchestrate._straggler_plan(hosts, dict(CFG, straggler_rounds=False)) is None
    ranks = [{"rank": 0, "host": "a", "stragglers": [{"round": 0, "ranks": [0, 2], "iter_s": [0.1, 0.3]},
                                                     {"round": 1, "ranks": [4, 0], "iter_s": [0.1, 0.1]}],
              "stragglers_s": 1.5},
             {"rank": 2, "host": "b", "stragglers": [{"round": 0, "ranks": [0, 2], "iter_s": [0.2, 0.1]}]},
             {"rank": 3, "host": "c", "stragglers_error": "RuntimeError: timed out"},
             {"rank": 4, "host": "d", "stragglers": [{"round": 1, "ranks": [4, 0], "iter_s": [0.1, 0.1]}]}]
    facts = orchestrate._straggler_facts(plan, ranks, hosts)
    pairs = {tuple(p["hosts"]): p for p in facts["pairs"]}
    assert pairs[("a", "b")]["iter_s"] == [0.2, 0.3]  # each iteration: the slower rank's view
    assert not pairs[("c", "d")]["ok"] and "timed out" in pairs[("c", "d")]["error"]
    assert pairs[("d", "a")]["ok"] and facts["rounds"] == 2 and facts["duration_s"] == 1.5
    # Hosts' output is data: a rank claiming another host's name, or sending junk, changes no pair's hosts.
    ranks[3] = {"rank": 4, "host": "evil", "stragglers": [{"round": 1, "ranks": [4, 0], "iter_s": ["x", None, True]}]}
    pairs = {tuple(p["hosts"]): p for p in orchestrate._straggler_facts(plan, ranks, hosts)["pairs"]}
    assert set(pairs) == {("a", "b"), ("c", "d"), ("b", "c"), ("d", "a")}
    assert pairs[("d", "a")]["iter_s"] == [0.1, 0.1]  # node a's own view stands


# --- fail fast: hosts that ports/iperf3 already proved unreachable are left out ---------------------------------------

def _ports_firewalled(prefix: str = "198.18.0.") -> dict:
    """ports facts recorded on 3 namespace hosts with node03 dropping inbound TCP 1024-65535 (tests/checks/ports/test_ports.py),
    on the addresses FakeCluster gives its hosts."""
    from tests.checks.ports.test_ports import RECORDED
    return json.loads(json.dumps(RECORDED["firewalled"]).replace("198.18.1.", prefix))


def _iperf3_firewalled(hosts=("node01", "node02", "node03", "node04"), bad="node04", prefix="198.18.0.") -> dict:
    """iperf3 facts of a ring + 2 rounds where every test to `bad` fails with iperf3's own connect error."""
    pairs = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1:]] + [(b, a) for i, a in enumerate(hosts)
                                                                            for b in hosts[i + 1:]]
    links = [{"src": a, "dst": b, "gbps": None if b == bad else 0.19, "retransmits": 0,
              "error": "unable to connect to server: Connection timed out" if b == bad else None} for a, b in pairs]
    net = {"network": prefix + "0/24", "devices": dict.fromkeys(hosts, "eth0"),
           "addresses": {h: prefix + str(i + 1) for i, h in enumerate(hosts)}, "links": links, "median_gbps": 0.19}
    return {"hosts": list(hosts), "networks": [net], "chosen": None, "errors": {}}


def test_ports_evidence_names_the_firewalled_host_on_the_allreduce_addresses():
    from preflight.hostside import mesh  # the ports check's probes, read as the all-reduce reads them
    facts = _ports_firewalled("198.18.1.")
    addrs = {"node01": "198.18.1.1", "node02": "198.18.1.2", "node03": "198.18.1.3"}
    found = mesh.blocked_hosts(facts, addrs)
    assert list(found) == ["node03"]
    assert "inbound TCP to node03 (198.18.1.3)" in found["node03"] and "from node01, node02" in found["node03"]
    assert "timed out" in found["node03"]
    # Other addresses (the all-reduce runs on another network): the SSH network's probes prove nothing there.
    assert mesh.blocked_hosts(facts, {h: f"10.9.0.{i}" for i, h in enumerate(addrs, 1)}) == {}
    from tests.checks.ports.test_ports import RECORDED
    assert mesh.blocked_hosts(RECORDED["healthy"], addrs) == {}


def test_iperf3_evidence_needs_every_inbound_test_to_fail():
    from preflight.hostside import mesh  # iperf3's links, read as the all-reduce reads them
    facts = _iperf3_firewalled()
    addrs = facts["networks"][0]["addresses"]
    found = mesh.unreachable_hosts(facts, addrs)
    assert list(found) == ["node04"] and "every test to node04" in found["node04"]
    # One lost test among good ones, a missing iperf3 (blame) or a broken agent is no network evidence.
    links = facts["networks"][0]["links"]
    for ln in links:
        if ln["dst"] == "node04" and ln["src"] != "node01":
            ln.update(gbps=0.19, error=None)
    assert mesh.unreachable_hosts(facts, addrs) == {}
    for ln in links:
        if ln["dst"] == "node04":
            ln.update(gbps=None, error="no iperf3 server on node04 (iperf3: command not found)", blame="node04")
    assert mesh.unreachable_hosts(facts, addrs) == {}


class _Service:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value

    def stop(self, timeout=15.0):
        return self.value

    def wait_ready(self, timeout):
        return {}

    def kill(self):
        pass


def _fake_group(host, params, timeout):
    """supervisor.run's answer: every rank of this host ok, 1 size at 0.19 Gbit/s-ish."""
    return _Service({"host": host, "ranks": [dict(spec, host=host, ok=True, sizes=[
        {"bytes": 1 << 20, "time_s": 0.06, "iters": 3}]) for spec in params["jobs"]]})


def _probe(host, params, timeout):
    return {"torch": "2.13.0+cpu", "cuda": False, "device_count": 0, "gpu_names": [], "nccl": None,
            "interface": {"ifname": "eth0", "address": None, "source": "route to MASTER_ADDR"}}


def test_coordinate_leaves_out_what_ports_and_iperf3_proved_and_runs_among_the_rest():
    from preflight.testing import FakeCluster
    cluster = FakeCluster(["node01", "node02", "node03"], thresholds=THRESHOLDS,
                          handlers={"allreduce.supervisor.probe": _probe, "allreduce.supervisor.run": _fake_group})
    cluster.facts["*"] = {"ports": _ports_firewalled(),
                          "iperf3": _iperf3_firewalled(("node01", "node02", "node03"), "node03")}
    facts = allreduce.coordinate(cluster)
    assert [e["host"] for e in facts["excluded"]] == ["node03"]
    assert facts["excluded"][0]["sources"] == ["ports", "iperf3"]
    assert facts["hosts"] == ["node01", "node02"] and facts["world_size"] == 2 and facts["status"] == "ok"
    started = {h for h, func, _ in cluster.calls if func == "allreduce.supervisor.run"}
    probed = {h for h, func, _ in cluster.calls if func == "allreduce.supervisor.probe"}
    assert started == probed == {"node01", "node02"}  # nothing is started on the firewalled host
    out = allreduce.evaluate(facts, THRESHOLDS)
    assert out["node03"].status == Status.FAIL
    assert out["node03"].message.startswith("all-reduce: left out, already found unreachable: ports: inbound TCP to "
                                            "node03 (198.18.0.3)")
    # The firewall the ports check read on node03: the rule goes in its own table's chain (issue 30).
    assert out["node03"].fix.splitlines()[1:] == [
        "  nft insert rule inet pf_firewall input ip saddr { 198.18.0.1, 198.18.0.2 } tcp dport 1024-65535 accept"]
    star = out["*"]
    assert star.status == Status.FAIL and star.message.startswith("left out node03: ports: inbound TCP")
    assert "among the other 2 hosts: busbw" in star.message
    assert "node01" not in out and "node02" not in out
    # Switched off: the old behaviour, every host runs.
    off = dict(THRESHOLDS, allreduce=dict(THRESHOLDS["allreduce"], exclude_unreachable=False))
    cluster2 = FakeCluster(["node01", "node02", "node03"], thresholds=off, facts={"*": cluster.facts["*"]},
                           handlers={"allreduce.supervisor.probe": _probe, "allreduce.supervisor.run": _fake_group})
    assert allreduce.coordinate(cluster2)["hosts"] == ["node01", "node02", "node03"]


def test_a_firewalled_master_is_left_out_and_another_host_leads():
    from preflight.testing import FakeCluster
    cluster = FakeCluster(["node04", "node01", "node02", "node03"], thresholds=THRESHOLDS,
                          handlers={"allreduce.supervisor.probe": _probe, "allreduce.supervisor.run": _fake_group})
    cluster.facts["*"] = {"iperf3": _iperf3_firewalled(("node04", "node01", "node02", "node03"), "node04")}
    facts = allreduce.coordinate(cluster)
    assert facts["master"] == "node01" and facts["master_addr"] == "198.18.0.2"
    assert [e["host"] for e in facts["excluded"]] == ["node04"]


def test_two_hosts_one_unreachable_fails_without_running_anything():
    from preflight.testing import FakeCluster

    def never(*a, **k):
        raise AssertionError("nothing may run: one rank left")
    cluster = FakeCluster(["node01", "node02", "node03"], unreachable=["node01"], thresholds=THRESHOLDS,
                          handlers={"allreduce.supervisor.probe": never, "allreduce.supervisor.run": never})
    cluster.facts["*"] = {"ports": _ports_firewalled()}
    facts = allreduce.coordinate(cluster)
    out = allreduce.evaluate(facts, THRESHOLDS)
    assert facts["status"] == "skipped" and out["node03"].status == Status.FAIL
    assert out["*"].status == Status.FAIL and "no all-reduce among the other 1 host" in out["*"].message


# --- host side, on this machine (no SSH, no root) ---------------------------------------------------------------------

def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def local_agent():
    """supervisor.run and rank.run as the agent runs them: children get the checks package as in-memory code."""
    pytest.importorskip("torch")
    from preflight.hostside import proc as procs
    from preflight.remote import agent_code
    procs.AGENT_CODE = agent_code()
    try:
        yield procs
    finally:
        procs.kill_all()
        procs.AGENT_CODE = None


def _group_params(world: int, ranks: int, init_timeout: float = 20.0, start_timeout: float = 60.0) -> dict:
    port = _free_port()
    return {"host": "localhost", "ifname": "lo", "grace_s": 2.0, "rank_timeout_s": 90.0,
            "rank_params": {"backend": "gloo", "sizes": [1 << 20, 2 << 20], "iters": 2, "size_budget_s": 10.0,
                            "sweep_budget_s": 30.0, "init_timeout_s": init_timeout, "start_timeout_s": start_timeout},
            "jobs": [{"tag": "main", "rank": r, "local_rank": r, "local_world_size": ranks, "world_size": world,
                      "master_addr": "127.0.0.1", "master_port": port, "device": r} for r in range(ranks)]}


def test_supervisor_runs_one_process_per_slot(local_agent):
    import torch  # noqa: F401 - as the agent's preload does: the forked ranks must find it imported
    out = supervisor.run(_group_params(2, 2), None)
    ranks = sorted(out["ranks"], key=lambda r: r["rank"])
    assert all(r["ok"] for r in ranks), ranks
    assert all(r["torch_preloaded"] for r in ranks), ranks  # forked, not a new interpreter
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert [row["bytes"] for row in ranks[0]["sizes"]] == [1 << 20, 2 << 20]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]  # every rank reports the agreed (slowest) time
    assert not local_agent.LIVE


def test_supervisor_bounds_a_rank_that_never_comes_and_kills_the_rest(local_agent):
    start = time.monotonic()
    # Rank 2 never starts: the others wait for it until their start deadline (start + init), not forever.
    out = supervisor.run(_group_params(3, 2, init_timeout=3.0, start_timeout=5.0), None)
    assert time.monotonic() - start < 40
    ranks = out["ranks"]
    assert ranks and not any(r["ok"] for r in ranks)
    assert all(r.get("error") for r in ranks), ranks
    assert {common.classify(r["error"], r["phase"]) for r in ranks} == {"incomplete"}, ranks
    for r in ranks:
        assert r["exit_code"] is not None  # reaped: no rank process is left
    assert not local_agent.LIVE


# --- the namespace cluster -------------------------------------------------------------------------------------------

# Small sizes and short timeouts: two shared cores, other engineers' tests, and gloo reducing on the CPU.
TEST_CONFIG = """
[allreduce]
min_bytes = 1048576
max_bytes = 8388608
iters = 3
size_budget_s = 10.0
sweep_budget_s = 40.0
start_timeout_s = 60.0
init_timeout_s = 10.0
pair_init_timeout_s = 8.0
grace_s = 3.0
straggler_bytes = 4194304
"""
RATE_MBIT = 200.0  # = 0.025 GB/s
CLI_LIMIT_S = 240  # the test fails (never hangs) if a run takes longer


def _cli_argv() -> list:
    return [sys.executable, "-m", "preflight"]


def run_cli(cluster, tmp_path: Path, hostfile: Path = None, extra=(), config_text: str = TEST_CONFIG,
            checks: str = "allreduce") -> tuple:
    config = tmp_path / "allreduce.toml"
    config.write_text(config_text)
    out = tmp_path / "out.json"
    argv = _cli_argv() + ["run", "--hostfile", str(hostfile or cluster.hostfile()), "--python", sys.executable,
                          "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
                          "--known-hosts", str(cluster.known_hosts), "--checks", checks,
                          "--config", str(config), "--json", str(out), *extra]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=CLI_LIMIT_S)
    elapsed = time.monotonic() - start
    assert out.exists(), f"no JSON report (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    cells = {r["host"]: r for r in report["results"] if r["check"] == "allreduce"}
    return proc, cells, elapsed


def survivors(cluster) -> dict:
    """Processes of preflight (agents, ranks) still alive in each host's network namespace."""
    found = {}
    for h in cluster.hosts:
        netns = cluster.exec(h, ["readlink", "/proc/self/ns/net"]).stdout.strip()
        inode = netns[netns.find("[") + 1:-1]
        ps = cluster.exec(h, ["ps", "-eo", "pid,stat,netns,args"]).stdout.splitlines()[1:]
        mine = []
        for line in ps:
            pid, stat, ns, args = (line.split(None, 3) + [""])[:4]
            if ns == inode and not stat.startswith("Z") and "python" in args and "readlink" not in args:
                mine.append(line.strip()[:200])
        if mine:
            found[h.name] = mine
    return found


def _wait_no_survivors(cluster, seconds: float = 5.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        left = survivors(cluster)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def run_cli_shaped(cluster, tmp_path: Path, rates: dict, **kwargs) -> tuple:
    """run_cli with every host's link shaped to rates.get(name, RATE_MBIT) Mbit/s, unshaped afterwards."""
    for h in cluster.hosts:
        cluster.shape(h, rates.get(h.name, RATE_MBIT))
    try:
        return run_cli(cluster, tmp_path, **kwargs)
    finally:
        for h in cluster.hosts:
            cluster.unshape(h)


def test_equal_links_busbw_matches_the_shaped_rate(cluster3, tmp_path):
    proc, cells, elapsed = run_cli_shaped(cluster3, tmp_path, {})
    star = cells["*"]
    assert star["status"] == "pass", f"{star['message']}\n{proc.stdout}\n{proc.stderr}"
    assert set(cells) == {"*"}, "nothing may be flagged on equal links"
    m = star["metrics"]
    assert m["backend"] == "gloo" and m["world_size"] == 3
    assert m["interfaces"] == {h.name: "eth0" for h in cluster3.hosts}
    largest = m["sizes"][-1]
    assert largest["bytes"] == 8 << 20
    rate_gbytes = RATE_MBIT / 1000 / 8  # Gbit/s -> GB/s
    # Ring all-reduce: each rank sends and receives 2(n-1)/n of the buffer (NCCL's bus factor), so busbw ~ the
    # link rate. The factor is checked exactly; against the shaped link only the physical bounds, since the two
    # shared cores can hold gloo below the rate when other work runs (CI, loaded: 84%), never above it.
    n = m["world_size"]
    assert largest["busbw_GBps"] == pytest.approx(largest["algbw_GBps"] * 2 * (n - 1) / n, rel=1e-9)
    assert 0.6 * rate_gbytes < largest["busbw_GBps"] < 1.15 * rate_gbytes, m["sizes"]
    assert elapsed < 120
    assert not _wait_no_survivors(cluster3)


def test_after_the_python_check_the_allreduce_probes_no_torch_of_its_own(cluster3, tmp_path):
    # Shaped links, as in the two-slot test: unshaped, the straggler rounds named a host at 74% (z -1.2) in CI.
    proc, cells, _ = run_cli_shaped(cluster3, tmp_path, {}, checks="python,allreduce")
    star = cells["*"]
    assert star["status"] == "pass", f"{star['message']}\n{proc.stderr}"
    assert star["metrics"]["interfaces"] == {h.name: "eth0" for h in cluster3.hosts}
    # The python check's worker recorded what a rank sees; the hosts were only asked for their interface.
    assert "allreduce: choosing interfaces on 3 hosts" in proc.stderr and "probing torch" not in proc.stderr
    # Each agent imported torch before the host checks; the ranks, forked from it, imported nothing.
    assert [r["torch_preloaded"] for r in star["metrics"]["ranks"]] == [True] * 3, star["metrics"]["ranks"]
    assert not _wait_no_survivors(cluster3)


def test_two_slots_on_a_host_get_local_ranks_and_their_own_processes(cluster3, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node01 slots=2\nnode02 slots=1\nnode03 slots=1\n")
    # Shaped links: unshaped, the bandwidth is whatever the two shared cores give, and the straggler rounds
    # named a host at 73% now and then (seen in 1 of 5 runs before and after the ranks were forked).
    proc, cells, _ = run_cli_shaped(cluster3, tmp_path, {}, hostfile=hostfile)
    star = cells["*"]
    assert star["status"] == "pass", f"{star['message']}\n{proc.stderr}"
    ranks = star["metrics"]["ranks"]
    layout = [(r["rank"], r["host"], r["local_rank"]) for r in ranks]
    assert layout == [(0, "node01", 0), (1, "node01", 1), (2, "node02", 0), (3, "node03", 0)]
    assert len({r["pid"] for r in ranks if r["host"] == "node01"}) == 2
    assert star["metrics"]["world_size"] == 4 and "4 ranks on 3 hosts" in star["message"]
    assert not _wait_no_survivors(cluster3)


def test_firewalled_hosts_fail_bounded_named_and_leave_no_worker(cluster3, tmp_path):
    # node03 alone would pass with gloo (it only ever connects out); blocking the master stops the rendezvous.
    cluster3.firewall("node03", drop_tcp_dports="1024-65535")
    cluster3.firewall("node01", drop_tcp_dports="1024-65535")
    try:
        proc, cells, elapsed = run_cli(cluster3, tmp_path)
        left = _wait_no_survivors(cluster3)
    finally:
        cluster3.unfirewall("node03")
        cluster3.unfirewall("node01")
    star = cells["*"]
    assert star["status"] in ("fail", "error"), star["message"]
    assert proc.returncode == 1
    assert "could not connect to MASTER_ADDR" in star["message"] and ":29500 within 10s" in star["message"]
    assert cells.get("node03", {}).get("status") == "fail", cells.keys()
    assert cells.get("node01", {}).get("status") == "fail"
    assert "node02" not in cells
    assert elapsed < 120, f"took {elapsed:.0f}s"
    assert not left, f"workers survived: {left}"


def test_host_that_ports_found_firewalled_is_left_out_and_the_rest_still_runs(cluster3, tmp_path):
    cluster3.firewall("node02", drop_tcp_dports="1024-65535")
    try:
        proc, cells, _ = run_cli(cluster3, tmp_path, checks="ports,allreduce")
        left = _wait_no_survivors(cluster3)
    finally:
        cluster3.unfirewall("node02")
    star, bad = cells["*"], cells.get("node02", {})
    assert bad.get("status") == "fail", cells
    assert bad["message"].startswith("all-reduce: left out, already found unreachable: ports: inbound TCP to node02")
    assert star["status"] == "fail" and star["message"].startswith("left out node02: ports:"), star["message"]
    # the two others really ran: a measured table, and no rank on node02
    assert "among the other 2 hosts: busbw" in star["message"], star["message"]
    assert star["metrics"]["sizes"] and star["metrics"]["world_size"] == 2
    assert {r["host"] for r in star["metrics"]["ranks"]} == {"node01", "node03"}
    assert "node01" not in cells and "node03" not in cells
    assert proc.returncode == 1 and not left, left


def test_a_slow_host_is_named_when_busbw_is_below_min_busbw(cluster3, tmp_path):
    # 0.02 GB/s: what equal links give (see above); node02 at a quarter of the rate drags the ring down.
    # Up to 2 MiB only: at a quarter of the rate every size takes 4x longer, and so do the pairwise runs.
    proc, cells, elapsed = run_cli_shaped(cluster3, tmp_path, {"node02": RATE_MBIT / 4},
                                          extra=["--min-busbw", "0.02"],
                                          config_text=TEST_CONFIG.replace("max_bytes = 8388608",
                                                                          "max_bytes = 2097152"))
    star = cells["*"]
    assert star["status"] == "fail", star["message"]
    assert "--min-busbw 0.02" in star["message"]
    assert cells.get("node02", {}).get("status") == "fail", f"{star['message']}\n{json.dumps(star['metrics'])[:3000]}"
    assert "node01" not in cells and "node03" not in cells
    assert elapsed < 150
    assert not _wait_no_survivors(cluster3)


def test_a_host_shaped_to_80_percent_is_named_by_the_straggler_rounds(cluster3, tmp_path):
    # No --min-busbw: busbw itself is not judged, only the rounds can name node03 (80%: above the 75% floor,
    # so it takes the statistics).
    proc, cells, elapsed = run_cli_shaped(cluster3, tmp_path, {"node03": 0.8 * RATE_MBIT})
    star = cells["*"]
    rounds = star["metrics"].get("stragglers") or {}
    detail = f"{star['message']}\n{json.dumps(rounds.get('hosts'))}\n{proc.stderr[-2000:]}"
    assert cells.get("node03", {}).get("status") == "warn", detail
    assert "straggler: its best ring pair" in cells["node03"]["message"], detail
    assert "node01" not in cells and "node02" not in cells, detail
    assert star["status"] == "warn" and "straggler: node03" in star["message"], detail
    # 3 hosts: 3 rounds of one pair; every pair timed straggler_iters (16) times, all of node03's pairs slow
    assert rounds["rounds"] == 3 and all(p["ok"] and len(p["iter_s"]) == 16 for p in rounds["pairs"]), detail
    assert rounds["named"]["node03"]["ratio"] == pytest.approx(0.8, abs=0.05), detail
    assert elapsed < 120
    assert not _wait_no_survivors(cluster3)


def _python_without_torch():
    """Another interpreter on this machine (>= 3.9, the agent's minimum) that cannot import torch, or None."""
    import shutil
    names = [shutil.which(n) for n in ("python3.9", "python3.10", "python3.12", "python3.13")]
    def version(p: Path) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in p.parent.parent.name.split("."))
    # pyenv and the like keep versions side by side; the oldest first: 3.9 is the agent's minimum.
    siblings = [str(p) for p in sorted(Path(sys.base_prefix).parent.glob("3.*/bin/python3"), key=version)]
    for path in [p for p in names + siblings if p]:
        probe = subprocess.run([path, "-c", "import sys; assert sys.version_info >= (3, 9)\n"
                                "try:\n import torch\nexcept ImportError:\n print('no torch')"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0 and "no torch" in probe.stdout:
            return path
    return None


@pytest.mark.parametrize("checks", ["allreduce", "python,allreduce"])  # probed, or seen by the python check
def test_hosts_without_torch_fail_with_the_reason_and_nothing_runs(cluster3, tmp_path, checks):
    python = _python_without_torch()
    if python is None:
        pytest.skip("no interpreter without torch on this machine")
    config = tmp_path / "allreduce.toml"
    config.write_text(TEST_CONFIG)
    out = tmp_path / "out.json"
    argv = _cli_argv() + ["run", "--hostfile", str(cluster3.hostfile()), "--python", python,
                          "--ssh-config", str(cluster3.ssh_config), "--ssh-key", str(cluster3.user_key),
                          "--known-hosts", str(cluster3.known_hosts), "--checks", checks,
                          "--config", str(config), "--json", str(out)]
    subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=CLI_LIMIT_S)
    star = next(r for r in json.loads(out.read_text())["results"] if r["check"] == "allreduce")
    assert star["status"] == "fail", star["message"]
    assert "torch is not importable on node01, node02, node03" in star["message"]
    assert "--python" in star["fix"]
    assert not _wait_no_survivors(cluster3)


def test_runs_over_the_network_iperf3_chose(netcluster_factory, tmp_path):
    import shutil
    if not shutil.which("iperf3"):
        pytest.skip("iperf3 is not installed")
    cluster = netcluster_factory(n=3, networks=2)
    for h in cluster.hosts:  # network 0 (the SSH network) slow, network 1 fast: the all-reduce must use network 1
        cluster.shape(h, RATE_MBIT / 4, network=0)
        cluster.shape(h, RATE_MBIT, network=1)
    config = TEST_CONFIG + "\n[iperf3]\nduration_s = 1.0\nextra_rounds = 0\n"
    proc, cells, elapsed = run_cli(cluster, tmp_path, config_text=config, checks="iperf3,allreduce")
    star = cells["*"]
    assert star["status"] == "pass", f"{star['message']}\n{proc.stdout[-3000:]}"
    m = star["metrics"]
    assert m["interfaces"] == {h.name: "eth1" for h in cluster.hosts}
    assert m["master_addr"] == cluster.hosts[0].addresses[1]
    assert m["sizes"][-1]["busbw_GBps"] == pytest.approx(RATE_MBIT / 1000 / 8, rel=0.15)


def test_a_large_deficit_that_noise_explains_is_not_named():
    """issue 26: the fractions need significance too. Pairs so noisy that a 60% host is within the spread name nobody;
    with the statistics off (max_p = 1) the fraction alone decides, as before."""
    import random
    rng = random.Random(5)  # a draw where the fraction alone also names a healthy host (node04, p = 0.19)
    noisy = copy.deepcopy(_slowed(ROUNDS["clean"], "node03", 0.6))
    for p in noisy["pairs"]:
        p["iter_s"] = [t / rng.uniform(0.3, 1.0) for t in p["iter_s"]]
    off = stragglers.find(noisy, dict(CFG, max_p=1.0))
    # the effect floor alone (max_p = 1) names a healthy host on weak evidence
    assert off["node04"]["by"] == "statistics" and off["node04"]["p_adj"] >= 0.05
    # node03 at 51% of its peers, with iterations that vary 3-fold: adjusted p = 0.11 over 4 hosts, short of the run's
    # 1% level (and of 10%; named at 20%)
    assert stragglers.find(noisy, CFG) == {} and stragglers.find(noisy, dict(CFG, max_p=0.1)) == {}
    named = stragglers.find(noisy, dict(CFG, max_p=0.2))
    assert list(named) == ["node03"] and 0.1 < named["node03"]["p_adj"] < 0.2
