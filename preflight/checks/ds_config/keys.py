"""DeepSpeed config key tables for the ds_config check: known keys per section, deprecated and removed keys,
and the DeepSpeed release a key first/last appeared in.

Built by reading the PyPI sdists of DeepSpeed 0.5.7, 0.5.8, 0.5.10, 0.6.0, 0.8.0, 0.9.0, 0.9.3, 0.10.0, 0.12.0,
0.13.0, 0.14.0, 0.15.0, 0.16.0, 0.17.0, 0.17.5, 0.18.0, 0.19.0, 0.19.4, 0.19.5, 0.19.6, 0.19.7 and 0.19.8
(runtime/config.py, runtime/constants.py, runtime/zero/config.py, runtime/zero/offload_config.py,
runtime/precision_config.py, monitor/config.py, comm/config.py, runtime/swap_tensor/constants.py, ...).
A version gate is the pair (last sampled release WITHOUT the key, first sampled release WITH it): a host
at or below the first is certainly missing it; one between the two may or may not have it (not reported).
A removal is (last release with it, first release without it). Keys no sampled release lacks have no gate.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

Gate = Tuple[str, str]  # (last sampled version without/with, first sampled version with/without)

SAMPLED_VERSIONS = ["0.5.7", "0.5.8", "0.5.10", "0.6.0", "0.8.0", "0.9.0", "0.9.3", "0.10.0", "0.12.0", "0.13.0",
                    "0.14.0", "0.15.0", "0.16.0", "0.17.0", "0.17.5", "0.18.0", "0.19.0", "0.19.4", "0.19.5",
                    "0.19.6", "0.19.7", "0.19.8"]

REMOVED_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

# --- top level ------------------------------------------------------------------------------
# key -> {"added": Gate, "removed": Gate, "why": text}. DeepSpeed silently ignores unknown top-level keys.
TOP_LEVEL: Dict[str, Dict[str, object]] = {
    # batch
    "train_batch_size": {}, "train_micro_batch_size_per_gpu": {}, "gradient_accumulation_steps": {},
    "managed_gradient_accumulation": {"added": ("0.19.0", "0.19.4")},
    # training loop / logging
    "steps_per_print": {}, "dump_state": {}, "wall_clock_breakdown": {}, "memory_breakdown": {},
    "log_level": {"added": ("0.19.0", "0.19.4")},
    "disable_python_gc": {"added": ("0.19.7", "0.19.8")},
    "dataloader_drop_last": {}, "vocabulary_size": {},
    # communication
    "disable_allgather": {}, "prescale_gradients": {}, "gradient_predivide_factor": {},
    "communication_data_type": {"added": ("0.5.7", "0.5.8")},
    "seq_parallel_comm_data_type": {"added": ("0.10.0", "0.12.0")},
    "seq_parallel_communication_data_type": {"added": ("0.16.0", "0.17.0")},
    "gradient_allreduce_op": {"added": ("0.19.5", "0.19.6")},
    "sequence_parallel_size": {"added": ("0.16.0", "0.17.0")},
    # optimizer, precision
    "optimizer": {}, "scheduler": {}, "gradient_clipping": {},
    "zero_allow_untested_optimizer": {},
    "zero_force_ds_cpu_optimizer": {"added": ("0.8.0", "0.9.0")},
    "fp16": {}, "bf16": {"added": ("0.5.10", "0.6.0")}, "bfloat16": {},
    "torch_autocast": {"added": ("0.17.0", "0.17.5")},
    "data_types": {"added": ("0.6.0", "0.8.0")},
    "zero_optimization": {},
    "allgather_size": {},  # only read with the deprecated boolean "zero_optimization": true
    "amp": {"removed": ("0.19.7", "0.19.8"),
            "why": "NVIDIA Apex AMP integration was removed; use fp16, bf16 or torch_autocast"},
    # features
    "activation_checkpointing": {}, "aio": {}, "checkpoint": {}, "pipeline": {}, "flops_profiler": {},
    "autotuning": {}, "tensorboard": {},
    "wandb": {"added": ("0.6.0", "0.8.0")}, "csv_monitor": {"added": ("0.6.0", "0.8.0")},
    "comet": {"added": ("0.14.0", "0.15.0")}, "comms_logger": {"added": ("0.6.0", "0.8.0")},
    "data_efficiency": {"added": ("0.6.0", "0.8.0")},
    "weight_quantization": {"added": ("0.6.0", "0.8.0")},
    "hybrid_engine": {"added": ("0.8.0", "0.9.0")},
    "use_data_before_expert_parallelism": {"added": ("0.12.0", "0.13.0")},
    "compile": {"added": ("0.13.0", "0.14.0")},
    "timers": {"added": ("0.14.0", "0.15.0")},
    "tensor_parallel": {"added": ("0.16.0", "0.17.0")},
    "datastates_ckpt": {"added": ("0.18.0", "0.19.0")},
    "expert_parallel": {"added": ("0.19.0", "0.19.4")},
    # removed features (DeepSpeed >= the removal release raises DeepSpeedConfigError on them)
    "nebula": {"added": ("0.6.0", "0.8.0"), "removed": ("0.19.6", "0.19.7"),
               "why": "Nebula checkpointing was removed (checkpoints would silently fall back to torch.save)"},
    "compression_training": {"added": ("0.6.0", "0.8.0"), "removed": ("0.19.6", "0.19.7"),
                             "why": "the DeepSpeed compression library was removed"},
    "quantize_training": {"removed": ("0.19.6", "0.19.7"),
                          "why": "Mixture-of-Quantization (quantize_training) was removed"},
    "sparse_attention": {"removed": ("0.19.6", "0.19.7"), "why": "DeepSpeed Sparse Attention was removed"},
    "sparse_gradients": {"removed": ("0.19.7", "0.19.8"),
                         "why": "sparse compression of dense embedding gradients was removed"},
    "eigenvalue": {"removed": ("0.19.7", "0.19.8"), "why": "eigenvalue-based MoQ was removed"},
    "elasticity": {"removed": ("0.19.7", "0.19.8"),
                   "why": "elastic training was removed; set the batch sizes directly"},
    "graph_harvesting": {"added": ("0.12.0", "0.13.0"), "removed": ("0.19.7", "0.19.8"),
                         "why": "graph harvesting was removed"},
    "curriculum_learning": {"removed": ("0.19.7", "0.19.8"),
                            "why": "legacy top-level curriculum_learning was removed; use "
                                   "data_efficiency.data_sampling.curriculum_learning"},
    "progressive_layer_drop": {"removed": ("0.19.7", "0.19.8"), "why": "Progressive Layer Dropping was removed"},
}

# --- sections -------------------------------------------------------------------------------
# section -> {key: {"added": Gate, "removed": Gate, "why": text}}. Pydantic sections (extra="forbid" in
# DeepSpeed): an unknown key is a DeepSpeedConfig error. Others are read with dict.get: an unknown key is
# silently ignored: a FAIL when it is a near miss of a known key (the setting meant keeps its default), else a WARN.
_ZERO_ALWAYS = [
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
    "offload_optimizer", "sub_group_size", "cpu_offload_param", "cpu_offload_use_pin_memory", "cpu_offload",
    "prefetch_bucket_size", "stage3_prefetch_bucket_size", "param_persistence_threshold",
    "stage3_param_persistence_threshold", "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients",
]
ZERO: Dict[str, Dict[str, object]] = {k: {} for k in _ZERO_ALWAYS}
ZERO.update({
    "memory_efficient_linear": {"added": ("0.8.0", "0.9.0")},
    "mics_shard_size": {"added": ("0.9.0", "0.9.3"), "removed": ("0.19.6", "0.19.7"),
                        "why": "MiCS ZeRO-3 sharding was removed"},
    "mics_hierarchical_params_gather": {"added": ("0.9.0", "0.9.3"), "removed": ("0.19.6", "0.19.7"),
                                        "why": "MiCS ZeRO-3 sharding was removed"},
    "zero_hpz_partition_size": {"added": ("0.9.3", "0.10.0")},
    "zero_quantized_weights": {"added": ("0.9.3", "0.10.0")},
    "zero_quantized_gradients": {"added": ("0.9.3", "0.10.0")},
    "zero_quantized_nontrainable_weights": {"added": ("0.10.0", "0.12.0")},
    "override_module_apply": {"added": ("0.10.0", "0.12.0")},
    "pipeline_loading_checkpoint": {"added": ("0.10.0", "0.12.0")},
    "use_multi_rank_bucket_allreduce": {"added": ("0.12.0", "0.13.0")},
    "use_all_reduce_for_fetch_params": {"added": ("0.14.0", "0.15.0")},
    "stage3_use_all_reduce_for_fetch_params": {"added": ("0.14.0", "0.15.0")},
    "module_granularity_threshold": {"added": ("0.15.0", "0.16.0")},
    "stage3_module_granularity_threshold": {"added": ("0.15.0", "0.16.0")},
    "zeropp_loco_param": {"added": ("0.16.0", "0.17.0"), "removed": ("0.19.7", "0.19.8"),
                          "why": "LoCo-Zero++ was removed"},
    "log_trace_cache_warnings": {"added": ("0.16.0", "0.17.0")},
    "zenflow": {"added": ("0.17.0", "0.17.5")},
    "enable_sanity_checks": {"added": ("0.17.5", "0.18.0")},
    "leaf_module": {"added": ("0.17.5", "0.18.0")},
    "allgather_sequential": {"added": ("0.18.0", "0.19.0")},
    "stage3_allgather_sequential": {"added": ("0.18.0", "0.19.0")},
    "save_muon_momentum_buffer_in_memory": {"added": ("0.18.0", "0.19.0")},
    "compute_grad_norm": {"added": ("0.19.6", "0.19.7")},
    "parameter_alignment": {"added": ("0.19.6", "0.19.7")},
})

OFFLOAD_PARAM: Dict[str, Dict[str, object]] = {
    k: {} for k in ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")}
OFFLOAD_OPTIMIZER: Dict[str, Dict[str, object]] = {
    k: {} for k in ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                    "fast_init")}
OFFLOAD_OPTIMIZER.update({
    "ratio": {"added": ("0.12.0", "0.13.0")},
    "super_offload": {"added": ("0.17.5", "0.18.0")},
    "cpuadam_cores_perc": {"added": ("0.17.5", "0.18.0")},
})

FP16: Dict[str, Dict[str, object]] = {
    k: {} for k in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")}
FP16["auto_cast"] = {"added": ("0.6.0", "0.8.0")}

BF16: Dict[str, Dict[str, object]] = {"enabled": {}}
BF16.update({
    "immediate_grad_update": {"added": ("0.13.0", "0.14.0")},
    "check_grad_overflow": {"added": ("0.17.0", "0.17.5")},
    "bf16_master_weights_and_grads": {"added": ("0.18.0", "0.19.0")},
    "bf16_optimizer_states": {"added": ("0.18.0", "0.19.0")},
})

SECTIONS: Dict[str, Dict[str, Dict[str, object]]] = {
    "zero_optimization": ZERO,
    "zero_optimization.offload_param": OFFLOAD_PARAM,
    "zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER,
    "fp16": FP16,
    "bf16": BF16,
    "bfloat16": BF16,
    "optimizer": {"type": {}, "params": {}, "legacy_fusion": {}},
    "scheduler": {"type": {}, "params": {}},
    "activation_checkpointing": {k: {} for k in (
        "partition_activations", "number_checkpoints", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing")},
    "flops_profiler": {k: {} for k in ("enabled", "profile_step", "module_depth", "top_modules", "detailed",
                                       "output_file")},
    "aio": {"block_size": {}, "queue_depth": {}, "thread_count": {}, "single_submit": {}, "overlap_events": {},
            "use_gds": {"added": ("0.14.0", "0.15.0")},
            "intra_op_parallelism": {"added": ("0.16.0", "0.17.0")}},
    "comms_logger": {k: {} for k in ("enabled", "verbose", "prof_all", "debug", "prof_ops")},
    "tensorboard": {k: {} for k in ("enabled", "output_path", "job_name")},
    "wandb": {k: {} for k in ("enabled", "group", "team", "project")},
    "csv_monitor": {k: {} for k in ("enabled", "output_path", "job_name")},
    "comet": {k: {} for k in ("enabled", "samples_log_interval", "project", "workspace", "api_key",
                              "experiment_name", "experiment_key", "online", "mode")},
    "data_types": {"grad_accum_dtype": {}, "param_dtype": {"added": ("0.19.0", "0.19.4")},
                   "buffer_dtype": {"added": ("0.19.0", "0.19.4")}},
    "torch_autocast": {k: {} for k in ("enabled", "dtype", "lower_precision_safe_modules")},
    # DeepSpeed 0.19.8 copies every pipeline key over its defaults (runtime/config.py:272-285: stages, partition,
    # seed_layers, activation_checkpoint_interval, pipe_partitioned, grad_partitioned) and the PipelineEngine
    # reads pipe_partitioned, grad_partitioned (runtime/pipe/engine.py:135-138), use_reentrant (:210-212) and
    # activation_checkpoint_interval (:217-218); any other key is kept and never read.
    "pipeline": {k: {} for k in ("stages", "partition", "seed_layers", "activation_checkpoint_interval",
                                 "pipe_partitioned", "grad_partitioned", "use_reentrant")},
}
SECTIONS["flops_profiler"]["recompute_fwd_factor"] = {"added": ("0.9.0", "0.9.3")}

# --- deprecated keys (DeepSpeed still maps them, or silently ignores the old name) ---------------------------
# (section or "" for top level, old key, modern spelling, note, renamed_in: the release from which only the
# new name works, or None when the old one is still accepted with a deprecation warning)
DEPRECATED: List[Tuple[str, str, str, str, Optional[str]]] = [
    ("zero_optimization", "cpu_offload", 'offload_optimizer: {"device": "cpu"}',
     "deprecated since DeepSpeed 0.3.x; still mapped with a warning", None),
    ("zero_optimization", "cpu_offload_param", 'offload_param: {"device": "cpu"}',
     "deprecated; still mapped with a warning", None),
    ("zero_optimization", "cpu_offload_params", 'offload_param: {"device": "cpu"}',
     "pre-0.8 spelling; rejected by the pydantic ZeRO config of DeepSpeed >= 0.8", "0.8.0"),
    ("zero_optimization", "cpu_offload_use_pin_memory", "offload_optimizer/offload_param: {\"pin_memory\": true}",
     "deprecated; DeepSpeed warns and ignores it", None),
    ("zero_optimization", "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save",
     "deprecated since 0.6.0; still mapped with a warning", None),
    ("", "bfloat16", "bf16", "old section name, still read when bf16 is absent", None),
    ("", "allgather_size", "zero_optimization.allgather_bucket_size",
     "read only with the deprecated boolean zero_optimization form", None),
    ("", "fp32_allreduce", 'communication_data_type: "fp32"', "replaced in 0.5.8; silently ignored since", "0.5.8"),
    ("", "seq_parallel_comm_data_type", "seq_parallel_communication_data_type",
     "renamed in 0.17.0; the old name is silently ignored there", "0.17.0"),
    ("aio", "thread_count", "intra_op_parallelism", "renamed in 0.17.0; the old name is silently ignored there",
     "0.17.0"),
]

# --- optimizers and schedulers --------------------------------------------------------------------
# DeepSpeed's own names (case-insensitive, runtime/config.py DEEPSPEED_OPTIMIZERS).
DS_OPTIMIZERS: Dict[str, Dict[str, object]] = {
    "adam": {}, "adamw": {}, "adagrad": {}, "lamb": {},
    "onebitadam": {"removed": ("0.19.6", "0.19.7"), "why": "1-bit Adam was removed"},
    "zerooneadam": {"added": ("0.6.0", "0.8.0"), "removed": ("0.19.6", "0.19.7"), "why": "0/1 Adam was removed"},
    "onebitlamb": {"removed": ("0.19.6", "0.19.7"), "why": "1-bit LAMB was removed"},
    "muadam": {"added": ("0.10.0", "0.12.0")}, "muadamw": {"added": ("0.10.0", "0.12.0")},
    "musgd": {"added": ("0.10.0", "0.12.0")},
    "lion": {"added": ("0.10.0", "0.12.0")},
    "muon": {"added": ("0.17.5", "0.18.0")},
}
# Any other name is looked up as getattr(torch.optim, name) (case-sensitive).
TORCH_OPTIMIZERS = ["ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon",
                    "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam"]
# ZeRO (stage >= 1) accepts these optimizer classes without zero_allow_untested_optimizer
# (runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS: torch Adam/AdamW/Adagrad, FusedAdam, DeepSpeedCPUAdam,
# DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion).
ZERO_SUPPORTED = {"adam", "adamw", "adagrad", "lion", "muon"}

# deepspeed.runtime.lr_schedules names (hasattr(lr_schedules, name)), then torch.optim.lr_scheduler.
DS_SCHEDULERS: Dict[str, Dict[str, object]] = {
    "LRRangeTest": {}, "OneCycle": {}, "WarmupLR": {}, "WarmupDecayLR": {},
    "WarmupCosineLR": {"added": ("0.12.0", "0.13.0")},
}
TORCH_SCHEDULERS = ["ChainedScheduler", "ConstantLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
                    "CyclicLR", "ExponentialLR", "LambdaLR", "LinearLR", "MultiStepLR", "MultiplicativeLR",
                    "OneCycleLR", "PolynomialLR", "ReduceLROnPlateau", "SequentialLR", "StepLR"]
