"""The job's Python environment on each host: interpreter version and torch/DeepSpeed/NVML package versions.

Collected by importing the packages in the interpreter given by ``--python``, e.g.:

    {"python": "3.11.7", "executable": "/opt/venv/bin/python3", "torch": "2.13.0+cpu", "torch_cuda": null,
     "nccl": null, "deepspeed": null, "nvidia_ml_py": null}

Thresholds: [python] in python.toml beside this module.
"""
from __future__ import annotations

import platform
import sys
from typing import Any, Dict

from ..hostside.fixes import pip_fix
from ..hostside.outcome import Finding, Outcome, Status, combine, limits
from ..hostside.seams import CheckSpec, HostContext

NAME = "python"


def _version_of(dist: str) -> Any:
    try:
        from importlib import metadata
        return metadata.version(dist)
    except Exception:
        return None


def collect(ctx: HostContext) -> Dict[str, Any]:
    facts: Dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                             "torch": None, "torch_cuda": None, "nccl": None, "torch_error": None,
                             "deepspeed": _version_of("deepspeed"), "nvidia_ml_py": _version_of("nvidia-ml-py")}
    from ..hostside.torchview import torch_view
    # What a rank will see (CUDA, device count, GPU names, NCCL): the all-reduce reads it from these facts instead
    # of importing torch again on every host to probe, and NCCL's version is read once, here.
    facts["rank_view"] = view = torch_view()
    facts["nccl"] = view["nccl"]
    try:
        import torch
        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    except Exception as exc:  # a broken install (ABI mismatch, missing .so) is a finding, not a crash
        facts["torch_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    lim = limits(thresholds, NAME)
    findings = []
    minimum = lim["min_version"]
    have = tuple(int(x) for x in facts["python"].split(".")[:2])
    want = tuple(int(x) for x in minimum.split(".")[:2])
    if have < want:
        findings.append(Finding(Status.FAIL, f"Python {facts['python']} < {minimum} required",
                                f"point --python at the job's interpreter (a venv with Python >= {minimum})"))
    if facts.get("torch_error"):
        # The failing interpreter's own pip (a bare `pip` is whatever is first on PATH: often another Python's).
        findings.append(Finding(Status.FAIL, f"torch is installed but fails to import: {facts['torch_error']}",
                                pip_fix("reinstall torch in this environment", facts.get("executable"),
                                        "--force-reinstall", "torch")))
    elif facts.get("torch") is None and lim["require_torch"]:
        # FAIL, as the all-reduce fails a multi-host run for the same cause: the job cannot start either way.
        message = f"torch is not importable by {facts.get('executable')}; the job needs it on every host"
        findings.append(Finding(Status.FAIL, message,
                                pip_fix("pass --python with the job's interpreter, or install torch into this one",
                                        facts.get("executable"), "torch")))
    summary = f"Python {facts['python']}" + "".join(
        f", {label} {facts[key]}" for key, label in
        (("torch", "torch"), ("torch_cuda", "CUDA"), ("nccl", "NCCL"), ("deepspeed", "DeepSpeed"),
         ("nvidia_ml_py", "nvidia-ml-py")) if facts.get(key))
    metrics = {k: facts.get(k) for k in ("python", "executable", "torch", "torch_cuda", "nccl", "deepspeed",
                                         "nvidia_ml_py")}
    out = combine(findings, summary, metrics)
    if out.status != Status.PASS:
        out.message = summary + ": " + out.message
    return out


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="interpreter version on the host, and torch, DeepSpeed and nvidia-ml-py versions if importable",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
    # The agent imports torch once before the host checks when a selected check uses it (agent.py, preload).
    uses_torch=True,
)
