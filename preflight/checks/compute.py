"""Compute stragglers: GEMM throughput and memory bandwidth of every GPU (or CPU) against its peers and baselines.

On each host, ``collect`` (the only code that touches the host) times with torch, for a fixed short time:

- per GPU: dense bf16 GEMM TFLOPS, HBM bandwidth (device-to-device copy), pinned host<->device GB/s;
- on a host without GPUs: CPU float32 GEMM GFLOPS and memory bandwidth (tensor copy).

and returns, e.g.::

    {"torch": "2.13.0+cu128", "cpu": {"model": "AMD EPYC 9654", "threads": 2},
     "gpus": [{"index": 0, "uuid": "GPU-5f1c...", "name": "NVIDIA H100 80GB HBM3", "gemm_tflops": 712.4,
               "hbm_gbps": 2890.1, "h2d_gbps": 53.2, "d2h_gbps": 52.8}]}
    {"torch": "2.13.0+cpu", "cpu": {"model": "Intel(R) Xeon(R) ...", "threads": 2, "gemm_gflops": 61.2,
     "mem_gbps": 9.8}}

Judging needs the whole cluster, so this is a cluster check: ``coordinate`` runs ``collect`` on the hosts
(``parallel_hosts`` at a time) and ``evaluate`` compares every device with the other devices of the same model by the
moderated t prediction test of ``hostside/stats.py`` (its slices' spread is its measured noise), Holm-adjusted over
every host x device x metric of the run, with an effect floor (``min_deficit``), and GPUs with the published peak of
their model; fewer than 3 devices of a model get no peer verdict (said in the host's line). A large deficit that is
not significant is measured again (``confirm``), then passes with a note, e.g. ``...; not named, the evidence is
weak (adjusted p >= 0.01): CPU: CPU memory copy 4.2 GB/s is 34% of the median of 3 peers (AMD EPYC x2 threads,
12.3 GB/s; t -1.7, 6 df; adjusted p = 0.6 over 8 comparisons (moderated t prediction test, Holm-adjusted))``.
A host whose CUDA torch cannot use its GPUs (``torch.cuda.is_available()`` warns and says False) is FAILed where GPUs
are expected (``[gpu] gpus_expected``, the device nodes, a CUDA build of torch), not measured as a CPU host.
Thresholds: the ``[compute]`` section of compute.toml beside this module.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..hostside.nvidia import gpu_evidence, gpus_expected
from ..hostside.outcome import Finding, Outcome, Status, combine, error, limits, skip
from ..hostside.seams import CheckSpec, ClusterView, HostContext, PromSample
from ..hostside.proc import read_text
from ..hostside import stats
from ..hostside.robust import MAD_TO_SIGMA, MEDIAN_SE

NAME = "compute"

CLUSTER = "*"
# (fact key, unit, label) of each metric, GPU then CPU.
GPU_METRICS = (("gemm_tflops", "TFLOPS", "bf16 GEMM"), ("hbm_gbps", "GB/s", "HBM copy"),
               ("h2d_gbps", "GB/s", "pinned H2D"), ("d2h_gbps", "GB/s", "pinned D2H"))
CPU_METRICS = (("gemm_gflops", "GFLOPS", "CPU fp32 GEMM"), ("mem_gbps", "GB/s", "CPU memory copy"))


# --- host side ---------------------------------------------------------------------------------------------------

def _cpu_info() -> Dict[str, Any]:
    model = None
    for line in (read_text("/proc/cpuinfo", "") or "").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    try:
        threads = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        threads = os.cpu_count() or 1
    return {"model": model or "unknown CPU", "threads": threads}


def _rates(fn: Any, work: float, seconds: float, sync: Any, chunks: int) -> Tuple[float, float]:
    """Call fn() (``work`` units each: flops or bytes) for about ``seconds`` after one warm-up call, in ``chunks``
    equal time slices: (median rate per second over the slices, their relative robust spread). The spread is this
    device's own measurement noise; ``evaluate`` never names a deficit smaller than that noise."""
    fn()
    sync()
    slice_s = seconds / max(1, chunks)
    rates: List[float] = []
    for _ in range(max(1, chunks)):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            if calls < 8 or calls % 8 == 0:  # a sync per call would time the sync; every 8th is enough
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= slice_s:
                    break
        rates.append(work * calls / elapsed)
    med = statistics.median(rates)
    mad = statistics.median([abs(r - med) for r in rates])
    return med, (MAD_TO_SIGMA * mad / med) if med else 0.0


def _measure_cpu(torch: Any, seconds: float, chunks: int, n: int, copy_mib: int, threads: int) -> Dict[str, Any]:
    if threads > 0:
        torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    out: Dict[str, Any] = {"gemm_n": n, "torch_threads": torch.get_num_threads()}
    rate, noise = _rates(lambda: torch.mm(a, b), 2.0 * n ** 3, seconds, lambda: None, chunks)
    out.update(gemm_gflops=round(rate / 1e9, 3), gemm_gflops_noise=round(noise, 4))
    src = torch.ones(copy_mib << 18, dtype=torch.float32)  # copy_mib MiB of 4-byte elements
    dst = torch.empty_like(src)
    # A copy reads and writes every byte: count both, as STREAM's Copy does.
    rate, noise = _rates(lambda: dst.copy_(src), 2.0 * src.numel() * 4, seconds / 2, lambda: None, chunks)
    out.update(mem_gbps=round(rate / 1e9, 3), mem_gbps_noise=round(noise, 4))
    return out


def _gpu_info(torch: Any, index: int) -> Dict[str, Any]:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)  # torch >= 2.1; "GPU-" + it is what nvidia-smi -L prints
    return {"index": index, "name": props.name, "uuid": f"GPU-{uuid}" if uuid else None,
            "memory_gib": round(props.total_memory / (1 << 30), 1)}


def _record(out: Dict[str, Any], key: str, scale: float, rate_noise: Tuple[float, float]) -> None:
    out[key] = round(rate_noise[0] / scale, 2)
    out[key + "_noise"] = round(rate_noise[1], 4)


def _gpu_compute(torch: Any, index: int, seconds: float, chunks: int, n: int, hbm_mib: int) -> Dict[str, Any]:
    """bf16 GEMM and HBM copy on one GPU; the GPUs of a host run this at once (nothing is shared between them)."""
    dev = torch.device("cuda", index)
    out: Dict[str, Any] = {}

    def sync() -> None:
        torch.cuda.synchronize(dev)

    def gemm() -> Tuple[float, float]:
        a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        return _rates(lambda: torch.mm(a, b), 2.0 * n ** 3, seconds, sync, chunks)

    def hbm() -> Tuple[float, float]:
        src = torch.empty(hbm_mib << 20, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        return _rates(lambda: dst.copy_(src), 2.0 * src.numel(), seconds / 2, sync, chunks)  # read + write

    with torch.cuda.device(index):
        _record(out, "gemm_tflops", 1e12, gemm())
        _record(out, "hbm_gbps", 1e9, hbm())
        torch.cuda.empty_cache()
    return out


def _gpu_pcie(torch: Any, index: int, seconds: float, chunks: int, mib: int) -> Dict[str, Any]:
    """Pinned host<->device copies of one GPU; one GPU at a time, so that the link is measured, not the host's
    memory or root complex shared by all of them."""
    dev = torch.device("cuda", index)
    out: Dict[str, Any] = {}

    def sync() -> None:
        torch.cuda.synchronize(dev)

    with torch.cuda.device(index):
        host = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
        gpu = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
        _record(out, "h2d_gbps", 1e9, _rates(lambda: gpu.copy_(host, non_blocking=True), float(host.numel()),
                                              seconds, sync, chunks))
        _record(out, "d2h_gbps", 1e9, _rates(lambda: host.copy_(gpu, non_blocking=True), float(host.numel()),
                                              seconds, sync, chunks))
    return out


def _measure_gpus(torch: Any, count: int, params: Dict[str, Any], seconds: float, chunks: int,
                  deadline: float) -> List[Dict[str, Any]]:
    from ..hostside.proc import parallel_map
    gpus = [_gpu_info(torch, i) for i in range(count)]
    computed = parallel_map(lambda i: _gpu_compute(torch, i, seconds, chunks, int(params["gpu_gemm_n"]),
                                                   int(params["hbm_mib"])),
                            list(range(count)), count, max(1.0, deadline - time.monotonic()))
    for g, res in zip(gpus, computed):
        if isinstance(res, BaseException):  # one GPU that fails (OOM: memory in use) is that GPU's result
            g["error"] = f"{type(res).__name__}: {str(res)[:300]}"
            continue
        g.update(res)
        try:
            g.update(_gpu_pcie(torch, g["index"], seconds / 4, chunks, int(params["pcie_mib"])))
        except Exception as exc:
            g["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return gpus


def _cuda_devices(torch: Any) -> Tuple[int, Optional[str]]:
    """(CUDA devices torch can use, why CUDA failed or None). ``torch.cuda.is_available()`` never throws: a driver
    that fails to initialise is a UserWarning and False (torch/cuda/__init__.py), so the warnings it gives are
    recorded as the error; a CPU-only torch (torch.version.cuda None) saying False is no error."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = bool(torch.cuda.is_available())
            count = int(torch.cuda.device_count()) if available else 0
        except Exception as exc:
            return 0, f"{type(exc).__name__}: {str(exc)[:200]}"
    said = "; ".join(str(w.message).strip()[:200] for w in caught if str(w.message).strip())
    if count:
        return count, None
    if said and getattr(getattr(torch, "version", None), "cuda", None):
        return 0, f"torch.cuda.is_available() is False: {said[:300]}"
    return 0, None


def collect(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Measure this host (called by ``coordinate`` through the agent as ``compute.collect``)."""
    # torch's cuda:N must be nvidia-smi's GPU N (the default orders fastest first), so findings name the right GPU.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    seconds = float(params["seconds"])
    chunks = int(params["chunks"])
    out: Dict[str, Any] = {"cpu": _cpu_info(), "seconds": seconds}
    try:
        import torch
    except Exception as exc:  # no torch in --python: nothing to measure with
        out["torch"] = None
        out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return out
    out["torch"] = torch.__version__
    start = time.monotonic()
    gpus, cuda_error = _cuda_devices(torch)
    if cuda_error:  # a driver problem: the gpu and driver_cuda checks say more
        out["cuda_error"] = cuda_error
    if not gpus:
        # Whether this host should have GPUs at all: if so, a CPU measurement is no result (evaluate FAILs it).
        out["gpu_evidence"] = gpu_evidence(getattr(getattr(torch, "version", None), "cuda", None))
    if params.get("start_at"):
        # Hosts that share CPUs start together, so that whatever else runs slows all of them alike.
        time.sleep(max(0.0, min(float(params["start_at"]) - time.time(), ctx.deadline - time.monotonic() - 30)))
    if gpus:
        out["gpus"] = _measure_gpus(torch, gpus, params, seconds, chunks, ctx.deadline - 5)
    else:
        out["cpu"].update(_measure_cpu(torch, seconds, chunks, int(params["cpu_gemm_n"]),
                                       int(params["cpu_copy_mib"]), int(params["cpu_threads"])))
    out["elapsed_s"] = round(time.monotonic() - start, 3)
    return out


# --- coordinator side --------------------------------------------------------------------------------------------

def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    lim = limits(cluster.thresholds, NAME)
    hosts = [h.name for h in cluster.hosts]
    params = {key: lim[key] for key in ("seconds", "chunks", "gpu_gemm_n", "hbm_mib", "pcie_mib", "cpu_gemm_n",
                                        "cpu_copy_mib", "cpu_threads")}
    facts: Dict[str, Any] = {"hosts": hosts, "unreachable": [h.name for h in cluster.all_hosts if h.name not in hosts],
                             "by_host": {}, "errors": {}}
    # One host's torch import plus ~4 timed loops per GPU; generous, since a cold environment imports slowly.
    timeout = 120.0 + 8 * 6 * float(lim["seconds"])
    width = int(lim["parallel_hosts"]) or len(hosts) or 1

    def measure(names: List[str]) -> Dict[str, Any]:
        found: Dict[str, Any] = {}
        for i in range(0, len(names), width):
            batch = names[i:i + width]
            start = {"start_at": time.time() + float(lim["align_s"])} if float(lim["align_s"]) > 0 else {}
            got = cluster.call_all(NAME + ".collect", {h: dict(params, **start) for h in batch},
                                   timeout + float(lim["align_s"]))
            for h, value in got.items():
                if isinstance(value, BaseException):
                    facts["errors"][h] = str(value) or type(value).__name__
                else:
                    found[h] = value
        return found

    facts["by_host"] = measure(hosts)
    # Further rounds over every host (each device keeps its best): on hosts that share CPUs with other work, load
    # that comes and goes then hits the rounds of every host alike instead of deciding one host's only number.
    for _ in range(int(lim["rounds"]) - 1):
        for h, again in measure([h for h in hosts if h in facts["by_host"]]).items():
            facts["by_host"][h] = best_of(facts["by_host"][h], again)
    # While any device looks off (more than min_deficit below its model's median), every host is measured again (up
    # to `confirm` times), and each device's best result counts: a slow device is slow every time, while a moment of
    # contention (another process, a periodic job) passes. Every host, not only the low ones: the median and the
    # spread rest on the peers' measurements too, and a peer caught by contention widens the spread until a real
    # straggler's z no longer stands out (recorded in tests/checks/compute/test_compute.py). A healthy cluster costs
    # nothing.
    facts["remeasured"] = {}
    for _ in range(int(lim["confirm"])):
        if not looks_off(_devices(facts["by_host"]), lim):
            break
        for h, again in measure([h for h in hosts if h in facts["by_host"]]).items():
            facts["by_host"][h] = best_of(facts["by_host"][h], again)
            facts["remeasured"][h] = facts["remeasured"].get(h, 0) + 1
    return facts


def looks_off(devices: List[Dict[str, Any]], lim: Dict[str, Any]) -> List[str]:
    """Hosts with a device more than ``min_deficit`` below the median of its model (in a model with at least
    ``min_peers`` devices) on any metric: a superset of the hosts ``_peer_findings`` names, whatever the spread."""
    off: set[str] = set()
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(d["model"], []).append(d)
    for members in groups.values():
        for key, _, _ in GPU_METRICS if members[0]["device"] == "gpu" else CPU_METRICS:
            values = [float(d[key]) for d in members if isinstance(d.get(key), (int, float))]
            if len(values) < int(lim["min_peers"]):
                continue
            med = statistics.median(values)
            off.update(d["host"] for d in members if isinstance(d.get(key), (int, float))
                       and float(d[key]) < (1.0 - float(lim["min_deficit"])) * med)
    return sorted(off)


def best_of(first: Dict[str, Any], second: Dict[str, Any]) -> Dict[str, Any]:
    """Per device and metric, the better of two measurements (with that measurement's noise)."""
    out = dict(first)

    def pick(a: Dict[str, Any], b: Dict[str, Any], keys: Sequence[str]) -> Dict[str, Any]:
        merged = dict(a)
        for key in keys:
            if isinstance(b.get(key), (int, float)) and (not isinstance(a.get(key), (int, float)) or b[key] > a[key]):
                merged[key], merged[key + "_noise"] = b[key], b.get(key + "_noise")
        return merged

    if isinstance(first.get("cpu"), dict) and isinstance(second.get("cpu"), dict):
        out["cpu"] = pick(first["cpu"], second["cpu"], [k for k, _, _ in CPU_METRICS])
    if first.get("gpus") and second.get("gpus"):
        again = {g.get("index"): g for g in second["gpus"]}
        out["gpus"] = [pick(g, again.get(g.get("index")) or {}, [k for k, _, _ in GPU_METRICS]) for g in first["gpus"]]
    return out


# --- evaluate (pure) ---------------------------------------------------------------------------------------------

def _model_key(name: Optional[str]) -> str:
    name = name or "unknown"
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def _devices(by_host: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One entry per measured device: {"host", "device", "model", "label", metrics...}."""
    out: List[Dict[str, Any]] = []
    for host, facts in by_host.items():
        if not isinstance(facts, dict) or facts.get("torch") is None:
            continue
        gpus = facts.get("gpus")
        if gpus:
            for g in gpus:
                if "error" in g:
                    continue
                out.append(dict(g, host=host, device="gpu", model=_model_key(g.get("name")),
                                label=f"GPU {g.get('index')} ({g.get('uuid') or 'uuid unknown'})"))
        elif isinstance(facts.get("cpu"), dict) and "gemm_gflops" in facts["cpu"]:
            cpu = facts["cpu"]
            out.append(dict(cpu, host=host, device="cpu", label="CPU",
                            model=f"{cpu.get('model')} x{cpu.get('threads')} threads"))
    return out


def _fmt(value: float, unit: str) -> str:
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def _comparisons(devices: List[Dict[str, Any]], lim: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every device's every metric against the other devices of its model across the cluster (leave-one-out:
    in a small fleet a straggler inside its own company pulls the median down and widens the spread, e.g. 4 hosts
    at 40/91/95/64 put the limited 40 at z -1.6 of its own company but at 45% of the others), by the moderated t
    prediction test of ``hostside/stats.py``; every p of the run (host x device x metric) is Holm-adjusted
    together. Each comparison gets its verdict: "fail" (named and below ``fail_fraction`` of its peers), "warn"
    (named: adjusted p < ``max_p`` and at least ``min_deficit`` slower), "unsure" (below ``fail_fraction`` but not
    significant: the peers disagree too much to tell) or None."""
    out: List[Dict[str, Any]] = []
    floor, fail_below, max_p = float(lim["min_deficit"]), float(lim["fail_fraction"]), float(lim["max_p"])
    # A device's figure is the median of `chunks` timed slices; its relative standard error follows from the
    # slices' spread (the "_noise" fact): measured on every device, never assumed.
    root = math.sqrt(max(1, int(lim["chunks"])))
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(d["model"], []).append(d)
    for model, members in groups.items():
        metrics = GPU_METRICS if members[0]["device"] == "gpu" else CPU_METRICS
        for key, unit, label in metrics:
            have = [d for d in members if isinstance(d.get(key), (int, float))]
            if len(have) < max(int(lim["min_peers"]), stats.MIN_PEERS + 1):
                continue
            tested = stats.compare_all([float(d[key]) for d in have], float(lim["prior_spread"]),
                                       float(lim["prior_df"]),
                                       [stats_noise(d.get(key + "_noise"), root) for d in have],
                                       float(lim["noise_floor"]))
            for d, c in zip(have, tested):
                if c is not None:
                    out.append({"device": d, "key": key, "unit": unit, "label": label, "model": model, "c": c})
    family = stats.adjust([e["c"] for e in out])
    for e in out:
        c = e["c"]
        e.update(value=c.value, median=c.median, ratio=c.ratio, peers=c.peers, family=family)
        e["verdict"] = (("fail" if c.ratio < fail_below else "warn") if stats.named(c, max_p, floor) else
                        "unsure" if c.ratio < fail_below else None)
    return out


def stats_noise(noise: Any, root: float) -> float:
    """The relative standard error of a median of slices whose relative spread is ``noise``."""
    return MEDIAN_SE * float(noise) / root if isinstance(noise, (int, float)) and noise > 0 else 0.0


def _peer_findings(compared: List[Dict[str, Any]], lim: Dict[str, Any],
                   remeasured: Optional[Dict[str, int]] = None) -> Dict[Tuple[str, str], List[Finding]]:
    """{(host, label): findings} for the devices ``_comparisons`` named (FAIL or WARN, each significant)."""
    remeasured = remeasured or {}
    out: Dict[Tuple[str, str], List[Finding]] = {}
    for c in compared:
        if c["verdict"] not in ("fail", "warn"):
            continue
        d = c["device"]
        status = Status.FAIL if c["verdict"] == "fail" else Status.WARN
        out.setdefault((d["host"], d["label"]), []).append(Finding(
            status, f"{d['host']} {d['label']}: {_compared(c, lim, remeasured)}", _fix(d, c["key"])))
    return out


def _compared(c: Dict[str, Any], lim: Dict[str, Any], remeasured: Dict[str, int]) -> str:
    """``CPU memory copy 8.2 GB/s is 82% of the median of 7 peers (AMD EPYC x2 threads, 10 GB/s; t -8.6, 10 df;
    adjusted p = 3e-05 over 16 comparisons (moderated t prediction test, Holm-adjusted))``: the value, the other
    devices' median (leave-one-out), and the test that decided."""
    host = c["device"]["host"]
    best = f"; the best of {1 + remeasured[host]} measurements" if remeasured.get(host) else ""
    return (f"{c['label']} {_fmt(c['value'], c['unit'])} is {100 * c['ratio']:.0f}% of the median of "
            f"{c['peers']} peers ({c['model']}, {_fmt(c['median'], c['unit'])}; "
            f"{stats.confidence_text(c['c'], c['family'], float(lim['max_p']))}{best})")


def _unsure(compared: List[Dict[str, Any]], lim: Dict[str, Any],
            remeasured: Optional[Dict[str, int]] = None) -> Dict[str, List[str]]:
    """{host: [notes]} for deficits below ``fail_fraction`` that are not significant: not named (no FAIL or WARN
    on weak evidence), but said in the host's PASS line, so that a reader sees what was measured."""
    out: Dict[str, List[str]] = {}
    for c in compared:
        if c["verdict"] == "unsure":
            note = f"{c['device']['label']}: {_compared(c, lim, remeasured or {})}"
            out.setdefault(c["device"]["host"], []).append(note)
    return out


def _baseline_findings(d: Dict[str, Any], lim: Dict[str, Any]) -> List[Finding]:
    """A GPU against the published peak of its model (``[compute] gpu_peaks``), below ``baseline_warn_fraction``."""
    peaks = (lim.get("gpu_peaks") or {}).get(d["model"]) if d["device"] == "gpu" else None
    found: List[Finding] = []
    if not isinstance(peaks, dict):
        return found
    for key, unit, label in GPU_METRICS:
        peak, x = peaks.get(key), d.get(key)
        fraction = float(lim["baseline_warn_fraction"].get(key, 0.0))
        if isinstance(peak, (int, float)) and peak > 0 and isinstance(x, (int, float)) and x < fraction * peak:
            found.append(Finding(Status.WARN, f"{d['host']} {d['label']}: {label} {_fmt(float(x), unit)} is below "
                                 f"{100 * fraction:.0f}% of the {d['model']} peak {_fmt(float(peak), unit)} "
                                 f"({100 * float(x) / float(peak):.0f}%)", _fix(d, key)))
    return found


def _fix(d: Dict[str, Any], key: str) -> str:
    host = d["host"]
    if d["device"] == "cpu":
        return (f"on {host}: look for CPU limits and load (cgroup cpu.max / cpu.cfs_quota_us, cpupower "
                "frequency-info, top), or leave the host out of the hostfile")
    gpu = d.get("index")
    if key in ("h2d_gbps", "d2h_gbps"):
        return (f"on {host} GPU {gpu}: nvidia-smi -q -i {gpu} -d PCIE (link generation and width downtrained?), NUMA "
                "binding of the process; CPU/NVMe offload runs over this path")
    if key == "hbm_gbps":
        return (f"on {host} GPU {gpu}: nvidia-smi -q -i {gpu} -d ECC,ROW_REMAPPER (a degraded HBM stack), then ask for "
                "the GPU to be replaced")
    return (f"on {host} GPU {gpu}: nvidia-smi -q -i {gpu} -d CLOCK,PERFORMANCE,POWER (clocks held low, power or "
            "thermal slowdown), then reset or drain the GPU")


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    lim = limits(thresholds, NAME)
    out: Dict[str, Outcome] = {}
    for h in facts.get("unreachable") or []:
        out[h] = error("not run: the host is unreachable (see its ssh result)")
    for h, why in (facts.get("errors") or {}).items():
        out[h] = error(f"could not measure on {h}: {why}", "rerun with -v for the host-side error")
    by_host: Dict[str, Any] = facts.get("by_host") or {}
    devices = _devices(by_host)
    compared = _comparisons(devices, lim)
    peers = _peer_findings(compared, lim, facts.get("remeasured"))
    unsure = _unsure(compared, lim, facts.get("remeasured"))
    by_device_host: Dict[str, List[Dict[str, Any]]] = {}
    per_model: Dict[str, int] = {}
    for d in devices:
        by_device_host.setdefault(d["host"], []).append(d)
        per_model[d["model"]] = per_model.get(d["model"], 0) + 1
    for h, hf in by_host.items():
        if not isinstance(hf, dict):
            continue
        if hf.get("torch") is None:
            out[h] = skip(f"torch is not importable by --python on {h} ({hf.get('error')}): nothing to measure with")
            continue
        mine = by_device_host.get(h, [])
        findings: List[Finding] = []
        expected, why = gpus_expected(hf, bool(limits(thresholds, "gpu")["gpus_expected"]))
        if expected and not hf.get("gpus"):
            cause = (f"CUDA failed on {h}: {hf['cuda_error']}" if hf.get("cuda_error") else
                     f"torch sees no CUDA device on {h}")
            findings.append(Finding(Status.FAIL, f"{cause}, although {why}; its CPU was measured instead, which says "
                                                 "nothing of its GPUs",
                                    f"see the driver_cuda and gpu checks of {h}; nvidia-smi there shows whether the "
                                    "driver answers"))
        for g in hf.get("gpus") or []:
            if "error" in g:
                findings.append(Finding(Status.ERROR, f"{h} GPU {g.get('index')}: could not measure: {g['error']}",
                                        "free the GPU (nvidia-smi shows who holds it) and rerun"))
        for d in mine:
            findings += peers.get((h, d["label"]), []) + _baseline_findings(d, lim)
        if not mine and not findings:
            out[h] = error(f"no measurement came back from {h}", "rerun with -v")
            continue
        if mine and mine[0]["device"] == "gpu":
            plural = "" if len(mine) == 1 else "s"
            each = "; ".join(f"GPU {d.get('index')} {d.get('gemm_tflops')} TFLOPS, HBM {d.get('hbm_gbps')} GB/s, "
                             f"H2D/D2H {d.get('h2d_gbps')}/{d.get('d2h_gbps')} GB/s" for d in mine[:8])
            ok = f"{len(mine)} GPU{plural}: {each}"
        elif mine:
            cpu = mine[0]
            ok = (f"CPU fp32 GEMM {cpu.get('gemm_gflops')} GFLOPS, memory copy {cpu.get('mem_gbps')} GB/s "
                  f"({cpu.get('torch_threads')} threads)")
        else:
            ok = "nothing measured"
        few = _too_few(mine, per_model, lim)
        if few:
            ok += "; " + few
        if unsure.get(h):
            # Measured low, but the other hosts disagree with each other too much for that to be evidence: no
            # FAIL or WARN at p >= max_p (it was measured again first: coordinate's confirm rounds).
            ok += f"; not named, the evidence is weak (adjusted p >= {float(lim['max_p']):g}): {'; '.join(unsure[h])}"
        keys = [k for k, _, _ in (GPU_METRICS if mine and mine[0]["device"] == "gpu" else CPU_METRICS)]
        shown = ["device", "index", "uuid", "model", "torch_threads"] + keys + [k + "_noise" for k in keys]
        metrics: Dict[str, Any] = {"devices": [{k: d.get(k) for k in shown if k in d} for d in mine]}
        if unsure.get(h):
            metrics["unsure"] = unsure[h]
        out[h] = combine(findings, ok, metrics)
    out[CLUSTER] = _summary(devices, out, lim, len(by_host))
    if devices:
        # How many times the hosts were measured (rounds, then re-measurements while a device looked off): what the
        # check's time was spent on.
        again = [n for n in (facts.get("remeasured") or {}).values() if isinstance(n, int)]
        out[CLUSTER].metrics["measurements"] = int(lim["rounds"]) + max(again, default=0)
    return out


def _too_few(mine: List[Dict[str, Any]], per_model: Dict[str, int], lim: Dict[str, Any]) -> str:
    """What a host's line says when its devices have too few peers to be compared with (no peer verdict then)."""
    if not mine:
        return ""
    model = mine[0]["model"]
    count = per_model.get(model, 0)
    need = max(int(lim["min_peers"]), stats.MIN_PEERS + 1)
    if count >= need:
        return ""
    known = isinstance((lim.get("gpu_peaks") or {}).get(model), dict)
    floors = ("judged against the published peak of its model only" if known else
              "no published peak is known for it, so nothing judged it" if mine[0]["device"] == "gpu" else
              "a CPU has no absolute floor, so nothing judged it")
    return (f"not compared with peers: {count} {model} in the run, a peer verdict needs {need}; {floors}")


def _summary(devices: List[Dict[str, Any]], out: Dict[str, Outcome], lim: Dict[str, Any], measured: int) -> Outcome:
    if not devices:
        return skip("nothing was measured (no host with torch answered)")
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for d in devices:
        groups.setdefault(d["model"], []).append(d)
    parts, medians = [], {}
    for model, members in groups.items():
        kinds = GPU_METRICS if members[0]["device"] == "gpu" else CPU_METRICS
        med = {key: statistics.median([float(d[key]) for d in members if isinstance(d.get(key), (int, float))] or
                                      [0.0]) for key, _, _ in kinds}
        medians[model] = med
        # "cluster median": of every device of the model; a device's own line compares it with the median of the
        # other devices (leave-one-out), and says so.
        figures = ", ".join(f"{label} {_fmt(med[key], unit)}" for key, unit, label in kinds)
        parts.append(f"{len(members)} x {model}: cluster median {figures}")
        if len(members) < int(lim["min_peers"]):
            parts[-1] += f" (fewer than {int(lim['min_peers'])}: not compared with each other)"
    named = sorted(h for h, o in out.items() if h != CLUSTER and o.status in (Status.WARN, Status.FAIL))
    message = "; ".join(parts)
    metrics = {"medians": medians, "named": named, "hosts_measured": measured}
    if named:
        return Outcome(Status.PASS, f"slow device(s) on {', '.join(named)} (see their rows); {message}",
                       metrics=metrics)
    return Outcome(Status.PASS, message, metrics=metrics)


def prom_metrics(results: Sequence[Mapping[str, Any]]) -> List[PromSample]:
    """--prom-textfile: each GPU's bf16 GEMM TFLOPS and copy rates (bytes per second), or the CPU's figures."""
    gpu = (("gemm_tflops", "preflight_compute_tflops", 1.0, "bf16 GEMM rate of the GPU (TFLOPS)"),
           ("hbm_gbps", "preflight_compute_hbm_bytes_per_second", 1e9, "device memory copy rate of the GPU"),
           ("h2d_gbps", "preflight_compute_h2d_bytes_per_second", 1e9, "pinned host-to-device copy rate"),
           ("d2h_gbps", "preflight_compute_d2h_bytes_per_second", 1e9, "pinned device-to-host copy rate"))
    cpu = (("gemm_gflops", "preflight_compute_cpu_gflops", 1.0, "fp32 GEMM rate of the host's CPU (GFLOPS)"),
           ("mem_gbps", "preflight_compute_cpu_memory_bytes_per_second", 1e9, "memory copy rate of the host's CPU"))
    out: List[PromSample] = []
    for r in results:
        for d in (r.get("metrics") or {}).get("devices") or []:
            on_gpu = d.get("device") == "gpu"
            labels = {"host": r["host"], "gpu": str(d.get("index"))} if on_gpu else {"host": r["host"]}
            for key, name, scale, what in gpu if on_gpu else cpu:
                if isinstance(d.get(key), (int, float)):
                    out.append(PromSample(name, what, "gauge", labels, float(d[key]) * scale))
    return out


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="GEMM TFLOPS and memory bandwidth per GPU (bf16, HBM, pinned H2D/D2H) or CPU; names slow devices",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    # Compared with the host's own past runs (preflight/history/), per device.
    baseline={f"devices[*].{key}": "higher" for key, _, _ in GPU_METRICS + CPU_METRICS},
    # The agent imports torch once before the host checks when a selected check uses it (agent.py, preload).
    uses_torch=True,
    prom_metrics=prom_metrics,
    # Its GEMM and copies time the cores (all of them: cpu_threads 0) and the GPUs, and keep them busy. It runs beside
    # what loads neither (ports' few connections), never beside the imports, iperf3's streams (a core each), SSH
    # handshakes or the ranks (runner.Schedule).
    measures=("cpu", "gpu"),
    loads=("cpu", "gpu"),
)
