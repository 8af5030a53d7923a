"""The python check's collect against a torch that reports NCCL the way each torch release does.

This machine has no CUDA torch, so a stand-in `torch` package answers with the recorded H100 host's values
(../shared/fixtures/h100-host/torchinfo.txt, copied to tests/fixtures/h100-host/). Only the NCCL version's shape
varies: a tuple on current torch, an int on old torch (22809 from NCCL 2.9 on, 2708 before).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.checks import python as py
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "h100-host"

STUB = '''
import types
__version__ = {torch!r}
version = types.SimpleNamespace(cuda={cuda!r})

class _Nccl:
    @staticmethod
    def version():
        return {nccl!r}

class cuda:
    nccl = _Nccl
    @staticmethod
    def is_available():
        return True
    @staticmethod
    def device_count():
        return {count!r}
    @staticmethod
    def get_device_name(i):
        return {name!r}
'''


@pytest.mark.parametrize("nccl, shown", [((2, 28, 9), "2.28.9"), (22809, "2.28.9"), (2708, "2.7.8")])
def test_nccl_version_of_every_torch_shape_is_read_and_torch_is_not_called_broken(tmp_path, nccl, shown):
    info = json.loads((FIX / "torchinfo.txt").read_text())
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text(STUB.format(torch=info["torch"], cuda=info["cuda"], nccl=nccl,
                                                     count=info["count"], name=info["name"]))
    code = ("import json, time; from preflight.checks import python as py; from preflight.hostside.seams import "
            "HostContext; print(json.dumps(py.collect(HostContext(params={}, deadline=time.monotonic() + 60))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["torch_error"] is None, facts
    assert facts["torch"] == info["torch"] and facts["torch_cuda"] == info["cuda"]
    assert facts["nccl"] == shown and facts["rank_view"]["nccl"] == shown
    assert facts["rank_view"]["gpu_names"] == [info["name"]]
    outcome = py.evaluate(facts, load_defaults())
    assert outcome.status != Status.FAIL, outcome.message
    assert f"NCCL {shown}" in outcome.message


def test_no_torch_fails_the_gate_in_a_local_run_as_over_ssh(tmp_path):
    """issue 26: a local run WARNed and exited 0 where a multi-host run FAILed (tests/checks/allreduce/test_allreduce.py)."""
    from tests.checks.allreduce.test_allreduce import _python_without_torch
    python = _python_without_torch()
    assert python, "no interpreter without torch on this machine (tests/checks/allreduce/test_allreduce.py needs one too)"
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "preflight", "run", "--python", python, "--checks", "python",
                        "--json", str(out)], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                       text=True, timeout=300)
    cell = next(c for c in json.loads(out.read_text())["results"] if c["check"] == "python")
    assert r.returncode == 1 and cell["status"] == "fail", (r.returncode, cell)
    assert "torch is not importable" in cell["message"] and "--python" in cell["fix"]
    assert py.evaluate({"python": "3.11.7", "executable": python, "torch": None},
                       {"python": dict(load_defaults()["python"], require_torch=False)}).status == Status.PASS
