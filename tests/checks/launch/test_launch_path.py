"""The launch path's checks (issue 24, item 2): what DeepSpeed's launcher and every rank meet before the first step.

- JIT viability of the ops the config needs, on the recorded H100 host (tests/fixtures/h100-host): no nvcc, an nvcc
  of another major version (DS_SKIP_CUDA_CHECK=1 allows it, with a WARN), no ninja, no C++ compiler.
- The .deepspeed_env files as DeepSpeed's runner reads them; driver_cuda's nvcc-mismatch fix.
- Resuming a checkpoint: its layout from DeepSpeed's own file names (made with DeepSpeed's naming functions),
  against the config's ZeRO stage and the hostfile's data-parallel size.
- On namespace hosts: the config file missing or different on some hosts, a checkpoint that does not fit, and the
  master address DeepSpeed's launcher picks (the first of `hostname -I` on the first host) on a network the others
  cannot reach.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from preflight import testing
from preflight.checks import driver_cuda as dc
from preflight.checks import ds_config as D
from preflight.checks.ds_config import gather
from preflight.checks.ds_config import host as ds_host
from preflight.checks.ds_report import parse_ds_report
from preflight.config import load_thresholds
from preflight.hostside import jit
from preflight.hostside.outcome import Status
from tests.h100 import read

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests" / "ds_configs"
TH = load_thresholds()


def h100_ds_report() -> Dict[str, Any]:
    """ds_report's facts as collect records them from the recorded H100 ds_report (nvcc 13.0, torch CUDA 13.0)."""
    parsed = parse_ds_report(read("ds_report.txt"))
    return dict(parsed, ninja_binary="/usr/bin/ninja", source="ds_report")


def facts_for(config_file: str, hosts: int = 2, slots: int = 8, ds_report: Optional[Dict[str, Any]] = None,
              **extra: Any) -> Dict[str, Any]:
    config, found = D.load_config(config_file)
    names = [f"node{i:02d}" for i in range(1, hosts + 1)]
    facts: Dict[str, Any] = {
        "config_path": config_file, "config": config, "load_findings": [f.to_dict() for f in found],
        "world_size": hosts * slots, "hosts": [{"name": n, "slots": slots} for n in names],
        "model_params": None, "largest_layer_params": None,
        "host_facts": {n: {"ds_report": copy.deepcopy(ds_report or h100_ds_report())} for n in names},
        "host_memory": {}, "host_probe": {}, "deepspeed_models": None,
    }
    facts.update(extra)
    return facts


def jit_findings(outcome) -> List[Any]:
    return [f for f in outcome.findings if "JIT-builds it" in f.message]


# --- JIT viability on the recorded H100 ------------------------------------------------------------------------

FUSED_ADAM = str(CONFIGS / "zero2_bf16_7b.json")  # AdamW on the GPU: fused_adam
CPU_ADAM = str(CONFIGS / "zero3_offload_13b.json")  # AdamW under CPU offload: cpu_adam


def test_recorded_h100_builds_fused_adam():
    out = D.evaluate(facts_for(FUSED_ADAM), TH)
    assert D.required_ops(D.load_config(FUSED_ADAM)[0]) == ["fused_adam"]
    assert jit_findings(out["*"]) == []


def test_recorded_h100_without_nvcc_fails_for_a_fused_adam_config():
    report = h100_ds_report()
    assert report["nvcc"] == "13.0" and report["ops"]["fused_adam"] == {"installed": False, "compatible": True,
                                                                          "note": None}
    report["nvcc"] = None  # nvcc removed: ds_report's "nvcc version" row reads None
    out = D.evaluate(facts_for(FUSED_ADAM, ds_report=report), TH)
    (found,) = jit_findings(out["*"])
    assert found.status == Status.FAIL and out["*"].status == Status.FAIL
    assert "op fused_adam" in found.message and "fails on node01, node02" in found.message
    assert "no CUDA toolkit" in found.message and "CUDA_HOME environment variable is not set" in found.message
    assert "install the CUDA toolkit 13.0" in found.fix and "CUDA_HOME=/usr/local/cuda-13.0" in found.fix
    assert "torch_adam true" in found.fix  # what avoids the build for this op
    # Each host's own row names it too.
    assert out["node01"].status == Status.FAIL and "fused_adam" in out["node01"].message

    # A toolkit whose nvcc is missing, as build_tools records it.
    report.update(cuda_home="/usr/local/cuda-13.0", nvcc_error="/usr/local/cuda-13.0/bin/nvcc does not exist")
    (found,) = jit_findings(D.evaluate(facts_for(FUSED_ADAM, ds_report=report), TH)["*"])
    assert "CUDA_HOME /usr/local/cuda-13.0 has no working nvcc" in found.message

    # A pre-built fused_adam needs no toolkit.
    report["ops"]["fused_adam"]["installed"] = True
    assert jit_findings(D.evaluate(facts_for(FUSED_ADAM, ds_report=report), TH)["*"]) == []


def test_nvcc_of_another_major_fails_unless_ds_skip_cuda_check(tmp_path):
    report = h100_ds_report()
    report["nvcc"] = "12.8"
    out = D.evaluate(facts_for(FUSED_ADAM, ds_report=report), TH)
    (found,) = jit_findings(out["*"])
    assert found.status == Status.FAIL
    assert "nvcc 12.8 and torch's CUDA 13.0 differ in major version" in found.message
    assert "CUDAMismatchException" in found.message
    assert "DS_SKIP_CUDA_CHECK=1" in found.fix and "CUDA_HOME=/usr/local/cuda-13.0" in found.fix

    # DeepSpeed's override, in every host's own environment: PASS with a WARN.
    skip = dict(report, ds_skip_cuda_check="1")
    out = D.evaluate(facts_for(FUSED_ADAM, ds_report=skip), TH)
    (found,) = jit_findings(out["*"])
    assert found.status == Status.WARN and out["*"].status == Status.WARN
    assert "DS_SKIP_CUDA_CHECK=1 (the host's environment)" in found.message
    assert "unexpected behavior" in found.message
    assert not [f for f in out["*"].findings if f.status == Status.FAIL]

    # ... or in a .deepspeed_env the launcher exports to every rank (it wins over the host's value).
    (tmp_path / ".deepspeed_env").write_text("NCCL_DEBUG=WARN\nDS_SKIP_CUDA_CHECK=1\n")
    launch = gather.read_deepspeed_env(cwd=str(tmp_path), home=str(tmp_path / "nohome"), environ={})
    out = D.evaluate(facts_for(FUSED_ADAM, ds_report=report, launch_env=launch), TH)
    (found,) = jit_findings(out["*"])
    assert found.status == Status.WARN and "DS_SKIP_CUDA_CHECK=1 (.deepspeed_env)" in found.message
    (tmp_path / ".deepspeed_env").write_text("DS_SKIP_CUDA_CHECK=0\n")
    launch = gather.read_deepspeed_env(cwd=str(tmp_path), home=str(tmp_path / "nohome"), environ={})
    (found,) = jit_findings(D.evaluate(facts_for(FUSED_ADAM, ds_report=skip, launch_env=launch), TH)["*"])
    assert found.status == Status.FAIL  # the exported 0 overrides the host's 1


def test_a_minor_difference_or_a_cpu_torch_is_no_blocker():
    report = h100_ds_report()
    report["nvcc"] = "13.1"
    assert jit_findings(D.evaluate(facts_for(FUSED_ADAM, ds_report=report), TH)["*"]) == []
    cpu = dict(h100_ds_report(), nvcc=None, torch_cuda=None)  # DeepSpeed builds its ops for the CPU
    assert jit_findings(D.evaluate(facts_for(FUSED_ADAM, ds_report=cpu), TH)["*"]) == []


def test_cpu_adam_needs_no_nvcc_but_a_compiler_and_ninja():
    report = dict(h100_ds_report(), nvcc=None)
    assert D.required_ops(D.load_config(CPU_ADAM)[0]) == ["cpu_adam"]
    assert jit_findings(D.evaluate(facts_for(CPU_ADAM, ds_report=report), TH)["*"]) == []

    no_cxx = dict(report, cxx=None, cxx_name="c++")
    (found,) = jit_findings(D.evaluate(facts_for(CPU_ADAM, ds_report=no_cxx), TH)["*"])
    assert found.status == Status.FAIL and "no C++ compiler" in found.message and "g++" in found.fix
    assert "DS_BUILD_CPU_ADAM=1" in found.fix

    no_ninja = dict(report, ninja_binary=None)
    (found,) = jit_findings(D.evaluate(facts_for(CPU_ADAM, ds_report=no_ninja), TH)["*"])
    assert found.status == Status.FAIL
    assert "Unable to JIT load the cpu_adam op due to ninja not being installed." in found.message
    assert "pip install ninja" in found.fix


def test_only_the_host_that_cannot_build_is_named():
    facts = facts_for(FUSED_ADAM, hosts=3)
    facts["host_facts"]["node02"]["ds_report"]["nvcc"] = None
    out = D.evaluate(facts, TH)
    (found,) = jit_findings(out["*"])
    assert "fails on node02:" in found.message
    assert out["node02"].status == Status.FAIL and "node01" not in out
    assert "node03" not in out


def test_read_deepspeed_env_as_the_runner_reads_it(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\nDS_SKIP_CUDA_CHECK=1\n")
    (cwd / ".deepspeed_env").write_text(" NCCL_SOCKET_IFNAME = ib0 \n\nNCCL_DEBUG\n")
    env = gather.read_deepspeed_env(cwd=str(cwd), home=str(home), environ={})
    # Home first, then the working directory (runner.py:38): the later file wins; KEY and VALUE are stripped.
    assert env["files"] == [str(home / ".deepspeed_env"), str(cwd / ".deepspeed_env")]
    assert env["vars"] == {"NCCL_SOCKET_IFNAME": "ib0", "DS_SKIP_CUDA_CHECK": "1"}
    # A line without '=' (an empty one too) makes DeepSpeed's `key, val = var.split('=', maxsplit=1)` raise.
    assert env["bad_lines"] == [f"{cwd / '.deepspeed_env'}:2: ", f"{cwd / '.deepspeed_env'}:3: NCCL_DEBUG"]
    (cwd / "other_env").write_text("A=1\n")
    assert gather.read_deepspeed_env(cwd=str(cwd), home=str(home), environ={"DS_ENV_FILE": "other_env"})["vars"] \
        == {"A": "1"}


def test_driver_cuda_mismatch_fix_says_prebuilding_fails_the_same_way():
    """issue 24: `DS_BUILD_OPS=1 pip install deepspeed` raises the same CUDAMismatchException (builder.py:804 ->
    assert_no_cuda_mismatch), so it is no fix; DS_SKIP_CUDA_CHECK=1 is DeepSpeed's override."""
    (finding,) = dc._nvcc_findings("12.8", "/usr/local/cuda-12.8/bin/nvcc", "13.0")
    assert "CUDAMismatchException" in finding.message
    assert "also avoids JIT" not in finding.fix
    assert "DS_BUILD_OPS=1 the job's interpreter's `-m pip install --force-reinstall --no-deps --no-cache-dir deepspeed` stops with the same " \
        "CUDAMismatchException" in finding.fix  # the host's python unknown here: whose pip, in words (issue 30)
    (named,) = dc._nvcc_findings("12.8", "/usr/local/cuda-12.8/bin/nvcc", "13.0", "/opt/venv/bin/python", "0.19.8")
    assert ("DS_BUILD_OPS=1 /opt/venv/bin/python -m pip install --force-reinstall --no-deps --no-cache-dir deepspeed==0.19.8 stops with the same"
            in named.fix), named.fix
    assert "DS_SKIP_CUDA_CHECK=1" in finding.fix and "CUDA_HOME=/usr/local/cuda-13.0" in finding.fix
    # A minor mismatch DeepSpeed accepts: pre-building works there.
    (finding,) = dc._nvcc_findings("12.4", "/usr/local/cuda-12.4/bin/nvcc", "12.8")
    assert "also avoids JIT" in finding.fix and "DS_SKIP_CUDA_CHECK" not in finding.fix


def test_deepspeed_builders_agree_with_the_cuda_op_table():
    """jit.CUDA_OPS (used when the op table came from ds_report's text) is DeepSpeed 0.19.8's CUDAOpBuilders."""
    import importlib
    import inspect
    import pkgutil

    import deepspeed.ops.op_builder as ob
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
    folder = os.path.dirname(ob.__file__)
    cuda = set()
    for _, name, _ in pkgutil.iter_modules([folder]):
        if name in ("all_ops", "builder") or os.path.isdir(os.path.join(folder, name)):
            continue
        module = importlib.import_module("deepspeed.ops.op_builder." + name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, CUDAOpBuilder) and cls not in (OpBuilder, CUDAOpBuilder) and getattr(cls, "NAME", None):
                cuda.add(cls.NAME)
    assert cuda == set(jit.CUDA_OPS)
    assert not {"cpu_adam", "cpu_adagrad", "cpu_lion"} & cuda


# --- resuming a checkpoint: DeepSpeed's own file names -------------------------------------------------------------

def deepspeed_names(stage: int, dp: int, mp: int = 1, bf16: bool = True) -> List[str]:
    """The files DeepSpeed 0.19.8's engine names for a checkpoint tag: its own _get_ckpt_name (model states) and
    _get_rank_zero_ckpt_name (ZeRO partitions), called on a stand-in engine with the stage and ranks asked for."""
    from deepspeed.runtime.engine import DeepSpeedEngine as E

    names = set()
    for mp_rank in range(mp):
        eng = types.SimpleNamespace(checkpoint_mp_rank=mp_rank, zero_optimization_partition_weights=lambda: stage == 3)
        eng._get_zero_ckpt_prefix = lambda dp_rank, bf16_mode: E._get_zero_ckpt_prefix(eng, dp_rank, bf16_mode)
        for dp_rank in range(dp):
            names.add(os.path.basename(E._get_ckpt_name(eng, "ckpt", "tag", pp_placeholder=str(dp_rank))))
            if stage >= 1:
                names.add(os.path.basename(E._get_rank_zero_ckpt_name(eng, "ckpt", "tag", mp_rank, dp_rank, bf16)))
    return sorted(names)


def make_checkpoint(directory: Path, stage: int, dp: int, mp: int = 1, tag: str = "global_step100") -> Path:
    """A checkpoint's layout only: empty files with DeepSpeed's names, and `latest` naming the tag."""
    (directory / tag).mkdir(parents=True)
    for name in deepspeed_names(stage, dp, mp):
        (directory / tag / name).write_bytes(b"")
    (directory / "latest").write_text(tag)
    return directory


def test_deepspeed_names_read_back_as_their_layout():
    z2 = deepspeed_names(2, dp=4)
    assert z2 == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)] + \
        ["mp_rank_00_model_states.pt"]
    z3 = deepspeed_names(3, dp=2, mp=2, bf16=False)
    assert "zero_pp_rank_1_mp_rank_01_model_states.pt" in z3 and "zero_pp_rank_1_mp_rank_01_optim_states.pt" in z3
    assert ds_host.checkpoint_layout(z2) == {"zero_stage": "1 or 2", "dp_size": 4, "mp_size": 1, "model_files": 1,
                                             "optim_files": 4, "bf16": True}
    assert ds_host.checkpoint_layout(z3) == {"zero_stage": "3", "dp_size": 2, "mp_size": 2, "model_files": 4,
                                             "optim_files": 4, "bf16": False}
    assert ds_host.checkpoint_layout(deepspeed_names(0, dp=1))["zero_stage"] == "0"
    # DeepSpeed still reads the old optimizer file pattern (engine.py:4793-4797).
    old = ds_host.checkpoint_layout(["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00optim_states.pt"])
    assert old["zero_stage"] == "1 or 2" and old["dp_size"] == 1
    assert ds_host.checkpoint_layout(["README"])["zero_stage"] is None


def write_config(path: Path, stage: int, **extra: Any) -> str:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    config.update(extra)
    path.write_text(json.dumps(config))
    return str(path)


def resume(config: str, checkpoint: Path, hosts: int = 2, slots: int = 4, **options: Any):
    """ds_config's coordinate and evaluate on in-process hosts (the host probe reads the real files)."""
    names = [f"node{i:02d}" for i in range(1, hosts + 1)]
    cluster = testing.FakeCluster(names, slots=slots, thresholds=TH,
                                  options=testing.check_options(deepspeed_config=config,
                                                                checkpoint_dir=str(checkpoint), **options))
    facts = D.coordinate(cluster)
    return facts, D.evaluate(facts, TH)


def resume_findings(outcome) -> List[Any]:
    return [f for f in outcome.findings if "checkpoint" in f.message and f.status != Status.PASS]


def test_a_zero2_checkpoint_and_a_zero3_config_fail_naming_both_stages(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", stage=2, dp=8)
    facts, out = resume(write_config(tmp_path / "z3.json", 3), ckpt)
    assert facts["host_probe"]["node01"]["checkpoint"]["layout"]["zero_stage"] == "1 or 2"
    (found,) = resume_findings(out["*"])
    assert found.status == Status.FAIL and out["*"].status == Status.FAIL
    assert "saved with ZeRO stage 1 or 2" in found.message and "the config sets ZeRO stage 3" in found.message
    assert str(ckpt / "global_step100") in found.message
    assert "zero_optimization.stage 1 or 2" in found.fix and "ds_to_universal" in found.fix

    # The same checkpoint resumes with stage 2 (DP 8 = 2 hosts x 4 slots): the summary says so.
    facts, out = resume(write_config(tmp_path / "z2.json", 2), ckpt)
    assert resume_findings(out["*"]) == []
    assert "resume global_step100 (ZeRO stage 1 or 2, DP 8)" in out["*"].message

    # And the other way round: a ZeRO-3 checkpoint under a stage-2 config.
    z3 = make_checkpoint(tmp_path / "ckpt3", stage=3, dp=8)
    (found,) = resume_findings(resume(write_config(tmp_path / "z2b.json", 2), z3)[1]["*"])
    assert "saved with ZeRO stage 3" in found.message and "sets ZeRO stage 2" in found.message


def test_a_checkpoint_saved_at_another_data_parallel_size_fails_with_the_universal_conversion(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", stage=3, dp=4)
    _, out = resume(write_config(tmp_path / "z3.json", 3), ckpt, hosts=2, slots=4)  # DP 8 now
    (found,) = resume_findings(out["*"])
    assert found.status == Status.FAIL
    assert "saved at data-parallel size 4" in found.message and "this hostfile gives 8" in found.message
    assert "The checkpoint being loaded used a DP world size of 4 but the current world size is 8" in found.message
    where = ckpt / "global_step100"
    assert f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {where} --output_folder {where}_universal" \
        in found.fix
    assert '"load_universal": true' in found.fix

    # With tensor parallelism the data-parallel size is world / model-parallel: 8 / 2 = 4 fits.
    _, out = resume(write_config(tmp_path / "z3.json", 3), ckpt, model_parallel_size=2)
    msgs = [f.message for f in resume_findings(out["*"])]
    assert not any("data-parallel size" in m for m in msgs)
    # ... but then the checkpoint's one MP rank does not.
    assert any("model-parallel size 1" in m and "--model-parallel-size 2" in m for m in msgs), msgs


def test_resume_edge_cases(tmp_path):
    # No `latest`: nothing to resume, nothing to say.
    (tmp_path / "empty").mkdir()
    _, out = resume(write_config(tmp_path / "z3.json", 3), tmp_path / "empty")
    assert resume_findings(out["*"]) == []
    # `latest` naming a tag without DeepSpeed files.
    bad = tmp_path / "bad"
    (bad / "global_step1").mkdir(parents=True)
    (bad / "latest").write_text("global_step1\n")
    (found,) = resume_findings(resume(write_config(tmp_path / "z3.json", 3), bad)[1]["*"])
    assert "holds no DeepSpeed model states" in found.message
    # load_universal without latest_universal: DeepSpeed raises (engine.py:4434-4435).
    ckpt = make_checkpoint(tmp_path / "ckpt", stage=2, dp=8)
    universal = write_config(tmp_path / "u.json", 3, checkpoint={"load_universal": True})
    (found,) = resume_findings(resume(universal, ckpt)[1]["*"])
    assert "no latest_universal" in found.message and "ds_to_universal" in found.fix
    # ... and with it, any stage and size resumes.
    (ckpt / "latest_universal").write_text("global_step100_universal")
    (ckpt / "global_step100_universal").mkdir()
    _, out = resume(universal, ckpt)
    assert resume_findings(out["*"]) == [] and "universal checkpoint" in out["*"].message
    # A host that does not see the checkpoint is named.
    ckpt2 = make_checkpoint(tmp_path / "ckpt2", stage=2, dp=8)
    names = ["node01", "node02"]

    def probe(host: str, params: Dict[str, Any], timeout: float) -> Any:
        if host == "node02":
            params = dict(params, checkpoint_dir=str(tmp_path / "elsewhere"))
        return testing.run_host_function("ds_config.host.probe", params, timeout)

    cluster = testing.FakeCluster(names, slots=4, thresholds=TH, handlers={"ds_config.host.probe": probe},
                                  options=testing.check_options(
                                      deepspeed_config=write_config(tmp_path / "z2.json", 2),
                                      checkpoint_dir=str(ckpt2)))
    out = D.evaluate(D.coordinate(cluster), TH)
    (found,) = resume_findings(out["*"])
    assert "not visible on node02" in found.message and out["node02"].status == Status.FAIL


def test_config_missing_or_different_on_a_host_is_named(tmp_path):
    config = write_config(tmp_path / "ds.json", 2)
    other = tmp_path / "other.json"
    write_config(other, 3)

    def probe(host: str, params: Dict[str, Any], timeout: float) -> Any:
        if host == "node02":
            params = dict(params, config_path=str(tmp_path / "missing.json"))
        if host == "node03":
            params = dict(params, config_path=str(other))
        return testing.run_host_function("ds_config.host.probe", params, timeout)

    cluster = testing.FakeCluster(["node01", "node02", "node03"], slots=1, thresholds=TH,
                                  handlers={"ds_config.host.probe": probe},
                                  options=testing.check_options(deepspeed_config=config))
    out = D.evaluate(D.coordinate(cluster), TH)
    msgs = [f.message for f in out["*"].findings if f.status == Status.FAIL]
    assert any("is missing on node02" in m for m in msgs), msgs
    assert any("on node03 is not the file checked here" in m for m in msgs), msgs
    assert out["node02"].status == Status.FAIL and out["node03"].status == Status.FAIL and "node01" not in out


# --- namespace hosts ---------------------------------------------------------------------------------------------

def run_cli(cluster, tmp_path: Path, *extra: str, checks: str = "ds_config", timeout: int = 180):
    report = tmp_path / (f"report-{os.urandom(3).hex()}.json")
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", checks, "--json", str(report), *extra]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    return proc, {(r["host"], r["check"]): r for r in data["results"]}


def findings(cell: Dict[str, Any]) -> str:
    return " | ".join(f["message"] for f in cell["metrics"].get("findings", [])) or cell["message"]


def test_real_config_and_checkpoint_as_each_host_sees_them(netcluster_factory, tmp_path):
    """Each host mounts a private /tmp: the config at /tmp/<dir>/ds.json is the coordinator's copy on node01,
    absent on node02 and another file on node03; then a ZeRO-2 checkpoint in each host's /tmp under a ZeRO-3
    config, and a ZeRO-3 checkpoint saved at data-parallel size 2 on this 3-rank cluster."""
    cluster = netcluster_factory(3)
    work = Path(tempfile.mkdtemp(prefix="pf-launch-", dir="/tmp"))
    try:
        config = work / "ds.json"
        write_config(config, 3)
        text = config.read_text()
        cluster.exec("node01", ["sh", "-c", f"mkdir -p {work} && cat > {config}"], check=True, input=text)
        cluster.exec("node03", ["sh", "-c", f"mkdir -p {work} && cat > {config}"], check=True,
                     input=text.replace('"stage": 3', '"stage": 1'))
        proc, cells = run_cli(cluster, tmp_path, "--deepspeed-config", str(config))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        star = findings(cells[("*", "ds_config")])
        assert f"{config} is missing on node02" in star, star
        assert f"{config} on node03 is not the file checked here" in star, star
        assert cells[("node02", "ds_config")]["status"] == "fail" and cells[("node03", "ds_config")]["status"] == "fail"
        assert ("node01", "ds_config") not in cells  # node01 has the same file: nothing to say there

        # The same file everywhere, and a ZeRO-2 checkpoint (DP 3) in every host's /tmp.
        ckpt = work / "ckpt"
        script = [f"mkdir -p {ckpt}/global_step100", f"echo global_step100 > {ckpt}/latest"]
        script += [f"touch {ckpt}/global_step100/{n}" for n in deepspeed_names(2, dp=3)]
        for h in ("node01", "node02", "node03"):
            cluster.exec(h, ["sh", "-c", f"mkdir -p {work} && cat > {config}"], check=True, input=text)
            cluster.exec(h, ["sh", "-c", " && ".join(script)], check=True)
        proc, cells = run_cli(cluster, tmp_path, "--deepspeed-config", str(config), "--checkpoint-dir", str(ckpt))
        assert proc.returncode == 1
        star = findings(cells[("*", "ds_config")])
        assert "saved with ZeRO stage 1 or 2" in star and "the config sets ZeRO stage 3" in star, star
        assert "is missing on" not in star and "not the file checked here" not in star, star

        # A ZeRO-3 checkpoint saved at DP 2: the data-parallel size differs, with the universal conversion.
        script = [f"rm -rf {ckpt}", f"mkdir -p {ckpt}/global_step7", f"echo global_step7 > {ckpt}/latest"]
        script += [f"touch {ckpt}/global_step7/{n}" for n in deepspeed_names(3, dp=2)]
        for h in ("node01", "node02", "node03"):
            cluster.exec(h, ["sh", "-c", " && ".join(script)], check=True)
        proc, cells = run_cli(cluster, tmp_path, "--deepspeed-config", str(config), "--checkpoint-dir", str(ckpt))
        assert proc.returncode == 1
        cell = cells[("*", "ds_config")]
        star = findings(cell)
        assert "saved at data-parallel size 2" in star and "this hostfile gives 3" in star, star
        assert "ds_to_universal" in cell["fix"]
        assert "saved with ZeRO stage" not in star, star  # stage 3 on both sides
    finally:
        shutil.rmtree(work, ignore_errors=True)


UNREACHABLE_NET = "10.213.7.1/24"  # an address only node01 has: the others have no route to it


def test_real_master_address_from_hostname_i_unreachable_by_the_others(netcluster_factory, tmp_path):
    """node01's `hostname -I` starts with an address on a network the other hosts are not on (as a docker0 or
    management address would): DeepSpeed's launcher gives the ranks that address, so the ports check FAILs on
    node01 naming it and the address that works; --master-addr with that one passes."""
    first_extra = ("a=$(ip -4 -o addr show dev eth0 | awk '{print $4}'); ip addr flush dev eth0; "
                   f"ip addr add {UNREACHABLE_NET} dev eth0; ip addr add $a dev eth0")
    cluster = netcluster_factory(3, setup={"node01": [first_extra]})
    words = cluster.exec("node01", ["hostname", "-I"], check=True).stdout.split()
    good = cluster.hosts[0].addresses[0]
    assert words[:2] == ["10.213.7.1", good], words  # the extra address comes first, as DeepSpeed reads it
    assert cluster.exec("node02", ["ip", "route", "get", "10.213.7.1"]).returncode != 0  # no route there

    proc, cells = run_cli(cluster, tmp_path, checks="ports")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cell = cells[("node01", "ports")]
    assert cell["status"] == "fail", cell
    assert "10.213.7.1" in cell["message"] and "hostname -I" in cell["message"], cell["message"]
    assert "node02" in cell["message"] and "node03" in cell["message"]
    assert f"deepspeed --master_addr {good}" in cell["fix"] and f"--master-addr {good}" in cell["fix"]
    assert cell["metrics"]["deepspeed_master_addr"] == "10.213.7.1"
    for h in ("node02", "node03"):
        assert cells[(h, "ports")]["status"] == "pass", cells[(h, "ports")]

    # The address that works, given as the job will give it: every host reaches it.
    proc, cells = run_cli(cluster, tmp_path, "--master-addr", good, checks="ports")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cells[("node01", "ports")]["metrics"]["deepspeed_master_addr"] == good

    # --master-addr naming the unreachable one fails the same way, attributed to the option.
    proc, cells = run_cli(cluster, tmp_path, "--master-addr", "10.213.7.1", checks="ports")
    assert proc.returncode == 1
    cell = cells[("node01", "ports")]
    assert "10.213.7.1 (--master-addr)" in cell["message"] and f"--master_addr {good}" in cell["fix"]


def test_master_addr_option_is_validated():
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--master-addr", "a b; rm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "--master-addr" in proc.stderr and "Traceback" not in proc.stderr
