"""``--num_nodes N`` beside ``--num_gpus``: DeepSpeed's meaning, the first N hosts of the hostfile
(deepspeed/launcher/runner.py:385-398, apply_num_nodes_and_gpus), checked against DeepSpeed's own function."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.hostfile import first_nodes, parse_hostfile
from tests.cli.test_cli_cluster import preflight

ROOT = Path(__file__).resolve().parents[2]
HOSTFILE = "node01 slots=2\nnode02 slots=2\n# a comment\nnode03 slots=4\nnode04 slots=2\n"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_the_first_n_hosts_as_deepspeeds_launcher_takes_them(tmp_path, n):
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, fetch_hostfile
    path = tmp_path / "hostfile"
    path.write_text(HOSTFILE)
    theirs = list(apply_num_nodes_and_gpus(fetch_hostfile(str(path)), n, -1))
    notes = []
    ours = [h.name for h in first_nodes(parse_hostfile(HOSTFILE), n, notes)]
    assert ours == theirs
    assert bool(notes) == (n > 4)
    if notes:
        assert notes[0] == "--num_nodes 7, but there are 4 hosts: DeepSpeed's launcher uses all 4, as preflight does"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "preflight", "run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_bad_combinations_are_refused_as_deepspeed_refuses_them(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(HOSTFILE)
    for args, words in ((["--hostfile", str(path), "--num_nodes", "2", "-e", "node03"],
                         "--num_nodes cannot be combined with --include/--exclude"),
                        (["--num_nodes", "2"], "--num_nodes 2 needs a --hostfile"),
                        (["--hostfile", str(path), "--num_nodes", "0"], "--num_nodes")):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr


def test_a_run_checks_the_first_n_hosts(cluster3, tmp_path):
    report = tmp_path / "report.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hostfile"), "--num_nodes", "2",
                     "--checks", "ssh", "--json", report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert [h["name"] for h in data["hosts"]] == ["node01", "node02"]
    assert {r["host"] for r in data["results"]} == {"node01", "node02"}
