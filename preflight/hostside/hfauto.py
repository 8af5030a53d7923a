"""A DeepSpeed config's "auto" values filled as the Hugging Face integration fills them (ds_config, the rehearsal).

Only transformers' Trainer (HfTrainerDeepSpeedConfig.trainer_config_process / trainer_config_finalize in
transformers/integrations/deepspeed.py) and Accelerate replace "auto" before DeepSpeed reads the config; each
value comes from the Trainer's arguments or the model, e.g. on 16 ranks::

    {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    -> {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 128, "gradient_clipping": 1.0}

(TrainingArguments' defaults: per_device_train_batch_size 8, max_grad_norm 1.0). The job's own arguments are not
known before it starts, so the defaults stand in for them, and each filled key says where its value came from.
Standard library only, Python 3.9: the launch check imports it too.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

AUTO = "auto"

# transformers' TrainingArguments defaults for the arguments trainer_config_process reads.
PER_DEVICE_TRAIN_BATCH_SIZE = 8
GRADIENT_ACCUMULATION_STEPS = 1
MAX_GRAD_NORM = 1.0
LEARNING_RATE = 5e-5
ADAM_BETAS = [0.9, 0.999]
ADAM_EPSILON = 1e-8
WEIGHT_DECAY = 0.0
FP16_OPT_LEVEL = "O1"
WARMUP_STEPS = 0
# DeepSpeed 0.19.8's own defaults (runtime/zero/config.py), standing in for the model's hidden_size when it is not
# known: the Trainer computes these three from it at start.
DS_REDUCE_BUCKET_SIZE = 500000000
DS_PREFETCH_BUCKET_SIZE = 50000000
DS_PARAM_PERSISTENCE_THRESHOLD = 100000
# The run's number of optimizer steps, unknown before it starts (the Trainer computes it from the data set).
TOTAL_STEPS = 1000

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def auto_paths(config: Any, prefix: str = "") -> List[str]:
    """The dotted paths of every "auto" value, e.g. ["train_batch_size", "optimizer.params.lr"]."""
    out: List[str] = []
    if isinstance(config, dict):
        for key, value in config.items():
            path = f"{prefix}{key}"
            if is_auto(value):
                out.append(path)
            elif isinstance(value, dict):
                out.extend(auto_paths(value, path + "."))
    return out


def _node(config: Dict[str, Any], path: str) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the dict holding the last key of ``path``, that key); None when a section on the way is missing."""
    *parents, key = path.split(".")
    node: Any = config
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), key


def _zero3(config: Dict[str, Any]) -> bool:
    zero = config.get("zero_optimization")
    return isinstance(zero, dict) and zero.get("stage") == 3


def _number(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value)


DEFAULTS = "TrainingArguments' defaults (the job's arguments replace them)"
FORMULA = "the Trainer's formula"
FROM_BATCH = "what the fixed train_batch_size needs"
DS_DEFAULTS = "DeepSpeed's defaults (the Trainer derives them from the model's hidden_size at start)"
MODEL = "the model's hidden_size"
STEPS = "the run's step count (the Trainer computes it at start)"

Fill = Tuple[str, Any, str, str]  # (dotted key, value, the group its value comes from, detail)


def _batch(config: Dict[str, Any], world_size: int) -> List[Fill]:
    """The batch keys as trainer_config_process fills them: micro batch and accumulation from the arguments,
    train_batch_size = world_size x micro x accumulation. A train_batch_size the config fixes must equal that
    product (the Trainer raises ValueError on a mismatch), so the arguments that fill the other keys must give it:
    those are chosen from it where it divides (ds_config's batch check FAILs where it does not)."""
    vals = {k: config.get(k) for k in BATCH_KEYS}
    auto = [k for k in BATCH_KEYS if is_auto(vals[k])]
    if not auto:
        return []
    ws = max(1, int(world_size))
    tb, mb, ga = (_number(vals[k]) for k in BATCH_KEYS)
    out: List[Fill] = []
    if is_auto(vals["gradient_accumulation_steps"]):
        if tb is not None and mb and tb % (ws * mb) == 0 and tb // (ws * mb) > 0:
            ga = tb // (ws * mb)
            out.append(("gradient_accumulation_steps", ga, FROM_BATCH, f"{tb} / ({ws} x {mb})"))
        else:
            ga = GRADIENT_ACCUMULATION_STEPS
            out.append(("gradient_accumulation_steps", ga, DEFAULTS, ""))
    if is_auto(vals["train_micro_batch_size_per_gpu"]):
        if tb is not None and ga and tb % (ws * ga) == 0 and tb // (ws * ga) > 0:
            mb = tb // (ws * ga)
            out.append(("train_micro_batch_size_per_gpu", mb, FROM_BATCH, f"{tb} / ({ws} x {ga})"))
        else:
            mb = PER_DEVICE_TRAIN_BATCH_SIZE
            out.append(("train_micro_batch_size_per_gpu", mb, DEFAULTS, "per_device_train_batch_size"))
    if is_auto(vals["train_batch_size"]) and mb is not None and ga is not None:
        out.append(("train_batch_size", ws * mb * ga, FORMULA, f"world size {ws} x micro batch {mb} x "
                                                               f"accumulation {ga}"))
    return out


def fill(config: Dict[str, Any], world_size: int, hidden_size: Optional[int] = None,
         total_steps: Optional[int] = None) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """(a copy of ``config`` with its "auto" values filled as the HF Trainer fills them, [{"key", "value", "from",
    "detail"}] for each filled key). world_size: the data-parallel size DeepSpeed divides the batch by.
    hidden_size: the model's, when known (else DeepSpeed's defaults stand in). A key the Trainer does not fill
    stays "auto" (in a section DeepSpeed validates with a model, its DeepSpeedConfigModel drops "auto" and uses
    the default)."""
    out = copy.deepcopy(config)
    notes: List[Dict[str, Any]] = []
    if not auto_paths(out):
        return out, notes
    lr = LEARNING_RATE
    opt = out.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    if isinstance(params, dict) and isinstance(params.get("lr"), (int, float)) and not isinstance(params["lr"], bool):
        lr = params["lr"]  # fill_match checks it against learning_rate: the job's arguments must agree with it
    if hidden_size:
        h = int(hidden_size)
        hidden: List[Fill] = [("zero_optimization.reduce_bucket_size", h * h, MODEL, f"{h} x {h}")]
        if _zero3(out):
            hidden += [("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h), MODEL, f"0.9 x {h} x {h}"),
                       ("zero_optimization.stage3_param_persistence_threshold", 10 * h, MODEL, f"10 x {h}")]
    else:
        hidden = [("zero_optimization.reduce_bucket_size", DS_REDUCE_BUCKET_SIZE, DS_DEFAULTS, "")]
        if _zero3(out):
            hidden += [("zero_optimization.stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET_SIZE, DS_DEFAULTS, ""),
                       ("zero_optimization.stage3_param_persistence_threshold", DS_PARAM_PERSISTENCE_THRESHOLD,
                        DS_DEFAULTS, "")]
    steps: Fill = (("scheduler.params.total_num_steps", int(total_steps), "the rehearsal's steps", "")
                   if total_steps else ("scheduler.params.total_num_steps", TOTAL_STEPS, STEPS, "a stand-in"))
    table: List[Fill] = _batch(out, world_size) + [
        ("gradient_clipping", MAX_GRAD_NORM, DEFAULTS, "max_grad_norm"),
        ("optimizer.params.lr", LEARNING_RATE, DEFAULTS, "learning_rate"),
        ("optimizer.params.betas", list(ADAM_BETAS), DEFAULTS, "adam_beta1, adam_beta2"),
        ("optimizer.params.eps", ADAM_EPSILON, DEFAULTS, "adam_epsilon"),
        ("optimizer.params.weight_decay", WEIGHT_DECAY, DEFAULTS, "weight_decay"),
        ("scheduler.params.warmup_min_lr", 0, FORMULA, "a constant"),
        ("scheduler.params.warmup_max_lr", lr, DEFAULTS, "learning_rate"),
        ("fp16.enabled", False, DEFAULTS, "fp16"),
        ("amp.enabled", False, DEFAULTS, "fp16_backend"),
        ("amp.opt_level", FP16_OPT_LEVEL, DEFAULTS, "fp16_opt_level"),
        ("bf16.enabled", False, DEFAULTS, "bf16"),
    ] + hidden + [
        steps,
        ("scheduler.params.warmup_num_steps", WARMUP_STEPS, DEFAULTS, "warmup_steps"),
    ]
    for path, value, group, detail in table:
        node, key = _node(out, path)
        if node is not None and is_auto(node.get(key)):
            node[key] = value
            notes.append({"key": path, "value": value, "from": group, "detail": detail})
    return out, notes


def unfilled(config: Dict[str, Any]) -> List[str]:
    """"auto" values the HF integration does not fill either (left in ``fill``'s result)."""
    return auto_paths(config)


def note_text(notes: Sequence[Dict[str, Any]]) -> str:
    """One clause per source: "TrainingArguments' defaults (...): train_micro_batch_size_per_gpu = 8
    (per_device_train_batch_size), ...; the Trainer's formula: train_batch_size = 128 (world size 16 x ...)"."""
    groups: Dict[str, List[str]] = {}
    for n in notes:
        detail = f" ({n['detail']})" if n.get("detail") else ""
        groups.setdefault(str(n["from"]), []).append(f"{n['key']} = {json.dumps(n['value'])}{detail}")
    return "; ".join(f"{group}: {', '.join(items)}" for group, items in groups.items())


# The filled copy the rehearsal's ranks open, in the launch directory on every host.
REHEARSAL_CONFIG = "ds_config.hf-auto.json"


def for_rehearsal(plan: Any, launch_dir: str) -> Tuple[Any, List[Tuple[str, bytes]]]:
    """(the plan, the files to write to every host's launch directory): a config with "auto" values is filled as
    the HF Trainer would fill it for this launch (its world size, the rehearsal model's width as hidden_size, its
    steps) into a copy in the launch directory, and the plan points the ranks at that copy; otherwise, or when
    the plan says the job runs plain DeepSpeed (``integration``) or the config cannot be read here as JSON, the
    plan is returned as it is and no file is added (the ranks open the job's own file, as the job's would)."""
    if getattr(plan, "integration", "hf") != "hf" or not getattr(plan, "deepspeed_config", None):
        return plan, []
    try:
        with open(plan.deepspeed_config) as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return plan, []
    if not isinstance(config, dict) or not auto_paths(config):
        return plan, []
    from .rehearsal import layer_width

    world = sum(len(h.gpus) if getattr(h, "gpus", None) else int(getattr(h, "slots", 0) or 0) for h in plan.hosts)
    hidden = layer_width(float(getattr(plan, "model_params", 1e6)), 4)  # the rank's --layers default
    filled, _ = fill(config, world or 1, hidden, int(getattr(plan, "steps", 2) or 2))
    path = os.path.join(launch_dir, REHEARSAL_CONFIG)
    return dataclasses.replace(plan, deepspeed_config=path), [(REHEARSAL_CONFIG, json.dumps(filled).encode())]
