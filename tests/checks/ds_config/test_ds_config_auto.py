""""auto" values mean the Hugging Face integration (issue 30): ds_config checks the config as transformers' Trainer
fills it (preflight/hostside/hfauto.py) and says so, WARNs only when the run says the job is plain DeepSpeed, and the
rehearsal's ranks open a copy filled the same way, so a config with "auto" values starts."""
from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.checks import ds_config as D
from preflight.checks.ds_config import deepspeed_models
from preflight.checks.launch.drive import LaunchRun
from preflight.checks.launch.judge import LaunchPlan
from preflight.hostside import hfauto
from preflight.hostside.outcome import Status
from preflight.testing import FakeHost
from tests.checks.ds_config.test_ds_config import (GiB, IGNORED_TOP_LEVEL, REAL_WORLD, TH_PLAIN, ds_report_with_libaio,
                                  make_facts, recorded_meminfo, run)
from tests.checks.ds_config.test_ds_config_fixes import deepspeed_batch_ok

REPO = Path(__file__).resolve().parents[3]
WITH_AUTO = sorted(p.name for p in REAL_WORLD.glob("*.json") if hfauto.auto_paths(json.loads(p.read_text())))


def test_the_real_world_configs_with_auto_are_the_hf_trainers():
    assert len(WITH_AUTO) >= 6, WITH_AUTO  # axolotl, LLaMA-Factory, InternVL, transformers' own tests


def coordinated_facts(name: str, hosts: int = 2, slots: int = 8):
    """make_facts on 2 x 8 H100, then what coordinate adds: DeepSpeed's validation of the config as checked."""
    big = dict(recorded_meminfo(), mem_total=1024 * GiB, mem_available=1000 * GiB)
    facts = make_facts(str(REAL_WORLD / name), hosts=hosts, slots=slots, ds_report=ds_report_with_libaio(), mem=big)
    checked, _ = D.as_checked(facts["config"], facts, "hf")
    facts["deepspeed_models"] = deepspeed_models.validate_with_deepspeed(checked)
    facts["deepspeed_validation"] = {"where": "this machine", "tried": []}
    return facts


@pytest.mark.parametrize("name", WITH_AUTO)
def test_real_world_auto_configs_give_no_warning_by_default_and_say_what_was_filled(name):
    pytest.importorskip("deepspeed")
    facts = coordinated_facts(name)
    out = run(facts)  # the default thresholds: [ds_config] integration = "hf"
    findings = [f for o in out.values() for f in o.findings]
    assert [f.message for f in findings if f.status in (Status.FAIL, Status.ERROR)] == [], name
    warned = {f.message.split(":")[0] for f in findings if f.status == Status.WARN}
    # The only WARNs left are the unknown top-level keys these configs carry (DeepSpeed ignores them): none about
    # "auto".
    assert warned == IGNORED_TOP_LEVEL.get(name, set()), (name, warned)
    assert not [f.message for f in findings if f.status == Status.WARN and '"auto"' in f.message]
    # The PASS says the config was checked as the Trainer fills it, and names every filled key with its source.
    (message,) = [f.message for f in out["*"].findings if f.status == Status.PASS]  # also beside a WARN
    if out["*"].status == Status.PASS:
        assert out["*"].message == message
    assert 'checked with "auto" filled as the Hugging Face Trainer fills it' in message
    _, notes = hfauto.fill(facts["config"], 16)
    assert notes and all(f"{n['key']} = {json.dumps(n['value'])}" in message for n in notes), message
    assert "TrainingArguments' defaults" in message
    assert [n["key"] for n in out["*"].metrics["auto_filled"]] == [n["key"] for n in notes]


@pytest.mark.parametrize("name", WITH_AUTO)
def test_the_filled_config_is_one_deepspeed_accepts_whole(name):
    """As the Trainer fills it on 16 ranks, DeepSpeed's own DeepSpeedConfig (every section and the batch
    assertion) accepts it, and no "auto" the Trainer fills is left."""
    pytest.importorskip("deepspeed")
    config = json.loads((REAL_WORLD / name).read_text())
    filled, notes = hfauto.fill(config, 16)
    assert deepspeed_batch_ok(filled, 16) is None, (name, deepspeed_batch_ok(filled, 16))
    left = hfauto.auto_paths(filled)
    # Left "auto" only where the Trainer leaves it too: ZeRO-3 bucket keys on a stage < 3 config (DeepSpeed's
    # model drops "auto" and keeps its default).
    assert all(k.startswith("zero_optimization.stage3_") for k in left), (name, left)
    assert config == json.loads((REAL_WORLD / name).read_text())  # the job's own config is not changed


@pytest.mark.parametrize("name", WITH_AUTO)
def test_plain_deepspeed_still_warns(name):
    facts = coordinated_facts(name)
    warns = [f.message for f in out_star(run(facts, TH_PLAIN)) if f.status == Status.WARN]
    assert any("only the Hugging Face integration" in m for m in warns), warns


def out_star(out):
    return out["*"].findings


def test_fill_follows_the_trainer():
    config = {"train_batch_size": 96, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "total_num_steps": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
              "bf16": {"enabled": "auto"}}
    filled, notes = hfauto.fill(config, 8, hidden_size=4096)
    assert filled["train_micro_batch_size_per_gpu"] == 12 and filled["gradient_accumulation_steps"] == 1
    assert filled["train_batch_size"] == 96  # fixed: the Trainer's arguments must give it
    assert filled["gradient_clipping"] == 1.0 and filled["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert filled["scheduler"]["params"]["warmup_max_lr"] == 3e-4  # the learning rate the config fixes
    assert filled["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096
    assert filled["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)  # an int: pydantic
    assert filled["bf16"]["enabled"] is False
    assert {n["key"] for n in notes} == set(hfauto.auto_paths(config))
    assert deepspeed_batch_ok(filled, 8) is None


# --- the rehearsal ---------------------------------------------------------------------------------------------

def plan_for(config_path: str, workdir: str, **kw) -> LaunchPlan:
    return LaunchPlan(hostfile="hostfile", hosts=[FakeHost("node01", 1, index=0)], deepspeed_config=config_path,
                      workdir=workdir, steps=1, **kw)


def test_the_rehearsal_points_the_ranks_at_a_filled_copy_in_its_launch_directory(tmp_path):
    original = str(REAL_WORLD / "hf_tests_zero3.json")
    run = LaunchRun(plan_for(original, str(tmp_path)))
    filled_path = os.path.join(run.dir, hfauto.REHEARSAL_CONFIG)
    assert run.o.deepspeed_config == filled_path
    argv = run.launcher_argv()
    assert argv[argv.index("--deepspeed_config") + 1] == filled_path
    (name, data), = run.config_files
    filled = json.loads(data)
    assert name == hfauto.REHEARSAL_CONFIG and not [k for k in hfauto.auto_paths(filled)]
    assert filled["train_batch_size"] == 8  # 1 rank x the Trainer's default micro batch 8 x accumulation 1
    assert filled["scheduler"]["params"]["total_num_steps"] == 1  # the rehearsal's steps
    # A config without "auto" is the job's own file, opened where the job opens it.
    plain = str(REAL_WORLD / "dsexamples_cifar_fp16.json")
    run = LaunchRun(plan_for(plain, str(tmp_path)))
    assert run.o.deepspeed_config == plain and run.config_files == []


def test_a_config_with_auto_values_runs_in_the_rehearsals_rank(tmp_path):
    """The rehearsal's own rank script (hostside/rehearsal.py, as DeepSpeed's launcher starts it, world size 1 on
    this machine) on the copy the rehearsal writes: initialize and a training step complete; on the job's own file
    with its "auto" values, plain DeepSpeed raises at initialize. One rank, about 20 s with DeepSpeed's CPU ops
    already built in ~/.cache/torch_extensions; minutes while another process rebuilds them (hence the lifetime).
    The full rehearsal is the next test."""
    pytest.importorskip("deepspeed")
    original = str(REAL_WORLD / "axolotl_zero1.json")
    run = LaunchRun(plan_for(original, str(tmp_path)))
    os.makedirs(run.dir)
    for name, data in run.config_files:
        Path(run.dir, name).write_bytes(data)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))

    def events(config_path: str):
        proc = subprocess.run([sys.executable, str(REPO / "preflight" / "hostside" / "rehearsal.py"),
                               "--deepspeed_config", config_path, "--preflight-run", "t", "--steps", "1",
                               "--init-timeout", "60", "--lifetime", "600"],
                              cwd=run.dir, env=env, capture_output=True, text=True, timeout=700)
        return [json.loads(ln.split(" ", 1)[1]) for ln in proc.stdout.splitlines() if ln.startswith("@@PF-REHEARSE")]

    filled = events(run.o.deepspeed_config)
    assert [e["event"] for e in filled][-2:] == ["step", "done"], filled[-1]
    init = [e for e in filled if e["event"] == "initialize"][0]
    assert init["micro_batch"] == 8 and init["train_batch"] == 8
    raw = events(original)
    assert raw[-1]["event"] == "error" and raw[-1].get("phase") == "initialize", raw[-1]
    assert copy.deepcopy(json.loads(Path(original).read_text()))["train_batch_size"] == "auto"


def test_plain_deepspeed_warns_on_auto_outside_the_batch_keys_in_one_line(tmp_path):
    """integration = "deepspeed": gradient_clipping "auto" is handed on as the string (a WARN of its own when the
    batch is numeric; folded into the batch WARN when that fires too: one cause, one line). Default: no WARN."""
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "auto",
                             "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}))
    facts = make_facts(str(p))
    (warn,) = [f for f in out_star(run(facts, TH_PLAIN)) if f.status == Status.WARN]
    assert warn.message.startswith('gradient_clipping = "auto": only the Hugging Face integration fills "auto"')
    assert "stage3_prefetch_bucket_size" not in warn.message  # DeepSpeed's ZeRO model drops "auto"
    assert not [f for f in out_star(run(facts)) if f.status == Status.WARN]
    p.write_text(json.dumps({"train_batch_size": "auto", "gradient_clipping": "auto"}))
    warns = [f for f in out_star(run(make_facts(str(p)), TH_PLAIN)) if f.status == Status.WARN]
    assert len(warns) == 1 and 'gradient_clipping = "auto" too' in warns[0].message


def test_preflight_rehearse_launches_a_config_with_auto_values_on_three_hosts(warm_ops, netcluster_factory,
                                                                            tmp_path):
    """The whole rehearsal, as a user runs it: `preflight rehearse` over DeepSpeed's pdsh launcher on 3 namespace
    hosts with axolotl's ZeRO-1 config, whose batch sizes and gradient_clipping are "auto": every rank initializes
    and steps (the ranks open the filled copy), and nothing is left behind."""
    # warm_ops: from a cold extensions cache each host JIT-builds every op in its own overlay, side by side (in CI
    # the three builds took the test's whole 400 s); the cold build is tests/rehearse/test_jit_cold.py's.
    cluster3 = netcluster_factory(3)
    from tests.cli.test_cli_cluster import assert_nothing_left
    from tests.rehearse.test_rehearse import INIT_TIMEOUT, LAUNCHER, _env

    if not shutil.which("pdsh") or not LAUNCHER.exists():
        pytest.fail("the rehearsal needs pdsh and DeepSpeed's launcher (tests/install-deps.sh installs both)")
    config = cluster3.dir / "ds_axolotl_auto.json"  # /run: every host sees it
    shutil.copy(REAL_WORLD / "axolotl_zero1.json", config)
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth0\n")  # the namespace hosts' one network
    report = tmp_path / "rehearse.json"
    argv = [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster3.hostfile(tmp_path / "hostfile")),
            "--deepspeed-config", str(config), "--ssh-config", str(cluster3.ssh_config),
            "--ssh-key", str(cluster3.user_key), "--known-hosts", str(cluster3.known_hosts),
            "--deepspeed", str(LAUNCHER), "--python", sys.executable, "--init-timeout", str(INIT_TIMEOUT),
            "--timeout", "200", "--jit-build-budget", "120", "--json", str(report)]
    try:
        try:  # preflight's own bound (--timeout + --jit-build-budget) comes well before this one
            proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=420,
                                  stdin=subprocess.DEVNULL, env=_env())
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"preflight rehearse outlived its own 320 s bound:\n{(e.stderr or b'').decode()[-3000:]}")
        assert "Traceback" not in proc.stderr, proc.stderr
        cells = {r["host"]: r for r in json.loads(report.read_text())["results"]}
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        for host in ("node01", "node02", "node03"):
            (rank,) = cells[host]["metrics"]["ranks"]
            assert rank["state"] == "done" and rank["train_batch"] == 3 * 8, rank  # 3 ranks x the Trainer's 8
    finally:
        config.unlink()
    assert_nothing_left(cluster3)
