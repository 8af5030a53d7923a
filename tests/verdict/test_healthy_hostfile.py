"""The launch still possible after a failed gate (issue 25 item 1): --write-hostfile, the -e spec and Slurm's
--exclude on the verdict line, --min-hosts. The written hostfile and the printed -e spec are read back with
DeepSpeed's own launcher functions (fetch_hostfile, parse_inclusion_exclusion), which must give exactly the healthy
hosts and slots. Reports are built in memory (6 hosts), then a 3-host namespace run with one dead host goes through
the real CLI for the exit codes and the file.
"""
from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from preflight import cli, launchable
from preflight.hostside.outcome import Status
from preflight.render import Settings, write_atomic
from preflight.render.terminal import console, print_report, write
from preflight.results import CLUSTER, Report, Result
from tests.verdict.test_verdict import cluster_report

runner = pytest.importorskip("deepspeed.launcher.runner")
ROOT = Path(__file__).resolve().parents[2]
ALL = list(range(8))


def gpu_fail(host: str, gpu: int, check: str = "gpu") -> Result:
    return Result(host, check, Status.FAIL, f"GPU {gpu} (NVIDIA H100, PCI 0000:{gpu:02x}:00.0): Xid 79 in the kernel "
                  "log", "drain the host", {"gpu_count": 8, "failed_gpus": [gpu]})


def two_failing(gpu_level: bool = True) -> Report:
    """6 hosts of 8 slots: node03 down (refused), node05 with GPU 3 failed (or its whole nvme check failed)."""
    extra = [gpu_fail("node05", 3)] if gpu_level else [Result("node05", "nvme", Status.FAIL, "write 0.1 GB/s")]
    return cluster_report(6, down=["node03"], extra=extra)


def deepspeed_pool(hostfile: Path, exclude: str) -> Dict[str, List[int]]:
    """What DeepSpeed's launcher would start on: its hostfile parser, then its -e filter."""
    pool = runner.fetch_hostfile(str(hostfile))
    assert pool is not None, hostfile
    return {h: list(s) for h, s in runner.parse_inclusion_exclusion(pool, "", exclude).items()}


def verdict_line(report: Report, context: launchable.Context) -> str:
    out = io.StringIO()
    print_report(report, console(out, 400), quiet=True, relaunch=context)
    return out.getvalue().splitlines()[0]


def printed_spec(line: str) -> Dict[str, str]:
    """The deepspeed command of a verdict line: {"--hostfile": path, "-e": spec}."""
    command = re.search(r"deepspeed (.*) \.\.\.", line)
    assert command, line
    words = shlex.split(command.group(1))
    return dict(zip(words[::2], words[1::2]))


def original_hostfile(tmp_path: Path, n: int = 6) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"node{i:02d} slots=8\n" for i in range(1, n + 1)))
    return path


# ----------------------------------------------------------------------------- what DeepSpeed reads back

def test_written_hostfile_gives_deepspeed_exactly_the_healthy_hosts_and_slots(tmp_path):
    report = two_failing()
    healthy = tmp_path / "healthy.txt"
    write_atomic(str(healthy), lambda fh: launchable.write(report, fh))
    lines = healthy.read_text().splitlines()
    assert lines[0] == "# preflight left out: node03 (unreachable); node05 GPU 3 (gpu): launch with -e node05:3"
    assert lines[1:] == ["node01 slots=8", "node02 slots=8", "node04 slots=8", "node05 slots=8", "node06 slots=8"]
    spec = printed_spec(verdict_line(report, launchable.Context("hostfile", str(healthy))))
    assert spec == {"--hostfile": str(healthy), "-e": "node05:3"}
    assert deepspeed_pool(healthy, spec["-e"]) == {
        "node01": ALL, "node02": ALL, "node04": ALL, "node05": [0, 1, 2, 4, 5, 6, 7], "node06": ALL}


def test_two_hosts_down_the_written_file_holds_the_four_others_with_their_slots(tmp_path):
    report = two_failing(gpu_level=False)
    healthy = tmp_path / "healthy.txt"
    with open(healthy, "w") as fh:
        launchable.write(report, fh)
    assert healthy.read_text().splitlines()[0] == "# preflight left out: node03 (unreachable); node05 (nvme)"
    line = verdict_line(report, launchable.Context("hostfile", str(healthy)))
    assert line.endswith(f"; launch now: deepspeed --hostfile {healthy} ..."), line
    assert deepspeed_pool(healthy, "") == {"node01": ALL, "node02": ALL, "node04": ALL, "node06": ALL}


@pytest.mark.parametrize("gpu_level, expected", [
    (True, {"node01": ALL, "node02": ALL, "node04": ALL, "node05": [0, 1, 2, 4, 5, 6, 7], "node06": ALL}),
    (False, {"node01": ALL, "node02": ALL, "node04": ALL, "node06": ALL}),
])
def test_printed_e_spec_on_the_original_hostfile_gives_deepspeed_the_healthy_hosts(tmp_path, gpu_level, expected):
    hostfile = original_hostfile(tmp_path)
    line = verdict_line(two_failing(gpu_level), launchable.Context(str(hostfile)))
    assert line.startswith("NOT READY: 2 hosts need fixing ("), line
    spec = printed_spec(line)
    assert spec["--hostfile"] == str(hostfile)
    assert spec["-e"] == ("node03@node05:3" if gpu_level else "node03@node05")
    assert deepspeed_pool(hostfile, spec["-e"]) == expected


def test_a_gpu_failure_without_gpu_indices_or_with_a_blocked_cell_leaves_the_whole_host_out():
    named = gpu_fail("node05", 3)
    unnamed = Result("node05", "gpu", Status.FAIL, "GPU 3: Xid 79")  # no failed_gpus: no slot to exclude
    assert launchable.launchable(cluster_report(6, extra=[named])).slots_out == {"node05": [3]}
    assert launchable.launchable(cluster_report(6, extra=[named, Result("node05", "nvme", Status.FAIL, "slow")]
                                                )).left_out == {"node05": ["gpu", "nvme"]}
    assert "node05" in launchable.launchable(cluster_report(6, extra=[unnamed])).left_out
    outside = Result("node05", "compute", Status.FAIL, "GPU 9 slow", metrics={"failed_gpus": [9]})  # slots=8
    assert "node05" in launchable.launchable(cluster_report(6, extra=[outside])).left_out
    every = Result("node05", "gpu", Status.FAIL, "all GPUs", metrics={"failed_gpus": ALL})
    assert "node05" in launchable.launchable(cluster_report(6, extra=[every])).left_out


def test_no_launch_command_when_ready_none_healthy_or_failed_cluster_wide(tmp_path):
    hostfile = str(original_hostfile(tmp_path))
    assert verdict_line(cluster_report(6), launchable.Context(hostfile)) == "READY"
    down = [f"node{i:02d}" for i in range(1, 7)]
    assert "launch now" not in verdict_line(cluster_report(6, down=down), launchable.Context(hostfile))
    allreduce = Result(CLUSTER, "allreduce", Status.FAIL, "busbw 0.1 GB/s below 1 GB/s")
    line = verdict_line(cluster_report(6, down=["node03"], extra=[allreduce]), launchable.Context(hostfile))
    assert "launch now" not in line and "cluster-wide: allreduce" in line, line
    # Without the run's context (other callers of print_report) the verdict line is as it was.
    assert verdict_line(two_failing(), None) == "NOT READY: 2 hosts need fixing (node03 unreachable, node05 gpu)"


# ------------------------------------------------------------------------------------------------ Slurm

def test_inside_a_slurm_allocation_the_verdict_prints_the_exclude_nodeset(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-20]")
    args = cli.build_parser().parse_args(["run"])
    assert cli.in_slurm(args)
    report = cluster_report(20, down=["node03"], extra=[gpu_fail("node17", 0)])
    line = verdict_line(report, launchable.Context(slurm=cli.in_slurm(args)))
    assert line.endswith("; launch now: --exclude=node[03,17]"), line
    monkeypatch.delenv("SLURM_JOB_ID")
    assert not cli.in_slurm(cli.build_parser().parse_args(["run"]))


# ------------------------------------------------------------------------------------------- --min-hosts

def test_min_hosts_counts_and_fractions():
    report = two_failing(gpu_level=False)  # 4 of 6 healthy
    assert report.exit_code == 1 and launchable.exit_code(report, "") == 1
    assert launchable.exit_code(report, "4") == 0 and launchable.exit_code(report, "5") == 1
    assert launchable.exit_code(report, "0.6") == 0 and launchable.exit_code(report, "0.7") == 1  # ceil(4.2) = 5
    assert launchable.exit_code(two_failing(), "5") == 0  # node05 still launches on 7 of its GPUs
    out = io.StringIO()
    write(report, out, Settings(quiet=True, width=400, relaunch=launchable.Context(min_hosts="4")))
    assert out.getvalue().splitlines()[0] == "READY on 4 of 6 hosts (--min-hosts 4), without 2 hosts that need " \
        "fixing (node03 unreachable, node05 nvme)"
    out = io.StringIO()
    write(report, out, Settings(quiet=True, width=400, relaunch=launchable.Context(min_hosts="5")))
    assert "4 of 6 hosts healthy, fewer than --min-hosts 5 (5)" in out.getvalue()
    allreduce = Result(CLUSTER, "allreduce", Status.FAIL, "busbw low")
    assert launchable.exit_code(cluster_report(6, down=["node03"], extra=[allreduce]), "1") == 1


@pytest.mark.parametrize("value", ["0", "1.5", "-2", "many", "0.0"])
def test_a_bad_min_hosts_is_exit_2_in_one_line(value):
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--min-hosts", value], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "--min-hosts" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_write_hostfile_in_a_missing_directory_is_exit_2_before_any_host(tmp_path):
    bad = tmp_path / "no" / "healthy.txt"
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--hostfile", str(original_hostfile(tmp_path)),
                           "--write-hostfile", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and f"--write-hostfile {bad}: directory" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------ on namespace hosts

def test_three_hosts_one_dead_through_the_cli(netcluster_factory, tmp_path):
    cluster = netcluster_factory(n=2)
    cluster.add_blackhole("deadhost")
    hostfile = cluster.hostfile(tmp_path / "hf", names=["node01", "deadhost", "node02"], slots=2)
    healthy = tmp_path / "healthy.txt"

    def preflight(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "preflight", "run", "--python", sys.executable, "--hostfile", str(hostfile),
                "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
                "--known-hosts", str(cluster.known_hosts), "--checks", "python", "--connect-timeout", "3", *args]
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("SLURM_")}
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                              env=env)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return proc

    plain = preflight("--write-hostfile", str(healthy))
    assert plain.returncode == 1, plain.stdout + plain.stderr
    verdict = plain.stdout.splitlines()[-2]
    assert verdict.startswith("NOT READY: 1 host needs fixing (deadhost unreachable)"), plain.stdout
    assert verdict.endswith(f"; launch now: deepspeed --hostfile {healthy} ..."), verdict
    assert healthy.read_text().splitlines()[0] == "# preflight left out: deadhost (unreachable)"
    assert deepspeed_pool(healthy, "") == {"node01": [0, 1], "node02": [0, 1]}

    enough = preflight("--min-hosts", "2", "-q")
    assert enough.returncode == 0, enough.stdout + enough.stderr
    line = enough.stdout.splitlines()[0]
    assert line.startswith("READY on 2 of 3 hosts (--min-hosts 2), without 1 host that needs fixing (deadhost "
                           "unreachable); launch now: deepspeed --hostfile "), line
    assert deepspeed_pool(hostfile, printed_spec(line)["-e"]) == {"node01": [0, 1], "node02": [0, 1]}
    assert preflight("--min-hosts", "0.9", "-q").returncode == 1  # 3 needed
