"""Host-side checks of preflight, one module each; ``ORDER`` is the registry (and the matrix's column order)."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import List

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
    "versions",
    "ports",
    "launcher_ssh",
    "iperf3",
    "allreduce",
    "ds_config",
]


def load(name: str) -> ModuleType:
    return importlib.import_module("." + name, __name__)


def all_checks() -> List[ModuleType]:
    return [load(name) for name in ORDER]
