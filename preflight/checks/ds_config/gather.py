"""Coordinator: the facts evaluate() reads, gathered from the run's options, the host checks' facts and calls
to the host-side functions in ``host.py``.

E.g. {"world_size": 16, "hosts": [{"name": "node01", "slots": 8}], "host_facts": {"node01": {"gpu": ...}},
"host_memory": {"node01": {"mem_available": 1.2e11, "memlock_soft": null}}}.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ...hostside.launchenv import read_deepspeed_env
from ...hostside.jobinputs import CHECKPOINT_DIR, MODEL_PARAMS
from ...hostside.seams import ClusterView, Option, positive
from ...hostside.outcome import Finding, Status
from .parse import nvme_paths, offload_devices
from .deepspeed_models import validate_or_why, clean_models
from .host import file_digest

LARGEST_LAYER_PARAMS = Option("--largest-layer-params", "parameters of the largest layer (ZeRO-3 estimate)",
                              positive(float, "a number", 1e15), "N")
MODEL_PARALLEL_SIZE = Option("--model-parallel-size", "tensor x pipeline parallel degree of the job (1: data parallel "
                             "only), so the batch math uses the data-parallel size: world size / N",
                             positive(int, "an integer", 100000), "N")
# ds_config's own inputs, and those it shares with checkpoint (hostside/jobinputs.py).
OPTIONS = (MODEL_PARAMS, LARGEST_LAYER_PARAMS, MODEL_PARALLEL_SIZE, CHECKPOINT_DIR)

# The host checks whose facts the verdicts read (compute: each host's CPUs, cpu.threads).
HOST_FACTS = ("gpu", "ds_report", "nvme", "python", "compute")


def base_facts(cluster: ClusterView) -> Dict[str, Any]:
    """The skeleton: options, world size, hosts and the host checks' facts; the config is filled in later."""
    opts = cluster.options
    hosts = [{"name": h.name, "slots": int(getattr(h, "slots", 0) or 0)} for h in cluster.hosts]
    facts: Dict[str, Any] = {
        "config_path": opts.deepspeed_config, "config": None, "load_findings": [],
        "world_size": int(cluster.world_size), "hosts": hosts,
        "model_params": MODEL_PARAMS.value(opts), "largest_layer_params": LARGEST_LAYER_PARAMS.value(opts),
        "model_parallel_size": MODEL_PARALLEL_SIZE.value(opts), "checkpoint_dir": CHECKPOINT_DIR.value(opts),
        "host_facts": {}, "host_memory": {}, "host_probe": {}, "deepspeed_models": None,
        "launch_env": read_deepspeed_env(),
    }
    for h in hosts:
        per = (cluster.facts or {}).get(h["name"]) or {}
        facts["host_facts"][h["name"]] = {k: per.get(k) for k in HOST_FACTS}
    return facts


def no_config_finding() -> Dict[str, str]:
    return Finding(Status.FAIL, "no DeepSpeed config given (ds_config runs with --deepspeed-config PATH)",
                   "pass --deepspeed-config PATH").to_dict()


def call_hosts(cluster: ClusterView, func: str, names: List[str], params: Dict[str, Any],
               timeout: float) -> Dict[str, Dict[str, Any]]:
    """func on every named host at once: {host: its dict result, or {"error": why}} (a failure is that host's)."""
    results: Dict[str, Any] = {}
    call_all = getattr(cluster, "call_all", None)
    if callable(call_all):
        try:
            results = call_all(func, {n: dict(params) for n in names}, timeout)
        except Exception as exc:
            results = {n: exc for n in names}
    else:
        for n in names:
            try:
                results[n] = cluster.call(n, func, dict(params), timeout)
            except Exception as exc:
                results[n] = exc
    out: Dict[str, Dict[str, Any]] = {}
    short = func.rpartition(".")[2]
    for n in names:
        r = results.get(n)
        if isinstance(r, BaseException) or not isinstance(r, dict):
            why = f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else "no result"
            out[n] = {"error": f"host_{short} failed: {why}"}
        else:
            out[n] = r
    return out


def load_universal(config: Dict[str, Any]) -> bool:
    """checkpoint.load_universal (DeepSpeed's runtime/config.py:549-550): load_checkpoint then reads the tag in
    ``latest_universal``, not ``latest`` (engine.py:4428)."""
    section = config.get("checkpoint")
    return isinstance(section, dict) and section.get("load_universal") is True


def probe_hosts(cluster: ClusterView, facts: Dict[str, Any], config: Dict[str, Any], timeout: float) -> None:
    """One ds_config.host.probe call per host: the config file at the path every rank opens (its hash), and what
    the config needs that the host checks did not bring: the hosts' DeepSpeed version (``--checks ds_config``
    alone), offload paths, memory for CPU/NVMe offload, the checkpoint to resume (--checkpoint-dir)."""
    memory = bool({"cpu", "nvme"} & set(offload_devices(config)))
    paths = nvme_paths(config)
    names = [h["name"] for h in facts["hosts"]]
    params: Dict[str, Any] = {"memory": memory, "nvme_paths": paths}
    if facts.get("config_path"):
        # The launcher passes the path as given, and every rank opens it after pdsh's `cd <the launch directory>`
        # (multinode_runner.py:108-112): relative to where deepspeed runs, taken as where preflight runs.
        facts["config_file"] = file_digest(os.path.abspath(str(facts["config_path"])))
        params["config_path"] = facts["config_file"]["path"]
    if facts.get("checkpoint_dir"):
        params["checkpoint_dir"] = os.path.abspath(str(facts["checkpoint_dir"]))
        params["checkpoint_latest"] = "latest_universal" if load_universal(config) else "latest"
    results = call_hosts(cluster, "ds_config.host.probe", names, params, timeout)
    for n in names:
        r = results[n]
        if "paths" not in r:  # the call failed: that host's facts say why
            facts["host_probe"][n] = {"error": r.get("error")}
            if memory:
                facts["host_memory"][n] = {"error": r.get("error")}
            continue
        facts["host_probe"][n] = {k: r.get(k) for k in ("deepspeed", "deepspeed_found", "paths", "config_file",
                                                        "checkpoint")}
        if memory:
            facts["host_memory"][n] = r.get("memory") or {"error": "host_probe returned no memory facts"}


def deepspeed_validation(cluster: ClusterView, facts: Dict[str, Any], config: Dict[str, Any],
                         timeout: float) -> None:
    """DeepSpeed's own validation of ``config`` wherever DeepSpeed is: on the coordinator when it imports there,
    else on the first host whose probe found DeepSpeed, through the agent in the job's interpreter (--python).
    Sets facts["deepspeed_models"] (None: it ran nowhere) and facts["deepspeed_validation"] = {"where": "this
    machine" | host | None, "tried": [why each place could not run it]}; call after probe_hosts."""
    tried: List[str] = []
    res, why = validate_or_why(config)
    if res is not None:
        facts["deepspeed_models"] = res
        facts["deepspeed_validation"] = {"where": "this machine", "tried": []}
        return
    tried.append(f"this machine: {why}")
    facts["deepspeed_models"] = None
    where = None
    probes = facts.get("host_probe") or {}
    with_ds = [h["name"] for h in facts["hosts"]
               if isinstance(probes.get(h["name"]), dict) and (probes[h["name"]].get("deepspeed")
                                                                or probes[h["name"]].get("deepspeed_found"))]
    if not with_ds:
        tried.append("no host has DeepSpeed in the job's interpreter (--python)")
    for host in with_ds[:1]:  # the first such host: every host runs the same config
        r = call_hosts(cluster, "ds_config.deepspeed_models.validate", [host], {"config": config}, timeout)[host]
        models = clean_models(r)
        if models is not None:
            facts["deepspeed_models"] = models
            where = host
        elif isinstance(r, dict) and (r.get("unavailable") or r.get("error")):
            tried.append(f"{host}: {str(r.get('unavailable') or r.get('error'))[:300]}")
        else:
            tried.append(f"{host}: an answer that is not DeepSpeed's validation")
    facts["deepspeed_validation"] = {"where": where, "tried": tried}
