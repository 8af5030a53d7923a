"""ds_config validates with DeepSpeed's own code wherever DeepSpeed is (issue 30): preflight installed as the README
says (its own virtualenv, `pip install .`, no DeepSpeed on the coordinator) against namespace hosts whose job
Python (--python) has DeepSpeed 0.19.8: a misspelled optimizer parameter FAILs naming the key with its did-you-mean,
from DeepSpeed's optimizer class on the first host; where DeepSpeed is nowhere, a WARN says what was not checked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

from preflight.checks import ds_config as D
from preflight.checks.ds_config import deepspeed_models
from preflight.hostside.outcome import Status
from preflight import testing
from preflight.hostside.seams import CheckOptions
from tests.checks.ds_config.test_ds_config import TH

REPO = Path(__file__).resolve().parents[3]
TYPO = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decy": 0.1}}}


@pytest.fixture(scope="module")
def readme_venv(tmp_path_factory):
    """The README's install: a fresh virtualenv (no system site-packages) and `pip install .` of a copy of this
    checkout, with its runtime dependencies from the package index (or pip's cache); DeepSpeed is not among them."""
    root = tmp_path_factory.mktemp("readme-venv")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    src = root / "src"  # a copy, so the build leaves nothing in the checkout
    src.mkdir()
    shutil.copytree(REPO / "preflight", src / "preflight", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "No matching distribution" in r.stderr:
        pytest.skip(f"no package index reachable: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    probe = subprocess.run([str(py), "-c", "import deepspeed"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'deepspeed'" in probe.stderr  # the coordinator has none
    return env_dir / "bin" / "preflight"


@pytest.fixture
def shared_dir():
    """A directory every namespace host sees at the same path (their /tmp is private)."""
    path = Path(tempfile.mkdtemp(prefix="pf-ds-remote-", dir="/run"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_installed(preflight_bin, cluster, tmp_path, config_path, python):
    out = tmp_path / "r.json"
    argv = [str(preflight_bin), "run", "--hostfile", str(cluster.hostfile(tmp_path / "hf", slots=1)),
            "--python", python, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "ds_config", "--deepspeed-config",
            str(config_path), "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "PYTEST_"))}
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env=env)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_readme_install_fails_the_misspelled_optimizer_param_from_the_hosts_deepspeed(readme_venv, cluster3,
                                                                                      tmp_path, shared_dir):
    config = shared_dir / "ds.json"
    config.write_text(json.dumps(TYPO))
    proc, report = run_installed(readme_venv, cluster3, tmp_path, config, sys.executable)
    star = {(r["host"], r["check"]): r for r in report["results"]}[("*", "ds_config")]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert star["status"] == "fail", star["message"]
    (fail,) = [f for f in star["metrics"]["findings"] if f["status"] == "fail"]
    assert fail["message"].startswith("optimizer.params.weight_decy: deepspeed.ops.adam.fused_adam.FusedAdam takes "
                                      "no such parameter"), fail["message"]
    assert "got an unexpected keyword argument 'weight_decy'" in fail["message"]
    assert "did you mean 'weight_decay'?" in fail["message"] and fail["fix"] == "rename it to 'weight_decay'"
    assert star["metrics"]["validated_on"] == "node01"  # the first host, in the job's interpreter
    assert "optimizer.params.weight_decy" in proc.stdout  # the terminal line a user reads

    # The same install with the config fixed: a PASS that says where DeepSpeed's own code checked it.
    TYPO_FIXED = dict(TYPO, optimizer={"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.1}})
    config.write_text(json.dumps(TYPO_FIXED))
    proc, report = run_installed(readme_venv, cluster3, tmp_path, config, sys.executable)
    star = {(r["host"], r["check"]): r for r in report["results"]}[("*", "ds_config")]
    assert star["status"] == "pass", star["message"]
    assert "validated by DeepSpeed 0.19.8's own code on node01" in star["message"]
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_readme_install_warns_what_was_not_checked_where_deepspeed_is_nowhere(readme_venv, cluster3, tmp_path,
                                                                              shared_dir):
    """--python the distribution's own /usr/bin/python3, which has no DeepSpeed: no DeepSpeed anywhere. The hosts
    FAIL for the missing DeepSpeed, and the cluster line says the optimizer params were not checked."""
    python = "/usr/bin/python3"
    if subprocess.run([python, "-c", "import deepspeed"], capture_output=True).returncode == 0:
        pytest.skip(f"{python} has DeepSpeed here: no interpreter without it to point the hosts at")
    config = shared_dir / "ds.json"
    config.write_text(json.dumps(TYPO))
    proc, report = run_installed(readme_venv, cluster3, tmp_path, config, python)
    star = {(r["host"], r["check"]): r for r in report["results"]}[("*", "ds_config")]
    warns = [f for f in star["metrics"]["findings"] if f["status"] == "warn"]
    assert any(f["message"].startswith("DeepSpeed's own validation of the config ran nowhere") and
               "optimizer.params against the optimizer's constructor" in f["message"] for f in warns), star
    assert proc.returncode == 1  # DeepSpeed missing in the job's interpreter is a FAIL on every host


# --- the same path without a cluster: FakeCluster runs the host function in this process -------------------

def test_coordinate_validates_on_the_first_host_with_deepspeed_when_this_machine_has_none(monkeypatch, tmp_path):
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(TYPO))
    # This machine's import of DeepSpeed fails; the hosts' (run in this process by FakeCluster) works.
    monkeypatch.setattr("preflight.checks.ds_config.gather.validate_or_why",
                        lambda config: (None, "import deepspeed: ModuleNotFoundError: No module named 'deepspeed'"))
    calls = []

    def validate(host, params, timeout):
        calls.append(host)
        return deepspeed_models.validate(params, None)

    cluster = testing.FakeCluster(["node01", "node02"], thresholds=TH, options=CheckOptions(deepspeed_config=str(path)),
                                  handlers={"ds_config.deepspeed_models.validate": validate})
    facts = D.coordinate(cluster)
    assert calls == ["node01"] and facts["deepspeed_validation"]["where"] == "node01"
    assert facts["deepspeed_validation"]["tried"][0].startswith("this machine: import deepspeed")
    out = D.evaluate(facts, TH)["*"]
    (fail,) = [f for f in out.findings if f.status == Status.FAIL]
    assert "weight_decy" in fail.message and "did you mean 'weight_decay'?" in fail.message
    # No host with DeepSpeed either: a WARN naming what was not checked, and no call.
    calls.clear()
    cluster.handlers["ds_config.host.probe"] = lambda host, params, timeout: {
        "deepspeed": None, "deepspeed_found": False, "paths": [], "memory": None, "config_file": None,
        "checkpoint": None}
    facts = D.coordinate(cluster)
    assert calls == [] and facts["deepspeed_models"] is None
    warns = [f.message for f in D.evaluate(facts, TH)["*"].findings if f.status == Status.WARN]
    assert any("ran nowhere" in m and "no host has DeepSpeed" in m and "optimizer.params" in m for m in warns), warns


def test_a_hosts_validation_answer_is_data(monkeypatch):
    """A host's answer is checked and bounded: a wrong shape is no validation, control characters are replaced."""
    assert deepspeed_models.clean_models({"errors": "x"}) is None
    res = deepspeed_models.clean_models({"version": "0.19.8\x1b[31m", "sections": ["zero_optimization"],
                                         "errors": [{"section": "fp16", "loc": ["x\n"], "type": "t", "msg": "m" * 999}],
                                         "param_errors": []})
    assert res["version"] == "0.19.8?[31m" and res["errors"][0]["loc"] == ["x?"]
    assert len(res["errors"][0]["msg"]) == 300
