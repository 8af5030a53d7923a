"""Batch-size math as DeepSpeedConfig._configure_train_batch_size does it, against the cluster's world size.

E.g. ``"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2`` on 16 GPUs
-> "64 != 4 * 2 * 16": FAIL with the corrected values. Pure.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...hostside import hfauto
from ...hostside.outcome import Status
from .parse import config_section
from .findings import Report, num


def resolve_batch(tb: Optional[float], mb: Optional[float], ga: Optional[float],
                  world_size: float) -> Tuple[Optional[Dict[str, float]], Optional[str]]:
    """Mirror _set_batch_related_parameters + _batch_assertion: (resolved values, None) or (values, error)."""
    ws = world_size
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = tb // mb
        ga //= ws
    elif tb is not None and ga is not None:
        mb = tb // ws
        mb //= ga
    elif mb is not None and ga is not None:
        tb = mb * ga
        tb *= ws
    elif tb is not None:
        ga = 1
        mb = tb // ws
    elif mb is not None:
        tb = mb * ws
        ga = 1
    else:
        return None, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
    values = {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga}
    if not tb > 0:
        return values, f"Train batch size: {num(tb)} has to be greater than 0"
    if not mb > 0:
        return values, f"Micro batch size per gpu: {num(mb)} has to be greater than 0"
    if not ga > 0:
        return values, f"Gradient accumulation steps: {num(ga)} has to be greater than 0"
    if tb != mb * ga * ws:
        return values, ("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size "
                        f"{num(tb)} != {num(mb)} * {num(ga)} * {num(ws)}")
    return values, None


def _batch_value(config: Dict[str, Any], key: str, report: Report) -> Tuple[bool, Optional[float]]:
    """(ok, value): value None when absent or "auto"; ok False when the value is unusable (reported)."""
    if key not in config or config[key] is None:
        return True, None
    v = config[key]
    if isinstance(v, str) and v.strip().lower() == "auto":
        return True, None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        report.add(Status.FAIL, f"{key} = {v!r} (expected a positive integer, or \"auto\" with the HF/Accelerate "
                                "integration)", f"set {key} to an integer")
        return False, None
    return True, v


def check_batch(config: Dict[str, Any], world_size: int, slots: Sequence[int], report: Report,
                model_parallel: Optional[int] = None, integration: str = "deepspeed",
                also_auto: Sequence[str] = ()) -> str:
    """model_parallel: --model-parallel-size (tensor x pipeline degree), None when not given. Known, the
    data-parallel size is world / (model_parallel x sequence_parallel_size) and a mismatch is a FAIL; unknown,
    a mismatch that a tensor-parallel degree would explain is a WARN naming the option. integration: ``[ds_config]
    integration``, "hf" when transformers' Trainer or Accelerate fills the "auto" values, else plain DeepSpeed."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    vals: Dict[str, Optional[float]] = {}
    for k in keys:
        ok, v = _batch_value(config, k, report)
        if not ok:
            return ""
        vals[k] = v
    auto = [k for k in keys if isinstance(config.get(k), str)]
    if config_section(config, "elasticity").get("enabled") is True:
        return "batch set by elasticity"
    dp, dp_note = _data_parallel_size(config, world_size, model_parallel, report)
    if dp is None:
        return ""
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    if auto:
        if integration != "hf":
            _auto_without_hf(auto, tb, mb, ga, dp, report, also_auto)
        return _auto_batch(tb, mb, ga, dp, dp_note, auto, report)

    values, err = resolve_batch(tb, mb, ga, dp)
    if err is None and values is not None:
        tb_text = num(values["train_batch_size"])
        mb_text = num(values["train_micro_batch_size_per_gpu"])
        ga_text = num(values["gradient_accumulation_steps"])
        return f"batch {tb_text} = {mb_text} x {ga_text} x {num(dp)} ({dp_note})"
    if values is None:
        report.add(Status.FAIL, f"no batch size given: {err} (DeepSpeed asserts at start)",
                   "set train_micro_batch_size_per_gpu = 1 (the batch per GPU; DeepSpeed derives train_batch_size "
                   "from it), or a train_batch_size")
        return ""
    _batch_mismatch(vals, dp, dp_note, str(err), slots, model_parallel, report)
    return ""


def _data_parallel_size(config: Dict[str, Any], world_size: int, model_parallel: Optional[int],
                        report: Report) -> Tuple[Optional[float], str]:
    """(the data-parallel size DeepSpeed will use, how it follows from the world size); None (and a FAIL) when
    the world size does not divide into the model-parallel groups."""
    sp = config.get("sequence_parallel_size")
    dp: float = world_size
    dp_note = f"world size {world_size}"
    if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1:
        dp = world_size / sp  # DeepSpeedConfig: dist.get_world_size() / config["sequence_parallel_size"]
        dp_note = f"world size {world_size} / sequence_parallel_size {sp}"
    if model_parallel is not None and model_parallel > 1:
        # DeepSpeed gets an mpu and uses its data-parallel world size: world / (tensor x pipeline [x sequence]).
        if dp % model_parallel != 0:
            report.add(Status.FAIL, f"the world size does not divide into model-parallel groups: {dp_note} is not a "
                                    f"multiple of --model-parallel-size {model_parallel}",
                       f"use a number of GPUs that is a multiple of {model_parallel}, or fix --model-parallel-size")
            return None, dp_note
        dp = dp / model_parallel
        dp_note += f" / model-parallel size {model_parallel}"
    return dp, dp_note


def _auto_without_hf(auto: List[str], tb: Optional[float], mb: Optional[float], ga: Optional[float], dp: float,
                     report: Report, also: Sequence[str] = ()) -> None:
    """"auto" under plain DeepSpeed: nothing replaces it, and DeepSpeedConfig's batch math runs on the string
    (runtime/config.py:607-648 _set_batch_related_parameters: ``train_batch // micro_batch``; :596-600
    _batch_assertion: ``train_batch > 0``), so deepspeed.initialize raises TypeError on every rank. Only the
    Hugging Face integration (transformers' HfTrainerDeepSpeedConfig, Accelerate) fills "auto" first. A WARN, not a
    FAIL: preflight cannot see which the launched script uses; ``[ds_config] integration = "hf"`` says so."""
    m = int(mb) if mb is not None else 1
    g = int(ga) if ga is not None else 1
    # Numbers that hold together: keep a fixed train_batch_size where the keys left "auto" can make it.
    if tb is not None and mb is None and tb % (g * dp) == 0 and tb // (g * dp) > 0:
        m = int(tb // (g * dp))
    elif tb is not None and ga is None and tb % (m * dp) == 0 and tb // (m * dp) > 0:
        g = int(tb // (m * dp))
    example = ", ".join(f'"{k}": {num(v)}' for k, v in (
        ("train_micro_batch_size_per_gpu", m), ("gradient_accumulation_steps", g),
        ("train_batch_size", m * g * dp)))
    and_values = f"; and values for {', '.join(also)}" if also else ""
    report.add(Status.WARN, f"{', '.join(auto)} = \"auto\": only the Hugging Face integration (transformers' "
                            f"Trainer, Accelerate) fills \"auto\"; under plain DeepSpeed the batch math runs on the "
                            f"string and deepspeed.initialize raises TypeError (runtime/config.py:596-648)"
                            + (f"; {', '.join(also)} = \"auto\" too, passed on as the string" if also else ""),
               f"put numbers in the config (e.g. {example}, train_batch_size = micro x accumulation x "
               f"{num(dp)}{and_values}), or, if the script runs through the Trainer or Accelerate, say so: a "
               f"--config file with [ds_config] integration = \"hf\" (the default)")


def _auto_batch(tb: Optional[float], mb: Optional[float], ga: Optional[float], dp: float, dp_note: str,
                auto: List[str], report: Report) -> str:
    """Some keys are "auto": the HF/Accelerate integration fills them (micro batch and accumulation from its
    arguments, train_batch_size = world_size * micro * accumulation); DeepSpeed then asserts the product."""
    if tb is None:
        return f"batch: {', '.join(auto)} filled by the HF integration"
    fixed = [v for v in (mb, ga) if v is not None]
    unit = dp
    for v in fixed:
        unit *= v
    if tb % unit != 0 or tb < unit:
        if fixed:
            factors = " x ".join([num(v) for v in fixed] + [num(dp)])
            unit_text = f"{factors} = {num(unit)}"
        else:
            unit_text = f"the world size {num(dp)}"
        near = " or ".join(num(v) for v in near_multiples(tb, unit))
        report.add(Status.FAIL,
                   f"train_batch_size {num(tb)} is not a multiple of {unit_text}: no value of {' / '.join(auto)} can "
                   f"make train_batch_size == micro_batch * grad_accum * world_size ({dp_note})",
                   f'set train_batch_size to "auto", or to {near} (a multiple of {num(unit)})')
        return ""
    factors = " x ".join([num(v) if v is not None else "auto" for v in (mb, ga)])
    return f"batch {num(tb)} = {factors} x {num(dp)}"


def _batch_mismatch(vals: Dict[str, Optional[float]], dp: float, dp_note: str, err: str, slots: Sequence[int],
                    model_parallel: Optional[int], report: Report) -> None:
    """The batch math fails: a WARN when a tensor-parallel degree would explain it (and none was given), else FAIL."""
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    given = ", ".join(f"{k}={num(v)}" for k, v in vals.items() if v is not None)
    fixes = _batch_fixes(vals, dp)
    # With tensor parallelism (DeepSpeed gets an mpu) its world size is the data-parallel size. Tensor
    # parallelism lives inside a node: a degree that divides every host's slots, leaving a data-parallel size
    # of at least 2 (with 1 nearly any batch fits, which would excuse every mistake), makes this a WARN.
    per_node = [s for s in slots if s > 0]
    if model_parallel is not None:  # the user said what the model parallelism is: no degree to guess
        per_node = []
    for degree in range(2, (min(per_node) if per_node else 1) + 1):
        if all(s % degree == 0 for s in per_node) and dp % degree == 0 and dp / degree >= 2 and \
                resolve_batch(tb, mb, ga, dp / degree)[1] is None:
            report.add(Status.WARN,
                       f"batch math fails with {given} ({dp_note}): {err}; it holds for a data-parallel size of "
                       f"{num(dp / degree)}, so it is right only if the job uses tensor parallelism of degree {degree} "
                       f"(say so with --model-parallel-size {degree}, and this becomes a PASS or a FAIL)",
                       f"if the job is purely data parallel (--model-parallel-size 1): {fixes}")
            return
    report.add(Status.FAIL, f"batch math fails with {given} ({dp_note}): {err}", fixes)


def near_multiples(value: float, unit: float) -> List[float]:
    """The multiples of ``unit`` nearest ``value``: the one below (when above 0) and the one above."""
    below = (value // unit) * unit
    return [v for v in (below, below + unit) if v > 0 and v != value]


def _batch_fixes(vals: Dict[str, Optional[float]], dp: float) -> str:
    """Corrected values, each of which passes DeepSpeed's batch assertion when pasted into the config (the other
    keys as they are): keep the micro batch and accumulation (a new train_batch_size), or keep train_batch_size (a
    new accumulation or micro batch), or, where DeepSpeed derives a key, a train_batch_size it divides evenly."""
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    out = []
    m, g = mb or 1, ga or 1
    if mb is not None or ga is not None:
        out.append(f"train_batch_size = {num(m)} x {num(g)} x {num(dp)} = {num(m * g * dp)}")
    if tb is not None:
        if mb is not None and tb % (mb * dp) == 0 and tb // (mb * dp) > 0:
            out.append(f"gradient_accumulation_steps = {num(tb // (mb * dp))} (keeping train_batch_size {num(tb)})")
        if tb % (g * dp) == 0 and tb // (g * dp) > 0:
            out.append(f"train_micro_batch_size_per_gpu = {num(tb // (g * dp))} (keeping train_batch_size {num(tb)})")
        if mb is None or ga is None:
            # DeepSpeed derives the missing key by integer division (train_batch // micro // world): the
            # product holds only for a train_batch_size that is a multiple of the keys given times the world.
            unit = m * g * dp
            for v in near_multiples(tb, unit):
                if v != m * g * dp or not (mb is not None or ga is not None):
                    out.append(f"train_batch_size = {num(v)} (a multiple of {num(unit)} near {num(tb)})")
    return "set " + ", or ".join(out) if out else "set train_micro_batch_size_per_gpu and gradient_accumulation_steps"


def plain_auto_keys(config: Dict[str, Any], model_sections: Sequence[str]) -> List[str]:
    """The "auto" values plain DeepSpeed hands on as the string, outside the batch keys."""
    return [p for p in hfauto.auto_paths(config)
            if p not in hfauto.BATCH_KEYS and p.split(".")[0] not in set(model_sections)]


def check_auto_plain(config: Dict[str, Any], model_sections: Sequence[str], report: Report) -> None:
    """``[ds_config] integration = "deepspeed"``: "auto" outside the batch keys (those have their own WARN) that
    plain DeepSpeed hands on as the string: gradient_clipping (``get_scalar_param``, compared with 0.0 by the
    engine), optimizer/scheduler params (keyword arguments of their constructors). In a section DeepSpeed reads
    with a config model, DeepSpeedConfigModel drops "auto" (runtime/config_utils.py:56) and its default applies:
    not judged here."""
    left = plain_auto_keys(config, model_sections)
    if any(hfauto.is_auto(config.get(k)) for k in hfauto.BATCH_KEYS):
        return  # the batch WARN names these keys too: one cause, one line
    if left:
        report.add(Status.WARN, f"{', '.join(left)} = \"auto\": only the Hugging Face integration fills \"auto\"; "
                                "plain DeepSpeed passes the string on where a number is expected",
                   f"put values in the config for {', '.join(left)}, or, if the script runs through the Trainer or "
                   "Accelerate, a --config file with [ds_config] integration = \"hf\" (the default)")
