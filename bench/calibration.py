"""Benchmark: the error rates of the straggler verdicts (compute, iperf3, all-reduce rounds) on simulated fleets.

Each run draws a fleet (numpy, vectorised), builds the facts the check's ``coordinate`` would have gathered, and calls
the check's REAL ``evaluate`` (compute, iperf3) or ``stragglers.find`` (the all-reduce's straggler rounds, what its
evaluate names hosts by) with the default thresholds. Per cell (hosts n, host-to-host spread, within-run noise):

- ``false_alarm``: the share of healthy runs in which any host got a WARN or FAIL from the peer comparison or a floor;
- ``power_90``, ``power_80``, ``power_50``: the share of runs in which the one slow host (at 90%, 80%, 50% of its
  healthy rate; for ``compute-gpu`` one GPU of the first host) was named.

The fleet: each host's true rate is lognormal around 1 (sigma = spread); a measurement is the median of repeated
samples each lognormal around the truth (sigma = noise), as the checks measure: compute, 5 timed slices per metric
(their spread is the device's ``_noise`` fact); iperf3, the link rate min(a, b) of its two hosts over the ring and
2 random rounds, 7 interval samples per link, on physical 10 Gbit/s NICs (base 9.4 Gbit/s, the link-rate floor
applies); all-reduce, each ring pair min(a, b) over 8 timed iterations. A host's metrics all scale with it.

    python3 bench/calibration.py                                  # the full grid -> bench/results/calibration.json
    python3 bench/calibration.py --hosts 4 16 --runs 200 --out /tmp/cal.json
    python3 bench/calibration.py --table bench/results/calibration.json   # the README's table
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from preflight.checks import compute, iperf3  # noqa: E402
from preflight.checks.allreduce import stragglers  # noqa: E402
from preflight.config import load_defaults  # noqa: E402
from preflight.hostside import mesh  # noqa: E402
from preflight.hostside.outcome import Status  # noqa: E402
from preflight.hostside.schedule import pair_rounds  # noqa: E402

TH = load_defaults()
NAMED = (Status.WARN, Status.FAIL)
HOSTS = (2, 3, 4, 8, 16, 64, 256, 1024)
SPREADS = (0.0, 0.02, 0.03, 0.05)
NOISES = (0.005, 0.03)
SLOW = (None, 0.9, 0.8, 0.5)
CHECKS = ("compute-cpu", "compute-gpu", "iperf3", "allreduce")


def _measure(rng: np.random.Generator, truth: np.ndarray, noise: float, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """(median of k lognormal samples around each truth, their relative robust spread 1.4826 x MAD / median)."""
    samples = truth[..., None] * np.exp(rng.normal(0.0, noise, truth.shape + (k,)))
    med = np.median(samples, axis=-1)
    mad = np.median(np.abs(samples - med[..., None]), axis=-1)
    return med, 1.4826 * mad / med


def _hosts(rng: np.random.Generator, shape: Tuple[int, ...], spread: float, slow: Optional[float]) -> np.ndarray:
    """True rates, lognormal around 1, for (runs, ..., n) units; the slow one is unit 0 of every run."""
    truth = np.exp(rng.normal(0.0, spread, shape))
    if slow is not None:
        truth[..., 0] *= slow
    return truth


# Each runner draws every run's fleet at once (numpy) and then feeds each run's facts to the check's real code, one
# run at a time; it returns the hosts named in each run.

def compute_cpu(rng: np.random.Generator, n: int, spread: float, noise: float, slow: Optional[float],
                runs: int) -> List[List[str]]:
    truth = _hosts(rng, (runs, 2, n), spread, slow)  # each metric its own healthy spread; the slow host both
    gemm, gnoise = (x.tolist() for x in _measure(rng, 40.0 * truth[:, 0], noise, 5))
    mem, mnoise = (x.tolist() for x in _measure(rng, 10.0 * truth[:, 1], noise, 5))
    names = [f"h{i:04d}" for i in range(n)]
    out = []
    for r in range(runs):
        by_host = {h: {"torch": "2.13.0+cpu", "cpu": {"model": "EPYC", "threads": 2, "torch_threads": 2,
                                                       "gemm_gflops": gemm[r][i], "gemm_gflops_noise": gnoise[r][i],
                                                       "mem_gbps": mem[r][i], "mem_gbps_noise": mnoise[r][i]}}
                   for i, h in enumerate(names)}
        found = compute.evaluate({"hosts": names, "unreachable": [], "errors": {}, "by_host": by_host}, TH)
        out.append([h for h, o in found.items() if o.status in NAMED])
    return out


GPUS = 8
GPU_KEYS = (("gemm_tflops", 700.0), ("hbm_gbps", 2900.0), ("h2d_gbps", 53.0), ("d2h_gbps", 53.0))


def compute_gpu(rng: np.random.Generator, n: int, spread: float, noise: float, slow: Optional[float],
                runs: int) -> List[List[str]]:
    """n hosts of 8 H100s; the slow unit is GPU 0 of the first host (all four of its metrics)."""
    values = {}
    for key, base in GPU_KEYS:
        truth = _hosts(rng, (runs, n * GPUS), spread, slow)
        values[key] = tuple(x.tolist() for x in _measure(rng, base * truth, noise, 5))
    names = [f"g{i:04d}" for i in range(n)]
    out = []
    for r in range(runs):
        by_host = {}
        for i, h in enumerate(names):
            gpus = []
            for g in range(GPUS):
                j = i * GPUS + g
                d: Dict[str, Any] = {"index": g, "uuid": f"GPU-{i}-{g}", "name": "NVIDIA H100 80GB HBM3"}
                for key, _ in GPU_KEYS:
                    d[key], d[key + "_noise"] = values[key][0][r][j], values[key][1][r][j]
                gpus.append(d)
            by_host[h] = {"torch": "2.11.0+cu130", "cpu": {"model": "Xeon", "threads": 224}, "gpus": gpus}
        found = compute.evaluate({"hosts": names, "unreachable": [], "errors": {}, "by_host": by_host}, TH)
        out.append([h for h, o in found.items() if o.status in NAMED])
    return out


_ROUNDS: Dict[int, List[Tuple[int, int]]] = {}


def _pairs(n: int) -> List[Tuple[int, int]]:
    if n not in _ROUNDS:
        _ROUNDS[n] = [p for rnd in pair_rounds(n, int(TH["iperf3"]["extra_rounds"]), 7) for p in rnd]
    return _ROUNDS[n]


def iperf3_fleets(rng: np.random.Generator, n: int, spread: float, noise: float, slow: Optional[float],
                  runs: int) -> Iterator[Tuple[List[Dict[str, Any]], List[str], Dict[str, Any]]]:
    """(links, host names, network) of each run: 10 Gbit/s NICs, each link min(a, b) of its hosts, 7 intervals."""
    truth = 9.4 * _hosts(rng, (runs, n), spread, slow)
    pairs = _pairs(n)
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    link = np.minimum(truth[:, a], truth[:, b])
    samples = link[..., None] * np.exp(rng.normal(0.0, noise, link.shape + (7,)))
    gbps = np.median(samples, axis=-1).tolist()
    samples_l = samples.tolist()
    names = [f"n{i:04d}" for i in range(n)]
    src = [names[x] for x in a.tolist()]
    dst = [names[y] for y in b.tolist()]
    for r in range(runs):
        links = [{"src": x, "dst": y, "gbps": g, "samples_gbps": v, "retransmits": 0, "error": None}
                 for x, y, g, v in zip(src, dst, gbps[r], samples_l[r])]
        net = {"network": "10.0.0.0/16", "devices": dict.fromkeys(names, "eno1"),
               "addresses": {h: f"10.0.{i // 250}.{i % 250 + 1}" for i, h in enumerate(names)}, "links": links,
               "median_gbps": statistics.median(gbps[r]), "link_mbps": dict.fromkeys(names, 10000),
               "link_types": dict.fromkeys(names, "ethernet")}
        yield links, names, net


def iperf3_evaluate(links: List[Dict[str, Any]], names: List[str], net: Dict[str, Any]) -> List[str]:
    facts = {"hosts": names, "networks": [net], "chosen": iperf3.choose([net], names), "errors": {}, "rounds": 3}
    return [h for h, o in iperf3.evaluate(facts, TH).items() if o.status in NAMED]


def run_iperf3(rng: np.random.Generator, n: int, spread: float, noise: float, slow: Optional[float],
               runs: int) -> List[List[str]]:
    judge = iperf3_core if n > CORE_ABOVE else iperf3_evaluate
    return [judge(*fleet) for fleet in iperf3_fleets(rng, n, spread, noise, slow, runs)]


# Above this many hosts iperf3 is judged by what its evaluate names hosts with (mesh.find_stragglers with the
# [iperf3] thresholds, and the link-rate floor of iperf3.link_floor on each host's median link), not by evaluate
# itself: evaluate's per-host rows scan every link (1.4 s per run at 1,024 hosts), which 4,000 runs per cell cannot
# afford. tests/verdict/test_calibration.py checks that the two name the same hosts.
CORE_ABOVE = 16


def iperf3_core(links: List[Dict[str, Any]], names: List[str], net: Dict[str, Any]) -> List[str]:
    t = TH["iperf3"]
    found = set(mesh.find_stragglers(links, names, float(t["straggler_warn_fraction"]), t, {}))
    floor, _ = iperf3.link_floor(net, t)
    if floor is not None:
        mine: Dict[str, List[float]] = {}
        for ln in links:
            mine.setdefault(ln["src"], []).append(ln["gbps"])
            mine.setdefault(ln["dst"], []).append(ln["gbps"])
        found |= {h for h, v in mine.items() if statistics.median(v) < floor}
    return sorted(found)


def run_allreduce(rng: np.random.Generator, n: int, spread: float, noise: float, slow: Optional[float],
                  runs: int) -> List[List[str]]:
    """The straggler rounds: every host with both ring neighbours, 16 MiB per iteration, 0.12 GB/s."""
    if n < 2:
        return [[] for _ in range(runs)]
    truth = 0.119 * _hosts(rng, (runs, n), spread, slow)
    pairs = [(i, (i + 1) % n) for i in range(n if n > 2 else 1)]
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    rate = np.minimum(truth[:, a], truth[:, b])
    iters = int(TH["allreduce"]["straggler_iters"])
    nbytes = 16 << 20
    times = (nbytes / 1e9 / (rate[..., None] * np.exp(rng.normal(0.0, noise, rate.shape + (iters,))))).tolist()
    names = [f"n{i:04d}" for i in range(n)]
    hosts = [[names[x], names[y]] for x, y in zip(a.tolist(), b.tolist())]
    out = []
    for r in range(runs):
        facts = {"bytes": nbytes, "pairs": [{"hosts": hp, "ok": True, "iter_s": ts} for hp, ts in zip(hosts, times[r])]}
        named = stragglers.find(facts, TH["allreduce"])
        out.append([h for h, s in named.items() if s.get("status") in ("warn", "fail")])
    return out


RUNNERS = {"compute-cpu": compute_cpu, "compute-gpu": compute_gpu, "iperf3": run_iperf3, "allreduce": run_allreduce}
SLOW_NAME = {"compute-cpu": "h0000", "compute-gpu": "g0000", "iperf3": "n0000", "allreduce": "n0000"}


def cell(args: Tuple[str, int, float, float, int, int]) -> Dict[str, Any]:
    check, n, spread, noise, runs, seed = args
    rng = np.random.default_rng(seed)
    fn = RUNNERS[check]
    start = time.perf_counter()
    out: Dict[str, Any] = {"check": check, "hosts": n, "spread": spread, "noise": noise, "runs": runs}
    out["power_runs"] = power_runs(n, runs)
    for slow in SLOW:
        hits = 0
        done = 0
        want = runs if slow is None else out["power_runs"]
        while done < want:  # batches of at most 250 runs: the drawn fleets of 1,024 hosts stay small
            batch = min(250, want - done)
            for named in fn(rng, n, spread, noise, slow, batch):
                hits += bool(named) if slow is None else (SLOW_NAME[check] in named)
            done += batch
        out["false_alarm" if slow is None else f"power_{int(slow * 100)}"] = hits / want
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


# Which cells run: every check at every size at 2% and 3% spread (the targets' range) with both noise levels; 0% and
# 5% spread (outside the targets: what the detectors do without spread, and beyond the range they are calibrated
# for) up to 16 hosts; compute-gpu (8 GPUs a host, 4 metrics each: 32 comparisons a host) up to 8 hosts at 2-3%.
# Every cell runs --runs runs (1,000) per setting (healthy, 90%, 80%, 50%).
EXTRA_SPREAD_UP_TO = 16
GPU_UP_TO = 8


# The slow-host settings run fewer times from 256 hosts on (each run of 1,024 hosts costs 20-100 ms of the real code,
# and the two cores are shared): the healthy runs, whose false-alarm share the 1% target is about, keep --runs.
POWER_RUNS = {256: 300, 1024: 100}


def power_runs(n: int, runs: int) -> int:
    return min([runs] + [most for size, most in POWER_RUNS.items() if n >= size])


def wanted(check: str, n: int, spread: float) -> bool:
    if check == "compute-gpu":
        return n <= GPU_UP_TO and spread in (0.02, 0.03)
    return spread in (0.02, 0.03) or n <= EXTRA_SPREAD_UP_TO


def markdown(result: Dict[str, Any]) -> str:
    """bench/README.md's table: one row per check, host count and spread; the false-alarm share and the power at 80%
    and 50% the worst of the noise levels, the power at 90% per noise level (it is where noise decides)."""
    rows: Dict[Tuple[str, int, float], Dict[str, Any]] = {}
    for c in result["cells"]:
        key = (c["check"], c["hosts"], c["spread"])
        r = rows.setdefault(key, {"runs": c["runs"], "power_runs": c.get("power_runs", c["runs"]), "false_alarm": 0.0,
                                  "power_80": 1.0, "power_50": 1.0, "p90": {}, "commits": set()})
        r["false_alarm"] = max(r["false_alarm"], c["false_alarm"])
        for k in ("power_80", "power_50"):
            r[k] = min(r[k], c[k])
        r["p90"][c["noise"]] = c["power_90"]
        r["commits"].add(str(c.get("commit") or result.get("commit"))[:7])
    lines = ["| check | hosts | spread | runs healthy / slow | healthy runs with a WARN/FAIL | named at 90%, noise "
             "0.5% / 3% | at 80% | at 50% | commit |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (check, n, spread), r in sorted(rows.items()):
        p90 = " / ".join(f"{100 * r['p90'][k]:.0f}%" for k in sorted(r["p90"]))
        lines.append(f"| {check} | {n} | {100 * spread:.0f}% | {r['runs']} / {r['power_runs']} | "
                     f"{100 * r['false_alarm']:.1f}% | {p90} | {100 * r['power_80']:.0f}% | "
                     f"{100 * r['power_50']:.0f}% | {', '.join(f'`{x}`' for x in sorted(r['commits']))} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, help="print bench/README.md's table from this results JSON and exit")
    ap.add_argument("--hosts", type=int, nargs="+", default=list(HOSTS))
    ap.add_argument("--spreads", type=float, nargs="+", default=list(SPREADS))
    ap.add_argument("--noises", type=float, nargs="+", default=list(NOISES))
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--merge", action="store_true", help="keep the cells of --out that this run does not measure")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "calibration.json")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return 0
    jobs = []
    for check in args.checks:
        for n in args.hosts:
            for spread in args.spreads:
                for noise in args.noises:
                    if wanted(check, n, spread):
                        seed = (CHECKS.index(check) * 1_000_003 + n * 7919 + int(spread * 1e4) * 31 + int(noise * 1e4))
                        jobs.append((check, n, spread, noise, args.runs, seed))
    if not jobs:
        ap.error("no cell to run")
    jobs.sort(key=lambda j: -j[1] * j[4])  # the big cells first, so that the two workers end together
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "preflight"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip())
    start = time.time()
    with Pool(args.workers) as pool:
        cells = pool.map(cell, jobs, chunksize=1)
    for c in cells:
        c["commit"], c["preflight_modified"] = commit, dirty
    seconds = round(time.time() - start, 1)
    if args.merge and args.out.exists():
        # Chunked runs (one check at a time, to keep each under ~10 minutes on shared cores): the cells already in
        # the file stay unless this run measured them again; every cell keeps the commit it measured.
        old = json.loads(args.out.read_text())
        mine = {(c["check"], c["hosts"], c["spread"], c["noise"]) for c in cells}
        for c in old["cells"]:
            c.setdefault("commit", old.get("commit"))
        cells += [c for c in old["cells"] if (c["check"], c["hosts"], c["spread"], c["noise"]) not in mine]
        seconds = round(seconds + float(old.get("seconds", 0)), 1)
    cells.sort(key=lambda c: (c["check"], c["hosts"], c["spread"], c["noise"]))
    result = {"commit": commit, "preflight_modified": dirty, "seconds": seconds,
              "thresholds": {k: {x: TH[k][x] for x in ("max_p", "min_deficit", "prior_spread", "prior_df",
                                                       "noise_floor")} for k in ("compute", "iperf3", "allreduce")},
              "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for c in cells:
        print(f"{c['check']:12s} n={c['hosts']:5d} spread={c['spread']:.3f} noise={c['noise']:.3f} runs={c['runs']:5d} "
              f"fa={c['false_alarm']:.3f} p90={c['power_90']:.2f} p80={c['power_80']:.2f} p50={c['power_50']:.2f} "
              f"({c['seconds']} s)")
    print(f"{result['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
