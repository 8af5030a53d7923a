"""The DeepSpeed version a checkpoint was saved with (preflight/checks/ds_config/ckpt_version.py), read from its
model states file without unpickling it, and ds_config's WARN when the hosts run another minor version (issue 31,
"the smaller gaps")."""
from __future__ import annotations

import io
import os
import pickle
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from preflight.checks.ds_config import ckpt_version
from preflight.checks.ds_config import host as ds_host
from preflight.hostside.outcome import Status
from tests.checks.launch.test_launch_path import make_checkpoint, resume, write_config

# A real DeepSpeed 0.19.8 checkpoint on the CPU accelerator, one rank, a torch optimizer (no op to JIT-build: the
# shared-memory comm op is switched off, it plays no part in what save_checkpoint writes).
SAVE = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")
import torch, deepspeed, deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
model = torch.nn.Linear(4, 4)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={"train_batch_size": 1, "zero_optimization": {"stage": 0}})
engine.save_checkpoint(sys.argv[1], tag="global_step1")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed_deepspeed() -> str:
    import importlib.metadata
    return importlib.metadata.version("deepspeed")


def test_a_real_checkpoint_reads_back_the_version_it_was_saved_with(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path / "ckpt"), str(free_port())], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = ds_host.read_checkpoint(str(tmp_path / "ckpt"))
    assert seen["latest"] == "global_step1" and seen["layout"]["zero_stage"] == "0"
    assert seen["ds_version"] == installed_deepspeed() == "0.19.8"


def save_like_deepspeed(path: Path, version: str) -> None:
    """torch.save of a dict with the keys DeepSpeed's _common_checkpoint_state saves (engine.py:5017-5038)."""
    import torch
    state = dict(module={"weight": torch.zeros(2, 2)}, buffer_names=[], optimizer=None, param_shapes=None,
                 frozen_param_shapes=None, shared_params=None, frozen_param_fragments=None, lr_scheduler=None,
                 data_sampler=None, random_ltd=None, skipped_steps=0, global_steps=100, global_samples=800,
                 dp_world_size=8, mp_world_size=1, ds_config={"train_batch_size": 8}, ds_version=version)
    torch.save(state, str(path))


def test_a_checkpoint_of_another_minor_version_warns_naming_both(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", stage=2, dp=8)
    save_like_deepspeed(ckpt / "global_step100" / "mp_rank_00_model_states.pt", "0.16.4")
    facts, out = resume(write_config(tmp_path / "z2.json", 2), ckpt)
    assert facts["host_probe"]["node01"]["checkpoint"]["ds_version"] == "0.16.4"
    (found,) = [f for f in out["*"].findings if "saved with DeepSpeed" in f.message]
    assert found.status == Status.WARN and out["*"].status == Status.WARN
    assert f"saved with DeepSpeed 0.16.4, but node01, node02 run DeepSpeed {installed_deepspeed()}" in found.message
    assert str(ckpt / "global_step100") in found.message and "deepspeed==0.16.4" in found.fix
    # A patch release keeps the format: nothing to say.
    save_like_deepspeed(ckpt / "global_step100" / "mp_rank_00_model_states.pt", "0.19.3")
    _, out = resume(write_config(tmp_path / "z2.json", 2), ckpt)
    assert not [f for f in out["*"].findings if "saved with DeepSpeed" in f.message]
    # No version in the file (the empty stand-ins of the layout tests): nothing either.
    assert ds_host.read_checkpoint(str(make_checkpoint(tmp_path / "empty", stage=2, dp=2)))["ds_version"] is None


def test_the_pickle_is_never_run(tmp_path):
    """A host's checkpoint file is data: a pickle whose loading would run a command only has its opcodes read."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = pickle.dumps({"module": Evil(), "ds_version": "0.18.0"}, protocol=2)
    path = tmp_path / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mp_rank_00_model_states/data.pkl", data)
    assert ckpt_version.saved_version(str(path)) == "0.18.0"
    assert not marker.exists()
    # Not a zip, a version that is not one, a truncated pickle: None, never an exception.
    (tmp_path / "junk.pt").write_bytes(b"\x80\x02}q\x00")
    assert ckpt_version.saved_version(str(tmp_path / "junk.pt")) is None
    assert ckpt_version.version_after_key(pickle.dumps({"ds_version": "$(reboot)"})) is None
    assert ckpt_version.version_after_key(pickle.dumps({"ds_version": "0.9.1"})[:-8]) in (None, "0.9.1")
    assert ckpt_version.version_after_key(io.BytesIO(b"").getvalue()) is None


@pytest.mark.parametrize("saved,hosts,named", [("0.16.4", {"a": "0.19.8"}, True), ("0.19.1", {"a": "0.19.8"}, False),
                                               ("1.0.0", {"a": "0.19.8"}, True), (None, {"a": "0.19.8"}, False),
                                               ("0.16.4", {"a": None}, False), ("0.16.4", {"a": "<b>"}, False)])
def test_mismatch_is_by_major_and_minor(saved, hosts, named):
    assert (ckpt_version.mismatch(saved, hosts, "/c/t") is not None) == named
