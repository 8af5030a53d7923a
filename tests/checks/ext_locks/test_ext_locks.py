"""The stale torch extension lock: the ``lock`` file a killed JIT build leaves in the torch extensions cache
(torch/utils/file_baton.py; pytorch issue 189245), found by the ``ext_locks`` check and kept out of ds_report's usable
count. Unit tests on real directories and real processes here; a namespace test as a user meets it."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from preflight.checks import ds_report, ext_locks
from preflight.hostside import jit
from preflight.hostside.outcome import Status
from tests.placeholders import assert_no_placeholder

ROOT = Path(__file__).resolve().parents[3]
OP = "deepspeed_shm_comm"


def _thresholds():
    from preflight.config import load_thresholds
    return load_thresholds(None)


def _plant(root: Path, layout: str = "py311_cpu", age_s: float = 7200.0, objects: int = 0) -> Path:
    op_dir = root / layout / OP if layout else root / OP
    op_dir.mkdir(parents=True)
    lock = op_dir / "lock"
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    for i in range(objects):  # a killed build's objects are as old as its lock
        (op_dir / f"src{i}.o").write_text("")
        os.utime(op_dir / f"src{i}.o", (then, then))
    return lock


def test_the_root_is_the_one_the_ranks_use():
    assert jit.extensions_root("/x/ext", {"TORCH_EXTENSIONS_DIR": "/y"})[:2] == (
        "/x/ext", "TORCH_EXTENSIONS_DIR in .deepspeed_env")
    assert jit.extensions_root(None, {"TORCH_EXTENSIONS_DIR": "/y"})[0] == "/y"
    assert jit.extensions_root(None, {"XDG_CACHE_HOME": "/c"})[0] == "/c/torch_extensions"
    root, _, default = jit.extensions_root(None, {})
    assert root == os.path.expanduser("~/.cache/torch_extensions") and default


def test_a_lock_nobody_holds_fails_naming_op_file_and_age_and_the_fix_removes_it(tmp_path):
    lock = _plant(tmp_path / "cache dir", objects=2)  # a space: the fix quotes the path
    facts = jit.scan_extensions(str(tmp_path / "cache dir"))
    out = ext_locks.evaluate(facts, _thresholds())
    assert out.status == Status.FAIL, out
    assert f"stale torch extensions lock {lock} (op {OP}, 2 h 0 min old)" in out.message, out.message
    assert out.fix == f"rm -f {shlex.quote(str(lock))}"
    subprocess.run(["sh", "-c", out.fix], check=True)  # the fix, pasted
    assert not lock.exists()
    again = ext_locks.evaluate(jit.scan_extensions(str(tmp_path / "cache dir")), _thresholds())
    assert again.status == Status.WARN and "partial build of deepspeed_shm_comm" in again.message  # objects, no .so


def test_a_lock_a_live_process_holds_open_or_a_build_running_there_is_not_stale(tmp_path):
    root = tmp_path / "ext"
    lock = _plant(root, layout="")  # TORCH_EXTENSIONS_DIR layout: ROOT/<op>
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "print('held', flush=True); time.sleep(60)", str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        facts = jit.scan_extensions(str(root))
        (entry,) = facts["dirs"]
        assert [h["pid"] for h in entry["holders"]] == [holder.pid] and entry["holders"][0]["how"] == ["fd"]
        out = ext_locks.evaluate(facts, _thresholds())
        assert out.status == Status.PASS and f"building now: {OP} (pid {holder.pid})" in out.message, out.message
    finally:
        holder.kill()
        holder.wait()
    worker = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # ninja's and the compiler's working directory
    try:
        time.sleep(0.2)
        facts = jit.scan_extensions(str(root))
        assert facts["dirs"][0]["holders"][0]["how"] == ["cwd"]
        assert ext_locks.evaluate(facts, _thresholds()).status == Status.PASS
    finally:
        worker.kill()
        worker.wait()
    assert ext_locks.evaluate(jit.scan_extensions(str(root)), _thresholds()).status == Status.FAIL


def test_an_old_lock_in_a_directory_written_just_now_warns_of_a_build_this_host_cannot_see(tmp_path):
    """A build in another container sharing the cache: its lock is old (a long build) and no process here holds it,
    but ninja wrote an object a moment ago. A WARN that says so, not a FAIL that would break a running build; once the
    directory has been quiet for quiet_s, the same lock FAILs."""
    lock = _plant(tmp_path / "ext", objects=1)
    (lock.parent / "src_new.o").write_text("")  # written now
    out = ext_locks.evaluate(jit.scan_extensions(str(tmp_path / "ext")), _thresholds())
    assert out.status == Status.WARN, out
    assert f"torch extensions lock {lock} (op {OP}, 2 h 0 min old)" in out.message
    assert "another container or PID namespace" in out.message and out.fix.endswith(f"rm -f {shlex.quote(str(lock))}")
    then = time.time() - 600
    os.utime(lock.parent / "src_new.o", (then, then))
    assert ext_locks.evaluate(jit.scan_extensions(str(tmp_path / "ext")), _thresholds()).status == Status.FAIL


def test_a_fresh_lock_is_a_build_starting_and_no_cache_passes(tmp_path):
    _plant(tmp_path / "ext", age_s=1.0)
    assert ext_locks.evaluate(jit.scan_extensions(str(tmp_path / "ext")), _thresholds()).status == Status.PASS
    out = ext_locks.evaluate(jit.scan_extensions(str(tmp_path / "none")), _thresholds())
    assert out.status == Status.PASS and "no torch extensions cache" in out.message


def test_ds_report_does_not_count_a_locked_op_as_usable():
    facts = {"deepspeed": "0.19.8", "torch": "2.13.0", "source": "api", "ninja": True, "ninja_binary": "/bin/ninja",
             "shm_bytes": 1 << 34, "cxx": "/usr/bin/c++", "cxx_name": "c++",
             "ops": {OP: {"installed": False, "compatible": True}, "fused_adam": {"installed": False,
                                                                                  "compatible": True}}}
    thresholds = _thresholds()
    assert "2/2 ops usable" in ds_report.evaluate(facts, thresholds).message
    facts["locked_ops"] = [{"op": OP, "path": f"/r/{OP}/lock", "age_s": 7200.0}]
    out = ds_report.evaluate(facts, thresholds)
    assert "1/2 ops usable" in out.message and f"locked by a stale torch extensions lock" in out.message, out.message
    assert out.metrics["ops_locked"] == [OP]


def _run(cluster, tmp_path, report):
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(cluster.hostfile(tmp_path / "hostfile")),
            "--python", sys.executable, "--ssh-config", str(cluster.ssh_config), "--ssh-key", str(cluster.user_key),
            "--known-hosts", str(cluster.known_hosts), "--checks", "ext_locks,ds_report", "--json", str(report)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="240")
    env.pop("DS_ENV_FILE", None)
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
                          env=env)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc, {(r["host"], r["check"]): r for r in json.loads(report.read_text())["results"]}


def test_a_stale_lock_on_one_host_fails_that_host_alone_and_the_pasted_fix_clears_it(netcluster_factory, tmp_path):
    """node02's cache (TORCH_EXTENSIONS_DIR=/tmp/pf-ext from ./.deepspeed_env; each host's /tmp is its own) holds a
    2-hour-old lock of deepspeed_shm_comm that no process holds: `preflight run` FAILs node02 alone, naming the file;
    the fix, pasted on node02, makes the next run pass."""
    cluster = netcluster_factory(3, names=["node01", "node02", "node03"])
    (tmp_path / ".deepspeed_env").write_text("TORCH_EXTENSIONS_DIR=/tmp/pf-ext\n")
    lock = f"/tmp/pf-ext/{OP}/lock"
    try:
        cluster.exec("node02", f"mkdir -p /tmp/pf-ext/{OP} && : > {lock} && touch -d '2 hours ago' {lock}",
                     check=True)
        proc, cells = _run(cluster, tmp_path, tmp_path / "r1.json")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        cell = cells[("node02", "ext_locks")]
        assert cell["status"] == "fail" and f"stale torch extensions lock {lock} (op {OP}, 2 h" in cell["message"]
        assert cell["fix"] == f"rm -f {lock}"
        assert "TORCH_EXTENSIONS_DIR in .deepspeed_env" in json.dumps(cell["metrics"])
        for host in ("node01", "node03"):
            assert cells[(host, "ext_locks")]["status"] == "pass", cells[(host, "ext_locks")]
        assert_no_placeholder(proc.stdout)
        verdict = next(line for line in proc.stdout.splitlines() if line.startswith("NOT READY"))
        assert "node02" in verdict and "node01" not in verdict and "node03" not in verdict, verdict
        report = cells[("node02", "ds_report")]
        # DeepSpeed is on the hosts (the test bed's): the locked op is not counted usable on node02.
        assert OP in report["metrics"]["ops_locked"], report
        assert report["metrics"]["ops_usable"] == cells[("node01", "ds_report")]["metrics"]["ops_usable"] - 1
        print(f"\nnode02: {cell['message']}\nds_report node02: {report['message']}")

        cluster.exec("node02", cell["fix"], check=True)  # the fix, pasted on node02
        proc, cells = _run(cluster, tmp_path, tmp_path / "r2.json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert all(cells[(h, "ext_locks")]["status"] == "pass" for h in ("node01", "node02", "node03"))
    finally:
        cluster.exec("node02", "rm -rf /tmp/pf-ext")
