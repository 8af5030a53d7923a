"""The default gate's overlap, read from a real run's timeline (the JSON report's ``timeline``) on 3 namespace hosts:
iperf3 measures while the hosts import torch and DeepSpeed (the host checks), and no two checks that disturb each
other (one loads what the other measures: SPEC.measures/loads) ever run at the same time. A runner that ran the
cluster checks one after the other, or iperf3 after the host checks, fails the first assertion; one that ran
compute beside iperf3's streams or launcher_ssh's handshakes fails the second.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from preflight import checks as registry
from preflight.hostside.seams import HOST_CHECKS, conflicts, usage

ROOT = Path(__file__).resolve().parents[2]


def run_gate(cluster: Any, tmp_path: Path) -> Dict[str, Any]:
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--json", str(report), "-q"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    data["exit"] = proc.returncode
    return data


def spans(timeline: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    return {t["phase"]: t for t in timeline}


def overlap(a: Dict[str, float], b: Dict[str, float]) -> bool:
    return a["start_s"] < b["end_s"] and b["start_s"] < a["end_s"]


def test_the_default_gate_measures_the_network_while_the_hosts_import(cluster3, tmp_path):
    data = run_gate(cluster3, tmp_path)
    # (ext_locks reads this machine's torch extensions cache, which other runs' JIT builds share with these hosts)
    bad = [r for r in data["results"] if r["status"] in ("fail", "error") and r["check"] != "ext_locks"]
    assert not bad, bad
    at = spans(data["timeline"])
    host, iperf3 = at["host checks"], at["iperf3"]
    # iperf3 (SPEC.early) starts before the host checks end, and measures beside them
    assert iperf3["start_s"] < host["end_s"] and overlap(iperf3, host), data["timeline"]
    # the all-reduce reads iperf3's chosen network: after it
    assert at["allreduce"]["start_s"] >= iperf3["end_s"], data["timeline"]
    # no two checks where one loads what the other measures (nor a cluster check that the host checks disturb)
    # overlap, counting a check busy until it waits for another's facts (it then loads nothing)
    used = {name: usage(registry.spec(name)) for name in at if name in registry.ORDER and name != "ssh"}
    used_spans = {name: dict(t, end_s=min([t["end_s"]] + [w["start_s"] for key, w in at.items()
                                                           if key.startswith(name + " waits for ")]))
                  for name, t in at.items()}
    names = sorted(used)
    for i, a in enumerate(names):
        if registry.spec(a).scope != "cluster":
            continue
        if not (registry.spec(a).early) and conflicts(used[a], HOST_CHECKS):
            assert not overlap(used_spans[a], host), (a, data["timeline"])
        for b in names[i + 1:]:
            if registry.spec(b).scope == "cluster" and conflicts(used[a], used[b]):
                assert not overlap(used_spans[a], used_spans[b]), (a, b, data["timeline"])
