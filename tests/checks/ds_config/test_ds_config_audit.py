"""ds_config's items from issue 24's audit: CPUs per rank, "auto" batch values without the Hugging Face
integration, the bf16 note for fp16/fp32 on bf16-capable GPUs, and the pipeline section's keys and values, each
checked against DeepSpeed 0.19.8's own code where it can be run here."""
from __future__ import annotations

import copy
import inspect
import json
import re

import pytest

from preflight.checks import ds_config as D
from preflight.checks.ds_config import keys as K
from preflight.config import load_thresholds
from preflight.hostside.outcome import Status
from tests.checks.ds_config.test_ds_config import HF_TRAINER, REAL_WORLD, TH, TH_HF, TH_PLAIN, h100_gpu, make_facts, run


def messages(out, status):
    return [f.message for o in out.values() for f in o.findings if f.status == status]


def star(out, status):
    return [f for f in out["*"].findings if f.status == status]


# --- "auto" without the HF integration ---------------------------------------------------------------------------

def deepspeed_config(config):
    """DeepSpeed 0.19.8's own parse and batch math (world size 1 without torch.distributed)."""
    runtime_config = pytest.importorskip("deepspeed.runtime.config")
    return runtime_config.DeepSpeedConfig(copy.deepcopy(config))


@pytest.mark.parametrize("name", sorted(HF_TRAINER))
def test_auto_batch_warns_under_plain_deepspeed_which_raises(name):
    path = str(REAL_WORLD / name)
    facts = make_facts(path, hosts=1, slots=1)
    auto = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
            if facts["config"].get(k) == "auto"]
    assert auto, name
    with pytest.raises(TypeError):  # what plain deepspeed.initialize does with them
        deepspeed_config(facts["config"])
    # Issue 30: "auto" means the HF integration unless the run says the job is plain DeepSpeed.
    (warn,) = [f for f in star(run(facts, TH_PLAIN), Status.WARN) if "only the Hugging Face integration" in f.message]
    assert warn.message.startswith(", ".join(auto) + ' = "auto"') and "TypeError" in warn.message
    assert '[ds_config] integration = "hf"' in warn.fix
    # The fix's numbers, pasted into the config, are what DeepSpeed accepts.
    example = re.search(r"e\.g\. (.*?), train_batch_size = micro", warn.fix).group(1)
    fixed = dict(facts["config"], **json.loads("{" + example + "}"))
    assert deepspeed_config(fixed).train_batch_size == fixed["train_batch_size"]
    # Declared as an HF-integration job, or by default: no such WARN.
    assert not [m for m in messages(run(facts, TH_HF), Status.WARN) if "Hugging Face" in m]
    assert not [m for m in messages(run(facts), Status.WARN) if "Hugging Face" in m]


def test_integration_is_set_in_a_config_file_and_validated(tmp_path):
    good = tmp_path / "p.toml"
    good.write_text('[ds_config]\nintegration = "hf"\n')
    assert load_thresholds(str(good))["ds_config"]["integration"] == "hf"
    assert TH["ds_config"]["integration"] == "hf"  # issue 30: "auto" means the HF integration unless the user says
    plain = tmp_path / "plain.toml"                 # the job is plain DeepSpeed
    plain.write_text('[ds_config]\nintegration = "deepspeed"\n')
    assert load_thresholds(str(plain))["ds_config"]["integration"] == "deepspeed"
    bad = tmp_path / "bad.toml"
    bad.write_text('[ds_config]\nintegration = "accelerate"\n')
    with pytest.raises(Exception, match="integration"):
        load_thresholds(str(bad))


# --- CPUs per rank ---------------------------------------------------------------------------------------------

def with_cpus(threads, slots=8, hosts=2):
    facts = make_facts(str(REAL_WORLD / "hf_tests_zero2.json"), hosts=hosts, slots=slots)
    for i, (_name, per) in enumerate(sorted(facts["host_facts"].items())):
        if threads[i] is not None:
            per["compute"] = {"cpu": {"model": "AMD EPYC 9654", "threads": threads[i]}}
    return facts


def test_cpus_per_rank_below_the_floor_warns_on_that_host():
    out = run(with_cpus([8, 96]), TH_HF)
    (warn,) = [f for f in star(out, Status.WARN) if "per rank" in f.message]
    assert warn.message.startswith("node00: 8 CPUs for 8 ranks (1 per rank), under 2 per rank "
                                   "([ds_config] min_cpus_per_slot)")
    assert "run fewer ranks there (hostfile: node00 slots=N)" in warn.fix and "num_workers=...) at 0" in warn.fix
    assert out["node00"].status == Status.WARN and "node01" not in out
    # Enough everywhere: the PASS message says the smallest ratio; a higher floor from --config names both.
    out = run(with_cpus([16, 96]), TH_HF)
    assert out["*"].status == Status.PASS and "2+ CPUs per rank" in out["*"].message
    strict = copy.deepcopy(TH_HF)
    strict["ds_config"]["min_cpus_per_slot"] = 4.0  # node00 has 2 per rank, node01 12
    warned = run(with_cpus([16, 96]), strict)
    assert sorted(h for h, o in warned.items() if h != "*" and o.status == Status.WARN) == ["node00"]
    strict["ds_config"]["min_cpus_per_slot"] = 16.0
    warned = run(with_cpus([16, 96]), strict)
    assert sorted(h for h, o in warned.items() if h != "*" and o.status == Status.WARN) == ["node00", "node01"]


def test_cpus_come_from_the_compute_checks_facts_only():
    # Without them (the compute check left out) there is no verdict and no claim.
    out = run(with_cpus([None, None]), TH_HF)
    assert out["*"].status == Status.PASS and "CPUs per rank" not in out["*"].message
    # compute's facts as its collect records them on this machine.
    from preflight.checks import compute
    threads = compute._cpu_info()["threads"]
    out = run(with_cpus([threads, threads], slots=threads + 1), TH_HF)
    assert sorted(h for h, o in out.items() if h != "*") == ["node00", "node01"]
    assert "compute" in D.SPEC.reads


# --- the bf16 note -----------------------------------------------------------------------------------------------

def precision_facts(tmp_path, section, gpus=None):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(dict({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
                                 **section)))
    return make_facts(str(p), hosts=1, slots=2, gpus=gpus)


def test_fp16_or_fp32_on_bf16_gpus_is_a_note_never_a_warning(tmp_path):
    assert h100_gpu()["cc"][0] == 9  # the recorded H100
    out = run(precision_facts(tmp_path, {"fp16": {"enabled": True}}))
    assert out["*"].status == Status.PASS
    assert ('fp16 (note: every GPU does bf16 (compute capability 9.0): "bf16": {"enabled": true} needs no loss '
            'scaling)') in out["*"].message
    out = run(precision_facts(tmp_path, {}))
    assert out["*"].status == Status.PASS and "fp32 (note: every GPU does bf16" in out["*"].message
    # bf16 already, autocast, GPUs before Ampere or of unknown capability: no note.
    assert "note:" not in run(precision_facts(tmp_path, {"bf16": {"enabled": True}}))["*"].message
    assert "note:" not in run(precision_facts(tmp_path, {"torch_autocast": {"enabled": True}}))["*"].message
    v100 = [dict(h100_gpu(i), cc=[7, 0], name="Tesla V100") for i in range(2)]
    assert "note:" not in run(precision_facts(tmp_path, {"fp16": {"enabled": True}}, v100))["*"].message
    unknown = [dict(h100_gpu(0)), dict(h100_gpu(1), cc=None)]
    assert "note:" not in run(precision_facts(tmp_path, {"fp16": {"enabled": True}}, unknown))["*"].message


# --- pipeline ----------------------------------------------------------------------------------------------------

def test_pipeline_keys_are_deepspeeds_own():
    """The table holds every key DeepSpeed 0.19.8's get_pipeline_config defaults and every key its PipelineEngine
    reads from config.pipeline, and nothing else."""
    runtime_config = pytest.importorskip("deepspeed.runtime.config")
    engine = pytest.importorskip("deepspeed.runtime.pipe.engine")
    read = set(re.findall(r"_config\.pipeline(?:\[|\.get\()'(\w+)'", inspect.getsource(engine)))
    assert read == {"pipe_partitioned", "grad_partitioned", "use_reentrant", "activation_checkpoint_interval"}
    assert set(K.SECTIONS["pipeline"]) == set(runtime_config.get_pipeline_config({})) | read


def test_pipeline_unknown_keys_and_bad_values(tmp_path):
    def out_of(section):
        p = tmp_path / "c.json"
        p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "pipeline": section}))
        return run(make_facts(str(p), hosts=1, slots=1))

    ok = out_of({"stages": "auto", "partition": "best", "activation_checkpoint_interval": 1,
                 "pipe_partitioned": False, "use_reentrant": None})
    assert not [f for f in ok["*"].findings if f.status in (Status.FAIL, Status.WARN)], ok["*"].message
    near = out_of({"activation_checkpoint_intervals": 1})
    (fail,) = star(near, Status.FAIL)
    assert fail.message.startswith("pipeline.activation_checkpoint_intervals: unknown pipeline key")
    assert "did you mean 'activation_checkpoint_interval'?" in fail.message
    assert fail.fix == "rename pipeline.activation_checkpoint_intervals to pipeline.activation_checkpoint_interval"
    (warn,) = star(out_of({"num_stages": 4}), Status.WARN)
    assert warn.message.startswith("pipeline.num_stages: unknown pipeline key")
    bad = out_of({"pipe_partitioned": 1, "activation_checkpoint_interval": "2"})
    fails = [f.message for f in star(bad, Status.FAIL)]
    assert any(m.startswith("pipeline.pipe_partitioned = 1 (expected true or false)") for m in fails), fails
    assert any(m.startswith("pipeline.activation_checkpoint_interval = '2' (expected an integer >= 0)")
               for m in fails), fails
    (not_object,) = star(out_of([1, 2]), Status.FAIL)
    assert "AttributeError" in not_object.message


def test_the_pipeline_value_verdicts_match_deepspeeds_engine():
    """What the FAILs say, run: the engine's own assert on a non-bool and its comparison of a str with 0."""
    engine = pytest.importorskip("deepspeed.runtime.pipe.engine")
    source = inspect.getsource(engine.PipelineEngine.__init__)
    assert "assert isinstance(self._config.pipeline['pipe_partitioned'], bool)" in source
    assert "if self._config.pipeline['activation_checkpoint_interval'] > 0:" in source
    with pytest.raises(TypeError):
        assert "2" > 0  # the comparison the engine makes
    # And preflight FAILs on exactly those values, as evaluate reports them.
    facts = make_facts(str(REAL_WORLD / "hf_tests_zero2.json"), hosts=1, slots=1)
    facts["config"]["pipeline"] = {"grad_partitioned": "yes"}
    assert [f.message.split(" (")[0] for f in star(D.evaluate(facts, TH_HF), Status.FAIL)] == [
        "pipeline.grad_partitioned = 'yes'"]
