"""`preflight node-check` on this machine: its total deadline, its thresholds from --config, bad input, the line.

The Slurm half (--drain against a real slurmctld) is in tests/slurm/test_slurm.py.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.hostside.outcome import Outcome, Status
from preflight.nodecheck import MAX_REASON, reason_line

ROOT = Path(__file__).resolve().parents[2]


def node_check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "preflight", "node-check", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def _processes_with(marker: str) -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_an_interpreter_that_never_answers_is_killed_at_the_deadline_and_nothing_is_left(tmp_path):
    # An interpreter that hangs before it reads its stdin (a stuck NFS home, a hung import hook): the agent's
    # code (~200 KB) stays in a full pipe. The 3 s deadline must still end the check, and its process.
    marker = f"{600 + secrets.randbelow(10**6) / 10**7:.7f}"
    hung = tmp_path / "python"
    hung.write_text(f"#!/bin/sh\nexec sleep {marker}\n")
    hung.chmod(0o755)
    try:
        # The subprocess timeout is the hang detector, far above the deadline: not a timing assertion.
        proc = node_check("--checks", "libaio", "--python", str(hung), "--deadline", "3", timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == \
            f"preflight: preflight (could not check): {hung} did not start within the 3s deadline"
        assert _processes_with(f"sleep\0{marker}") == []
    finally:
        for pid in _processes_with(f"sleep\0{marker}"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("floor", [999, 998])
def test_thresholds_come_from_the_config_run_takes_and_the_test_file_is_removed(tmp_path, floor):
    config = tmp_path / "thresholds.toml"
    config.write_text(f"[nvme]\nmin_write_gbps = {floor}\ntest_mib = 64\n")
    target = tmp_path / "scratch"
    target.mkdir()
    proc = node_check("--checks", "nvme", "--nvme-path", str(target), "--config", str(config), "--strict", "-v")
    line = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert line.startswith("preflight: nvme: ") and f"< {floor}.00 GB/s" in line, line
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("args, wanted", [
    (["--config", "{bad}"], "{bad}: unknown key nvme.min_write_gb"),
    (["--checks", "allreduce"], "node-check runs per-host checks only; allreduce"),
    (["--checks", "nosuch"], "nosuch"),
    (["--deadline", "-1"], "--deadline"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, wanted):
    bad = tmp_path / "bad.toml"
    bad.write_text("[nvme]\nmin_write_gb = 1\n")
    proc = node_check(*[a.replace("{bad}", str(bad)) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and wanted.replace("{bad}", str(bad)) in lines[0], proc.stderr
    assert proc.stdout == ""


def test_the_line_names_every_bad_check_on_one_printable_line_within_the_reason_limit():
    outcomes = [("libaio", Outcome(Status.FAIL, "libaio.so.1 cannot be loaded. Install libaio1.")),
                ("gpu", Outcome(Status.PASS, "8 GPUs healthy")),
                ("nvme", Outcome(Status.WARN, "/local_nvme: 0.4 GB/s < 1.0; check the device")),
                ("driver_cuda", Outcome(Status.ERROR, "nvidia-smi\n\x1b[31mtimed out\x07"))]
    assert reason_line(outcomes) == \
        "preflight: libaio: libaio.so.1 cannot be loaded; driver_cuda (could not check): nvidia-smi ?[31mtimed out?"
    assert reason_line(outcomes, strict=True).startswith(
        "preflight: libaio: libaio.so.1 cannot be loaded; nvme: /local_nvme: 0.4 GB/s < 1.0; driver_cuda")
    assert reason_line(outcomes[1:2]) == "preflight: ok (1 check: gpu)"
    mixed = [("gpu", Outcome(Status.PASS, "ok")), ("nvme", Outcome(Status.SKIP, "no path")),
             ("ds_report", Outcome(Status.SKIP, "no DeepSpeed")), ("memlock", Outcome(Status.WARN, "64 KiB"))]
    assert reason_line(mixed) == "preflight: ok (4 checks, 2 skipped, 1 warning: gpu, nvme, ds_report, memlock)"
    long = reason_line([(f"check{i}", Outcome(Status.FAIL, "x" * 80)) for i in range(5)])
    assert len(long) == MAX_REASON and long.endswith("...")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_checks_node_check_and_run_run_come_from_the_same_config(tmp_path):
    """One file for a site's health check and its pre-job gate: [checks] only/skip select for both; node-check
    keeps the per-host ones of the selection; the command line wins."""
    from preflight.cli import select_checks
    from preflight.config import load_thresholds
    skipping = _write(tmp_path / "skip.toml", '[checks]\nskip = ["memlock", "compute"]\n')
    default = select_checks(None, "", None)
    assert select_checks(None, "", None, load_thresholds(str(skipping)), str(skipping)) == \
        [c for c in default if c not in ("memlock", "compute")]
    assert select_checks(None, "nvme", None, load_thresholds(str(skipping)), str(skipping)) == \
        [c for c in default if c != "nvme"]  # --skip replaces the file's skip
    config = _write(tmp_path / "site.toml", '[checks]\nonly = ["libaio", "memlock", "ports"]\n')
    thresholds = load_thresholds(str(config))
    assert select_checks(None, "", None, thresholds, str(config)) == ["libaio", "memlock", "ports"]
    assert select_checks("gpu", "", None, thresholds, str(config)) == ["gpu"]  # --checks replaces both
    assert select_checks(None, "memlock", None, thresholds, str(config)) == ["libaio", "ports"]
    # For real: node-check runs the per-host ones (ports is a cluster check)...
    proc = node_check("--config", str(config), "--skip", "memlock", "-v")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "preflight: ok (1 check: libaio)"
    assert "::libaio PASSED - " in proc.stdout  # the words of `preflight run` (it said PASS)
    # ...and `preflight run` on this machine runs all three, after ssh.
    report = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "preflight", "run", "--python", sys.executable, "--config",
                          str(config), "--json", str(report)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         stdin=subprocess.DEVNULL)
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    import json
    assert sorted({r["check"] for r in json.loads(report.read_text())["results"]}) == \
        ["libaio", "memlock", "ports", "ssh"]


@pytest.mark.parametrize("text, wanted", [
    ('[checks]\nskip = ["nosuch"]\n', "checks.skip: unknown check 'nosuch'"),
    ('[checks]\nonly = [1]\n', "checks.only must be a list of check names"),
    ('[checks]\nonly = "libaio"\n', "checks.only = 'libaio' must be a list"),
    ('[checks]\nonly = ["libaio"]\nskip = ["libaio"]\n', "checks.only and checks.skip both name libaio"),
])
def test_a_bad_checks_section_is_one_line_naming_the_file_and_key(tmp_path, text, wanted):
    config = _write(tmp_path / "site.toml", text)
    for command in (["node-check"], ["run", "--python", sys.executable]):
        proc = subprocess.run([sys.executable, "-m", "preflight", *command, "--config", str(config)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (command, proc.stdout, proc.stderr)
        assert str(config) in lines[0] and wanted in lines[0], (command, lines)


def test_run_and_node_check_read_the_same_bad_answer_the_same_way():
    """One host-side failure (nvme's collect raises on this host: its paths are a number, not a list) through
    `preflight run` on this machine and through `node-check`: one interpretation (preflight.answer), so the same
    cell, word for word; the drain reason keeps it short."""
    from preflight.config import load_defaults
    from preflight.hostfile import HostSpec
    from preflight.nodecheck import NodeCheckOptions, run_checks
    from preflight.runner import RunOptions, Runner

    thresholds = load_defaults()
    broken = {"nvme_paths": 5}
    report = Runner(RunOptions(hosts=[HostSpec("localhost", 1, 0)], checks=["nvme"], thresholds=thresholds, local=True,
                               python=sys.executable, host_params=broken)).run()
    ran = next(r for r in report.results if r.check == "nvme")
    verdict = run_checks(NodeCheckOptions(checks=["nvme"], thresholds=thresholds, python=sys.executable,
                                          host_params=broken, node_name="localhost"))
    (check, judged), = verdict.outcomes
    assert check == "nvme" and judged.status == ran.status == Status.ERROR
    assert judged.message == ran.message and judged.message.startswith("could not run: TypeError")
    assert judged.fix == ran.fix and "traceback" in judged.fix
    assert ran.metrics["traceback"] == judged.metrics["traceback"] != ""
    assert verdict.failed and verdict.line.startswith("preflight: nvme (could not check): TypeError")
