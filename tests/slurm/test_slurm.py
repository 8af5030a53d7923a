"""preflight on a real Slurm cluster (tests/slurmcluster.py): srun transport, allocation awareness, node-check."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.netcluster import code_in_run
from tests.slurmcluster import SlurmCluster, slurm_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]


def _need_slurm() -> None:
    if reason := slurm_unavailable_reason():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def healthy3():
    """Three healthy Slurm nodes slm1..slm3 without any SSH key; tests must undo what they change."""
    _need_slurm()
    with SlurmCluster(3) as cluster:
        cluster.remove_ssh_keys()
        yield cluster


@pytest.fixture(scope="module")
def broken3(tmp_path_factory):
    """slm1..slm3 where slm2's libaio cannot be loaded (inside slm2's own mount namespace only)."""
    _need_slurm()
    from tests.runner.test_host_checks_cluster import libaio_runtime
    lib = libaio_runtime()
    # Not under /tmp: each host mounts a private tmpfs there before the setup commands run.
    fd, empty = tempfile.mkstemp(prefix="preflight-empty-", dir="/dev/shm")
    os.close(fd)
    try:
        with SlurmCluster(3, setup={"slm2": [["mount", "--bind", empty, lib]]}) as cluster:
            cluster.remove_ssh_keys()
            cluster.libaio, cluster.empty = lib, empty
            yield cluster
    finally:
        os.unlink(empty)


def test_testbed_runs_one_step_per_node_under_its_own_hostname_and_leaves_nothing():
    if reason := slurm_unavailable_reason():
        pytest.skip(reason)
    cluster = SlurmCluster(2)
    try:
        proc = cluster.client(["salloc", "-N2", "srun", "--label", "hostname"])
        assert sorted(proc.stdout.split()) == ["0:", "1:", "slm1", "slm2"]
        net_dir, namespaces = cluster.net.dir, [h.ns for h in cluster.net.hosts]
    finally:
        cluster.close()
    assert not net_dir.exists()
    assert not [ns for ns in namespaces if os.path.exists(f"/run/netns/{ns}")]
    assert cluster._munged is not None and cluster._munged.poll() is not None


@pytest.fixture(scope="module")
def node_code():
    """preflight as a node imports it: a copy under /run (a node's /tmp is private, and may hide the checkout)."""
    with code_in_run(coordinator=True) as code:
        yield code


def _node_check(cluster: SlurmCluster, node: str, code: Path, *args: str):
    proc = cluster.node_exec(node, [sys.executable, "-m", "preflight", "node-check", "--python", sys.executable,
                                    *args], timeout=120, env={"PYTHONPATH": str(code)})
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def _salloc_run(cluster: SlurmCluster, tmp_path: Path, *args: str, nodes: int = 3, env=None):
    """`salloc -N3 preflight run ...` from the submit host: no hostfile, no SSH options."""
    out = tmp_path / "report.json"
    proc = cluster.client(["salloc", f"-N{nodes}", sys.executable, "-m", "preflight", "run", "--python",
                           sys.executable, "--json", str(out), *args], check=False, timeout=540, cwd=ROOT,
                          env=env or cluster.env)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc, {(r["host"], r["check"]): r for r in report.get("results", [])}


# Link rates and CPU speed swing with the load of the two shared cores (compute FAILed a node at under 50% of its
# peers in 2 of this session's runs); these tests are about the transport, not about bandwidth or speed.
RELAXED = ("[iperf3]\nstraggler_warn_fraction = 0.05\nstraggler_fail_fraction = 0.01\n"
           "[compute]\nfail_fraction = 0.05\n")


def test_salloc_run_over_srun_without_ssh_keys_passes_with_the_full_matrix(healthy3, tmp_path):
    config = tmp_path / "relaxed.toml"
    config.write_text(RELAXED)
    proc, cells = _salloc_run(healthy3, tmp_path, "--config", str(config))
    assert proc.returncode == 0, [c for c in cells.values() if c["status"] in ("fail", "error")] or proc.stdout[-4000:]
    assert "SLURM_JOB_NODELIST=slm[1-3] (3 nodes, expanded by scontrol show hostnames)" in proc.stderr
    assert "transport: srun" in proc.stderr
    from preflight import checks as registry
    from preflight.cli import select_checks
    every = select_checks(None, "", None)
    per_host = [c for c in every if registry.load(c).SPEC.scope == "host"]
    # The full matrix: every host x every host-scope check, and one cluster row per cross-host check that has one.
    for host in healthy3.names:
        assert [c for c in ["ssh", *per_host, "ports", "iperf3"] if (host, c) not in cells] == [], host
        assert "one step shared by every node (srun), no SSH" in cells[(host, "ssh")]["message"]
        assert cells[(host, "launcher_ssh")]["status"] == "skip" and "srun" in cells[(host, "launcher_ssh")]["message"]
        # ports: every other node connected to this one's listeners, through services started over srun.
        ports = cells[(host, "ports")]
        assert ports["status"] == "pass" and sorted(ports["metrics"]["sources"]) == sorted(
            set(healthy3.names) - {host}), ports
    assert [c for c in ("versions", "clock", "compute", "iperf3", "allreduce") if ("*", c) not in cells] == []
    # iperf3 measured every link of the ring between the nodes' own addresses, and gloo ran one rank per node.
    chosen = cells[("*", "iperf3")]["metrics"]["chosen"]
    assert cells[("*", "iperf3")]["status"] == "pass" and sorted(chosen["hosts"]) == healthy3.names
    assert chosen["addresses"] == {n: healthy3.net.host(n).addresses[0] for n in healthy3.names}
    allreduce = cells[("*", "allreduce")]
    assert allreduce["status"] == "pass" and allreduce["metrics"]["world_size"] == 3, allreduce
    assert sorted(allreduce["metrics"]["hosts"]) == healthy3.names
    assert cells[("*", "versions")]["status"] == "pass"
    assert all(c["status"] in ("pass", "warn", "skip") for c in cells.values()), \
        [c for c in cells.values() if c["status"] not in ("pass", "warn", "skip")]
    for word in ("slm1", "slm2", "slm3", "cluster"):
        assert word in proc.stdout


def test_inside_an_sbatch_script_the_run_gates_the_job_over_srun(healthy3, node_code):
    """`preflight run` in a batch script: it runs on the job's first node, takes the allocation's nodes and
    reaches all three over srun, with no SSH key anywhere."""
    where = Path(tempfile.mkdtemp(prefix="preflight-sbatch-", dir="/dev/shm"))  # a node's /tmp is private
    try:
        script = where / "job.sh"
        script.write_text(f"#!/bin/sh\nexport PYTHONPATH={node_code}\nexec {sys.executable} -m preflight run "
                          f"--python {sys.executable} --checks libaio,ports --json {where}/report.json\n")
        script.chmod(0o755)
        proc = healthy3.client(["sbatch", "-N3", "--wait", f"--output={where}/out.txt", str(script)],
                               check=False, timeout=300)
        out = (where / "out.txt").read_text() if (where / "out.txt").exists() else ""
        assert proc.returncode == 0 and "Traceback" not in out, proc.stdout + proc.stderr + out
        cells = {(r["host"], r["check"]): r for r in json.loads((where / "report.json").read_text())["results"]}
        assert sorted(cells) == sorted((h, c) for h in healthy3.names for c in ("ssh", "libaio", "ports"))
        assert all(c["status"] == "pass" for c in cells.values()), cells
        assert all("shared by every node (srun)" in cells[(h, "ssh")]["message"] for h in healthy3.names)
        assert "transport: srun" in out and "slm1::" not in out  # no failure lines
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_killing_the_coordinator_mid_run_leaves_no_process_on_any_node(healthy3):
    alloc = healthy3.client(["salloc", "--no-shell", "-N3"]).stderr
    job = re.search(r"Granted job allocation (\d+)", alloc)[1]
    try:
        env = healthy3.env
        env.update(SLURM_JOB_ID=job, SLURM_JOB_NODELIST="slm[1-3]", SLURM_TASKS_PER_NODE="1(x3)")
        coordinator = subprocess.Popen([sys.executable, "-m", "preflight", "run", "--python", sys.executable,
                                        "--checks", "ds_report,iperf3"], cwd=ROOT, env=env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            # Mid-run: the agent of this run is working on every node.
            while not all(any("preflight-" in cmd for cmd in healthy3.node_processes(n).values())
                          for n in healthy3.names):
                assert coordinator.poll() is None, "the run ended before it was killed"
                assert time.monotonic() < deadline, {n: healthy3.node_processes(n) for n in healthy3.names}
                time.sleep(0.1)
        finally:
            coordinator.kill()
            coordinator.wait()
        # The allocation is still there: only the lifeline (srun's stdin) and srun itself can end the steps.
        _wait_until_nothing_left(healthy3, healthy3.names, job, "the kill")
        assert healthy3.client(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip() == "RUNNING"
    finally:
        healthy3.client(["scancel", job], check=False)


@pytest.mark.parametrize("checks, how", [("libaio", "subprocess"), ("libaio,ports", "subprocess"),
                                         ("libaio", "in-process")])
def test_a_run_inside_a_live_allocation_leaves_no_agent_or_step_on_any_node(healthy3, tmp_path, monkeypatch, checks,
                                                                            how):
    """`salloc --no-shell` then `preflight run` with its SLURM_JOB_ID: the job outlives the run, so nothing but the
    run's own teardown can end its shared step. (`salloc -N3 preflight run` hides a leak: the job's end kills
    every step.) Once the run has returned, no agent, no slurmstepd of its step and no step may stay, while the
    allocation is still RUNNING."""
    alloc = healthy3.client(["salloc", "--no-shell", "-N3"]).stderr
    job = re.search(r"Granted job allocation (\d+)", alloc)[1]
    try:
        env = dict(healthy3.env, SLURM_JOB_ID=job, SLURM_JOB_NODELIST="slm[1-3]", SLURM_TASKS_PER_NODE="1(x3)")
        out = tmp_path / "report.json"
        argv = ["run", "--python", sys.executable, "--checks", checks, "--json", str(out)]
        if how == "subprocess":
            proc = subprocess.run([sys.executable, "-m", "preflight", *argv], cwd=ROOT, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
        else:
            from preflight.cli import main
            from preflight.transport import srun
            monkeypatch.setattr(srun, "_addr_cache", {})  # this cluster's addresses stay out of other tests' runs
            for key in [k for k in os.environ if k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
                monkeypatch.delenv(key)
            for key in ("SLURM_CONF", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE"):
                monkeypatch.setenv(key, env[key])
            assert main([*argv, "-q"]) == 0
        cells = {(r["host"], r["check"]): r for r in json.loads(out.read_text())["results"]}
        assert all("one step shared by every node" in cells[(n, "ssh")]["message"] for n in healthy3.names), cells
        _wait_until_nothing_left(healthy3, healthy3.names, job, "the run")
        steps = healthy3.client(["squeue", "-h", "-s", "-j", job, "-o", "%i"]).stdout.split()
        assert steps in ([], [f"{job}.extern"]), healthy3.client(["squeue", "-s", "-j", job]).stdout
        assert healthy3.client(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip() == "RUNNING"
    finally:
        healthy3.client(["scancel", job], check=False)


def test_a_timed_out_step_is_taken_down_although_its_command_ignores_the_lifeline(healthy3):
    """The deadline path: `sleep` does not read stdin, so only kill() (srun alone gets SIGKILL, its helper
    cancels the step) can end it; nothing may stay on the node, and no srun on the submit host."""
    from preflight.transport.srun import SrunTransport
    alloc = healthy3.client(["salloc", "--no-shell", "-N1", "-w", "slm2"]).stderr
    job = re.search(r"Granted job allocation (\d+)", alloc)[1]
    try:
        env = healthy3.env
        old = dict(os.environ)
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        try:
            result = SrunTransport("slm2", job_id=job).run(["sleep", "600"], timeout=5)
        finally:
            os.environ.clear()
            os.environ.update(old)
        assert result.rc == 124, result
        _wait_until_nothing_left(healthy3, ["slm2"], job, "the timeout")
    finally:
        healthy3.client(["scancel", job], check=False)


def _wait_until_nothing_left(cluster: SlurmCluster, nodes, job: str, after: str) -> None:
    """No process of a job on the nodes within 60 s, and no srun of it on the submit host within 30 s more."""
    deadline = time.monotonic() + 60
    while left := {n: procs for n in nodes if (procs := cluster.node_processes(n))}:
        assert time.monotonic() < deadline, f"left on the nodes 60 s after {after}: {left}"
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while _sruns_of(job):
        assert time.monotonic() < deadline, f"srun left on the submit host: {_sruns_of(job)}"
        time.sleep(0.2)


def _sruns_of(job: str) -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"srun") and f"--jobid={job}".encode() in cmd:
            found.append(int(entry))
    return found


def _step_launches(cluster: SlurmCluster) -> dict[str, list[str]]:
    """{node: [StepId of every task launch, in order]} from each node's slurmd.log."""
    return {n: re.findall(r"launch task StepId=(\S+)", (cluster.dir / "nodes" / n / "slurmd.log").read_text())
            for n in cluster.names}


@pytest.mark.parametrize("steps", ["shared", "per-node"])
def test_srun_run_names_the_node_whose_libaio_cannot_be_loaded(broken3, tmp_path, steps):
    before = _step_launches(broken3)
    proc, cells = _salloc_run(broken3, tmp_path, "--checks", "libaio", "--srun-steps", steps)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert cells[("slm2", "libaio")]["status"] == "fail" and "load" in cells[("slm2", "libaio")]["message"]
    assert cells[("slm1", "libaio")]["status"] == "pass" and cells[("slm3", "libaio")]["status"] == "pass"
    assert "slm2::libaio FAILED" in proc.stdout
    # The agents ran as one step over the three nodes, or as a step per node; no other step was launched.
    launched = {n: ids[len(before[n]):] for n, ids in _step_launches(broken3).items()}
    assert all(len(ids) == 1 for ids in launched.values()), launched
    assert len({ids[0] for ids in launched.values()}) == (1 if steps == "shared" else 3), launched
    wanted = "one step shared by every node" if steps == "shared" else "a job step of its own"
    assert all(wanted in cells[(n, "ssh")]["message"] for n in broken3.names), cells


def test_a_shared_step_that_cannot_start_leaves_each_node_a_step_of_its_own(broken3, tmp_path):
    # Fault injection on the submit host only: an srun that refuses the shared step (--input=all), as a site's
    # wrapper or an srun without it might, and runs every other step with the real srun.
    wrapper = tmp_path / "bin" / "srun"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = --input=all ] && { echo "srun: error: refused" >&2; '
                       f'exit 1; }}; done\nexec {shutil.which("srun")} "$@"\n')
    wrapper.chmod(0o755)
    env = dict(broken3.env, PATH=f"{wrapper.parent}:{broken3.env['PATH']}")
    before = _step_launches(broken3)
    proc, cells = _salloc_run(broken3, tmp_path, "--checks", "libaio", env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert cells[("slm2", "libaio")]["status"] == "fail" and cells[("slm1", "libaio")]["status"] == "pass"
    assert all("a job step of its own" in cells[(n, "ssh")]["message"] for n in broken3.names), \
        [cells[(n, "ssh")]["message"] for n in broken3.names]
    launched = {n: ids[len(before[n]):] for n, ids in _step_launches(broken3).items()}
    assert len({i for ids in launched.values() for i in ids}) == 3, launched


def test_past_step_nodes_max_the_agents_share_several_steps_and_each_node_keeps_its_own_result(broken3, tmp_path,
                                                                                                 monkeypatch):
    """srun writes every request line to every node of its step, so one step over 4,000 nodes would cost srun
    minutes of CPU (docs/performance.md): nodes share steps of at most STEP_NODES_MAX. At 2 here, slm1 and slm2
    share one step and slm3 has one of its own; each node's verdict is still its own agent's (slm2's libaio FAILs).
    In-process, so that the limit can be lowered; the allocation is cancelled at the end."""
    from preflight.cli import main
    from preflight.transport import srun
    monkeypatch.setattr(srun, "STEP_NODES_MAX", 2)
    monkeypatch.setattr(srun, "_addr_cache", {})  # this cluster's addresses stay out of other tests' runs
    for key in [k for k in os.environ if k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
        monkeypatch.delenv(key)
    alloc = broken3.client(["salloc", "--no-shell", "-N3"]).stderr
    job = re.search(r"Granted job allocation (\d+)", alloc)[1]
    for key, value in (("SLURM_CONF", broken3.env["SLURM_CONF"]), ("SLURM_JOB_ID", job),
                       ("SLURM_JOB_NODELIST", "slm[1-3]"), ("SLURM_TASKS_PER_NODE", "1(x3)")):
        monkeypatch.setenv(key, value)
    before = _step_launches(broken3)
    out = tmp_path / "report.json"
    try:
        rc = main(["run", "--python", sys.executable, "--checks", "libaio", "--json", str(out), "-q"])
        launched = {n: ids[len(before[n]):] for n, ids in _step_launches(broken3).items()}
    finally:
        broken3.client(["scancel", job], check=False)
    cells = {(r["host"], r["check"]): r for r in json.loads(out.read_text())["results"]}
    assert rc == 1
    assert cells[("slm2", "libaio")]["status"] == "fail" and "load" in cells[("slm2", "libaio")]["message"]
    assert cells[("slm1", "libaio")]["status"] == "pass" and cells[("slm3", "libaio")]["status"] == "pass"
    assert all("one step shared by" in cells[(n, "ssh")]["message"] for n in broken3.names), \
        [cells[(n, "ssh")]["message"] for n in broken3.names]
    assert len(launched["slm1"]) == 1 and launched["slm1"] == launched["slm2"], launched
    assert len(launched["slm3"]) == 1 and launched["slm3"] != launched["slm1"], launched


def test_step_groups_are_consecutive_and_as_equal_as_can_be():
    from preflight.transport.srun import step_groups
    names = [f"n{i}" for i in range(300)]
    groups = step_groups(names, 128)
    assert [len(g) for g in groups] == [100, 100, 100] and sum(groups, []) == names
    assert [len(g) for g in step_groups(names[:7], 3)] == [3, 2, 2]
    assert step_groups(names[:128], 128) == [names[:128]] and step_groups([], 128) == []


def test_node_check_drain_drains_exactly_the_broken_node_and_resumes_only_its_own_drains(broken3, node_code):
    cluster = broken3
    procs = {n: _node_check(cluster, n, node_code, "--drain", "--checks", "libaio") for n in cluster.names}
    assert {n: p.returncode for n, p in procs.items()} == {"slm1": 0, "slm2": 1, "slm3": 0}, \
        {n: p.stdout + p.stderr for n, p in procs.items()}
    line = procs["slm2"].stdout.strip().splitlines()[-1]
    assert line.startswith("preflight: libaio: ") and "load" in line
    assert procs["slm1"].stdout.strip().startswith("preflight: ok")
    # Exactly the broken node is drained, with the printed line as its reason.
    assert cluster.drain_reasons() == {"slm2": line}
    assert "slm2" in cluster.client(["sinfo", "-R"]).stdout
    try:
        # A node an admin drained for another reason stays drained when it passes.
        cluster.client(["scontrol", "update", "nodename=slm1", "state=drain", "reason=admin: fan noise"])
        proc = _node_check(cluster, "slm1", node_code, "--drain", "--checks", "libaio")
        assert proc.returncode == 0 and "not drained by preflight" in proc.stderr
        assert cluster.drain_reasons()["slm1"] == "admin: fan noise"
        # Once repaired, the node preflight drained is resumed by the next passing health check.
        cluster.net.exec("slm2", ["umount", cluster.libaio], check=True)
        proc = _node_check(cluster, "slm2", node_code, "--drain", "--checks", "libaio")
        assert proc.returncode == 0 and "resumed" in proc.stderr, proc.stdout + proc.stderr
        assert set(cluster.drain_reasons()) == {"slm1"}
        # A failing node that an admin drained keeps the admin's reason: were it replaced by preflight's, the
        # next passing check would resume a node preflight did not drain.
        cluster.net.exec("slm2", ["mount", "--bind", cluster.empty, cluster.libaio], check=True)
        cluster.client(["scontrol", "update", "nodename=slm2", "state=drain", "reason=admin: RMA 1234"])
        proc = _node_check(cluster, "slm2", node_code, "--drain", "--checks", "libaio")
        assert proc.returncode == 1 and "not drained by preflight" in proc.stderr, proc.stdout + proc.stderr
        assert cluster.drain_reasons()["slm2"] == "admin: RMA 1234"
    finally:
        cluster.client(["scontrol", "update", "nodename=slm1,slm2", "state=resume"], check=False)


# --- allocation parsing and option wiring (no daemons needed) ------------------------------------------------

def test_tasks_per_node_and_nodelist_expansion_without_scontrol():
    from preflight import slurm
    assert slurm.tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(slurm.AllocationError, match="SLURM_TASKS_PER_NODE"):
        slurm.tasks_per_node("2(x3)", 4)
    with pytest.raises(slurm.AllocationError, match="cannot read"):
        slurm.tasks_per_node("2x3", 3)
    names, how = slurm.expand_nodelist("gpu[01-03,7],login1", {"PATH": "/nonexistent"})
    assert names == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"] and how == "preflight's range expansion"


def test_allocation_slots_prefer_the_option_then_gpus_on_node_then_tasks():
    from preflight import slurm
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4,2", "PATH": "/nonexistent"}
    alloc = slurm.allocation(env)
    assert [(h.name, h.slots) for h in alloc.hosts] == [("n1", 4), ("n2", 2)]
    assert "SLURM_TASKS_PER_NODE=4,2" in alloc.source and "job 7" in alloc.source
    assert [h.slots for h in slurm.allocation({**env, "SLURM_GPUS_ON_NODE": "8"}).hosts] == [8, 8]
    assert [h.slots for h in slurm.allocation({**env, "SLURM_GPUS_ON_NODE": "8"}, gpus_per_node=2).hosts] == [2, 2]
    with pytest.raises(slurm.AllocationError, match="SLURM_JOB_NODELIST"):
        slurm.allocation({"SLURM_JOB_ID": "7"})


def test_inside_a_job_the_hostfile_still_wins_and_srun_outside_a_job_is_a_usage_error(tmp_path, monkeypatch):
    from preflight.cli import build_options, build_parser, main
    hostfile = tmp_path / "hf"
    hostfile.write_text("a slots=2\nb slots=2\n")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "x[1-3]")
    options = build_options(build_parser().parse_args(["run", "--hostfile", str(hostfile)]))
    assert [h.name for h in options.hosts] == ["a", "b"] and options.transport == "ssh"
    assert options.check_options.transport == "ssh"
    assert "wins over the Slurm allocation" in options.host_source
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the range library expands the list
    options = build_options(build_parser().parse_args(["run"]))
    assert [h.name for h in options.hosts] == ["x1", "x2", "x3"] and options.transport == "srun"
    assert options.check_options.transport == "srun"
    assert not options.local
    monkeypatch.delenv("SLURM_JOB_ID")
    assert main(["run", "--transport", "srun", "--hostfile", str(hostfile)]) == 2


def test_closing_the_srun_transport_leaves_no_srun_that_ignores_its_lifeline(tmp_path, monkeypatch):
    """An srun whose controller or node stopped answering does not end when its stdin closes: close() kills it
    after the grace. The stand-in is an `srun` on PATH that ignores stdin and hangs, as such an srun does."""
    from preflight.transport.srun import SrunTransport
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    transport = SrunTransport("slm1", job_id="1")
    transport.close_grace_s = 0.5
    hung = transport.start(["python3", "-c", "pass"], keep_stdin_open=True)
    pid = hung._proc.pid  # type: ignore[attr-defined]
    assert not hung.join(0.3)
    transport.close()
    assert hung.done
    assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]


def test_an_srun_that_never_reads_its_stdin_cannot_hold_the_agent_past_its_deadline(tmp_path, monkeypatch):
    """srun reads its stdin only once its step runs. One still waiting for the step (or hung) leaves the agent's
    code (~200 KB) in a full pipe: starting the agent must still return, and close() end that srun."""
    import threading
    from preflight.remote import Agent
    from preflight.transport.srun import SrunTransport
    marker = f"600.{os.getpid()}{time.monotonic_ns() % 10**6}"
    fake = tmp_path / "srun"
    fake.write_text(f"#!/bin/sh\nexec sleep {marker}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    transport = SrunTransport("slm1", job_id="1")
    transport.close_grace_s = 0.5
    agent = Agent(transport, "python3", "preflight-test")
    answer: list = []
    opener = threading.Thread(target=lambda: answer.append(agent.open(1.0)), daemon=True)
    try:
        opener.start()
        opener.join(30)  # a hang detector far above the 1 s wait, not a timing assertion
        assert answer == [None], "Agent.open() was stuck writing the agent's code into srun's full stdin pipe"
        agent.close()
        transport.close()
        assert _live_pids_with(f"sleep\0{marker}") == []
    finally:
        for pid in _live_pids_with(f"sleep\0{marker}"):
            os.kill(pid, signal.SIGKILL)


def _live_pids_with(marker: str) -> list:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes() and \
                    "Z" not in Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1][:3]:
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_shared_step_that_stops_taking_input_is_stopped_instead_of_hanging_its_senders(healthy3, monkeypatch):
    """Every node's requests go through the shared step's one stdin. When a node stops reading (here: a task
    that never reads; in life a frozen node), slurmstepd and srun fill their buffers and srun stops reading: a
    send must then fail within the stall limit and take the step down (each node then gets a step of its own),
    not block every sender behind it for ever."""
    from preflight.transport import base as transport
    from preflight.transport.srun import SharedStep

    from tests.stdin_flood import flood_until_it_fails
    monkeypatch.setattr(transport, "SEND_STALL_S", 2.0)
    monkeypatch.setenv("SLURM_CONF", healthy3.env["SLURM_CONF"])
    alloc = healthy3.client(["salloc", "--no-shell", "-N2", "-w", "slm1,slm2"]).stderr
    job = re.search(r"Granted job allocation (\d+)", alloc)[1]
    step = SharedStep(["slm1", "slm2"], ["sleep", "600"], b"", job)
    try:
        # 200 MB of 4 KB lines for slm1: far more than srun and slurmstepd buffer.
        outcome = flood_until_it_fails(lambda line: step.send_to("slm1", line), lines=50_000, size=4000, wait=300)
        assert outcome and isinstance(outcome[0], transport.StdinStalled), outcome
        assert all(c.join(30) for c in step.channels.values()), "the step's channels did not end"
        _wait_until_nothing_left(healthy3, ["slm1", "slm2"], job, "the stall")
    finally:
        step.close(grace_s=1)
        healthy3.client(["scancel", job], check=False)
