"""Host-side checks of preflight, one module (or subpackage) each; ``ORDER`` is the registry and the matrix's
column order. Installed as ``preflight.checks``; every import inside is relative, so the agent can ship the
package to a host under that name without anything else of preflight.

Each check's thresholds are a ``[name]`` TOML section beside it: ``nvme.toml`` beside ``nvme.py``,
``thresholds.toml`` inside a subpackage (``allreduce/thresholds.toml``); ``preflight.config`` assembles them.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Tuple

from ..hostside.seams import CheckSpec, Option, validate_spec

# Stable check ids, in the order they run and appear as matrix columns.
ORDER = [
    "ssh",
    "python",
    "driver_cuda",
    "gpu",
    "ds_report",
    "ext_locks",
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
    "launch",  # opt-in, last: the real launch of the job's config (--rehearse), after every cheaper check
]


def load(name: str) -> ModuleType:
    """Import one check and verify its ``SPEC`` (``hostside.seams.CheckSpec``): TypeError naming what is wrong."""
    module = importlib.import_module("." + name, __name__)
    spec = validate_spec(getattr(module, "SPEC", None), module.__name__)
    if spec.name != name:
        raise TypeError(f"check module {module.__name__}: SPEC.name {spec.name!r} "
                        f"differs from its registry name {name!r}")
    check_reads(spec, module.__name__)
    return module


def check_reads(spec: CheckSpec, where: str) -> None:
    """A check reads only registered checks that run before it (``SPEC.reads``): the runner runs the checks in
    ORDER, so a later one's facts are not there yet. TypeError naming ``where`` and each wrong name if not."""
    problems = []
    for read in spec.reads:
        if read not in ORDER:
            problems.append(f"reads {read!r}, which is not a registered check ({', '.join(ORDER)})")
        elif spec.name in ORDER and ORDER.index(read) > ORDER.index(spec.name):
            problems.append(f"reads {read!r}, which runs after it in ORDER (its facts are not there yet)")
    if problems:
        raise TypeError(f"check module {where}: {'; '.join(problems)}")


def thresholds_path(name: str) -> Path:
    """The check's thresholds TOML: ``<name>.toml`` beside a module, ``<name>/thresholds.toml`` in a subpackage."""
    here = Path(__file__).resolve().parent / name
    return here / "thresholds.toml" if here.is_dir() else here.with_name(name + ".toml")


def spec(name: str) -> CheckSpec:
    """The definition of one registered check."""
    return load(name).SPEC


def all_specs() -> List[CheckSpec]:
    return [spec(name) for name in ORDER]


def all_checks() -> List[ModuleType]:
    return [load(name) for name in ORDER]


def options(command: str = "run") -> List[Tuple[Option, List[str]]]:
    """Every check's own command-line inputs the command offers, in ORDER, each flag once: (option, the checks that
    declare it). An input several checks read is the same ``Option`` in each of their SPECs; two different
    declarations of one flag are a TypeError naming both checks."""
    seen: Dict[str, Tuple[Option, List[str]]] = {}
    for spec_ in all_specs():
        for option in spec_.options:
            if command not in option.commands:
                continue
            if option.flag in seen and seen[option.flag][0] != option:
                raise TypeError(f"check {spec_.name}: its option {option.flag} differs from the one "
                                f"{seen[option.flag][1][0]} declares; declare it once (preflight/hostside/jobinputs.py)"
                                " and list the same Option in both SPECs")
            seen.setdefault(option.flag, (option, []))[1].append(spec_.name)
    return list(seen.values())
