"""No placeholder where a fact belongs (issue 30 item 2): no HOST, ADDRESS, FINGERPRINT, PORT or PATH standing for a
value in any message or fix of any check, nor in a grouped cause's line.

The checks' own unit tests are the fixtures: their unit tier (-m unit) runs again in a child pytest with tests/placeholder_plugin.py, which
records what every check's ``evaluate`` returns (message, fix, findings) and every cause line printed, and each
recorded text is grepped (tests/placeholders.py). Namespace-host tests are left out there (the scenarios' reports
are grepped by their own tests).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from preflight import checks as registry
from preflight.hostside.outcome import Status
from preflight.render.json import to_json
from preflight.render.terminal import console, print_report
from preflight.results import HostRecord, Report, Result
from tests.placeholders import assert_no_placeholder, placeholders

ROOT = Path(__file__).resolve().parents[2]
# The checks' unit tests: each feeds its check's evaluate the recorded fixtures (tests/fixtures) or built facts.
UNIT_TESTS = ["checks/allreduce/test_allreduce.py", "checks/test_check_deps.py",
              "checks/checkpoint/test_checkpoint.py", "checks/clock/test_clock.py", "checks/compute/test_compute.py",
              "checks/driver_cuda/test_driver_cuda.py", "checks/ds_config/test_ds_config.py",
              "checks/ds_config/test_ds_config_audit.py", "checks/ds_report/test_ds_report.py",
              "verdict/test_fix_strings.py", "checks/gpu/test_gpu.py", "checks/gpu/test_gpu_device.py",
              "checks/gpu/test_gpu_expected.py", "checks/interfaces/test_interfaces.py",
              "checks/interfaces/test_interfaces_gdr.py", "checks/iperf3/test_iperf3.py",
              "checks/iperf3/test_iperf3_floor.py", "checks/launch/test_launch_path.py",
              "checks/launcher_ssh/test_launcher_ssh.py", "checks/libaio/test_libaio.py",
              "checks/memlock/test_memlock.py", "checks/nvme/test_nvme.py", "checks/ports/test_ports.py",
              "checks/python/test_python_check.py", "checks/versions/test_versions.py",
              "checks/versions/test_versions_hardware.py", "runner/test_same_machine.py", "verdict/test_severity.py",
              "verdict/test_verdict.py", "verdict/test_root_cause_model.py", "rehearse/test_rehearse.py",
              "untrusted/test_validate.py", "checks/ext_locks/test_ext_locks.py", "rehearse/test_jit_cold.py"]


def test_no_placeholder_in_any_message_of_any_checks_fixtures(tmp_path):
    texts = tmp_path / "texts.jsonl"
    env = dict(os.environ, PREFLIGHT_TEXTS=str(texts))
    env.pop("PREFLIGHT_STRICT_SKIPS", None)  # the plugin skips the namespace tests on purpose
    files = [str(ROOT / "tests" / name) for name in UNIT_TESTS]
    assert [f for f in files if not Path(f).exists()] == []  # a moved test file would drop out of the grep unseen
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.placeholder_plugin", "-p",
                           "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    entries = [json.loads(line) for line in texts.read_text().splitlines()]
    # Every registered check's evaluate ran, and cause lines were printed: the grep saw what it is for.
    sources = {e["source"] for e in entries}
    assert {f"{name}.evaluate" for name in registry.ORDER} <= sources, sorted(sources)
    assert "causes.Cause.line" in sources
    found = {}
    for entry in entries:
        for hit in placeholders(entry["text"]):
            found.setdefault(f"{entry['source']}: {hit[:160]}", entry["test"])
    assert not found, "\n".join(f"{k}  ({test})" for k, test in found.items())


def grouped_report() -> Report:
    """Three hosts that each say the same in their own words: their names, addresses, SSH key fingerprints."""
    hosts = [("node1", "10.7.0.1"), ("node2", "10.7.0.2"), ("node3", "10.7.0.3")]
    results = []
    for i, (name, address) in enumerate(hosts, 1):
        fingerprint = "SHA256:" + f"{i}abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ"[:43]
        results += [
            Result(name, "ssh", Status.FAIL, f"unknown SSH host key for {address} (ssh-ed25519 {fingerprint}); "
                   "refusing to connect", f"compare: ssh-keygen -lf <(ssh-keyscan {address}) must print "
                   f"{fingerprint}", {"address": address, "hostname": name}),
            Result(name, "checkpoint", Status.FAIL, f"/ckpt does not exist on {name}",
                   f"create it on {name}: mkdir -p /ckpt"),
            Result(name, "clock", Status.ERROR, f"could not read the clock of {name}", "rerun with -v")]
    return Report("t", 1.0, [HostRecord(n, a, 8, True) for n, a in hosts], results, ["ssh", "checkpoint", "clock"])


def test_grouped_causes_print_each_hosts_value_never_a_placeholder():
    report = grouped_report()
    out = io.StringIO()
    print_report(report, console(out, 300))
    text = out.getvalue()
    assert_no_placeholder(text, "the terminal report")
    assert_no_placeholder(to_json(report), "the JSON report")
    lines = text.splitlines()
    ssh = next(i for i, ln in enumerate(lines) if ln.startswith("node[1-3]::ssh FAILED"))
    assert lines[ssh + 1:ssh + 4] == [
        f"    node{i}: address 10.7.0.{i}, fingerprint SHA256:" + f"{i}abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ"[:43]
        for i in (1, 2, 3)]
    # The fix's command is per host (pasteable), and a host's own name is the group's NodeSet in prose.
    assert "node[1-3]::checkpoint FAILED - /ckpt does not exist on node[1-3]; fix: create it on node[1-3]: mkdir " \
           "-p /ckpt" in text
    assert "node[1-3]::clock ERROR - could not read the clock of node[1-3]" in text
