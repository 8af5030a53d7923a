"""ZeRO memory: DeepSpeed's model-state estimators, and the verdicts on GPU memory, CPU RAM and locked memory.

Pure. E.g. ZeRO-3 + optimizer offload to cpu, --model-params 13e9, 16 GPUs -> "est. 0.0 GiB/GPU"
(4*L) on the GPU and N*16/nodes*1.5 of CPU RAM per host, against the gpu facts' ``memory_free`` and the
``host.memory`` facts (``MemAvailable``, ``RLIMIT_MEMLOCK``).
Thresholds: ``[ds_config]`` in thresholds.toml in this package.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...hostside.outcome import Status, limits
from .parse import enabled, offload_device, offload_devices, zero_section, zero_stage
from .findings import GiB, Report, gib, host_versions, hosts_text, params_text

NAME = "ds_config"  # the thresholds section

# DeepSpeed's estimators use this buffer factor for CPU memory (additional_buffer_factor=1.5).
BUFFER_FACTOR = 1.5


# --- estimators (DeepSpeed's formulas; bytes) ---------------------------------------------------------

def estimate_zero2(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                   additional_buffer_factor: float = BUFFER_FACTOR) -> Tuple[int, int]:
    """deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs -> (cpu_mem, gpu_mem)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 = params_16bit; 18 = 2 grads_16bit + 4 grads_32bit + 4 params_32bit + 8 optimizer states (Adam)
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                   num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                   zero_init: bool = True, additional_buffer_factor: float = BUFFER_FACTOR) -> Tuple[int, int, int]:
    """deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs -> (cpu_mem, gpu_mem, largest_layer)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


def stage_label(stage: int, opt_dev: str, par_dev: str) -> str:
    parts = [f"ZeRO-{stage}"]
    if opt_dev in ("cpu", "nvme"):
        parts.append(f"optimizer offload to {opt_dev}")
    if par_dev in ("cpu", "nvme") and stage == 3:
        parts.append(f"param offload to {par_dev}")
    return " + ".join(parts)


def model_state_estimate(stage: int, opt_dev: str, par_dev: str, n_params: float, largest_layer: float,
                         world_size: int, mixed_precision: bool = True) -> Dict[str, Any]:
    """Per-GPU bytes of model states (params, grads, optimizer states) for a stage and offload choice.

    ZeRO-2 / ZeRO-3 use DeepSpeed's estimators above (ZeRO-3 with zero_init=True). DeepSpeed has no
    estimator for stages 0 and 1; they use its ZeRO-2 multipliers with nothing / only the 16 optimizer
    bytes (4 grads_32 + 4 params_32 + 8 Adam) partitioned: stage 0 = 20N (16N without fp16/bf16),
    stage 1 = 4N + 16N/G, stage 1 with optimizer offload = 4N (16-bit params + grads stay on the GPU).
    param offload without optimizer offload (stage 3) moves the 2N/G 16-bit partition off the GPU: L + 16N/G.
    """
    n, G = float(n_params), max(1, int(world_size))
    opt_off = opt_dev in ("cpu", "nvme")
    par_off = par_dev in ("cpu", "nvme") and stage == 3
    if stage >= 3:
        if opt_off or not par_off:
            _, gpu, _ = estimate_zero3(n, largest_layer, G, 1, cpu_offload=opt_off, cpu_offload_params=par_off)
            formula = ("DeepSpeed estimate_zero3_model_states_mem_needs: " +
                       ("4*L" if opt_off and par_off else "4*L + 2N/G" if opt_off else "4*L + 18N/G"))
        else:
            gpu = int(4 * largest_layer + 16 * n / G)
            formula = "4*L + 16N/G (ZeRO-3 multipliers with the 16-bit partition offloaded)"
    elif stage == 2:
        _, gpu = estimate_zero2(n, G, 1, cpu_offload=opt_off)
        formula = "DeepSpeed estimate_zero2_model_states_mem_needs: " + ("2N" if opt_off else "2N + 18N/G")
    elif stage == 1:
        gpu = int(4 * n) if opt_off else int(4 * n + 16 * n / G)
        formula = "4N (16-bit params + grads)" if opt_off else "4N + 16N/G (ZeRO-2 multipliers, grads unpartitioned)"
    else:
        gpu = int((20 if mixed_precision else 16) * n)
        formula = "20N (2+2 16-bit params/grads + 16 fp32/Adam bytes)" if mixed_precision else "16N (fp32 + Adam)"
    return {"gpu": int(gpu), "formula": formula, "label": stage_label(stage, opt_dev, par_dev)}


def cpu_offload_estimate(stage: int, opt_dev: str, par_dev: str, n_params: float, largest_layer: float,
                         slots: int, num_nodes: int) -> Optional[Dict[str, Any]]:
    """CPU RAM one host needs for offloaded model states (DeepSpeed's estimators); None without CPU offload.

    ZeRO-1/2: estimate_zero2(..., num_gpus_per_node=slots, num_nodes=1, cpu_offload=True)[0], i.e. DeepSpeed's
    single-node figure N*max(4*slots, 16)*1.5 for this host. ZeRO-3: estimate_zero3(..., zero_init=True)[0]
    = N*18/nodes*1.5 (params and optimizer) or N*16/nodes*1.5 (optimizer only). NVMe offload is not CPU RAM.
    """
    n = float(n_params)
    if stage in (1, 2) and opt_dev == "cpu":
        cpu, _ = estimate_zero2(n, max(1, slots), 1, cpu_offload=True)
        return {"cpu": cpu, "formula": f"N*max(4*{max(1, slots)} GPUs, 16)*1.5 (estimate_zero2_model_states_mem_needs)"}
    if stage >= 3 and opt_dev == "cpu":
        cpu, _, _ = estimate_zero3(n, largest_layer, max(1, slots), max(1, num_nodes), cpu_offload=True,
                                   cpu_offload_params=(par_dev == "cpu"), zero_init=True)
        per_param = 18 if par_dev == "cpu" else 16
        return {"cpu": cpu, "formula": f"N*{per_param}/{max(1, num_nodes)} nodes*1.5 "
                                       "(estimate_zero3_model_states_mem_needs, zero_init)"}
    if stage >= 3 and par_dev == "cpu":  # params only: the 16-bit partitions, 2N/nodes with the same buffer
        return {"cpu": int(n * 2 / max(1, num_nodes) * BUFFER_FACTOR),
                "formula": f"N*2/{max(1, num_nodes)} nodes*1.5 (16-bit param partitions)"}
    return None


# Offload choices from least to most GPU-memory saving: what a FAIL suggests next.
LADDER = [(1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "none"),
          (3, "cpu", "cpu")]


PIN_MEMORY_DEFAULT_TRUE_SINCE = (0, 19, 5)  # offload_config.py: pin_memory default False up to 0.19.4, True from 0.19.5


def pinned_reason(config: Dict[str, Any], version: Optional[Tuple[int, int, int]] = None) -> Optional[str]:
    """Why offloaded tensors are pinned on a host running DeepSpeed `version` (None: they are not).

    An explicit pin_memory wins; without one DeepSpeed >= 0.19.5 pins by default (mlock'ed pages, counted
    against RLIMIT_MEMLOCK); an unknown version is taken as not pinning by default.
    """
    zero = zero_section(config)
    reasons = []
    for sec in ("offload_param", "offload_optimizer"):
        s = zero.get(sec)
        if not isinstance(s, dict) or offload_device(s) not in ("cpu", "nvme"):
            continue
        pin = s.get("pin_memory")
        if pin is True:
            reasons.append(f"{sec}.pin_memory true")
        elif pin is None and version is not None and version >= PIN_MEMORY_DEFAULT_TRUE_SINCE:
            reasons.append(f"{sec} pins by default in DeepSpeed >= 0.19.5")
    if not reasons and zero.get("cpu_offload_use_pin_memory") is True and "cpu" in offload_devices(config):
        reasons.append("cpu_offload_use_pin_memory true")
    return ", ".join(reasons) or None


# --- verdicts -----------------------------------------------------------------------------------------

Hosts = Sequence[Dict[str, Any]]
Mem = Dict[str, Dict[str, Any]]


def check_memlock(config: Dict[str, Any], facts: Dict[str, Any], floor: float,
                  report: Report) -> Dict[str, Optional[str]]:
    """WARN where offloaded tensors are pinned and RLIMIT_MEMLOCK is under the floor; returns {host: why pinned}."""
    hosts: Hosts = facts.get("hosts") or []
    mem: Mem = facts.get("host_memory") or {}
    versions = host_versions(facts)
    pinned = {h["name"]: pinned_reason(config, versions.get(h["name"])) for h in hosts}
    small: Dict[str, str] = {}
    for h in hosts:
        m = mem.get(h["name"]) or {}
        if not pinned[h["name"]] or "memlock_soft" not in m:
            continue  # nothing pinned, or host memory unknown
        soft = m.get("memlock_soft")  # None: unlimited
        if soft is not None and soft < floor:
            limit = gib(soft) if soft >= GiB else f"{soft // 1024} KiB"
            small[h["name"]] = (f"memlock soft limit {limit} (expected unlimited or >= {gib(floor)}) while offloaded "
                                f"tensors are pinned ({pinned[h['name']]})")
    if small:
        listed = "; ".join(f"{h}: {small[h]}" for h in sorted(small)[:4])
        report.add(Status.WARN, "pinned offload on hosts with a small locked-memory limit (DeepSpeed mlock()s pinned "
                                f"offload buffers): {listed}",
                   "raise it: ulimit -l unlimited (/etc/security/limits.conf '* - memlock unlimited', docker "
                   "--ulimit memlock=-1), or set pin_memory false in the offload sections", small)
    return pinned


class Plan:
    """The model and cluster a memory estimate is for: N params, largest layer L, world size, nodes, stage."""

    def __init__(self, config: Dict[str, Any], facts: Dict[str, Any], stage: int, n: float) -> None:
        self.hosts: Hosts = facts.get("hosts") or []
        self.mem: Mem = facts.get("host_memory") or {}
        self.stage = stage
        self.opt_dev, self.par_dev = offload_devices(config)
        self.n = n
        ll = facts.get("largest_layer_params")
        self.ll_known = ll not in (None, 0)
        self.L = float(ll) if ll is not None and self.ll_known else 0.0
        self.ws = int(facts.get("world_size") or sum(h.get("slots") or 0 for h in self.hosts) or 1)
        self.nodes = max(1, len(self.hosts))
        self.mixed = enabled(config.get("fp16")) is not False or enabled(
            config.get("bf16") if "bf16" in config else config.get("bfloat16")) is not False

    def gpu(self, s: int, o: str, p: str) -> Dict[str, Any]:
        return model_state_estimate(s, o, p, self.n, self.L, self.ws, self.mixed)

    def cpu(self, s: int, o: str, p: str, slots: int) -> Optional[Dict[str, Any]]:
        return cpu_offload_estimate(s, o, p, self.n, self.L, slots, self.nodes)


def check_cpu_ram(plan: Plan, label: str, cpu_frac: float, report: Report) -> Dict[str, int]:
    """FAIL where offloaded model states exceed a host's MemAvailable; SKIP where it is unknown. {host: bytes}."""
    cpu_fail: Dict[str, str] = {}
    cpu_need: Dict[str, int] = {}
    for h in plan.hosts:
        c = plan.cpu(plan.stage, plan.opt_dev, plan.par_dev, h.get("slots") or 1)
        if c is None:
            break
        cpu_need[h["name"]] = c["cpu"]
        m = plan.mem.get(h["name"]) or {}
        avail = m.get("mem_available")
        if avail is None:
            continue
        if c["cpu"] > avail * cpu_frac:
            cpu_fail[h["name"]] = (f"offloaded model states need {gib(c['cpu'])} of CPU RAM ({c['formula']}), "
                                   f"{gib(avail)} available (MemTotal {gib(m.get('mem_total'))})")
    if cpu_fail:
        listed = "; ".join(f"{h}: {cpu_fail[h]}" for h in sorted(cpu_fail)[:3])
        report.add(Status.FAIL, f"{label}: not enough CPU RAM on {hosts_text(sorted(cpu_fail))}: {listed}",
                   "free RAM on those hosts, offload to NVMe instead (device \"nvme\"), or use more nodes", cpu_fail)
    missing = [h["name"] for h in plan.hosts
               if cpu_need and (plan.mem.get(h["name"]) or {}).get("mem_available") is None]
    if missing:
        why = (plan.mem.get(missing[0]) or {}).get("error") or "not collected"
        report.add(Status.SKIP, f"CPU RAM for offload not compared on {hosts_text(missing)} (host memory unknown: "
                                f"{why})")
    return cpu_need


def check_pinned_need(plan: Plan, cpu_need: Dict[str, int], pinned: Dict[str, Optional[str]], floor: float,
                      report: Report) -> None:
    """WARN where the pinned offload buffers exceed a memlock limit that passed the floor."""
    low: Dict[str, str] = {}
    for name, need in cpu_need.items():
        soft = (plan.mem.get(name) or {}).get("memlock_soft")
        if pinned.get(name) and soft is not None and need > soft >= floor:
            low[name] = f"memlock soft limit {gib(soft)} is below the {gib(need)} of pinned offload buffers"
    if low:
        listed = "; ".join(low[h] for h in sorted(low)[:2])
        report.add(Status.WARN, f"pin_memory offload may exceed the locked-memory limit on {hosts_text(sorted(low))}: "
                                f"{listed}",
                   "ulimit -l unlimited on those hosts, or set pin_memory false", low)


def smallest_free(gpus: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Tuple[int, str]]:
    """{host: (free bytes of its GPU with the least free memory, "GPU i (name)")} from the gpu facts."""
    free_by_host: Dict[str, Tuple[int, str]] = {}
    for host, lst in gpus.items():
        frees = [(float(g["memory_free"]), g) for g in lst if isinstance(g.get("memory_free"), (int, float))]
        if frees:
            f, g = min(frees, key=lambda x: x[0])
            free_by_host[host] = (int(f), f"GPU {g.get('index')} ({g.get('name') or '?'})")
    return free_by_host


def suggest(plan: Plan, current_gpu: int, min_free: int, warn_frac: float, fail_frac: float,
            cpu_frac: float) -> Optional[Dict[str, Any]]:
    """The first step up LADDER that fits the GPUs (comfortably, else at all) and every host's CPU RAM."""

    def fits(s: int, o: str, p: str, limit: float) -> Optional[Dict[str, Any]]:
        e = plan.gpu(s, o, p)
        if e["gpu"] > limit:
            return None
        for h in plan.hosts:
            c = plan.cpu(s, o, p, h.get("slots") or 1)
            avail = (plan.mem.get(h["name"]) or {}).get("mem_available")
            if c is not None and avail is not None and c["cpu"] > avail * cpu_frac:
                return None
        return e

    for limit in (min_free * warn_frac, min_free * fail_frac):
        for s, o, p in LADDER:
            if plan.gpu(s, o, p)["gpu"] >= current_gpu:
                continue  # not a step forward from the configured stage/offload
            found = fits(s, o, p, limit)
            if found is not None:
                return found
    return None


def check_gpu_fit(plan: Plan, est: Dict[str, Any], free_by_host: Dict[str, Tuple[int, str]], ll_note: str,
                  lim: Dict[str, Any], report: Report) -> None:
    """FAIL (with the next stage/offload that fits) or WARN when the model states crowd the free GPU memory."""
    min_host = min(free_by_host, key=lambda h: free_by_host[h][0])
    min_free = free_by_host[min_host][0]
    fail_frac = float(lim["gpu_mem_fail_fraction"])
    warn_frac = float(lim["gpu_mem_warn_fraction"])
    label, need = est["label"], gib(est["gpu"])
    over = {h: v for h, v in free_by_host.items() if est["gpu"] > v[0] * fail_frac}
    if over:
        found = suggest(plan, est["gpu"], min_free, warn_frac, fail_frac, float(lim["cpu_mem_fail_fraction"]))
        fix = (f"use {found['label']}: est. {gib(found['gpu'])}/GPU ({found['formula']})"
               if found else "no ZeRO stage/offload fits: use more GPUs, NVMe offload (ZeRO-Infinity), or a "
                             "smaller model")
        report.add(Status.FAIL, f"{label} needs an estimated {need} per GPU for model states ({est['formula']})"
                                f"{ll_note}, above the free GPU memory on {hosts_text(sorted(over))} (smallest "
                                f"{gib(min_free)} on {min_host})", fix,
                   {h: f"{label} needs an estimated {need} per GPU; {v[1]} has {gib(v[0])} free"
                    for h, v in over.items()})
        return
    tight = {h: v for h, v in free_by_host.items() if est["gpu"] > v[0] * warn_frac}
    if tight:
        report.add(Status.WARN, f"{label} needs an estimated {need} per GPU for model states alone ({est['formula']})"
                                f"{ll_note}, over {warn_frac * 100:.0f}% of the free GPU memory on "
                                f"{hosts_text(sorted(tight))} (smallest {gib(min_free)}): little room for activations",
                   "use a higher ZeRO stage or offload, or activation checkpointing with a smaller micro batch",
                   {h: f"model states est. {need} of {gib(v[0])} free on {v[1]}"
                    for h, v in tight.items()})
    if plan.stage == 3:
        e2 = plan.gpu(2, "none", "none")
        comfort = float(lim["stage3_comfort_fraction"])
        if e2["gpu"] <= min_free * comfort:
            report.add(Status.WARN, "ZeRO-3 for a model that fits comfortably with ZeRO-2: ZeRO-2 needs an estimated "
                                    f"{gib(e2['gpu'])} per GPU ({e2['formula']}), under {comfort * 100:.0f}% of the "
                                    f"smallest free {gib(min_free)}; ZeRO-3 adds parameter all-gathers (about 1.5x the "
                                    "communication) for no memory need",
                       'use "zero_optimization": {"stage": 2} (without offload) for this model size')


def check_memory(config: Dict[str, Any], facts: Dict[str, Any], gpus: Dict[str, List[Dict[str, Any]]],
                 thresholds: Dict[str, Any], report: Report) -> str:
    """Locked memory (always), then with --model-params: CPU RAM for offload and GPU memory. Returns a summary."""
    lim = limits(thresholds, NAME)
    floor = float(lim["pin_memory_min_memlock_gib"]) * GiB
    pinned = check_memlock(config, facts, floor, report)
    n = facts.get("model_params")
    if n in (None, 0):
        return "memory not checked (no --model-params)"
    stage = zero_stage(config)
    if stage not in (0, 1, 2, 3):
        report.add(Status.SKIP, "ZeRO memory not estimated: zero_optimization.stage is "
                                f"{zero_section(config).get('stage')!r}")
        return ""
    assert stage is not None
    plan = Plan(config, facts, stage, float(n))
    est = plan.gpu(stage, plan.opt_dev, plan.par_dev)
    ll_note = "" if stage < 3 or plan.ll_known else " (largest layer unknown, counted as 0: a lower bound; pass " \
                                                    "--largest-layer-params)"
    summary = f"{est['label']} est. {gib(est['gpu'])}/GPU for {params_text(plan.n)} params on {plan.ws} GPUs"
    cpu_need = check_cpu_ram(plan, est["label"], float(lim["cpu_mem_fail_fraction"]), report)
    if cpu_need:
        check_pinned_need(plan, cpu_need, pinned, floor, report)
    if not gpus:
        report.add(Status.SKIP, "GPU memory not compared: no GPU facts (the gpu check did not run or found no "
                                f"GPUs); {summary}{ll_note}")
        return summary
    free_by_host = smallest_free(gpus)
    if not free_by_host:
        report.add(Status.SKIP, "GPU memory not compared: the gpu facts have no free-memory figures; " + summary)
        return summary
    min_host = min(free_by_host, key=lambda h: free_by_host[h][0])
    summary += f" (smallest free: {gib(free_by_host[min_host][0])} on {min_host} {free_by_host[min_host][1]})"
    check_gpu_fit(plan, est, free_by_host, ll_note, lim, report)
    return summary
