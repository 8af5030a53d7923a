"""ds_report: parser on the recorded ds_report output, evaluate with faults, collect for real (API child + fallback)."""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import time

import pytest

from preflight.checks import ds_report as dr
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

from tests.h100 import FIX, read as _read
INCOMPATIBLE_ON_FIXTURE = {"async_io", "evoformer_attn", "gds"}


@pytest.fixture
def healthy():
    """Facts as collect records them on the recorded H100 via the ds_report fallback."""
    parsed = dr.parse_ds_report(_read("ds_report.txt"))
    return {
        "deepspeed": parsed["deepspeed"], "torch": parsed["torch"], "torch_cuda": parsed["torch_cuda"],
        "ops": parsed["ops"], "ninja": True, "ninja_module": parsed["ninja"], "ninja_binary": "/usr/bin/ninja",
        "shm_bytes": parsed["shm_bytes"], "source": "ds_report", "installed": False,
        "import_error": "ModuleNotFoundError: No module named 'deepspeed'", "python": "/usr/bin/python3",
        "api_error": None, "ds_report_error": None, "tool_timeout": None, "required_ops": [],
        "nvcc": parsed["nvcc"],  # ds_report's "nvcc version": DeepSpeed's own reading of CUDA_HOME/bin/nvcc -V
    }


# --- parser on the real fixture ----------------------------------------------------------------

def test_parse_ds_report_fixture():
    text = _read("ds_report.txt")
    assert "\x1b[" in text  # the fixture really is coloured
    parsed = dr.parse_ds_report(text)
    assert parsed["deepspeed"] == "0.19.8" and parsed["torch"] == "2.11.0+cu130"
    assert parsed["torch_cuda"] == "13.0" and parsed["nvcc"] == "13.0"
    assert parsed["ninja"] is True
    assert parsed["shm_bytes"] == 128 * 1024 ** 3
    ops = parsed["ops"]
    assert len(ops) == 23
    assert {n for n, e in ops.items() if not e["compatible"]} == INCOMPATIBLE_ON_FIXTURE
    assert not any(e["installed"] for e in ops.values())
    assert "libaio" in ops["async_io"]["note"] and "libaio" in ops["gds"]["note"]
    assert "CUTLASS" in ops["evoformer_attn"]["note"]
    assert ops["fused_adam"] == {"installed": False, "compatible": True, "note": None}
    assert ops["stochastic_transformer"]["compatible"] is True  # the one-dot row


def test_parse_helpers():
    assert dr.strip_ansi("\x1b[93m[NO]\x1b[0m") == "[NO]"
    assert dr.parse_size("128.00 GB") == 128 * 1024 ** 3
    assert dr.parse_size("64.00 MB") == 64 * 1024 ** 2
    assert dr.parse_size("UNKNOWN") is None
    assert dr.parse_api_output("noise\n" + dr._MARK + '{"deepspeed": "1.0"}\n') == {"deepspeed": "1.0"}
    assert dr.parse_api_output("Segmentation fault\n") is None
    failed = dr.parse_ds_report("ninja .................. \x1b[91m[FAIL]\x1b[0m\nop name ........ installed .. compatible\n"
                                "cpu_adam ............... \x1b[92m[YES]\x1b[0m ...... \x1b[92m[OKAY]\x1b[0m\n")
    assert failed["ninja"] is False and failed["ops"]["cpu_adam"]["installed"] is True


# --- evaluate ---------------------------------------------------------------------------------

def test_fixture_host_warns_about_incompatible_ops(healthy, thresholds):
    out = dr.evaluate(healthy, thresholds)
    assert out.status == Status.WARN
    for op in INCOMPATIBLE_ON_FIXTURE:
        assert f"op {op} is not compatible" in out.message
    assert "libaio-dev" in out.fix and "CUTLASS_PATH" in out.fix
    assert out.metrics["ops_usable"] == 20 and out.metrics["ops_total"] == 23


def test_ignored_ops_pass(healthy, thresholds):
    t = copy.deepcopy(thresholds)
    t["ds_report"]["ignore_ops"] = sorted(INCOMPATIBLE_ON_FIXTURE)
    out = dr.evaluate(healthy, t)
    assert out.status == Status.PASS and "0.19.8" in out.message and "20/23" in out.message


def test_required_async_io_without_libaio_fails(healthy, thresholds):
    t = copy.deepcopy(thresholds)
    t["ds_report"]["required_ops"] = ["async_io"]
    out = dr.evaluate(healthy, t)
    assert out.status == Status.FAIL
    assert "required op async_io" in out.message and "libaio" in out.message
    assert "libaio-dev" in out.fix
    # the same through the coordinator's per-host param
    assert dr.evaluate(dict(healthy, required_ops=["async_io"]), thresholds).status == Status.FAIL
    # a pre-built op does not need JIT compatibility
    healthy["ops"]["async_io"]["installed"] = True
    assert "required op async_io" not in dr.evaluate(healthy, t).message


def test_required_compatible_op_and_unknown_op(healthy, thresholds):
    t = copy.deepcopy(thresholds)
    t["ds_report"].update(required_ops=["cpu_adam"], ignore_ops=sorted(INCOMPATIBLE_ON_FIXTURE))
    assert dr.evaluate(healthy, t).status == Status.PASS
    t["ds_report"]["required_ops"] = ["cpu_adamw"]
    out = dr.evaluate(healthy, t)
    assert out.status == Status.FAIL and "'cpu_adamw' is not a DeepSpeed" in out.message


def test_small_shm_warns(healthy, thresholds):
    t = copy.deepcopy(thresholds)
    t["ds_report"]["ignore_ops"] = sorted(INCOMPATIBLE_ON_FIXTURE)
    healthy["shm_bytes"] = 64 * 1024 ** 2  # docker's default
    out = dr.evaluate(healthy, t)
    assert out.status == Status.WARN and "/dev/shm is 64 MiB, below 512 MiB" in out.message
    assert "--shm-size" in out.fix
    healthy["shm_bytes"] = 512 * 1024 ** 2
    assert dr.evaluate(healthy, t).status == Status.PASS


def test_missing_ninja(healthy, thresholds):
    t = copy.deepcopy(thresholds)
    t["ds_report"]["ignore_ops"] = sorted(INCOMPATIBLE_ON_FIXTURE)
    healthy.update(ninja=False, ninja_module=False)
    out = dr.evaluate(healthy, t)
    assert out.status == Status.WARN and "ninja is missing" in out.message and "pip install ninja" in out.fix
    t["ds_report"]["required_ops"] = ["fused_adam"]  # not pre-built: needs a JIT build, hence ninja
    assert dr.evaluate(healthy, t).status == Status.FAIL


def test_deepspeed_not_installed_skips_or_fails_when_ops_required(thresholds):
    facts = {"deepspeed": None, "torch": "2.13.0+cpu", "ops": {}, "ninja": False, "ninja_module": False,
             "ninja_binary": None, "shm_bytes": 8 * 1024 ** 3, "source": None, "installed": False,
             "import_error": "ModuleNotFoundError: No module named 'deepspeed'", "python": "/usr/bin/python3",
             "api_error": None, "ds_report_error": "rc=127: ds_report: command not found", "tool_timeout": None,
             "required_ops": []}
    out = dr.evaluate(facts, thresholds)
    assert out.status == Status.SKIP and "not installed" in out.message
    assert out.fix == "/usr/bin/python3 -m pip install deepspeed"
    out = dr.evaluate(dict(facts, required_ops=["async_io"]), thresholds)
    assert out.status == Status.FAIL and "async_io" in out.message
    broken = dict(facts, installed=True, import_error="ImportError: libcudart.so.12: cannot open shared object file")
    out = dr.evaluate(broken, thresholds)
    assert out.status == Status.FAIL and "libcudart" in out.message
    assert dr.evaluate(dict(facts, installed=None, api_error="rc=124: timed out",
                            tool_timeout="ds_report timed out after 240s"), thresholds).status == Status.ERROR


# --- collect, for real -------------------------------------------------------------------------

def _no_deepspeed_here():
    if importlib.util.find_spec("deepspeed") is not None or shutil.which("ds_report"):
        pytest.skip("DeepSpeed is installed on this machine")


def test_collect_without_deepspeed_on_this_machine(monkeypatch):
    _no_deepspeed_here()
    facts = dr.collect(HostContext(params={}, deadline=time.monotonic() + 240))
    json.dumps(facts)
    assert facts["deepspeed"] is None and facts["installed"] is False and facts["source"] is None
    assert isinstance(facts["shm_bytes"], int) and facts["shm_bytes"] > 0
    out = dr.evaluate(facts, load_defaults())
    assert out.status == Status.SKIP and "DeepSpeed is not installed" in out.message and "pip install" in out.fix


# A stand-in with the API surface the child uses, as in DeepSpeed 0.19 (op_builder/all_ops.py ALL_OPS,
# OpBuilder.is_compatible/warning/error_log, git_version_info.installed_ops/accelerator_name,
# accelerator.get_accelerator()._name).
_FAKE_ALL_OPS = '''
class _Builder:
    def __init__(self, name, ok, log=None):
        self.name, self._ok, self._log, self.error_log = name, ok, log, None
    def is_compatible(self, verbose=False):
        if not self._ok:
            self.error_log = self._log
            print(" [WARNING]  " + self._log)  # DeepSpeed prints its warnings to stdout
        return self._ok
class _Broken:
    name = "broken_op"
    def is_compatible(self, verbose=False):
        raise RuntimeError("nvcc exploded")
ALL_OPS = {
    "async_io": _Builder("async_io", False, "async_io requires the dev libaio .so object and headers but these were not found."),
    "cpu_adam": _Builder("cpu_adam", True),
    "fused_adam": _Builder("fused_adam", True),
    "broken_op": _Broken(),
}
'''


@pytest.fixture
def fake_deepspeed(tmp_path, monkeypatch):
    _no_deepspeed_here()
    pkg = tmp_path / "site" / "deepspeed"
    (pkg / "ops" / "op_builder").mkdir(parents=True)
    (pkg / "accelerator").mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0.19.8'\nprint('[INFO] Setting ds_accelerator to cuda')\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "op_builder" / "__init__.py").write_text("")
    (pkg / "ops" / "op_builder" / "all_ops.py").write_text(_FAKE_ALL_OPS)
    (pkg / "git_version_info.py").write_text("installed_ops = {'cpu_adam': True}\naccelerator_name = 'cuda'\n")
    (pkg / "accelerator" / "__init__.py").write_text(
        "class _Acc:\n    _name = 'cuda'\n\ndef get_accelerator():\n    return _Acc()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    return pkg


def test_collect_through_deepspeed_api(fake_deepspeed, thresholds):
    facts = dr.collect(HostContext(params={"required_ops": ["async_io"]}, deadline=time.monotonic() + 240))
    json.dumps(facts)
    assert facts["source"] == "api" and facts["deepspeed"] == "0.19.8" and facts["installed"] is True
    ops = facts["ops"]
    assert ops["async_io"]["compatible"] is False and "libaio" in ops["async_io"]["note"]
    assert ops["cpu_adam"] == {"installed": True, "compatible": True, "note": None}
    assert ops["fused_adam"]["installed"] is False and ops["fused_adam"]["compatible"] is True
    assert ops["broken_op"]["compatible"] is False and "nvcc exploded" in ops["broken_op"]["note"]
    assert facts["required_ops"] == ["async_io"]
    out = dr.evaluate(facts, thresholds)
    assert out.status == Status.FAIL and "required op async_io" in out.message and "libaio-dev" in out.fix


def test_collect_falls_back_to_ds_report_on_path(tmp_path, monkeypatch, thresholds):
    _no_deepspeed_here()
    script = tmp_path / "ds_report"
    script.write_text(f"#!/bin/sh\ncat '{FIX / 'ds_report.txt'}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    facts = dr.collect(HostContext(params={}, deadline=time.monotonic() + 240))
    json.dumps(facts)
    assert facts["source"] == "ds_report" and facts["deepspeed"] == "0.19.8" and facts["torch"] == "2.11.0+cu130"
    assert len(facts["ops"]) == 23 and facts["ninja_module"] is True
    out = dr.evaluate(facts, thresholds)
    assert out.status in (Status.WARN, Status.FAIL) and "op async_io is not compatible" in out.message


# --- the DeepSpeed probe in a forked child (torch already imported by the python check) ------------------------

def test_fork_python_inherits_this_processs_imports_and_is_bounded(tmp_path):
    import subprocess
    import sys
    from preflight.hostside.proc import LIVE, fork_python
    import colorsys  # noqa: F401 - a module nothing else imports: only a forked child can have it already
    res = fork_python("import sys; print('colorsys' in sys.modules); sys.exit(3)", timeout=30)
    assert (res.rc, res.out.strip()) == (3, "True")
    fresh = dr.sh([sys.executable, "-c", "import sys; print('colorsys' in sys.modules)"], timeout=30)
    assert fresh.out.strip() == "False"
    # A child that outlives its deadline is killed with everything in its process group, and forgotten.
    pidfile = tmp_path / "grandchild.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    res = fork_python(script, timeout=2)
    assert res.rc == 124 and "started" in res.out and "timed out" in res.err and res.duration < 10
    grandchild = int(pidfile.read_text())
    time.sleep(0.2)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(grandchild)], capture_output=True, text=True).stdout
    assert state.strip()[:1] in ("", "Z"), state  # gone, or dead and not yet reaped by its new parent
    assert not LIVE
    res = fork_python("raise ValueError('boom')", timeout=30)
    assert res.rc == 1 and "ValueError: boom" in res.err


def test_collect_in_a_forked_child_reports_what_a_fresh_interpreter_reports(monkeypatch):
    import sys
    pytest.importorskip("torch")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed on this machine")
    calls, real = [], dr.fork_python
    monkeypatch.setattr(dr, "fork_python", lambda script, timeout: calls.append(timeout) or real(script, timeout))
    forked = dr.collect(HostContext(params={}, deadline=time.monotonic() + 240))
    assert calls  # torch is imported here, so the probe was forked
    monkeypatch.setattr(dr, "fork_python", lambda script, timeout: dr.sh([sys.executable, "-c", script], timeout))
    fresh = dr.collect(HostContext(params={}, deadline=time.monotonic() + 240))
    assert forked["source"] == "api" and forked["deepspeed"] and forked["ops"]
    assert forked == fresh


def test_the_forked_probe_finishes_inside_an_agent_worker():
    """In a worker the lifeline thread holds stdin's lock while it blocks in read(); a forked child that freed
    that stream hung on the lock until the check's deadline (seen: 120 s on every host of the default gate)."""
    import sys
    from preflight.remote import Agent
    from preflight.transport import LocalTransport
    pytest.importorskip("torch")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed on this machine")
    agent = Agent(LocalTransport(), sys.executable, "pf-test-forked-probe")
    try:
        out = agent.collect(["python", "ds_report"], {}, 60)
    finally:
        agent.close()
    assert out["python"]["facts"]["torch"], out["python"]
    assert "error" not in out["ds_report"], out["ds_report"]
    assert out["ds_report"]["facts"]["source"] == "api" and out["ds_report"]["facts"]["api_error"] is None


# --- usable ops: a JIT build needs its tools (issue 24) ------------------------------------------------------------

NOT_CUDA_ON_FIXTURE = {"cpu_adam", "cpu_adagrad", "cpu_lion", "pin_memory", "utils"}


def test_ops_usable_counts_a_cuda_op_only_where_nvcc_can_build_it(healthy, thresholds):
    """The recorded H100 has nvcc 13.0 and torch's CUDA 13.0: 20 of 23 usable (async_io, evoformer_attn and gds are
    not compatible). Without nvcc only the 5 ops that are not CUDA ops can be built."""
    t = copy.deepcopy(thresholds)
    t["ds_report"]["ignore_ops"] = sorted(INCOMPATIBLE_ON_FIXTURE)
    out = dr.evaluate(healthy, t)
    assert out.status == Status.PASS and "20/23 ops usable;" in out.message and out.metrics["ops_unbuildable"] == []

    no_nvcc = dict(healthy, nvcc=None)
    out = dr.evaluate(no_nvcc, t)
    assert out.metrics["ops_usable"] == len(NOT_CUDA_ON_FIXTURE) == 5
    assert "5/23 ops usable (15 compatible but not buildable here: no nvcc)" in out.message
    assert "fused_adam" in out.metrics["ops_unbuildable"] and "cpu_adam" not in out.metrics["ops_unbuildable"]
    # A pre-built CUDA op needs no nvcc.
    no_nvcc["ops"] = copy.deepcopy(healthy["ops"])
    no_nvcc["ops"]["fused_adam"]["installed"] = True
    assert dr.evaluate(no_nvcc, t).metrics["ops_usable"] == 6
    # A CPU build of torch builds DeepSpeed's ops without nvcc.
    assert dr.evaluate(dict(healthy, nvcc=None, torch_cuda=None), t).metrics["ops_usable"] == 20

    # nvcc of another major version: not buildable, unless DS_SKIP_CUDA_CHECK=1 on the host.
    out = dr.evaluate(dict(healthy, nvcc="12.8"), t)
    assert out.metrics["ops_usable"] == 5 and "nvcc 12.8 vs torch's CUDA 13.0" in out.message
    assert dr.evaluate(dict(healthy, nvcc="12.8", ds_skip_cuda_check="1"), t).metrics["ops_usable"] == 20
    # A minor difference is DeepSpeed's to accept or not (driver_cuda warns), not a blocker.
    assert dr.evaluate(dict(healthy, nvcc="13.1"), t).metrics["ops_usable"] == 20

    # No C++ compiler: nothing that is not pre-built can be built.
    out = dr.evaluate(dict(healthy, cxx=None, cxx_name="c++"), t)
    assert out.metrics["ops_usable"] == 0 and "no C++ compiler (c++)" in out.message


def test_build_tools_look_where_torch_and_deepspeed_look(tmp_path, monkeypatch):
    from preflight.hostside import jit
    cuda = tmp_path / "cuda-12.8"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    "echo 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK", raising=False)
    monkeypatch.setenv("PATH", f"{cuda / 'bin'}:{os.environ['PATH']}")
    tools = jit.build_tools()
    # torch's _find_cuda_home: nvcc on PATH -> its parent's parent.
    assert tools["cuda_home"] == str(cuda) and tools["cuda_home_from"] == "nvcc on PATH"
    assert tools["nvcc"] == "12.8" and tools["nvcc_path"] == str(nvcc) and tools["nvcc_error"] is None
    assert tools["cxx_name"] == "c++" and tools["cxx"] == shutil.which("c++")
    assert tools["ds_skip_cuda_check"] is None
    # $CUDA_HOME wins over PATH; DeepSpeed runs CUDA_HOME/bin/nvcc, so one without it has no nvcc.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "runtime-only"))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")
    tools = jit.build_tools()
    assert tools["cuda_home"] == str(tmp_path / "runtime-only") and tools["cuda_home_from"] == "CUDA_HOME"
    assert tools["nvcc"] is None and "does not exist" in tools["nvcc_error"]
    assert tools["cxx"] is None and tools["cxx_name"] == "no-such-compiler"
    assert tools["ds_skip_cuda_check"] == "1"
    assert jit.parse_nvcc_release(_read("nvcc.txt")) == "13.0"
