"""The job's DeepSpeed config checked against the real cluster: keys, batch math, precision, ZeRO memory, offload, ops.

Parses the config like DeepSpeed does (hjson: comments allowed; duplicate keys are an error), e.g.::

    {
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,   // x world size = train_batch_size
      "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    }

Where each part runs: ``coordinate`` (coordinator) gathers facts with ``gather`` (and ``host`` on each host
through the agent) and DeepSpeed's own models (``deepspeed_models``); ``evaluate`` is pure and reads as the
list of verdicts: ``keycheck`` (keys, versions, optimizer), ``batch`` ("auto" without the HF integration too),
``precision`` (and the bf16 note), ``pipeline``, ``cpus`` (CPUs per rank), ``ops`` (and whether their JIT build
can run), ``offload``, ``memory``, ``launch`` (the config file on every host, the checkpoint to resume).
``parse`` reads the config; ``keys`` holds DeepSpeed's key tables. Thresholds: ``[ds_config]``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from ...hostside import hfauto
from ...hostside.seams import CheckOptions, CheckSpec, ClusterView
from ...hostside.outcome import Finding, Outcome, Status, combine, limits
from .batch import check_auto_plain, check_batch, plain_auto_keys
from .cpus import check_cpus_per_slot
from .gather import HOST_FACTS, OPTIONS, base_facts, deepspeed_validation, no_config_finding, probe_hosts
from .launch import check_config_file, check_resume
from .keycheck import (FORBID_EXTRA, check_deprecated, check_installed, check_keys, check_optimizer, check_validated,
                       check_versions)
from .memory import check_memory, stage_label
from .offload import check_nvme, check_offload_stage
from .ops import check_ops, required_ops
from .pipeline import check_pipeline
from .parse import load_config, nvme_paths, offload_devices, optimizer_type, usage_error, zero_stage
from .precision import check_precision
from .findings import Report, gpus_by_host, host_versions, vstr

__all__ = ["NAME", "SPEC", "coordinate", "evaluate"]

NAME = "ds_config"

CLUSTER = "*"


def params_from_options(options: CheckOptions) -> Dict[str, Any]:
    """What the job's config asks of every host: its nvme_path runs the nvme check there, its ops ds_report.

    ValueError with one line (``file:line:col: ...``) for a config DeepSpeed would refuse at start: the CLI stops
    on it before contacting any host, since there is nothing to check it against.
    """
    path = options.deepspeed_config
    if not path:
        return {}
    bad = usage_error(path)
    if bad:
        raise ValueError(bad)
    config, _ = load_config(path)
    if not config:
        return {}
    return {"nvme_paths": nvme_paths(config), "required_ops": required_ops(config)}


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    """Gather everything evaluate() needs into plain JSON-able facts (see the schema in evaluate)."""
    facts = base_facts(cluster)
    path = facts["config_path"]
    if not path:
        facts["load_findings"] = [no_config_finding()]
        return facts
    config, found = load_config(str(path))
    facts["load_findings"] = [f.to_dict() for f in found]
    if not config:
        return facts
    facts["config"] = config
    lim = limits(cluster.thresholds or {}, NAME)
    probe_hosts(cluster, facts, config, float(lim["host_memory_timeout_s"]))
    checked, _ = as_checked(config, facts, str(lim["integration"]))
    try:
        deepspeed_validation(cluster, facts, checked, float(lim["deepspeed_validate_timeout_s"]))
    except Exception as exc:  # DeepSpeed importable but broken: fall back to our tables, and say so
        facts["deepspeed_models"] = None
        facts["deepspeed_validation"] = {"where": None, "tried": [f"{type(exc).__name__}: {str(exc)[:300]}"]}
    return facts


def as_checked(config: Dict[str, Any], facts: Dict[str, Any], integration: str) -> Tuple[Dict[str, Any],
                                                                                        List[Dict[str, Any]]]:
    """(the config as the job's DeepSpeed will read it, the "auto" values filled): with the Hugging Face
    integration ([ds_config] integration = "hf", the default) its "auto" values filled as transformers' Trainer
    fills them (hostside/hfauto.py), on the data-parallel size; under plain DeepSpeed the config as it is."""
    if integration != "hf" or not hfauto.auto_paths(config):
        return config, []
    world = int(facts.get("world_size") or 0) or 1
    sp = config.get("sequence_parallel_size")
    mp = facts.get("model_parallel_size")
    for div in (sp, mp):
        if isinstance(div, int) and not isinstance(div, bool) and div > 1 and world % div == 0:
            world //= div
    return hfauto.fill(config, world)


_Versions = Dict[str, Tuple[int, int, int]]


def _run_checks(config: Dict[str, Any], facts: Dict[str, Any], thresholds: Dict[str, Any], versions: _Versions,
                report: Report) -> Tuple[Dict[str, Any], List[Dict[str, Any]], str, List[str]]:
    """Every verdict on the config into report: (the config as checked, the "auto" values filled, the precision
    part of the summary, the other checks' summary parts)."""
    gpus = gpus_by_host(facts)
    lim = limits(thresholds, NAME)
    integration = str(lim["integration"])
    # The batch math reads the config as written (an "auto" batch is judged against what the integration can
    # fill); every other verdict reads it as the job's DeepSpeed will, its "auto" values filled.
    model_sections = (facts.get("deepspeed_models") or {}).get("sections") or FORBID_EXTRA
    batch = check_batch(config, int(facts.get("world_size") or 0) or 1,
                        [int(h.get("slots") or 0) for h in facts.get("hosts") or []], report,
                        facts.get("model_parallel_size"), integration, plain_auto_keys(config, model_sections))
    if integration != "hf":
        check_auto_plain(config, model_sections, report)
    written = config
    config, filled = as_checked(config, facts, integration)
    check_installed(facts, report)
    check_validated(facts, config, report)
    check_keys(config, facts.get("deepspeed_models"), report)
    check_deprecated(config, versions, report)
    check_versions(config, versions, report)
    precision = check_precision(config, gpus, report)
    check_optimizer(config, versions, report)
    check_pipeline(config, report)
    cpus = check_cpus_per_slot(facts, float(lim["min_cpus_per_slot"]), report)
    ops = check_ops(config, facts, report)
    check_offload_stage(config, report)
    check_nvme(config, facts, report)
    # The memory estimate keeps an "auto" precision undecided (16-bit, the larger model states), not the
    # stand-in defaults' fp32: the job's --bf16/--fp16 decide it.
    memory = check_memory(written, facts, gpus, thresholds, report)
    same_file = check_config_file(facts, report)
    resume = check_resume(config, facts, report)
    return config, filled, precision, [batch, cpus, ops, memory, same_file, resume]


def _summary(config: Dict[str, Any], facts: Dict[str, Any], versions: _Versions, filled: List[Dict[str, Any]],
             precision: str, extras: List[str]) -> Tuple[str, Dict[str, Any]]:
    """The PASS line of what was checked and how, and the metrics beside it."""
    stage = zero_stage(config)
    opt_dev, par_dev = offload_devices(config)
    if {"fp16.enabled", "bf16.enabled"} & {n["key"] for n in filled}:
        precision = "precision from the Trainer's --bf16/--fp16 (\"auto\")"  # not the stand-in defaults' fp32
    parts = [stage_label(stage, opt_dev, par_dev) if stage is not None else "ZeRO stage ?", precision]
    if optimizer_type(config):
        parts.append(f"optimizer {optimizer_type(config)}")
    parts += [p for p in extras if p]
    if versions:
        ds_versions = ", ".join(sorted({vstr(v) for v in versions.values()}))
        parts.append(f"DeepSpeed {ds_versions} on the hosts")
    where = (facts.get("deepspeed_validation") or {}).get("where")
    models_version = (facts.get("deepspeed_models") or {}).get("version")
    if where and models_version:
        parts.append(f"validated by DeepSpeed {models_version}'s own code on {where}")
    if filled:
        parts.append(f'checked with "auto" filled as the Hugging Face Trainer fills it ([ds_config] integration = '
                     f'"hf"; say "deepspeed" if the script calls deepspeed.initialize itself), from '
                     f'{hfauto.note_text(filled)}')
    config_name = os.path.basename(str(facts.get("config_path") or "config"))
    ok = f"{config_name}: {'; '.join(parts)}"
    metrics = {"zero_stage": stage, "offload": {"optimizer": opt_dev, "param": par_dev},
               "required_ops": required_ops(config), "nvme_paths": nvme_paths(config),
               "deepspeed_models": (facts.get("deepspeed_models") or {}).get("version"),
               "validated_on": where, "auto_filled": filled}
    return ok, metrics


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    """Pure: coordinate()'s facts -> {"*": cluster-wide outcome, host: that host's outcome (only hosts with findings)}.

    facts: {"config_path", "config": dict|None, "load_findings": [finding dicts], "world_size": int,
            "hosts": [{"name", "slots"}], "model_params", "largest_layer_params",
            "host_facts": {host: {"gpu", "ds_report", "nvme", "python"}},
            "host_memory": {host: {"mem_total", "mem_available", "memlock_soft", "memlock_hard", "error"}},
            "host_probe": {host: {"deepspeed", "deepspeed_found", "paths": [...]} | {"error"}},
            "model_parallel_size": int | None,
            "deepspeed_models": None | {"version", "sections", "errors": [...], "param_errors": [...]}}
    """
    report = Report()
    for f in facts.get("load_findings") or []:
        report.star.append(Finding(Status(f.get("status", "fail")), f.get("message", ""), f.get("fix", "")))
    config = facts.get("config")
    if not isinstance(config, dict):
        if not report.star:
            report.star.append(Finding(Status.ERROR, "no parsed DeepSpeed config in the facts"))
        return {CLUSTER: combine(report.star, "")}
    versions = host_versions(facts)
    config, filled, precision, extras = _run_checks(config, facts, thresholds, versions, report)
    ok, metrics = _summary(config, facts, versions, filled, precision, extras)
    # The summary is a finding of its own, also beside a WARN or FAIL: what was checked, and how (the "auto"
    # values filled, where DeepSpeed's own code ran) stays in the report's findings.
    report.star.append(Finding(Status.PASS, ok))
    out = {CLUSTER: combine(report.star, ok, metrics)}
    for host, fs in sorted(report.hosts.items()):
        out[host] = combine(fs, f"{NAME}: ok")
    return out


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="DeepSpeed config (--deepspeed-config): keys, deprecations, batch math, precision vs GPUs, "
               "ZeRO memory vs GPU/CPU, offload paths, required ops and their JIT build, DeepSpeed version, the "
               "same config file on every host, the checkpoint to resume (--checkpoint-dir)",
    scope="cluster",
    default=False,
    coordinate=coordinate,
    evaluate=evaluate,
    reads=HOST_FACTS,
    options=OPTIONS,
    selected_by=("deepspeed_config",),  # --deepspeed-config runs it without --checks
    params_from_options=params_from_options,
    # Reads the host checks' facts and asks the hosts little, but a required op's JIT build (host.probe) compiles on
    # the cores and writes to disk: quiet, loading "cpu" and "disk" (runner.Schedule).
    quiet=True,
    loads=("cpu", "disk"),
)
