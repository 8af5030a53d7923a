"""Verdicts on the ``pipeline`` section's values, as DeepSpeed 0.19.8's PipelineEngine reads them. Pure.

E.g. ``"pipeline": {"activation_checkpoint_interval": "1", "pipe_partitioned": 1}``: a str compared with 0 raises
TypeError, a non-bool fails DeepSpeed's assert (deepspeed/runtime/pipe/engine.py:135-136). Unknown keys are
keycheck's (keys.SECTIONS["pipeline"]).
"""
from __future__ import annotations

from typing import Any, Dict

from ...hostside.outcome import Status
from .findings import Report

# runtime/pipe/engine.py:135-136 asserts isinstance(..., bool); :210-212 reads use_reentrant (None -> True).
BOOLS = ("pipe_partitioned", "grad_partitioned", "use_reentrant")


def check_pipeline(config: Dict[str, Any], report: Report) -> None:
    section = config.get("pipeline")
    if section is None:
        return
    if not isinstance(section, dict):
        # runtime/config.py:283 iterates param_dict.get("pipeline", {}).items(): AttributeError on anything else.
        report.add(Status.FAIL, f"pipeline = {section!r} (expected an object): DeepSpeed's get_pipeline_config "
                                f"calls .items() on it and deepspeed.initialize raises AttributeError "
                                f"(runtime/config.py:283)", 'make it an object, e.g. "pipeline": {}, or remove it')
        return
    for key in BOOLS:
        value = section.get(key)
        if key in section and not isinstance(value, bool) and not (key == "use_reentrant" and value is None):
            report.add(Status.FAIL, f"pipeline.{key} = {value!r} (expected true or false): the PipelineEngine "
                                    f"{'asserts a bool' if key != 'use_reentrant' else 'compares it with False'} "
                                    f"(runtime/pipe/engine.py:{'135-136' if key != 'use_reentrant' else '210-212'})",
                       f'set "pipeline": {{"{key}": {"true" if value else "false"}}}')
    interval = section.get("activation_checkpoint_interval")
    if "activation_checkpoint_interval" in section and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
        report.add(Status.FAIL, f"pipeline.activation_checkpoint_interval = {interval!r} (expected an integer >= 0):"
                                f" the PipelineEngine compares it with 0 (runtime/pipe/engine.py:217), which raises "
                                f"TypeError or checkpoints nothing",
                   '"activation_checkpoint_interval": 1 checkpoints every layer, 0 none')
