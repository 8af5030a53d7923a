"""Host-side checks of preflight, one module (or subpackage) each; ``ORDER`` is the registry and the matrix's
column order. Installed as ``preflight.checks``; every import inside is relative, so the agent can ship the
package to a host under that name without anything else of preflight.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import List

from ..hostside.seams import validate_check_module

# Stable check ids, in the order they run and appear as matrix columns.
ORDER = [
    "ssh",
    "python",
    "driver_cuda",
    "gpu",
    "ds_report",
    "libaio",
    "nvme",
    "interfaces",
    "memlock",
    "versions",
    "clock",
    "compute",
    "ports",
    "launcher_ssh",
    "iperf3",
    "allreduce",
    "checkpoint",
    "ds_config",
]


def load(name: str) -> ModuleType:
    """Import one check and verify it against ``hostside.seams.CheckModule`` (TypeError naming what it lacks)."""
    module = importlib.import_module("." + name, __name__)
    validate_check_module(module)
    return module


def all_checks() -> List[ModuleType]:
    return [load(name) for name in ORDER]
