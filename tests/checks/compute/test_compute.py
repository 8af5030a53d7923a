"""The compute check: the verdict on recorded measurements (GPU and CPU), this machine's real measurement, and a
host slowed for real (a cgroup CPU limit) on the namespace cluster."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.checks import compute
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from preflight.testing import FakeCluster
from tests.netcluster import NetCluster

REPO = Path(__file__).resolve().parents[3]
TH = load_defaults()

# Figures of a real H100 SXM host scaled per GPU: a healthy 8 x H100 80GB HBM3 node measures about these (bf16
# 8192^3 GEMM ~700 TFLOPS, HBM copy ~2.9 TB/s, pinned Gen5 copies ~53 GB/s); noise is the slices' relative spread.
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1, "gemm_tflops": 702.0, "gemm_tflops_noise": 0.004,
        "hbm_gbps": 2895.0, "hbm_gbps_noise": 0.002, "h2d_gbps": 53.4, "h2d_gbps_noise": 0.003, "d2h_gbps": 52.9,
        "d2h_gbps_noise": 0.003}


def gpu_cluster(hosts=2, gpus=8, jitter=0.004):
    """{host: facts} of healthy H100 hosts, each GPU a little different (as real ones are)."""
    by_host = {}
    for h in range(hosts):
        name = f"gpu{h + 1:02d}"
        devs = []
        for i in range(gpus):
            wobble = 1 + jitter * (((h * gpus + i) * 7) % 5 - 2) / 2  # deterministic +-1 jitter steps
            g = {k: (round(v * wobble, 2) if isinstance(v, float) and not k.endswith("_noise") and k != "memory_gib"
                     else v) for k, v in H100.items()}
            g.update(index=i, uuid=f"GPU-{h:08x}-1111-2222-3333-{i:012x}")
            devs.append(g)
        by_host[name] = {"torch": "2.11.0+cu130", "cpu": {"model": "Intel(R) Xeon(R) Platinum 8480C", "threads": 224},
                         "gpus": devs}
    return {"hosts": list(by_host), "unreachable": [], "errors": {}, "by_host": by_host}


# Recorded on 4 namespace hosts of this 2-core machine (bench/compute_straggler.py), node03 in a cgroup limited to
# half a core; measured one host at a time (parallel_hosts = 1).
CPU_RECORDED = {
    "hosts": ["node01", "node02", "node03", "node04"], "unreachable": [], "errors": {},
    "by_host": {
        "node01": {"torch": "2.13.0+cpu", "cpu": {"model": "AMD EPYC", "threads": 2, "gemm_n": 512, "torch_threads": 2,
                                                   "gemm_gflops": 38.2, "gemm_gflops_noise": 0.021, "mem_gbps": 9.61,
                                                   "mem_gbps_noise": 0.012}},
        "node02": {"torch": "2.13.0+cpu", "cpu": {"model": "AMD EPYC", "threads": 2, "gemm_n": 512, "torch_threads": 2,
                                                   "gemm_gflops": 36.9, "gemm_gflops_noise": 0.034, "mem_gbps": 9.34,
                                                   "mem_gbps_noise": 0.019}},
        "node03": {"torch": "2.13.0+cpu", "cpu": {"model": "AMD EPYC", "threads": 2, "gemm_n": 512, "torch_threads": 2,
                                                   "gemm_gflops": 9.4, "gemm_gflops_noise": 0.41, "mem_gbps": 4.02,
                                                   "mem_gbps_noise": 0.35}},
        "node04": {"torch": "2.13.0+cpu", "cpu": {"model": "AMD EPYC", "threads": 2, "gemm_n": 512, "torch_threads": 2,
                                                   "gemm_gflops": 37.5, "gemm_gflops_noise": 0.025, "mem_gbps": 9.48,
                                                   "mem_gbps_noise": 0.015}},
    }}


def named(out):
    return sorted(h for h, o in out.items() if h != "*" and o.status in (Status.WARN, Status.FAIL))


# --- pure ---------------------------------------------------------------------------------------------------------

def test_healthy_gpus_pass_with_their_numbers():
    out = compute.evaluate(gpu_cluster(), TH)
    assert named(out) == [], {h: o.message for h, o in out.items()}
    assert out["gpu01"].status == Status.PASS and "GPU 0 " in out["gpu01"].message
    assert "16 x H100 80GB HBM3: cluster median bf16 GEMM" in out["*"].message  # "median" before issue 26


def test_a_gpu_at_low_clocks_is_named_with_index_and_uuid_and_confidence():
    facts = gpu_cluster()
    slow = facts["by_host"]["gpu02"]["gpus"][5]
    slow["gemm_tflops"] = round(slow["gemm_tflops"] * 0.90, 2)  # 10% slower: below -5 sigma and the 5% floor
    out = compute.evaluate(facts, TH)
    assert named(out) == ["gpu02"]
    bad = out["gpu02"]
    assert bad.status == Status.WARN
    assert "gpu02 GPU 5 (GPU-00000001-1111-2222-3333-000000000005): bf16 GEMM" in bad.message
    assert "90% of the median of 15 peers (H100 80GB HBM3" in bad.message and "; t -" in bad.message
    assert "18 df; adjusted p = 3e-05 over 64 comparisons (moderated t prediction test, Holm-adjusted)" in bad.message
    assert "nvidia-smi -q -i 5 -d CLOCK" in bad.fix
    assert "slow device(s) on gpu02" in out["*"].message


def test_small_deficits_and_noisy_measurements_are_not_named():
    facts = gpu_cluster()
    g = facts["by_host"]["gpu01"]["gpus"][2]
    g["hbm_gbps"] = round(g["hbm_gbps"] * 0.97, 1)  # 3%: below the practical floor, however clear statistically
    assert named(compute.evaluate(facts, TH)) == []
    facts = gpu_cluster()
    for h in facts["by_host"].values():
        for d in h["gpus"]:
            d["h2d_gbps_noise"] = 0.05  # every device's own slices vary by 5%
    # 8% low: a median of 5 slices that vary by 5% is known to about 2.8%, so t is about -2.9 (p = 0.005 before the
    # Holm adjustment over 64 comparisons): within that noise.
    facts["by_host"]["gpu01"]["gpus"][3]["h2d_gbps"] *= 0.92
    assert named(compute.evaluate(facts, TH)) == []
    facts["by_host"]["gpu01"]["gpus"][3]["h2d_gbps"] = 53.4 * 0.8  # 20% low stands out of that noise: named
    assert named(compute.evaluate(facts, TH)) == ["gpu01"]
    facts["by_host"]["gpu01"]["gpus"][3]["h2d_gbps"] = 53.4 * 0.45  # x8 link: below half FAILs whatever the noise
    out = compute.evaluate(facts, TH)
    assert named(out) == ["gpu01"] and out["gpu01"].status == Status.FAIL
    assert "pinned H2D" in out["gpu01"].message and "-d PCIE" in out["gpu01"].fix


def test_baselines_catch_a_cluster_that_is_uniformly_slow():
    facts = gpu_cluster(hosts=1, gpus=2)  # 2 GPUs: too few to compare with each other
    for d in facts["by_host"]["gpu01"]["gpus"]:
        d["gemm_tflops"] = 300.0  # both at 30% of the 989 TFLOPS dense peak (clocks held low everywhere)
    out = compute.evaluate(facts, TH)
    assert out["gpu01"].status == Status.WARN
    assert "bf16 GEMM 300 TFLOPS is below 50% of the H100 80GB HBM3 peak 989 TFLOPS (30%)" in out["gpu01"].message
    assert "fewer than 3: not compared with each other" in out["*"].message
    unknown = gpu_cluster(hosts=1, gpus=2)
    for d in unknown["by_host"]["gpu01"]["gpus"]:
        d.update(name="NVIDIA L40S", gemm_tflops=1.0)  # no published peak configured: no baseline verdict
    assert compute.evaluate(unknown, TH)["gpu01"].status == Status.PASS


def test_recorded_cpu_hosts_name_the_throttled_one():
    out = compute.evaluate(copy.deepcopy(CPU_RECORDED), TH)
    assert named(out) == ["node03"]
    assert out["node03"].status == Status.FAIL  # a quarter of the others' GEMM rate
    assert out["node03"].message.startswith("node03 CPU: CPU fp32 GEMM 9.4 GFLOPS is 25% of the median of 3 peers "
                                            "(AMD EPYC")
    assert "cpu.max" in out["node03"].fix
    for h in ("node01", "node02", "node04"):
        assert out[h].status == Status.PASS and "CPU fp32 GEMM" in out[h].message
    healthy = copy.deepcopy(CPU_RECORDED)
    healthy["by_host"]["node03"]["cpu"].update(gemm_gflops=37.8, gemm_gflops_noise=0.03, mem_gbps=9.5,
                                               mem_gbps_noise=0.02)
    assert named(compute.evaluate(healthy, TH)) == []


def test_no_torch_skips_errors_are_errors_and_a_failed_gpu_is_an_error():
    facts = copy.deepcopy(CPU_RECORDED)
    facts["by_host"]["node02"] = {"torch": None, "error": "ModuleNotFoundError: No module named 'torch'",
                                  "cpu": {"model": "x", "threads": 1}}
    facts["errors"]["node04"] = "timed out after 160s"
    del facts["by_host"]["node04"]
    facts["unreachable"] = ["node05"]
    out = compute.evaluate(facts, TH)
    assert out["node02"].status == Status.SKIP and "No module named 'torch'" in out["node02"].message
    assert out["node04"].status == Status.ERROR and out["node05"].status == Status.ERROR
    gpu = gpu_cluster(hosts=1, gpus=3)
    gpu["by_host"]["gpu01"]["gpus"][1] = {"index": 1, "error": "OutOfMemoryError: CUDA out of memory"}
    out = compute.evaluate(gpu, TH)
    assert out["gpu01"].status == Status.ERROR and "GPU 1: could not measure" in out["gpu01"].message


def test_a_gpu_host_whose_cuda_fails_is_failed_not_measured_as_a_cpu():
    facts = copy.deepcopy(CPU_RECORDED)
    err = "RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu."
    facts["by_host"]["node02"].update(cuda_error=err, gpu_evidence=["/dev/nvidia0 exists"])
    facts["by_host"]["node04"].update(cuda_error=err, gpu_evidence=[])  # a CPU host: its CPU is what it has
    out = compute.evaluate(facts, TH)
    assert out["node02"].status == Status.FAIL and "CUDA failed on node02" in out["node02"].message
    assert "/dev/nvidia0 exists" in out["node02"].message and "driver_cuda" in out["node02"].fix
    assert out["node04"].status == Status.PASS


# Rounds recorded by bench/compute_straggler.py (results/compute_straggler-before.json) on 4 namespace hosts measured
# one at a time, CPU fp32 GEMM GFLOPS; the limited host is in a cgroup at half a core. In its first round (run
# limited-0) node01 is limited, but node04 and node03 were measured while other work loaded the machine: the spread
# of the peers hid node01 (z -1.1), nobody was named, and nothing was measured again. The later rounds are node01
# and its peers as run limited-8 measured them when the machine was quiet.
LIMITED_ROUNDS = {"node01": [38.3, 42.6, 41.9], "node02": [75.5, 87.3, 86.0], "node03": [58.5, 88.1, 87.5],
                  "node04": [52.0, 86.9, 88.0]}
# Run healthy-3: node02 caught by contention in the first round; as quiet peers measured it in run healthy-4.
HEALTHY_ROUNDS = {"node01": [92.2, 90.9, 91.0], "node02": [69.7, 92.5, 92.0], "node03": [93.3, 90.1, 90.5],
                  "node04": [93.2, 92.9, 92.0]}


def replay(rounds):
    """A FakeCluster whose hosts answer compute.collect with the recorded rounds, one per call."""
    calls = {h: 0 for h in rounds}

    def collect(host, params, timeout):
        gemm = rounds[host][min(calls[host], len(rounds[host]) - 1)]
        calls[host] += 1
        return {"torch": "2.13.0+cpu", "cpu": {"model": "AMD EPYC", "threads": 2, "torch_threads": 1,
                                               "gemm_gflops": gemm, "gemm_gflops_noise": 0.02,
                                               "mem_gbps": 9.0 * gemm / 90.0, "mem_gbps_noise": 0.02}}

    cluster = FakeCluster(sorted(rounds), thresholds=TH, handlers={"compute.collect": collect})
    return cluster, calls


def test_peers_caught_by_contention_are_measured_again_so_the_limited_host_stands_out():
    cluster, calls = replay(LIMITED_ROUNDS)
    facts = compute.coordinate(cluster)
    out = compute.evaluate(facts, TH)
    assert named(out) == ["node01"], {h: o.message for h, o in out.items()}
    assert "the best of 3 measurements" in out["node01"].message
    # every host measured again, not only the low ones: node02 (75.5) was within 5% of nobody's median either
    assert calls == {"node01": 3, "node02": 3, "node03": 3, "node04": 3}


def test_a_healthy_host_caught_by_contention_once_is_not_named_and_a_quiet_cluster_is_measured_once():
    cluster, calls = replay(HEALTHY_ROUNDS)
    out = compute.evaluate(compute.coordinate(cluster), TH)
    assert named(out) == [], {h: o.message for h, o in out.items()}
    assert calls == {"node01": 2, "node02": 2, "node03": 2, "node04": 2}  # once looked off, then all within 5%
    quiet = {h: [v[1]] for h, v in HEALTHY_ROUNDS.items()}
    cluster, calls = replay(quiet)
    assert named(compute.evaluate(compute.coordinate(cluster), TH)) == []
    assert calls == {h: 1 for h in quiet}


def test_looks_off_is_any_device_more_than_min_deficit_below_its_models_median():
    devices = compute._devices({h: {"torch": "x", "cpu": {"model": "m", "threads": 1, "gemm_gflops": v[0],
                                                         "mem_gbps": 9.0}} for h, v in LIMITED_ROUNDS.items()})
    assert compute.looks_off(devices, TH["compute"]) == ["node01", "node04"]  # below 95% of the median 55.25
    assert compute.looks_off(devices[:2], TH["compute"]) == []  # fewer than min_peers: not compared


def test_the_limited_host_is_judged_against_the_other_devices_not_its_own_company():
    # Final best-of-3 GEMM GFLOPS of two runs of bench/compute_straggler.py (results/compute_straggler-equal.json,
    # limited-4 and limited-3) while other work loaded the machine to a load average of 20-57: the limited host plus
    # peers still caught by contention. Inside the median/MAD of all four, the limited host was at z -1.6 and -3.6.
    # Against the other three: 53% of 78.2 where they agree (75-88) is named; 45% of 90.6 where one of them is at
    # 63.8 is a deficit the peers' own disagreement leaves unproven at the run's 1% level (adjusted p = 0.01): not
    # named, but said in the host's line, and named at the 5% level.
    for rounds, slow, status, max_p in (
            ({"node01": [40.4], "node02": [90.6], "node03": [94.7], "node04": [63.8]}, "node01", Status.FAIL, 0.05),
            ({"node01": [88.3], "node02": [75.1], "node03": [78.2], "node04": [41.2]}, "node04", Status.WARN, 0.01)):
        facts = {"hosts": sorted(rounds), "unreachable": [], "errors": {}, "remeasured": {h: 2 for h in rounds},
                 "by_host": {h: {"torch": "2.13.0+cpu",
                                 "cpu": {"model": "AMD EPYC", "threads": 2, "torch_threads": 1, "gemm_gflops": v[0],
                                         "gemm_gflops_noise": 0.02, "mem_gbps": 9.0, "mem_gbps_noise": 0.02}}
                             for h, v in rounds.items()}}
        th = dict(TH, compute=dict(TH["compute"], max_p=max_p))
        out = compute.evaluate(facts, th)
        assert named(out) == [slow], {h: o.message for h, o in out.items()}
        assert out[slow].status == status and "of the median of 3 peers (AMD EPYC" in out[slow].message
        if max_p == 0.05:
            quiet = compute.evaluate(facts, TH)[slow]
            assert quiet.status == Status.PASS and "not named, the evidence is weak" in quiet.message, quiet.message


# --- this machine: the real measurement ---------------------------------------------------------------------------

def test_collect_measures_this_cpu_for_real():
    pytest.importorskip("torch")
    lim = TH["compute"]
    params = {k: lim[k] for k in ("seconds", "chunks", "gpu_gemm_n", "hbm_mib", "pcie_mib", "cpu_gemm_n",
                                  "cpu_copy_mib", "cpu_threads")}
    facts = compute.collect(params, HostContext(params=params, deadline=time.monotonic() + 120))
    cpu = facts["cpu"]
    if facts.get("gpus"):
        pytest.skip("a real NVIDIA driver is present: the GPU path runs instead")
    assert cpu["gemm_gflops"] > 0 and cpu["mem_gbps"] > 0 and cpu["threads"] >= 1
    assert 0 <= cpu["gemm_gflops_noise"] < 5
    out = compute.evaluate({"hosts": ["me"], "by_host": {"me": facts}, "errors": {}, "unreachable": []}, TH)
    assert out["me"].status == Status.PASS and "(fewer than 3" in out["*"].message


# --- the namespace cluster ----------------------------------------------------------------------------------------

needs_cluster = pytest.mark.skipif(NetCluster.unavailable_reason() is not None,
                                   reason=str(NetCluster.unavailable_reason()))
# Namespace hosts share this machine's 2 cores. They are measured together (the default), starting at one moment
# (align_s), so that other work on this machine slows all of them alike, with one thread each (cpu_threads): each
# host then gets about half a core, and a host limited to a fifth of a core is a clear straggler. 1 s in 0.2 s
# slices spans two periods of the CPU limit (100 ms) per slice.
CONFIG = "[compute]\nalign_s = 15.0\nseconds = 1.0\nchunks = 5\ncpu_threads = 1\n"
LIMIT_CORES = 0.2


def run_compute(cluster, tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config, out = tmp_path / "compute.toml", tmp_path / "out.json"
    config.write_text(CONFIG)
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "compute", "--config", str(config),
            "--json", str(out)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.exists(), proc.stderr[-3000:]
    return {r["host"]: r for r in json.loads(out.read_text())["results"] if r["check"] == "compute"}, proc


@needs_cluster
def test_a_host_in_a_cpu_limited_cgroup_is_named_and_nobody_when_none_is(netcluster_factory, tmp_path):
    cluster = netcluster_factory(4, names=["node01", "node02", "node03", "node04"])
    # Every host in a cgroup of its own (the healthy ones without a real limit): the kernel shares CPU between
    # cgroups as groups, so a limited host alone in one would compete as a group against each other process here.
    for h in ("node01", "node02", "node04"):
        cluster.throttle(h, cores=float(os.cpu_count() or 1))
    cluster.throttle("node03", cores=float(os.cpu_count() or 1))
    cells, proc = run_compute(cluster, tmp_path / "healthy")
    assert [h for h, c in cells.items() if c["status"] != "pass"] == [], {h: c["message"] for h, c in cells.items()}
    assert proc.returncode == 0
    cluster.throttle("node03", cores=LIMIT_CORES)
    try:
        cells, proc = run_compute(cluster, tmp_path / "throttled")
    finally:
        for h in ("node01", "node02", "node03", "node04"):
            cluster.unthrottle(h)
    bad = cells["node03"]
    assert bad["status"] in ("warn", "fail"), {h: (c["message"], c.get("metrics")) for h, c in cells.items()}
    assert bad["message"].startswith("node03 CPU: CPU fp32 GEMM"), bad["message"]
    assert "of the median of 3 peers" in bad["message"] and "adjusted p" in bad["message"]
    for h in ("node01", "node02", "node04"):
        assert cells[h]["status"] == "pass", cells[h]["message"]
    assert "slow device(s) on node03" in cells["*"]["message"]


def test_one_fast_host_of_three_does_not_fail_the_other_two():
    # CI, salloc -N3 on the Slurm test bed, all three measured at once on two shared cores: memory copy 5.62, 5.70
    # and 25.5 GB/s. The median of two peers is their mean (15.6), which put each slow host at 36% of it: both
    # FAILed on the hard floor at robust z -0.7. The two agree with each other; the odd one is the fast one.
    def facts(mem):
        return {"hosts": sorted(mem), "unreachable": [], "errors": {}, "remeasured": {},
                "by_host": {h: {"torch": "2.13.0+cpu",
                                "cpu": {"model": "AMD EPYC", "threads": 2, "torch_threads": 1, "gemm_gflops": 50.0,
                                        "gemm_gflops_noise": 0.02, "mem_gbps": v, "mem_gbps_noise": 0.02}}
                            for h, v in mem.items()}}
    out = compute.evaluate(facts({"slm1": 5.62, "slm2": 5.70, "slm3": 25.5}), TH)
    assert named(out) == [], {h: o.message for h, o in out.items()}
    # The floor still fails one host at under half of both others.
    out = compute.evaluate(facts({"slm1": 2.5, "slm2": 5.70, "slm3": 6.1}), TH)
    assert named(out) == ["slm1"] and out["slm1"].status == Status.FAIL


# --- a GPU host whose CUDA does not initialise ------------------------------------------------------------------

# torch.cuda.is_available() never throws: a driver that fails to initialise is a UserWarning and False
# (torch/cuda/__init__.py). This stand-in is the real torch with that behaviour and a CUDA build's version.
STANDIN = '''
import os, sys, warnings
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["torch"]
import torch as _real


def _is_available():
    warnings.warn("CUDA initialization: CUDA driver initialization failed, you might not have a CUDA GPU. "
                  "(Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:109.)")
    return False


_real.cuda.is_available = _is_available
_real.version.cuda = "12.8"
sys.modules["torch"] = _real
'''
COLLECT = ("import json, time; from preflight.checks import compute; from preflight.config import load_defaults; "
           "from preflight.hostside.seams import HostContext; lim = load_defaults()['compute']; "
           "params = {k: lim[k] for k in ('seconds', 'chunks', 'gpu_gemm_n', 'hbm_mib', 'pcie_mib', 'cpu_gemm_n', "
           "'cpu_copy_mib', 'cpu_threads')}; params.update(seconds=0.1, cpu_gemm_n=64, cpu_copy_mib=1); "
           "print(json.dumps(compute.collect(params, HostContext(params=params, deadline=time.monotonic() + 60))))")


def test_a_cuda_torch_whose_is_available_warns_and_says_false_is_not_passed(tmp_path):
    pytest.importorskip("torch")
    site = tmp_path / "site" / "torch"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(STANDIN)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
    # With an NVIDIA device node: /dev/nvidia0 in a private mount namespace (a tmpfs over /dev), where root can.
    node = ("mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3 && mknod -m 444 /dev/urandom c 1 9 && "
            "touch /dev/nvidia0 && exec \"$0\" -c \"$1\"")
    cmd = (["unshare", "-m", "--propagation", "private", "sh", "-c", node, sys.executable, COLLECT]
           if os.geteuid() == 0 and shutil.which("unshare") else [sys.executable, "-c", COLLECT])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["torch"].startswith("2.") and "gpus" not in facts
    assert facts["cuda_error"].startswith("torch.cuda.is_available() is False: CUDA initialization: CUDA driver")
    assert "the job's torch is a CUDA 12.8 build" in facts["gpu_evidence"]
    if cmd[0] == "unshare":
        assert "/dev/nvidia0 exists" in facts["gpu_evidence"]
    by_host = copy.deepcopy(CPU_RECORDED)
    facts["cpu"].update({k: by_host["by_host"]["node01"]["cpu"][k] for k in ("gemm_gflops", "mem_gbps", "model")})
    by_host["by_host"]["node03"] = facts
    out = compute.evaluate(by_host, TH)
    assert out["node03"].status == Status.FAIL, out["node03"].message
    assert "CUDA failed on node03: torch.cuda.is_available() is False: CUDA initialization" in out["node03"].message
    assert "its CPU was measured instead" in out["node03"].message and "driver_cuda" in out["node03"].fix


def test_gpus_expected_in_the_gpu_section_is_honoured():
    facts = copy.deepcopy(CPU_RECORDED)  # CPU torch, no sign of a GPU: measured as CPU hosts
    assert named(compute.evaluate(facts, TH)) == ["node03"]
    expected = dict(TH, gpu=dict(TH["gpu"], gpus_expected=True))
    out = compute.evaluate(facts, expected)
    for h in ("node01", "node02", "node04"):
        assert out[h].status == Status.FAIL, out[h].message
        assert out[h].message.startswith(f"torch sees no CUDA device on {h}, although gpus_expected = true in [gpu]")
