"""ds_config: parsing, keys, deprecations, batch math, precision, ZeRO memory, offload paths, ops, versions.

Configs live in tests/ds_configs/; host facts are built from the recorded H100 host (tests/fixtures/h100-host:
nvml.txt through checks.gpu, ds_report.txt through checks.ds_report) and changed only where a case needs it.
"""
from __future__ import annotations

import copy
import json
import os
import re
import resource
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from preflight.checks import ds_config as D
from preflight.checks.ds_config import batch, deepspeed_models, keycheck, memory, parse, findings
from preflight.checks.ds_config import host as ds_host
from preflight.checks.ds_config import keys as K
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status, ThresholdsError
from preflight.checks.ds_report import parse_ds_report
from preflight.checks.gpu import normalize_nvml_gpu
from preflight import testing
from preflight.config import load_thresholds

HERE = Path(__file__).resolve().parents[2]
CONFIGS = HERE / "ds_configs"
FIX = HERE / "fixtures" / "h100-host"
GiB = 1 << 30
TH = load_thresholds()
# The script runs through transformers' Trainer or Accelerate, which fill "auto" ([ds_config] integration = "hf",
# the default since issue 30: only that integration fills "auto").
TH_HF = copy.deepcopy(TH)
TH_HF["ds_config"]["integration"] = "hf"
# The script calls deepspeed.initialize itself: nothing fills "auto".
TH_PLAIN = copy.deepcopy(TH)
TH_PLAIN["ds_config"]["integration"] = "deepspeed"


def cfg(name: str) -> str:
    return str(CONFIGS / name)


def h100_gpu(index: int = 0) -> Dict[str, Any]:
    raw = json.loads((FIX / "nvml.txt").read_text())
    gpu = normalize_nvml_gpu(raw["gpus"][0], index)
    gpu["index"] = index
    return gpu


def recorded_ds_report() -> Dict[str, Any]:
    return parse_ds_report((FIX / "ds_report.txt").read_text())


def ds_report_with_libaio() -> Dict[str, Any]:
    """The recorded report as it reads once libaio-dev is installed (async_io and gds compatible)."""
    r = copy.deepcopy(recorded_ds_report())
    for op in ("async_io", "gds"):
        r["ops"][op] = {"installed": False, "compatible": True, "note": None}
    return r


def recorded_meminfo() -> Dict[str, Any]:
    text = (FIX / "meminfo.txt").read_text()
    kb = {m.group(1): int(m.group(2)) * 1024 for m in re.finditer(r"^(\w+):\s+(\d+) kB", text, re.M)}
    return {"mem_total": kb["MemTotal"], "mem_available": kb["MemAvailable"], "memlock_soft": None,
            "memlock_hard": None, "error": None}


def make_facts(config_file: str, hosts: int = 1, slots: int = 8, gpus: Optional[List[Dict[str, Any]]] = None,
               ds_report: Optional[Dict[str, Any]] = None, mem: Optional[Dict[str, Any]] = None,
               nvme: Optional[Dict[str, Any]] = None, **extra: Any) -> Dict[str, Any]:
    config, found = D.load_config(config_file)
    names = [f"node{i:02d}" for i in range(hosts)]
    gpu_list = gpus if gpus is not None else [h100_gpu(i) for i in range(slots)]
    facts = {
        "config_path": config_file, "config": config or None, "load_findings": [f.to_dict() for f in found],
        "world_size": hosts * slots, "hosts": [{"name": n, "slots": slots} for n in names],
        "model_params": None, "largest_layer_params": None,
        "host_facts": {n: {"gpu": {"gpus": copy.deepcopy(gpu_list)},
                           "ds_report": copy.deepcopy(ds_report if ds_report is not None else recorded_ds_report()),
                           "nvme": copy.deepcopy(nvme), "python": None} for n in names},
        "host_memory": {n: dict(mem if mem is not None else recorded_meminfo()) for n in names},
        "deepspeed_models": None,
    }
    facts.update(extra)
    return facts


def non_pass(outcome) -> List[Any]:
    return [f for f in outcome.findings if f.status not in (Status.PASS,)]


def of(outcome, status: Status) -> List[Any]:
    return [f for f in outcome.findings if f.status == status]


def run(facts: Dict[str, Any], thresholds: Optional[Dict[str, Any]] = None):
    out = D.evaluate(facts, TH if thresholds is None else thresholds)
    json.dumps({h: o.metrics for h, o in out.items()})  # metrics stay JSON-able
    return out


# --- parsing -----------------------------------------------------------------------------------

def test_load_config_hjson_with_comments_and_quoteless_keys():
    config, found = D.load_config(cfg("real_hjson_comments.hjson"))
    assert found == []
    assert config["fp16"] == {"enabled": True, "loss_scale": 0}
    assert config["zero_optimization"] == {"stage": 1}
    assert type(config["optimizer"]) is dict  # plain dicts, not hjson's OrderedDict


def test_parse_error_reports_line_and_column():
    path = cfg("bad_syntax.json")
    lines = Path(path).read_text().splitlines()
    lineno = next(i for i, ln in enumerate(lines, 1) if ",," in ln)
    col = lines[lineno - 1].index(",,") + 2  # the second comma, 1-based
    config, found = D.load_config(path)
    assert config == {}
    assert len(found) == 1 and found[0].status == Status.FAIL
    assert f"line {lineno} column {col}" in found[0].message
    out = run(make_facts(path))
    assert out["*"].status == Status.FAIL and f"line {lineno}" in out["*"].message


def test_duplicate_keys_fail_with_their_lines():
    path = cfg("duplicate_keys.json")
    lines = [i for i, ln in enumerate(Path(path).read_text().splitlines(), 1) if '"stage"' in ln]
    assert len(lines) == 2
    _, found = D.load_config(path)
    assert [f.status for f in found] == [Status.FAIL]
    assert "'stage'" in found[0].message and f"lines {lines[0]}, {lines[1]}" in found[0].message


def test_missing_file_and_non_object(tmp_path):
    config, found = D.load_config(str(tmp_path / "nope.json"))
    assert config == {} and found[0].status == Status.FAIL and "no such file" in found[0].message
    config, found = D.load_config(str(tmp_path))
    assert config == {} and "directory" in found[0].message
    config, found = D.load_config(cfg("not_an_object.json"))
    assert config == {} and "list at the top level" in found[0].message


# --- keys ---------------------------------------------------------------------------------------

def test_misspelled_top_level_keys_fail_with_did_you_mean():
    out = run(make_facts(cfg("misspelled_top.json")))
    fails = of(out["*"], Status.FAIL)
    msgs = " | ".join(f.message for f in fails)
    assert "zero_optimisation: unknown top level key" in msgs and "did you mean 'zero_optimization'" in msgs
    assert "optimiser: unknown top level key" in msgs and "did you mean 'optimizer'" in msgs
    assert any(f.fix == "rename optimiser to optimizer" for f in fails)


def test_unknown_section_keys_from_own_tables():
    out = run(make_facts(cfg("unknown_subkeys.json")))
    fails = {f.message.split(":")[0]: f for f in of(out["*"], Status.FAIL)}
    assert "did you mean 'overlap_comm'" in fails["zero_optimization.overlap_comms"].message
    assert "did you mean 'pin_memory'" in fails["zero_optimization.offload_optimizer.pin_memroy"].message
    assert "did you mean 'loss_scale_window'" in fails["fp16.loss_scale_windows"].message
    assert "optimizer.params" in fails["optimizer.adam_w_mode"].fix


def test_known_key_at_the_wrong_level_and_comment_keys(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "_comment": "ours",
                             "stage3_gather_16bit_weights_on_model_save": True,
                             "zero_optimization": {"stage": 3, "#note": "x"}}))
    out = run(make_facts(str(p)))
    assert not of(out["*"], Status.FAIL)  # DeepSpeed ignores it and runs: a WARN that says where it belongs
    warns = of(out["*"], Status.WARN)
    assert len(warns) == 1
    assert "stage3_gather_16bit_weights_on_model_save" in warns[0].message
    assert "zero_optimization" in warns[0].message and "move" in warns[0].fix


def test_valid_configs_have_no_unknown_keys():
    for name in sorted(p.name for p in CONFIGS.iterdir() if p.is_file()):
        if not (name.startswith("real_") or name.startswith("zero")):
            continue
        config, found = D.load_config(cfg(name))
        rep = findings.Report()
        keycheck.check_keys(config, None, rep)
        assert found == [] and rep.star == [], (name, [f.message for f in rep.star])


# --- deprecated ---------------------------------------------------------------------------------

def test_deprecated_keys_warn_with_modern_name():
    out = run(make_facts(cfg("deprecated.json")))
    warns = of(out["*"], Status.WARN)
    text = " | ".join(f.message for f in warns)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                     ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
                     ("cpu_offload_use_pin_memory", "pin_memory")):
        assert any(f"zero_optimization.{old} is deprecated" in f.message and new in f.message for f in warns), old
    assert not of(out["*"], Status.FAIL), text
    # the deprecated booleans still count as offload (what DeepSpeed maps them to)
    assert parse.offload_devices(D.load_config(cfg("deprecated.json"))[0]) == ("cpu", "cpu")


def test_renamed_key_warns_only_where_the_old_name_is_ignored(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "aio": {"thread_count": 2}}))
    old = make_facts(str(p))
    for n in old["host_facts"]:
        old["host_facts"][n]["ds_report"]["deepspeed"] = "0.16.0"
    assert not non_pass(run(old)["*"])
    new = make_facts(str(p))  # recorded hosts: DeepSpeed 0.19.8
    warns = of(run(new)["*"], Status.WARN)
    assert len(warns) == 1 and "aio.thread_count" in warns[0].message and "intra_op_parallelism" in warns[0].message


# --- batch math ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tb,mb,ga,ws", [
    (256, 4, 8, 8), (256, 4, None, 8), (256, None, 8, 8), (None, 4, 8, 8), (256, None, None, 8),
    (None, 4, None, 8), (100, 4, None, 8), (100, None, 4, 8), (4, None, None, 8), (96, 4, 4, 6),
])
def test_resolve_batch_mirrors_deepspeed(tb, mb, ga, ws):
    """Re-derive DeepSpeed's rule independently: fill the missing values, then tb == mb * ga * ws, all > 0."""
    values, err = batch.resolve_batch(tb, mb, ga, ws)
    t, m, g = values["train_batch_size"], values["train_micro_batch_size_per_gpu"], values[
        "gradient_accumulation_steps"]
    for given, got in ((tb, t), (mb, m), (ga, g)):
        if given is not None:
            assert got == given
    if tb is None:
        assert t == m * g * ws
    if mb is None and tb is not None:
        assert m == tb // ws // (ga or 1)
    if ga is None and tb is not None and mb is not None:
        assert g == tb // mb // ws
    assert (err is None) == (t > 0 and m > 0 and g > 0 and t == m * g * ws)


def test_batch_mismatch_fails_with_numbers_and_corrections():
    config = D.load_config(cfg("batch_mismatch.json"))[0]
    tb, mb, ga = (config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps"))
    out = run(make_facts(cfg("batch_mismatch.json"), hosts=1, slots=8))
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1
    assert f"{tb} != {mb} * {ga} * 8" in fails[0].message
    assert f"train_batch_size = {mb} x {ga} x 8 = {mb * ga * 8}" in fails[0].fix


def test_batch_derived_value_uses_integer_division(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}))
    fails = of(run(make_facts(str(p), slots=8))["*"], Status.FAIL)
    assert len(fails) == 1 and f"100 != 4 * {100 // 4 // 8} * 8" in fails[0].message
    p.write_text(json.dumps({"train_batch_size": 96, "train_micro_batch_size_per_gpu": 4}))
    out = run(make_facts(str(p), slots=8))
    assert out["*"].status == Status.PASS and "96 = 4 x 3 x 8" in out["*"].message


def test_batch_missing_and_auto():
    fails = of(run(make_facts(cfg("batch_missing.json")))["*"], Status.FAIL)
    assert len(fails) == 1 and "train_micro_batch_size_per_gpu needs to be provided" in fails[0].message
    fails = of(run(make_facts(cfg("batch_auto_indivisible.json"), slots=8))["*"], Status.FAIL)
    assert len(fails) == 1 and "100 is not a multiple of the world size 8" in fails[0].message
    # 96 is a multiple of 8: HF can fill micro batch x accumulation = 12
    config = D.load_config(cfg("batch_auto_indivisible.json"))[0]
    config["train_batch_size"] = 96
    facts = make_facts(cfg("batch_auto_indivisible.json"), slots=8, config=config)
    assert not non_pass(run(facts, TH_HF)["*"])


def test_batch_sequence_parallel_and_tensor_parallel(tmp_path):
    p = tmp_path / "c.json"
    # DeepSpeed divides the world size by sequence_parallel_size: 64 = 4 * 2 * (16 / 2)
    p.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2, "sequence_parallel_size": 2}))
    assert run(make_facts(str(p), hosts=2, slots=8))["*"].status == Status.PASS
    # 64 = 4 * 2 * 8 holds for data-parallel size 8 of 16 GPUs: right with tensor parallel degree 2 -> WARN
    p.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2}))
    out = run(make_facts(str(p), hosts=2, slots=8))
    warns = of(out["*"], Status.WARN)
    assert out["*"].status == Status.WARN and "data-parallel size of 8" in warns[0].message
    # 3 GPUs per host: no tensor-parallel degree divides it to give 64 -> FAIL
    out = run(make_facts(str(p), hosts=2, slots=3))
    assert out["*"].status == Status.FAIL


def test_non_integer_batch_value_fails(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": "four"}))
    fails = of(run(make_facts(str(p)))["*"], Status.FAIL)
    assert len(fails) == 1 and "train_micro_batch_size_per_gpu = 'four'" in fails[0].message


# --- precision ----------------------------------------------------------------------------------

def test_fp16_and_bf16_both_enabled_fail():
    fails = of(run(make_facts(cfg("fp16_and_bf16.json")))["*"], Status.FAIL)
    assert len(fails) == 1 and "both true" in fails[0].message


def test_bf16_on_pre_ampere_gpus_fails_naming_the_host():
    facts = make_facts(cfg("zero2_bf16_7b.json"), hosts=2, slots=8)
    v100 = [dict(h100_gpu(i), name="Tesla V100-SXM2-32GB", cc=[7, 0]) for i in range(8)]
    facts["host_facts"]["node01"]["gpu"] = {"gpus": v100}
    out = run(facts)
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1 and "node01" in fails[0].message and "node00" not in fails[0].message
    assert "7.0" in fails[0].message
    assert out["node01"].status == Status.FAIL and "node00" not in out
    # the same config on the recorded H100 (compute capability 9.0) passes
    assert run(make_facts(cfg("zero2_bf16_7b.json")))["*"].status == Status.PASS


def test_fp16_static_loss_scale_without_clipping_warns():
    warns = of(run(make_facts(cfg("fp16_static_no_clip.json")))["*"], Status.WARN)
    assert len(warns) == 1 and "static loss_scale of 128" in warns[0].message
    config = D.load_config(cfg("fp16_static_no_clip.json"))[0]
    config["gradient_clipping"] = 1.0
    assert not non_pass(run(make_facts(cfg("fp16_static_no_clip.json"), config=config))["*"])
    config["gradient_clipping"] = 0
    config["fp16"]["loss_scale"] = 0
    assert not non_pass(run(make_facts(cfg("fp16_static_no_clip.json"), config=config))["*"])


# --- ZeRO memory --------------------------------------------------------------------------------

def test_estimators_follow_deepspeed_formulas():
    N, L = 13e9, 0.4e9
    for g, nodes in ((8, 1), (8, 4), (4, 2)):
        G = g * nodes
        assert memory.estimate_zero2(N, g, nodes, cpu_offload=True) == (int(N * max(4 * G, 16) * 1.5), int(2 * N))
        assert memory.estimate_zero2(N, g, nodes, cpu_offload=False)[1] == int(2 * N + int(18 * N / G))
        assert memory.estimate_zero3(N, L, g, nodes, True, True)[1] == int(4 * L)
        assert memory.estimate_zero3(N, L, g, nodes, True, False)[1] == int(4 * L + int(2 * N / G))
        assert memory.estimate_zero3(N, L, g, nodes, False, False)[1] == int(4 * L + int(18 * N / G))
        assert memory.estimate_zero3(N, L, g, nodes, True, True)[0] == int(N * 18 / nodes * 1.5)


def test_zero2_bf16_7b_on_8_h100_gives_no_findings():
    out = run(make_facts(cfg("zero2_bf16_7b.json"), hosts=1, slots=8, model_params=7e9))
    assert set(out) == {"*"}
    assert out["*"].status == Status.PASS and non_pass(out["*"]) == []
    est = (2 * 7e9 + 18 * 7e9 / 8) / GiB
    assert f"{est:.1f} GiB/GPU" in out["*"].message and "79.2 GiB" in out["*"].message


def test_zero2_too_big_fails_and_suggests_a_stage_that_fits():
    facts = make_facts(cfg("zero2_bf16_7b.json"), hosts=4, slots=8, model_params=70e9, largest_layer_params=1e9)
    config = facts["config"]
    config["train_batch_size"] = 4 * 8 * 32  # keep the batch math right for 32 GPUs
    out = run(facts)
    fails = of(out["*"], Status.FAIL)
    free = h100_gpu()["memory_free"]
    need = 2 * 70e9 + 18 * 70e9 / 32
    assert need > free
    assert len(fails) == 1 and f"{need / GiB:.1f} GiB per GPU" in fails[0].message
    assert "ZeRO-3" in fails[0].fix and f"{(4 * 1e9 + 18 * 70e9 / 32) / GiB:.1f} GiB" in fails[0].fix
    assert all(out[f"node{i:02d}"].status == Status.FAIL for i in range(4))


def test_one_host_with_a_busy_gpu_is_named():
    facts = make_facts(cfg("zero2_bf16_7b.json"), hosts=2, slots=8, model_params=7e9)
    facts["config"]["train_batch_size"] = 4 * 8 * 16
    busy = [h100_gpu(i) for i in range(8)]
    busy[3]["memory_free"] = 10 * GiB  # a stray process holds GPU 3
    facts["host_facts"]["node01"]["gpu"] = {"gpus": busy}
    out = run(facts)
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1 and "node01" in fails[0].message and "node00" not in fails[0].message
    assert out["node01"].status == Status.FAIL and "GPU 3" in out["node01"].message and "node00" not in out


def test_zero3_offload_13b_fits_on_big_memory_hosts_and_fails_on_small_ones():
    big = dict(recorded_meminfo(), mem_total=1024 * GiB, mem_available=1000 * GiB)
    facts = make_facts(cfg("zero3_offload_13b.json"), hosts=1, slots=8, mem=big,
                       model_params=13e9, largest_layer_params=0.33e9)
    out = run(facts)
    assert out["*"].status == Status.PASS and non_pass(out["*"]) == [], [f.message for f in non_pass(out["*"])]
    # the recorded host has 125 GiB available; DeepSpeed's estimate is 13e9 * 18 * 1.5 bytes
    need = 13e9 * 18 * 1.5
    recorded = recorded_meminfo()
    assert need > recorded["mem_available"]
    facts = make_facts(cfg("zero3_offload_13b.json"), hosts=2, slots=8, model_params=13e9,
                       largest_layer_params=0.33e9)
    facts["host_memory"]["node00"] = big
    out = run(facts)
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1 and "node01" in fails[0].message and "node00" not in fails[0].message
    assert f"{13e9 * 18 / 2 * 1.5 / GiB:.1f} GiB" in fails[0].message
    assert out["node01"].status == Status.FAIL and "node00" not in out


def test_stage3_for_a_small_model_warns():
    big = dict(recorded_meminfo(), mem_available=1000 * GiB)
    out = run(make_facts(cfg("zero3_offload_13b.json"), mem=big, model_params=1e9, largest_layer_params=0.1e9))
    warns = of(out["*"], Status.WARN)
    assert len(warns) == 1 and "fits comfortably with ZeRO-2" in warns[0].message
    assert f"{(2 * 1e9 + 18 * 1e9 / 8) / GiB:.1f} GiB" in warns[0].message


def test_memory_skips_without_gpu_facts():
    facts = make_facts(cfg("zero2_bf16_7b.json"), model_params=7e9)
    for n in facts["host_facts"]:
        facts["host_facts"][n]["gpu"] = None
    out = run(facts)
    skips = of(out["*"], Status.SKIP)
    assert out["*"].status == Status.PASS
    assert len(skips) == 1 and "no GPU facts" in skips[0].message
    assert not of(out["*"], Status.FAIL) and not of(out["*"], Status.WARN)


def test_pin_memory_with_small_memlock_warns():
    big = dict(recorded_meminfo(), mem_available=1000 * GiB)
    facts = make_facts(cfg("zero3_offload_13b.json"), hosts=2, mem=big)
    facts["host_memory"]["node01"]["memlock_soft"] = 8 * 1024 * 1024  # systemd's default 8 MiB
    out = run(facts)
    warns = of(out["*"], Status.WARN)
    assert len(warns) == 1 and "node01" in warns[0].message and "8192 KiB" in warns[0].message
    assert out["node01"].status == Status.WARN and "node00" not in out


def test_pin_memory_default_follows_the_hosts_deepspeed():
    """offload_optimizer without pin_memory: DeepSpeed >= 0.19.5 pins (mlock) by default, 0.19.4 does not."""
    facts = make_facts(cfg("real_zero_tutorial_offload.json"), hosts=2, slots=4)  # 64 = 8 x 1 x 8 GPUs
    assert "pin_memory" not in facts["config"]["zero_optimization"]["offload_optimizer"]
    for n in facts["host_memory"]:
        facts["host_memory"][n]["memlock_soft"] = 64 * 1024  # Docker's default 64 KiB
    with_version(facts, {"node00": "0.19.4", "node01": "0.19.8"})
    out = run(facts)
    warns = of(out["*"], Status.WARN)
    assert len(warns) == 1 and "node01" in warns[0].message and "node00" not in warns[0].message
    assert "pins by default" in warns[0].message and "64 KiB" in warns[0].message
    facts["config"]["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    assert not of(run(facts)["*"], Status.WARN)


# --- offload paths and ops --------------------------------------------------------------------------

def nvme_entry(path: str, **kw: Any) -> Dict[str, Any]:
    e = {"path": path, "exists": True, "is_dir": True, "writable": True, "fstype": "xfs", "free_bytes": 2 << 40,
         "write_Bps": 2.5e9, "read_Bps": 3.0e9, "direct": True, "test_bytes": 1 << 30, "error": None}
    e.update(kw)
    return e


def test_nvme_paths_and_required_ops():
    config = D.load_config(cfg("zero3_nvme.json"))[0]
    assert parse.nvme_paths(config) == ["/local_nvme"]
    assert D.required_ops(config) == ["async_io", "cpu_adam"]
    assert parse.nvme_paths(D.load_config(cfg("zero3_offload_13b.json"))[0]) == []
    assert D.required_ops(D.load_config(cfg("zero3_offload_13b.json"))[0]) == ["cpu_adam"]
    assert D.required_ops(D.load_config(cfg("zero2_bf16_7b.json"))[0]) == ["fused_adam"]
    config = D.load_config(cfg("zero2_bf16_7b.json"))[0]
    config["optimizer"]["params"]["torch_adam"] = True
    assert D.required_ops(config) == []
    config["optimizer"] = {"type": "Lion", "params": {}}
    assert D.required_ops(config) == ["fused_lion"]
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert D.required_ops(config) == ["cpu_lion"]


def test_nvme_offload_fails_where_async_io_is_not_compatible():
    """The recorded host has no libaio-dev: ds_report says async_io [NO] [NO]."""
    nv = {"paths": [nvme_entry("/local_nvme")]}
    out = run(make_facts(cfg("zero3_nvme.json"), hosts=2, nvme=nv))
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1 and "async_io" in fails[0].message and "node00, node01" in fails[0].message
    assert "libaio-dev" in fails[0].fix
    out = run(make_facts(cfg("zero3_nvme.json"), hosts=2, nvme=nv, ds_report=ds_report_with_libaio()))
    assert out["*"].status == Status.PASS and non_pass(out["*"]) == []


def test_nvme_path_missing_or_unwritable_on_one_host():
    facts = make_facts(cfg("zero3_nvme.json"), hosts=3, ds_report=ds_report_with_libaio(),
                       nvme={"paths": [nvme_entry("/local_nvme/")]})
    facts["host_facts"]["node01"]["nvme"] = {"paths": [nvme_entry("/local_nvme", exists=False, is_dir=False,
                                                                  writable=False, error="does not exist")]}
    facts["host_facts"]["node02"]["nvme"] = {"paths": [nvme_entry("/local_nvme", writable=False,
                                                                  error="not writable (access(W_OK) denied)")]}
    out = run(facts)
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1 and "node01, node02" in fails[0].message and "node00" not in fails[0].message
    assert "does not exist" in out["node01"].message and "not writable" in out["node02"].message
    assert "node00" not in out


def test_nvme_without_path_fails():
    fails = of(run(make_facts(cfg("nvme_no_path.json"), ds_report=ds_report_with_libaio()))["*"], Status.FAIL)
    assert len(fails) == 1 and "nvme_path is not set" in fails[0].message


def test_cpu_adam_not_compatible_on_one_host():
    facts = make_facts(cfg("zero3_offload_13b.json"), hosts=2)
    facts["host_facts"]["node01"]["ds_report"]["ops"]["cpu_adam"] = {"installed": False, "compatible": False,
                                                                     "note": None}
    out = run(facts)
    fails = of(out["*"], Status.FAIL)
    assert len(fails) == 1 and "cpu_adam" in fails[0].message and "node01" in fails[0].message
    assert out["node01"].status == Status.FAIL and "node00" not in out


def test_unknown_optimizer_and_scheduler_fail_with_known_names():
    fails = of(run(make_facts(cfg("unknown_optimizer_scheduler.json")))["*"], Status.FAIL)
    assert len(fails) == 2
    opt, sched = fails
    assert "'AdamX'" in opt.message and "adamw" in opt.message and "SGD" in opt.message
    assert "'WarmupCosine'" in sched.message and "did you mean 'WarmupCosineLR'" in sched.message


def test_optimizer_rules():
    fails = of(run(make_facts(cfg("sgd_zero_untested.json")))["*"], Status.FAIL)
    assert len(fails) == 1 and "zero_allow_untested_optimizer" in fails[0].message
    config = D.load_config(cfg("sgd_zero_untested.json"))[0]
    config["zero_allow_untested_optimizer"] = True
    assert not non_pass(run(make_facts(cfg("sgd_zero_untested.json"), config=config))["*"])
    fails = of(run(make_facts(cfg("max_grad_norm.json")))["*"], Status.FAIL)
    assert len(fails) == 1 and "max_grad_norm" in fails[0].message and "gradient_clipping" in fails[0].fix


def test_onebit_adam_with_zero_and_on_new_deepspeed():
    facts = make_facts(cfg("onebit_zero.json"))
    for n in facts["host_facts"]:
        facts["host_facts"][n]["ds_report"]["deepspeed"] = "0.16.0"
    fails = of(run(facts)["*"], Status.FAIL)
    assert len(fails) == 1 and "not compatible with ZeRO" in fails[0].message
    fails = of(run(make_facts(cfg("onebit_zero.json")))["*"], Status.FAIL)  # recorded: 0.19.8
    assert any("removed in DeepSpeed 0.19.7" in f.message for f in fails)


# --- DeepSpeed versions -----------------------------------------------------------------------------

def with_version(facts: Dict[str, Any], versions: Dict[str, Optional[str]]) -> Dict[str, Any]:
    for host, v in versions.items():
        facts["host_facts"][host]["ds_report"]["deepspeed"] = v
    return facts


def test_keys_newer_than_the_hosts_deepspeed_warn():
    facts = with_version(make_facts(cfg("version_keys.json"), hosts=2), {"node00": "0.9.0", "node01": "0.19.8"})
    out = run(facts)
    warns = of(out["*"], Status.WARN)
    gate = K.ZERO["zero_quantized_weights"]["added"]
    assert any(f"zero_optimization.zero_quantized_weights needs DeepSpeed >= {gate[1]}" in w.message
               and "node00" in w.message and "node01" not in w.message for w in warns)
    assert not any("communication_data_type" in w.message for w in warns)  # 0.9.0 has it
    fails = of(out["*"], Status.FAIL)  # sparse_attention: removed in 0.19.7, node01 runs 0.19.8
    assert len(fails) == 1 and "sparse_attention" in fails[0].message and "node01" in fails[0].message
    assert out["node00"].status == Status.WARN and out["node01"].status == Status.FAIL
    facts = with_version(make_facts(cfg("version_keys.json")), {"node00": "0.5.7"})
    warns = of(run(facts)["*"], Status.WARN)
    assert any(w.message.startswith("communication_data_type needs DeepSpeed >= 0.5.8") for w in warns)


def test_versions_unknown_removed_key_warns_and_added_key_is_silent():
    facts = with_version(make_facts(cfg("version_keys.json")), {"node00": None})
    out = run(facts)
    assert not of(out["*"], Status.FAIL)
    warns = of(out["*"], Status.WARN)
    assert len(warns) == 1 and "sparse_attention was removed" in warns[0].message


def test_optimizer_newer_than_hosts_fails():
    config = D.load_config(cfg("zero2_bf16_7b.json"))[0]
    config["optimizer"] = {"type": "Lion", "params": {"lr": 1e-4}}
    facts = with_version(make_facts(cfg("zero2_bf16_7b.json"), config=config), {"node00": "0.10.0"})
    facts["host_facts"]["node00"]["ds_report"]["ops"]["fused_lion"] = {"installed": False, "compatible": True}
    fails = of(run(facts)["*"], Status.FAIL)
    assert len(fails) == 1 and "optimizer type Lion needs DeepSpeed >= 0.12.0" in fails[0].message


def test_version_gates_are_consistent():
    order = [parse.parse_version(v) for v in K.SAMPLED_VERSIONS]
    assert order == sorted(order)
    tables = [K.TOP_LEVEL, K.DS_OPTIMIZERS, K.DS_SCHEDULERS] + list(K.SECTIONS.values())
    for table in tables:
        for key, info in table.items():
            for gate in ("added", "removed"):
                if gate in info:
                    a, b = info[gate]
                    assert a in K.SAMPLED_VERSIONS and b in K.SAMPLED_VERSIONS, (key, gate)
                    assert K.SAMPLED_VERSIONS.index(b) == K.SAMPLED_VERSIONS.index(a) + 1 or \
                        parse.parse_version(a) < parse.parse_version(b), (key, gate)
            if "added" in info and "removed" in info:
                assert parse.parse_version(info["added"][1]) <= parse.parse_version(info["removed"][0]), key
    assert parse.parse_version("0.14.5+cu121") == (0, 14, 5) and parse.parse_version("unknown") is None


# --- DeepSpeed's own models (when importable) ---------------------------------------------------------

def install_fake_deepspeed(monkeypatch):
    """A stand-in 'deepspeed' whose ZeRO and fp16 configs are pydantic models with extra='forbid', like DeepSpeed's."""
    pydantic = pytest.importorskip("pydantic")

    class Model(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)

        def __init__(self, **data):  # DeepSpeedConfigModel drops "auto" values
            super().__init__(**{k: v for k, v in data.items() if v != "auto"})

    class Offload(Model):
        device: str = "none"
        pin_memory: bool = False

    class Zero(Model):
        stage: int = pydantic.Field(0, ge=0, le=3)
        overlap_comm: Optional[bool] = None
        offload_optimizer: Optional[Offload] = None
        prefetch_bucket_size: int = pydantic.Field(50000000, alias="stage3_prefetch_bucket_size")

    class FP16(Model):
        enabled: bool = False
        loss_scale: float = 0

    class DeepSpeedConfig:  # runtime/config.py: _initialize_params builds each section's model
        def _initialize_params(self, param_dict):
            Zero(**param_dict.get("zero_optimization", {}))
            FP16(**param_dict.get("fp16", {}))

    mods = {}
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.config"):
        mods[name] = types.ModuleType(name)
    mods["deepspeed"].__version__ = "9.9.9"
    mods["deepspeed.runtime.config"].DeepSpeedConfig = DeepSpeedConfig
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def test_validate_with_deepspeed_models(monkeypatch, tmp_path):
    install_fake_deepspeed(monkeypatch)
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                             "fp16": {"enabled": True, "loss_scale": "auto"},
                             "zero_optimization": {"stage": 7, "stage3_prefetch_bucket_size": "auto",
                                                   "offload_optimizer": {"device": "cpu", "pin_memroy": True}}}))
    config = D.load_config(str(p))[0]
    res = deepspeed_models.validate_with_deepspeed(config)
    assert res["version"] == "9.9.9" and set(res["sections"]) == {"zero_optimization", "fp16"}
    locs = {(e["section"], tuple(e["loc"])): e["type"] for e in res["errors"]}
    assert locs[("zero_optimization", ("offload_optimizer", "pin_memroy"))] == "extra_forbidden"
    assert ("zero_optimization", ("stage",)) in locs
    out = run(make_facts(str(p), deepspeed_models=res))
    fails = of(out["*"], Status.FAIL)
    msgs = " | ".join(f.message for f in fails)
    assert "zero_optimization.offload_optimizer.pin_memroy" in msgs and "DeepSpeed 9.9.9" in msgs
    assert "did you mean 'pin_memory'" in msgs
    assert "zero_optimization.stage: invalid value" in msgs
    # the section DeepSpeed validated is not checked twice from our tables
    assert sum("pin_memroy" in f.message for f in fails) == 1


def test_coordinator_deepspeed_older_than_the_hosts_does_not_reject_newer_keys():
    """The coordinator's DeepSpeed may predate a key the hosts' DeepSpeed has: the hosts' version decides."""
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    old_models = {"version": "0.9.0", "sections": ["zero_optimization"],
                  "errors": [{"section": "zero_optimization", "loc": ["zero_quantized_weights"],
                              "type": "extra_forbidden", "msg": "Extra inputs are not permitted"}]}
    facts = make_facts(cfg("zero2_bf16_7b.json"), config=config, deepspeed_models=old_models)
    assert not non_pass(run(facts)["*"])  # hosts run 0.19.8, which has it
    with_version(facts, {"node00": "0.9.0"})
    warns = of(run(facts)["*"], Status.WARN)
    assert len(warns) == 1 and "zero_quantized_weights needs DeepSpeed >= 0.10.0" in warns[0].message


def test_validate_with_real_deepspeed_when_installed():
    pytest.importorskip("deepspeed")
    res = deepspeed_models.validate_with_deepspeed({"zero_optimization": {"stage": 2, "overlap_comms": True}})
    assert res is not None and "zero_optimization" in res["sections"]
    assert any(e["loc"][-1:] == ["overlap_comms"] for e in res["errors"])


def test_validate_without_deepspeed_returns_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    assert deepspeed_models.validate_with_deepspeed({"zero_optimization": {"stage": 2}}) is None


# --- real-world configs: no false positives ----------------------------------------------------------

@pytest.mark.parametrize("name,hosts,slots", [
    ("real_hf_zero2_auto.json", 2, 8), ("real_hf_zero3_auto.json", 2, 8), ("real_ds_docs_fp16_adam.json", 1, 8),
    ("real_zero_tutorial_offload.json", 1, 8), ("real_zero_infinity.json", 2, 8),
    ("real_megatron_ds_bf16.json", 2, 8), ("real_hjson_comments.hjson", 2, 8),
])
def test_real_world_configs_have_no_fail_or_warn(name, hosts, slots):
    big = dict(recorded_meminfo(), mem_total=1024 * GiB, mem_available=1000 * GiB)
    facts = make_facts(cfg(name), hosts=hosts, slots=slots, ds_report=ds_report_with_libaio(), mem=big,
                       nvme={"paths": [nvme_entry("/local_nvme")]})
    assert facts["config"], name
    # where DeepSpeed is importable, its own pydantic models must accept these configs too
    facts["deepspeed_models"] = deepspeed_models.validate_with_deepspeed(facts["config"])
    assert not (facts["deepspeed_models"] or {}).get("errors"), (name, facts["deepspeed_models"])
    out = run(facts, TH_HF if "_auto" in name else TH)  # transformers' configs: its Trainer fills "auto"
    bad = [f.message for o in out.values() for f in o.findings if f.status in (Status.FAIL, Status.WARN,
                                                                              Status.ERROR)]
    assert bad == [], (name, bad)
    assert out["*"].status == Status.PASS


# --- host side and coordinator ----------------------------------------------------------------------

def test_host_memory_reads_this_machine():
    ctx = HostContext(params={}, deadline=time.monotonic() + 10)
    res = ds_host.memory({}, ctx)
    text = Path("/proc/meminfo").read_text()
    total = int(re.search(r"^MemTotal:\s+(\d+) kB", text, re.M).group(1)) * 1024
    assert res["mem_total"] == total and res["error"] is None
    assert 0 < res["mem_available"] <= total
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert res["memlock_soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert res["memlock_hard"] == (None if hard == resource.RLIM_INFINITY else hard)
    json.dumps(res)


def FakeCluster(config_path: str, hosts: int = 2, fail_on: str = "", **options: Any) -> testing.FakeCluster:
    """node00.. with 8 recorded H100s each; the host probe runs in this process, and raises on ``fail_on``."""
    names = [f"node{i:02d}" for i in range(hosts)]

    def probe(host: str, params: Dict[str, Any], timeout: float) -> Any:
        if host == fail_on:
            raise RuntimeError("agent died")
        return testing.run_host_function("ds_config.host.probe", params, timeout)

    opts = testing.check_options(**{"deepspeed_config": config_path, "model_params": None, "largest_layer_params": None,
                           **options})
    facts = {h: {"gpu": {"gpus": [h100_gpu(i) for i in range(8)]}, "ds_report": recorded_ds_report()} for h in names}
    return testing.FakeCluster(names, slots=8, thresholds=TH, facts=facts, options=opts,
                             handlers={"ds_config.host.probe": probe})


def called(cluster: testing.FakeCluster) -> List[Any]:
    return sorted((host, func) for host, func, _ in cluster.calls)


def test_coordinate_gathers_json_facts_and_calls_host_memory():
    cluster = FakeCluster(cfg("zero3_offload_13b.json"), model_params=13e9)
    facts = D.coordinate(cluster)
    json.dumps(facts)
    assert facts["config"]["zero_optimization"]["stage"] == 3 and facts["load_findings"] == []
    assert facts["world_size"] == 16 and [h["name"] for h in facts["hosts"]] == ["node00", "node01"]
    assert called(cluster) == [("node00", "ds_config.host.probe"), ("node01", "ds_config.host.probe")]
    assert facts["host_memory"]["node00"]["mem_total"] > 0
    assert facts["host_facts"]["node00"]["gpu"]["gpus"][0]["cc"] == [9, 0]
    assert facts["host_facts"]["node00"]["nvme"] is None
    out = D.evaluate(facts, TH)
    assert "*" in out


def test_coordinate_records_host_failures_and_bad_configs():
    cluster = FakeCluster(cfg("zero3_offload_13b.json"), fail_on="node01", model_params=13e9,
                          largest_layer_params=0.3e9)
    facts = D.coordinate(cluster)
    assert "agent died" in facts["host_memory"]["node01"]["error"]
    out = D.evaluate(facts, TH)
    skips = of(out["*"], Status.SKIP)
    assert any("node01" in s.message and "host memory unknown" in s.message for s in skips)
    # no host memory asked for a config without offload (issue 24: every host is probed now, for the config file
    # the ranks will open there, but not for its memory)
    cluster = FakeCluster(cfg("zero2_bf16_7b.json"))
    D.coordinate(cluster)
    assert called(cluster) == [("node00", "ds_config.host.probe"), ("node01", "ds_config.host.probe")]
    assert all(params["memory"] is False and params["config_path"] == os.path.abspath(cfg("zero2_bf16_7b.json"))
               for _, _, params in cluster.calls)
    facts = D.coordinate(FakeCluster(cfg("bad_syntax.json")))
    assert facts["config"] is None and facts["load_findings"][0]["status"] == "fail"
    assert D.evaluate(facts, TH)["*"].status == Status.FAIL


def test_thresholds_come_only_from_defaults_toml():
    facts = make_facts(cfg("zero2_bf16_7b.json"), model_params=7e9)
    assert run(facts)["*"].status == Status.PASS
    # no fallback copy in the module: a merged config without [ds_config] is an error that names the section
    with pytest.raises(ThresholdsError, match=r"\[ds_config\]"):
        run(facts, thresholds={})


# --- issue 13: severities that match what DeepSpeed does ---------------------------------------------

REAL_WORLD = HERE / "ds_configs" / "real_world"
# The unknown top-level keys these configs carry: DeepSpeed ignores them and runs, so they WARN (never FAIL).
IGNORED_TOP_LEVEL = {"dsexamples_bert_squad.json": {"cuda_visible_devices"}, "internvl_zero1_log.json": {"log"},
                     "llamafactory_z3_offload.json": {"comms_config", "monitor_config"}}


# Configs of projects whose script runs through transformers' Trainer, which fills "auto" ([ds_config] integration
# = "hf"): axolotl, LLaMA-Factory and InternVL train with it, and transformers' own tests.
HF_TRAINER = {"axolotl_zero1.json", "axolotl_zero3_bf16_cpuoffload_all.json", "hf_tests_zero2.json",
              "hf_tests_zero3.json", "internvl_zero1_log.json", "llamafactory_z3_offload.json"}


def deepspeed_accepts(config: Dict[str, Any]) -> bool:
    """DeepSpeed 0.19's own parsing of the whole config (what deepspeed.initialize runs before the batch math)."""
    runtime_config = pytest.importorskip("deepspeed.runtime.config")
    parser = runtime_config.DeepSpeedConfig.__new__(runtime_config.DeepSpeedConfig)
    runtime_config._reject_removed_config_keys(copy.deepcopy(config))
    parser._initialize_params(copy.deepcopy(config))
    return True


@pytest.mark.parametrize("name", sorted(p.name for p in REAL_WORLD.glob("*.json")))
def test_real_world_shaped_configs_that_deepspeed_accepts_have_no_fail(name):
    """Shapes of DeepSpeedExamples, transformers' tests/deepspeed, Megatron-DeepSpeed, LLaMA-Factory, axolotl and
    InternVL configs, on 2 hosts x 8 H100 with every op usable and DeepSpeed 0.19.8 on the hosts."""
    path = str(REAL_WORLD / name)
    big = dict(recorded_meminfo(), mem_total=1024 * GiB, mem_available=1000 * GiB)
    facts = make_facts(path, hosts=2, slots=8, ds_report=ds_report_with_libaio(), mem=big)
    assert facts["config"] and deepspeed_accepts(facts["config"])
    facts["deepspeed_models"] = deepspeed_models.validate_with_deepspeed(facts["config"])
    assert facts["deepspeed_models"]["errors"] == [] and facts["deepspeed_models"]["param_errors"] == []
    out = run(facts, TH_HF if name in HF_TRAINER else TH)
    findings = [f for o in out.values() for f in o.findings]
    assert [f.message for f in findings if f.status in (Status.FAIL, Status.ERROR)] == [], name
    warned = {f.message.split(":")[0] for f in findings if f.status == Status.WARN}
    expected = set(IGNORED_TOP_LEVEL.get(name, set()))
    if name == "megatron_ds_tp2.json":  # right only with tensor parallelism: a WARN naming the option
        expected.add("batch math fails with train_batch_size=32, train_micro_batch_size_per_gpu=4 (world size 16)")
    assert warned == expected, (name, warned)


def test_unknown_top_level_key_fails_only_as_a_near_miss(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {"stage": 3},
                             "Train_Batch_Size": 8, "fp61": {"enabled": True}, "cuda_visible_devices": "0,1",
                             "log": {"enable": False}, "comms_config": {}, "monitor_config": {}}))
    out = run(make_facts(str(p)))
    fails = {f.message.split(":")[0]: f for f in of(out["*"], Status.FAIL)}
    warns = {f.message.split(":")[0] for f in of(out["*"], Status.WARN)}
    assert set(fails) == {"zero_optimisation", "Train_Batch_Size", "fp61"}
    assert "did you mean 'zero_optimization'" in fails["zero_optimisation"].message
    assert "zero_optimization keeps its default" in fails["zero_optimisation"].message
    assert fails["fp61"].fix == "rename fp61 to fp16"
    assert warns == {"cuda_visible_devices", "log", "comms_config", "monitor_config"}


def test_ignored_section_keys_warn_unless_near_misses_and_forbidden_ones_fail(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                             "activation_checkpointing": {"partition_activation": True, "my_note": 1},
                             "zero_optimization": {"stage": 1, "my_note": 1}}))
    fails = {f.message.split(":")[0] for f in of(run(make_facts(str(p)))["*"], Status.FAIL)}
    warns = {f.message.split(":")[0] for f in of(run(make_facts(str(p)))["*"], Status.WARN)}
    # activation_checkpointing is read with dict.get: a typo silently keeps the default (FAIL), other keys WARN;
    # zero_optimization's model forbids extra keys: DeepSpeed refuses the config (FAIL)
    assert fails == {"activation_checkpointing.partition_activation", "zero_optimization.my_note"}
    assert warns == {"activation_checkpointing.my_note"}


@pytest.mark.parametrize("section, value", [
    ("compile", {"deepcompile": False, "offload_activaton": True}),
    ("tensor_parallel", {"autotp_size": 2, "tp_sise": 2}),
    ("weight_quantization", {"quantized_initialization": {}, "post_init_quant_typo": {}}),
])
def test_sections_deepspeed_validates_are_found_by_asking_deepspeed(section, value):
    pytest.importorskip("deepspeed")
    config = {"train_micro_batch_size_per_gpu": 1, section: value}
    res = deepspeed_models.validate_with_deepspeed(config)
    assert section in res["sections"]
    facts = make_facts(cfg("zero2_bf16_7b.json"), config=config, deepspeed_models=res)
    fails = of(run(facts)["*"], Status.FAIL)
    bad = [k for k in value if k not in ("deepcompile", "autotp_size", "quantized_initialization")][0]
    assert any(f.message.startswith(f"{section}.{bad}: unknown") and "rejects it" in f.message
               for f in fails), [f.message for f in fails]


def test_optimizer_and_scheduler_params_are_checked_against_the_constructors():
    pytest.importorskip("deepspeed")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "beta": [0.9, 0.99], "torch_adam": False}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lrr": 1e-4}}}
    res = deepspeed_models.validate_with_deepspeed(config)
    assert {(e["path"], e["key"]) for e in res["param_errors"]} == {("optimizer.params", "beta"),
                                                                     ("scheduler.params", "warmup_max_lrr")}
    assert "FusedAdam" in res["param_errors"][0]["class"]
    fails = of(run(make_facts(cfg("zero2_bf16_7b.json"), config=config, deepspeed_models=res))["*"], Status.FAIL)
    msgs = {f.message.split(":")[0]: f for f in fails}
    assert "did you mean 'betas'" in msgs["optimizer.params.beta"].message
    assert msgs["scheduler.params.warmup_max_lrr"].fix == "rename it to 'warmup_max_lr'"
    # with CPU offload DeepSpeed builds DeepSpeedCPUAdam and passes adamw_mode itself: a duplicate is a TypeError
    config["optimizer"]["params"] = {"lr": 1e-4, "adamw_mode": True}
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    errs = deepspeed_models.validate_with_deepspeed(config)["param_errors"]
    assert [(e["key"], "multiple values" in e["why"]) for e in errs if e["path"] == "optimizer.params"] == \
        [("adamw_mode", True)]
    # torch.optim classes by name, exact case (SGD takes momentum, Adagrad does not)
    for name, ok in (("SGD", True), ("Adagrad", False)):
        config = {"optimizer": {"type": name, "params": {"lr": 0.1, "momentum": 0.9}}}
        errs = deepspeed_models.validate_with_deepspeed(config)["param_errors"]
        assert (errs == []) == ok, (name, errs)


@pytest.mark.parametrize("mp, status, words", [
    (None, Status.WARN, "say so with --model-parallel-size 2"),
    (2, Status.PASS, "batch 32 = 4 x 1 x 8 (world size 16 / model-parallel size 2)"),
    (1, Status.FAIL, "batch math fails with train_batch_size=32, train_micro_batch_size_per_gpu=4 (world size 16)"),
    (3, Status.FAIL, "world size 16 is not a multiple of --model-parallel-size 3"),
])
def test_model_parallel_size_decides_the_batch_math(mp, status, words):
    facts = make_facts(str(REAL_WORLD / "megatron_ds_tp2.json"), hosts=2, slots=8,
                       ds_report=ds_report_with_libaio(), model_parallel_size=mp)
    star = run(facts)["*"]
    assert star.status == status, [f.message for f in star.findings]
    assert any(words in f.message for f in star.findings), [f.message for f in star.findings]


def test_host_probe_reads_the_version_and_tests_offload_paths(tmp_path):
    ok, missing, afile = tmp_path / "ok", tmp_path / "missing", tmp_path / "file"
    ok.mkdir()
    afile.write_text("x")
    ctx = HostContext(params={}, deadline=time.monotonic() + 10)
    res = ds_host.probe({"nvme_paths": [str(ok), str(missing), str(afile)], "memory": True}, ctx)
    by = {e["path"]: e for e in res["paths"]}
    assert by[str(ok)]["writable"] and by[str(ok)]["error"] is None
    assert not by[str(missing)]["exists"] and by[str(missing)]["error"] == "does not exist"
    assert by[str(afile)]["exists"] and not by[str(afile)]["is_dir"]
    assert os.listdir(ok) == []  # the test file is gone
    assert res["memory"]["mem_total"] > 0
    try:
        import importlib.metadata
        want: Optional[str] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        want = None
    assert res["deepspeed"] == want


def test_probed_version_and_paths_are_used_without_the_other_checks():
    config = json.loads((CONFIGS / "zero3_nvme.json").read_text())
    config["amp"] = {"enabled": False}  # removed in 0.19.8: judged by the probed version
    facts = make_facts(cfg("zero3_nvme.json"), hosts=2, ds_report=ds_report_with_libaio(), config=config)
    for n in facts["host_facts"]:
        facts["host_facts"][n] = {"gpu": facts["host_facts"][n]["gpu"], "ds_report": None, "nvme": None,
                                  "python": None}
    path = D.nvme_paths(config)[0]
    facts["host_probe"] = {
        "node00": {"deepspeed": "0.19.8", "paths": [{"path": path, "exists": True, "is_dir": True, "writable": True,
                                                     "error": None}]},
        "node01": {"deepspeed": "0.19.8", "paths": [{"path": path, "exists": False, "is_dir": False,
                                                     "writable": False, "error": "does not exist"}]}}
    out = run(facts)
    assert out["node01"].status == Status.FAIL and path in out["node01"].message
    assert path not in " ".join(f.message for f in out["node00"].findings)
    assert any(f.status == Status.FAIL and f.message.startswith("amp was removed in DeepSpeed 0.19.8")
               and "node00, node01 run 0.19.8" in f.message for f in out["*"].findings)


def test_cli_stops_on_a_config_that_does_not_parse_with_file_line_col(tmp_path):
    import subprocess
    bad = tmp_path / "ds.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,,}\n}\n')
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--deepspeed-config", str(bad), "--checks",
                           "ds_config"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"preflight: error: {bad}:3:28: DeepSpeed config does not parse")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_probe_without_deepspeed_fails_on_that_host():
    facts = make_facts(cfg("zero2_bf16_7b.json"), hosts=2, ds_report=ds_report_with_libaio())
    facts["host_probe"] = {"node00": {"deepspeed": "0.19.8", "deepspeed_found": True, "paths": []},
                           "node01": {"deepspeed": None, "deepspeed_found": False, "paths": []}}
    out = run(facts)
    assert out["node01"].status == Status.FAIL and "not installed" in out["node01"].message
    assert "node00" not in out


def test_a_deepspeed_whose_parser_cannot_run_alone_falls_back_to_the_tables(monkeypatch):
    install_fake_deepspeed(monkeypatch)
    runtime_config = sys.modules["deepspeed.runtime.config"]

    class Broken(runtime_config.DeepSpeedConfig):
        def _initialize_params(self, param_dict):
            return self.world_size  # set only by __init__ in this imagined release

    monkeypatch.setattr(runtime_config, "DeepSpeedConfig", Broken)
    assert deepspeed_models.validate_with_deepspeed({"zero_optimization": {"stage": 2}}) is None


def test_the_unusable_nvme_path_fix_works_when_pasted_with_an_odd_path(tmp_path):
    """The fix names the user's path quoted: pasted into bash it creates that directory, and nothing else runs."""
    from preflight.checks.ds_config.findings import Report
    from preflight.checks.ds_config.offload import check_nvme

    path = str(tmp_path / "nv me $(touch pwned)")
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path}}}
    facts = {"hosts": [{"name": "node01"}],
             "host_facts": {"node01": {"nvme": {"paths": [{"path": path, "exists": False}]}}}}
    report = Report()
    check_nvme(config, facts, report)
    (finding,) = [f for f in report.star if f.status.value == "fail"]
    command = finding.fix.split("as root: ", 1)[1]
    r = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "USER": "root"})
    assert r.returncode == 0, r.stderr
    assert os.path.isdir(path) and not (tmp_path / "pwned").exists()
