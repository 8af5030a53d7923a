"""GPUs are expected on a host with NVIDIA device nodes, an NVIDIA PCI device or a CUDA build of torch: there a
missing driver FAILs (naming which sign applied) instead of SKIPping as on a CPU host."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.checks import driver_cuda, gpu
from preflight.hostside.outcome import Status

REPO = Path(__file__).resolve().parents[3]
NO_DRIVER = {"driver": None, "nvml_error": "NVML Shared Library Not Found", "smi_error": "command not found"}


@pytest.mark.parametrize("module, facts", [
    (driver_cuda, dict(NO_DRIVER)),
    (gpu, dict(NO_DRIVER, driver_present=False, gpus=[])),
])
def test_evidence_turns_a_missing_driver_into_a_fail_that_says_why(module, facts, thresholds):
    assert module.evaluate(facts, thresholds).status == Status.SKIP  # a CPU host
    out = module.evaluate(dict(facts, gpu_evidence=["/dev/nvidia0 exists"]), thresholds)
    assert out.status == Status.FAIL and "/dev/nvidia0 exists" in out.message
    cuda = module.evaluate(dict(facts, gpu_evidence=["the job's torch is a CUDA 12.8 build"]), thresholds)
    assert cuda.status == Status.FAIL and "CUDA 12.8 build" in cuda.message
    configured = dict(thresholds, gpu=dict(thresholds["gpu"], gpus_expected=True))
    assert "gpus_expected = true in [gpu]" in module.evaluate(facts, configured).message
    # the coordinator's per-host answer wins over the host's evidence
    assert module.evaluate(dict(facts, gpu_evidence=["/dev/nvidia0 exists"], gpus_expected=False),
                           thresholds).status == Status.SKIP


def test_a_real_device_node_is_evidence(tmp_path):
    """In a private mount namespace /dev gets an nvidia0 node (a real char device, major 195 as the driver's):
    collect on that 'host' reports it, and the verdict is FAIL, not SKIP."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    script = ("import json, sys, time\n"
              f"sys.path.insert(0, {str(REPO)!r})\n"
              "from preflight.checks import driver_cuda\n"
              "from preflight.hostside.seams import HostContext\n"
              "print('FACTS=' + json.dumps(driver_cuda.collect(HostContext({}, time.monotonic() + 60))))\n")
    setup = ("mount -t tmpfs preflight-dev /dev\nmknod /dev/nvidia0 c 195 0\nmknod /dev/null c 1 3\n"
             "chmod 666 /dev/null\n")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec", setup + 'exec "$0" -c "$1"',
                        sys.executable, script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    facts = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("FACTS=")][-1][len("FACTS="):])
    assert "/dev/nvidia0 exists" in facts["gpu_evidence"]
    from preflight.config import load_defaults
    out = driver_cuda.evaluate(facts, load_defaults())
    assert out.status == Status.FAIL and "/dev/nvidia0 exists" in out.message, out.message
