"""The job's inputs that more than one check reads, declared once (``seams.Option``): each check that reads one
lists the same object in its ``SPEC.options``, and the command offers it once. Sample: ``--model-params 7e9``
reaches both ds_config's ZeRO estimate and checkpoint's free-space need as ``MODEL_PARAMS.value(cluster.options)``.
"""
from __future__ import annotations

from .seams import Option, positive

COUNT = positive(float, "a number", 1e15)

MODEL_PARAMS = Option("--model-params", "model parameter count (e.g. 7e9) for the ZeRO memory estimate",
                      COUNT, "N")

CHECKPOINT_DIR = Option("--checkpoint-dir", "the job's checkpoint directory: exists and writable on every host, free "
                        "space for one checkpoint (with --model-params), one shared filesystem; the test files are "
                        "removed", metavar="DIR")
