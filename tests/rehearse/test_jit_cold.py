"""The first job start: a cold JIT build (a measurement, not a failure), the torch extension locks the rehearsal's
ranks take (never left behind), and a stale lock named as such, not as a build in progress.

Unit tests feed the judge recorded event lines and run the rank's lock watch on real files and processes; the
namespace tests run the real launch on 3 hosts with a per-test empty, host-local TORCH_EXTENSIONS_DIR (each host's
/tmp is its own), so that every host JIT-builds deepspeed_shm_comm: one cold rehearsal killed three ways right when
its lock appears (the build budget, Ctrl-C, kill -9 of the coordinator), then one that builds to the end."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight.hostfile import HostSpec
from preflight.hostside import rehearsal as host_side
from preflight.hostside.outcome import Status
from preflight.rehearse import EventLog, Outcomes, RehearseOptions
from tests.netcluster import _is_alive as _alive  # zombies (killed, not yet reaped) count as gone
from tests.placeholders import assert_no_placeholder

OP = "deepspeed_shm_comm"
HOSTS3 = ["node01", "node02", "node03"]


def _options(hosts, **kw):
    return RehearseOptions(hostfile="hostfile", hosts=hosts, deepspeed_config="/shared/ds.json", **kw)


def _log(token, hosts, lines):
    log = EventLog(token, hosts)
    log.feed("".join(line + "\n" for line in lines).encode())
    log.finish()
    return log


def _ev(host, rank, event, **fields):
    payload = {"run": "t", "event": event, "rank": rank, "local_rank": 0, "host": host}
    payload.update(fields)
    return f"{host}: {host_side.TAG} {json.dumps(payload)}"


def _three():
    return [HostSpec(h, 1, i, [0]) for i, h in enumerate(HOSTS3)]


def _done(host, rank, build_s, acquired=True, waited=False):
    ops = [{"name": OP, "jit": True, "s": build_s, "cold": True, "build_var": "DS_BUILD_SHM_COMM",
            "build_dir": f"/tmp/ext/{OP}", "acquired": acquired, "waited": waited}]
    return [_ev(host, rank, "start", python="/venv/bin/python3"), _ev(host, rank, "imported", deepspeed="0.19.8"),
            _ev(host, rank, "op_begin", op=OP),
            _ev(host, rank, "op_jit", op=OP, cold=True, build_dir=f"/tmp/ext/{OP}"),
            _ev(host, rank, "op_end", **ops[0]), _ev(host, rank, "init_begin", backend="gloo"),
            _ev(host, rank, "init", s=0.5), _ev(host, rank, "initialize", s=2.0, zero_stage=2, micro_batch=1,
                                                 gradient_accumulation=1, train_batch=3),
            _ev(host, rank, "step", index=0, s=0.1), _ev(host, rank, "step", index=1, s=0.1),
            _ev(host, rank, "done", ops=ops)]


def test_a_cold_build_that_finishes_is_a_warn_per_host_with_its_time_and_the_prebuild_fix():
    lines = [f"{host_side.TAG} " + json.dumps({"run": "t", "event": "launcher", "role": "launcher",
                                                "launcher_path": "/venv/bin/deepspeed", "launcher_from": "beside",
                                                "launcher_python": "/venv/bin/python3", "python": "/venv/bin/python3",
                                                "same_python": True})]
    for rank, (host, s) in enumerate(zip(HOSTS3, (95.2, 90.1, 99.0))):
        lines += _done(host, rank, s)
    out = Outcomes(_options(_three()), "node01", _log("t", HOSTS3, lines), "every rank ended", 120.0, {"rc": 0})
    rows = out.host_rows()
    for host, s in zip(HOSTS3, ("95.2 s", "90.1 s", "99 s")):
        row = rows[host]
        assert row.status == Status.WARN, row
        assert f"the first job start spends {s} building {OP} on {host}" in row.message, row.message
        # The pre-build runs the pip of the interpreter the rank ran (its start event), not a bare `pip`.
        # ... and rebuilds the version the rank imported (a plain install of an installed package builds nothing).
        assert ("DS_BUILD_SHM_COMM=1 /venv/bin/python3 -m pip install --force-reinstall --no-deps --no-cache-dir "
                "deepspeed==0.19.8") in row.fix, row.fix
        assert "TORCH_EXTENSIONS_DIR" in row.fix
        assert row.metrics["jit_builds"][OP]["s"] == float(s.split()[0])
    whole = out.cluster_row(rows)
    assert whole.status == Status.WARN, whole
    assert (f"the first job start spends 99 s building {OP} on every host (node01 95.2 s, node02 90.1 s, node03 99 s)"
            in whole.message), whole.message
    assert "launcher /venv/bin/deepspeed (beside /venv/bin/python3), interpreter /venv/bin/python3" in whole.message
    assert whole.blocked_by is None and all(r.blocked_by is None for r in rows.values())


def test_ranks_that_waited_for_another_hosts_build_in_one_shared_directory_warn_with_a_host_local_line():
    lines = _done("node01", 0, 95.0)
    lines += _done("node02", 1, 96.0, acquired=False, waited=True)
    out = Outcomes(_options(_three()[:2]), "node01", _log("t", HOSTS3[:2], lines), "every rank ended", 99.0, {})
    rows = out.host_rows()
    assert "spends 95 s building" in rows["node01"].message
    row = rows["node02"]
    assert row.status == Status.WARN and "waited for another host's build of deepspeed_shm_comm" in row.message
    assert "shared torch extensions directory /tmp/ext" in row.message
    assert "TORCH_EXTENSIONS_DIR=/var/tmp/torch_extensions" in row.fix and ".deepspeed_env" in row.fix


def test_a_build_past_the_budget_fails_with_the_compilers_last_lines():
    lines = [_ev("node01", 0, "start", python="/venv/bin/python3"), _ev("node01", 0, "op_begin", op=OP),
             _ev("node01", 0, "op_jit", op=OP, cold=True), "node01: [1/3] c++ -MMD -c shm.cpp -o shm.o",
             "node01: cc1plus: still compiling"]
    stop = f"[launch] jit_build_budget_s 60 s passed while node01 was still building {OP}"
    out = Outcomes(_options(_three()[:1], build_budget=60.0), "node01", _log("t", ["node01"], lines), stop, 70.0, {})
    row = out.host_rows()["node01"]
    assert row.status == Status.FAIL and f"was still JIT-building DeepSpeed op {OP}" in row.message
    assert "the JIT build budget ran out" in row.message and "cc1plus: still compiling" in row.message, row.message
    assert "jit_build_budget_s (now 60 s)" in row.fix
    assert ("DS_BUILD_OPS=1 /venv/bin/python3 -m pip install --force-reinstall --no-deps --no-cache-dir "
            "deepspeed") in row.fix, row.fix


def test_a_stale_lock_is_named_with_its_rm_not_as_a_build_in_progress():
    path = f"/root/.cache/torch_extensions/py311_cpu/{OP}/lock"
    error = {"phase": "init", "type": "StaleLock", "op": OP, "message": "stale torch extensions lock",
             "stale_lock": {"op": OP, "path": path, "age_s": 7200.0}}
    lines = [_ev("node01", 0, "start"), _ev("node01", 0, "init_begin", backend="gloo"),
             _ev("node02", 1, "start"), _ev("node02", 1, "op_begin", op=OP), _ev("node02", 1, "error", **error),
             _ev("node03", 2, "start"), _ev("node03", 2, "init_begin", backend="gloo")]
    out = Outcomes(_options(_three()), "node01", _log("t", HOSTS3, lines), "stopped 10 s after the first rank raised",
                   20.0, {})
    rows = out.host_rows()
    row = rows["node02"]
    assert row.status == Status.FAIL and f"stale torch extensions lock {path}" in row.message, row.message
    assert "not a build in progress" in row.message and "JIT build)" not in row.message
    assert row.fix == f"rm -f {path}" and row.metrics["cause"] == "stale lock"
    for host in ("node01", "node03"):  # they waited in init for node02: its victims
        assert rows[host].blocked_by is not None and rows[host].blocked_by.host == "node02", rows[host]
    whole = out.cluster_row(rows)
    assert whole.blocked_by is not None and whole.blocked_by.host == "node02" and path in whole.message


def test_the_config_missing_on_one_host_blocks_the_two_that_waited_for_it():
    error = {"phase": "config", "type": "FileNotFoundError", "message": "[Errno 2] No such file or directory"}
    lines = [_ev("node01", 0, "start"), _ev("node01", 0, "init_begin", backend="gloo"),
             _ev("node02", 1, "start"), _ev("node02", 1, "error", **error),
             _ev("node03", 2, "start"), _ev("node03", 2, "op_begin", op=OP)]  # cut short while building
    out = Outcomes(_options(_three()), "node01", _log("t", HOSTS3, lines), "stopped 10 s after the first rank raised",
                   20.0, {})
    rows = out.host_rows()
    assert rows["node02"].status == Status.FAIL and rows["node02"].blocked_by is None
    for host in ("node01", "node03"):
        assert rows[host].status == Status.FAIL and rows[host].blocked_by is not None, rows[host]
        assert (rows[host].blocked_by.host, rows[host].blocked_by.check) == ("node02", "launch")
    assert "build cut short" == rows["node03"].metrics["cause"]


def test_a_launcher_whose_interpreter_is_not_pythons_warns_naming_both(tmp_path):
    script = tmp_path / "deepspeed"
    script.write_text("#!/usr/bin/python3\nprint('x')\n")
    script.chmod(0o755)
    found = host_side.resolve_launcher([str(script)], beside=False)
    assert found["launcher_python"] == "/usr/bin/python3" and found["launcher_from"] == "given"
    assert found["same_python"] is (os.path.realpath("/usr/bin/python3") == os.path.realpath(sys.executable))
    env = tmp_path / "envscript"
    env.write_text("#!/usr/bin/env python3\n")
    assert host_side.script_interpreter(str(env)) and host_side.script_interpreter("/bin/sh") is None
    line = {"run": "t", "event": "launcher", "role": "launcher", "launcher_path": str(script), "launcher_from": "path",
            "launcher_python": "/usr/bin/python3", "python": "/venv/bin/python3", "same_python": False}
    lines = [f"{host_side.TAG} {json.dumps(line)}"] + _done("node01", 0, 1.0)
    out = Outcomes(_options(_three()[:1], python="/venv/bin/python3"), "node01", _log("t", ["node01"], lines),
                   "every rank ended", 5.0, {})
    whole = out.cluster_row(out.host_rows())
    assert whole.status == Status.WARN, whole
    assert f"the launcher {script} runs /usr/bin/python3, not --python /venv/bin/python3" in whole.message


def _clean_up(launch: Path) -> None:
    """The clean-up's line for one launch directory, as the coordinator and the supervisor run it on a host."""
    subprocess.run(["sh", "-c", f'd="$1"; {host_side.RELEASE_LOCKS}; rm -rf -- "$d"', "sh", str(launch)],
                   check=True, timeout=30)


def test_the_rank_records_the_locks_it_takes_and_a_stale_one_raises(tmp_path):
    """The rank's lock watch on torch's real FileBaton: a lock it takes is recorded in the launch directory until it
    releases it; waiting on a lock nobody holds from before the run raises StaleLock within seconds."""
    from torch.utils.file_baton import FileBaton
    saved = (FileBaton.try_acquire, FileBaton.release, FileBaton.wait)
    rep = host_side.Reporter("t", {"rank": 0})
    (tmp_path / "launch").mkdir()
    log = host_side.OpLog(rep, str(tmp_path / "launch" / "locks"))
    try:
        log._watch_locks()
        build = tmp_path / "ext" / OP
        build.mkdir(parents=True)
        baton = FileBaton(str(build / "lock"))
        assert baton.try_acquire()
        (record,) = (tmp_path / "launch" / "locks").iterdir()
        assert record.read_text() == str(build / "lock")
        baton.release()
        assert not list((tmp_path / "launch" / "locks").iterdir()) and not (build / "lock").exists()
        # A stale lock from two hours ago that nobody holds.
        (build / "lock").write_text("")
        then = time.time() - 7200
        os.utime(build / "lock", (then, then))
        started = time.monotonic()
        with pytest.raises(host_side.StaleLock) as raised:
            FileBaton(str(build / "lock")).wait()
        assert raised.value.path == str(build / "lock") and raised.value.age_s > 7000
        assert time.monotonic() - started < 10
        # One that a live process holds open is waited on until it goes.
        holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY);"
                                   " print('held', flush=True); time.sleep(5); os.unlink(sys.argv[1])",
                                   str(build / "lock")], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        FileBaton(str(build / "lock")).wait()  # returns once the holder removed it
        assert holder.wait() == 0
    finally:
        FileBaton.try_acquire, FileBaton.release, FileBaton.wait = saved


def test_the_clean_up_removes_only_the_locks_the_runs_ranks_recorded(tmp_path):
    """RELEASE_LOCKS follows this host's records only: it kills what still builds in the lock's directory and
    removes the lock; a lock no record of this host names stays."""
    launch = tmp_path / "preflight-rehearse-0123"
    (launch / "locks").mkdir(parents=True)
    ours, theirs = tmp_path / "ext" / "ours" / "lock", tmp_path / "ext" / "theirs" / "lock"
    for lock in (ours, theirs):
        lock.parent.mkdir(parents=True)
        lock.write_text("")
    (launch / "locks" / f"{socket.gethostname()}-123-1").write_text(str(ours))
    # Another host's record (a --workdir the hosts share): its path names that host's lock, not this one's.
    (launch / "locks" / f"x{socket.gethostname()}-123-1").write_text(str(theirs))
    builder = subprocess.Popen(["sleep", "60"], cwd=ours.parent)  # a compiler left running by the killed rank
    try:
        time.sleep(0.2)
        _clean_up(launch)
        assert builder.wait(timeout=5) == -signal.SIGKILL
    finally:
        if builder.poll() is None:
            builder.kill()
    assert not ours.exists() and theirs.exists() and not launch.exists()


# A rank in a launch directory ($1) takes the lock ($2) through OpLog._try, with a "create" that stands for torch's
# O_EXCL create and then: "die" (SIGKILL right after the create, as the clean-up's pkill can land) or "abandon" (the
# watchdog's abandon() starts while the create is still in progress, then the rank ends as the watchdog does).
RANK_TAKING_A_LOCK = """
import os, signal, sys, threading, time
sys.path.insert(0, os.environ["PF_ROOT"])
from preflight.hostside import rehearsal as r
here, lock, how = sys.argv[1], sys.argv[2], sys.argv[3]
ops = r.OpLog(r.Reporter("t", {}), os.path.join(here, r.LOCKS_DIR))
def create():
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    if how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)
    return fd + 1
if how == "abandon":
    def watchdog():
        time.sleep(0.5)
        ops.abandon()
        os._exit(124)
    threading.Thread(target=watchdog, daemon=True).start()
ops._try(lock, create)
time.sleep(30)
"""


@pytest.mark.parametrize("how", ["die", "abandon"])
def test_a_lock_half_taken_when_the_rank_ends_is_still_removed(tmp_path, how):
    """The instant between torch's O_EXCL create of a lock and the rank's record of it: a rank SIGKILLed there (the
    clean-up's pkill) leaves a *.try record that RELEASE_LOCKS follows; the rank's own watchdog waits until the
    record is written, then removes the lock. (Before the record was written first, both left the lock for good.)"""
    launch, lock = tmp_path / "preflight-rehearse-0123", tmp_path / "ext" / OP / "lock"
    launch.mkdir()
    lock.parent.mkdir(parents=True)
    rank = subprocess.run([sys.executable, "-c", RANK_TAKING_A_LOCK, str(launch), str(lock), how], timeout=60,
                          env=dict(os.environ, PF_ROOT=str(ROOT)))
    if how == "die":
        assert rank.returncode == -signal.SIGKILL and lock.exists()
        (record,) = (launch / host_side.LOCKS_DIR).iterdir()
        assert record.name.endswith(".try") and record.read_text() == str(lock)
        _clean_up(launch)
    else:
        assert rank.returncode == 124
    assert not lock.exists()


def test_a_try_record_does_not_remove_a_lock_older_than_the_try(tmp_path):
    """A *.try record whose lock was there before the try (another job's, which the try did not get) is left."""
    launch, lock = tmp_path / "preflight-rehearse-0123", tmp_path / "ext" / OP / "lock"
    (launch / host_side.LOCKS_DIR).mkdir(parents=True)
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    then = time.time() - 600
    os.utime(lock, (then, then))
    (launch / host_side.LOCKS_DIR / f"{socket.gethostname()}-123-1.try").write_text(str(lock))
    _clean_up(launch)
    assert lock.exists() and not launch.exists()
    # Not taken: the try's record goes at once.
    log = host_side.OpLog(host_side.Reporter("t", {}), str(tmp_path / "again" / host_side.LOCKS_DIR))
    (tmp_path / "again").mkdir()
    assert not log._try(str(lock), lambda: False)
    assert not os.listdir(tmp_path / "again" / host_side.LOCKS_DIR) and not log.records


# ----------------------------------------------------------------------------------- on namespace hosts

ROOT = Path(__file__).resolve().parents[2]
EXT = "/tmp/pf-cold-ext"  # TORCH_EXTENSIONS_DIR of the cold tests: in each host's own /tmp, empty at first
LOCK = f"{EXT}/{OP}/lock"
CONFIG = {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 2}}  # no optimizer section: torch's AdamW, so only the comm op is built


@pytest.fixture(scope="module")
def cold_cluster():
    pytest.importorskip("deepspeed")
    from tests.netcluster import NetCluster
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(3, names=HOSTS3) as cluster:
        (cluster.dir / "ds_cold.json").write_text(json.dumps(CONFIG))  # /run: every host sees it
        try:
            yield cluster
        finally:
            for host in HOSTS3:
                cluster.exec(host, ["rm", "-rf", EXT])


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / ".deepspeed_env").write_text(f"GLOO_SOCKET_IFNAME=eth0\nTORCH_EXTENSIONS_DIR={EXT}\n")
    return tmp_path


def _argv(cluster, workdir: Path, *extra: str):
    return [sys.executable, "-m", "preflight", "rehearse", "--hostfile", str(cluster.hostfile(workdir / "hostfile")),
            "--deepspeed-config", str(cluster.dir / "ds_cold.json"), "--ssh-config", str(cluster.ssh_config),
            "--ssh-key", str(cluster.user_key), "--known-hosts", str(cluster.known_hosts), "--python", sys.executable,
            "--init-timeout", "40", "--json", str(workdir / "r.json"), *extra]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="240")
    env.pop("DS_ENV_FILE", None)
    env.update(extra)
    return env


def _locks(cluster):
    """{host: the lock files under EXT there}."""
    out = {}
    for host in HOSTS3:
        found = cluster.exec(host, f"find {EXT} -name lock 2>/dev/null").stdout.split()
        if found:
            out[host] = found
    return out


def _nothing_of_the_run_left(cluster, keep=()):
    """No process of the run on any host, no launch directory, and no lock but those in ``keep``."""
    from tests.cli.test_cli_cluster import leftovers
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        left = {h: v for h, v in leftovers(cluster).items() if v["processes"] or set(v["tmp"]) - {"pf-cold-ext"}}
        locks = {h: [p for p in v if p not in keep] for h, v in _locks(cluster).items()}
        if not left and not any(locks.values()):
            return
        time.sleep(1)
    assert left == {} and not any(locks.values()), (left, locks)


def _cells(workdir: Path):
    return {r["host"]: r for r in json.loads((workdir / "r.json").read_text())["results"]}


def test_a_stale_lock_is_named_in_the_rehearsal_and_the_other_hosts_locks_go(cold_cluster, tmp_path):
    """node02's cache holds a 2-hour-old deepspeed_shm_comm lock nobody holds: its rank names it (not a build in
    progress) within seconds; node01 and node03 were building theirs and are stopped: their locks are removed,
    node02's planted one (not the run's) is left alone, and the pasted fix removes it."""
    cluster = cold_cluster
    cluster.exec("node02", f"mkdir -p {EXT}/{OP} && : > {LOCK} && touch -d '2 hours ago' {LOCK}", check=True)
    workdir = _workdir(tmp_path)
    started = time.monotonic()
    proc = subprocess.run(_argv(cluster, workdir), cwd=workdir, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, env=_env())
    elapsed = time.monotonic() - started
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    cells = _cells(workdir)
    row = cells["node02"]
    assert f"stale torch extensions lock {LOCK}" in row["message"] and "not a build in progress" in row["message"]
    assert "(JIT build)" not in row["message"] and row["fix"] == f"rm -f {LOCK}", row
    for host in ("node01", "node03"):
        assert cells[host]["blocked_host"] == "node02", cells[host]
    assert f"node02::launch FAILED - rank 1 (local 0) waits forever on a stale torch extensions lock {LOCK}" \
        in proc.stdout, proc.stdout
    _nothing_of_the_run_left(cluster, keep=(LOCK,))
    assert _locks(cluster) == {"node02": [LOCK]}  # someone else's lock: left alone
    assert_no_placeholder(proc.stdout)
    cluster.exec("node02", row["fix"], check=True)
    assert _locks(cluster) == {}
    print(f"\nstale lock named in {elapsed:.1f} s: {row['message']}")


def _until_every_host_builds(cluster, proc, limit=300):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if len(_locks(cluster)) == len(HOSTS3):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    pytest.fail(f"no build lock on every host within {limit} s: {_locks(cluster)}")


@pytest.mark.parametrize("how", ["budget", "ctrl-c", "kill-9"])
def test_a_cold_rehearsal_stopped_mid_build_leaves_no_lock(cold_cluster, tmp_path, how):
    """Each host JIT-builds deepspeed_shm_comm into its empty cache; right when every host holds its build lock the
    rehearsal is stopped: by its build budget (30 s), by Ctrl-C, or by kill -9 of the coordinator (the launch
    host's supervisor then cleans up over pdsh). No lock of the run is left on any host, nor a process."""
    cluster = cold_cluster
    for host in HOSTS3:  # cold: whatever an earlier stop left (objects of a cut build) goes
        cluster.exec(host, ["rm", "-rf", EXT])
    workdir = _workdir(tmp_path)
    extra = ("--jit-build-budget", "30") if how == "budget" else ()
    proc = subprocess.Popen(_argv(cluster, workdir, *extra), cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=_env())
    try:
        _until_every_host_builds(cluster, proc)
        stopped = time.monotonic()
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        elif how == "kill-9":
            proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "budget":
        assert proc.returncode == 1, out + err
        cells = _cells(workdir)
        assert "the JIT build budget ran out" in json.dumps(cells), out
        assert any("jit_build_budget_s 30 s passed" in c["message"] for c in cells.values()), out
    elif how == "ctrl-c":
        assert proc.returncode == 130 and "cleaned up on the hosts" in err, out + err
    else:
        assert proc.returncode == -signal.SIGKILL
    _nothing_of_the_run_left(cluster)
    print(f"\n{how}: no lock and no process left {time.monotonic() - stopped:.1f} s after the stop")


def test_a_cold_rehearsal_passes_with_each_ops_build_time_and_names_the_launcher_beside_python(cold_cluster, tmp_path):
    """The cold rehearsal to the end, on 3 hosts with empty caches: exit 0, a WARN naming each op and its build time
    on every host. node01's PATH has another `deepspeed` first (a fake, of the system Python): with --python V and
    no --deepspeed, the launcher beside V runs, and the report names it and its interpreter."""
    cluster = cold_cluster
    for host in HOSTS3:
        cluster.exec(host, ["rm", "-rf", EXT])
    first = "/root/.cargo/bin"  # first on the namespace hosts' ssh PATH: a tmpfs there, on node01 only
    cluster.exec("node01", ["mount", "-t", "tmpfs", "tmpfs", first], check=True)
    fake = (f"cat > {first}/deepspeed <<'X'\n#!/usr/bin/python3\nimport sys\nprint('the fake deepspeed ran')\n"
            f"sys.exit(3)\nX\nchmod 755 {first}/deepspeed")
    cluster.exec("node01", fake, check=True)
    assert cluster.exec("node01", "PATH=/root/.cargo/bin:$PATH command -v deepspeed").stdout.strip() == \
        f"{first}/deepspeed"
    workdir = _workdir(tmp_path)
    started = time.monotonic()
    try:
        proc = subprocess.run(_argv(cluster, workdir), cwd=workdir, capture_output=True, text=True, timeout=1500,
                              stdin=subprocess.DEVNULL, env=_env())
    finally:
        cluster.exec("node01", ["umount", first])
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = _cells(workdir)
    beside = str(Path(sys.executable).parent / "deepspeed")
    times = {}
    for host in HOSTS3:
        cell = cells[host]
        assert cell["status"] == "warn", cell
        assert "the first job start spends " in cell["message"] and f"building {OP} on {host}" in cell["message"]
        assert re.search(r"DS_BUILD_SHM_COMM=1 /\S+ -m pip install --force-reinstall --no-deps --no-cache-dir "
                         r"deepspeed==\d", cell["fix"]), cell["fix"]
        times[host] = cell["metrics"]["jit_builds"][OP]["s"]
        assert times[host] > 5
    whole = cells["*"]
    assert whole["status"] == "warn" and f"building {OP} on every host" in whole["message"], whole["message"]
    assert f"launcher {beside} (beside {sys.executable}), interpreter" in whole["message"], whole["message"]
    assert "fake deepspeed" not in proc.stdout + proc.stderr and "not --python" not in whole["message"]
    assert_no_placeholder(proc.stdout)
    _nothing_of_the_run_left(cluster)
    print(f"\ncold rehearsal: exit 0 in {elapsed:.1f} s; {OP} build per host: {times}; {whole['message']}")


# A rank in a launch directory: it takes a build lock (recorded, as OpLog does), starts a "compiler" child, and
# waits; its watchdog is the rank's own (_watchdog). argv: the launch directory, the lock, the lifetime.
RANK_HOLDING_A_LOCK = """
import os, subprocess, sys, time
sys.path.insert(0, os.environ["PF_ROOT"])
from preflight.hostside import rehearsal as r
here, lock, lifetime = sys.argv[1], sys.argv[2], float(sys.argv[3])
ops = r.OpLog(r.Reporter("t", {}), os.path.join(here, r.LOCKS_DIR))
ops._try(lock, lambda: os.open(lock, os.O_CREAT | os.O_EXCL) + 1)
child = subprocess.Popen(["sleep", "300"])
print("child", child.pid, flush=True)
r._watchdog(r.Reporter("t", {}), lifetime, here, ops)
time.sleep(300)
"""


@pytest.mark.parametrize("ends", ["launch-directory-removed", "lifetime"])
def test_a_rank_that_outlives_its_run_stops_its_build_and_removes_its_lock(tmp_path, ends):
    """A rank the clean-up could not reach (still starting when its pkill ran; in CI one host kept its lock after a
    budget stop) ends by itself when its launch directory is removed, or at its lifetime: it kills its build's
    processes and removes the lock it holds. The control: while the directory stays, it keeps both."""
    here, lock = tmp_path / "launch", tmp_path / "ext" / "lock"
    here.mkdir()
    lock.parent.mkdir()
    lifetime = "4" if ends == "lifetime" else "300"
    rank = subprocess.Popen([sys.executable, "-c", RANK_HOLDING_A_LOCK, str(here), str(lock), lifetime],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PF_ROOT=str(ROOT)))
    try:
        child = int(next(line for line in rank.stdout if line.startswith("child ")).split()[1])
        time.sleep(2.5)
        assert rank.poll() is None and lock.exists() and _alive(child)  # the control
        assert os.listdir(here / host_side.LOCKS_DIR)  # the lock's record
        if ends == "launch-directory-removed":
            subprocess.run(["rm", "-rf", str(here)], check=True)
        assert rank.wait(timeout=10) == 124
        assert not lock.exists()
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        rank.kill()
        rank.wait()


def test_descendants_reads_the_process_tree_from_proc(tmp_path):
    """_descendants follows ppid through /proc/<pid>/stat, whose comm may hold spaces and parentheses."""
    for pid, comm, ppid in ((10, "python", 1), (11, "ninja", 10), (12, "cc1plus (x) y", 11), (13, "other", 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0\n")
    (tmp_path / "self").mkdir()
    assert sorted(host_side._descendants(10, str(tmp_path))) == [11, 12]
    assert host_side._descendants(13, str(tmp_path)) == []


def test_the_launch_check_of_preflight_run_keeps_who_blocked_whom():
    """The `launch` check carries the judge's blocked_by through its facts (a victim stays a victim in `preflight
    run`), and a rank stuck on a stale lock that ext_locks named on the same host is blocked by that result."""
    from preflight.checks import launch
    from preflight.checks.launch import _row, _stale_lock_seen
    from preflight.hostside.outcome import BlockedBy, Outcome
    row = _row(Outcome(Status.FAIL, "rank 0 hung", "", {}, blocked_by=BlockedBy("node02", "launch")))
    out = launch.evaluate({"rows": {"node01": json.loads(json.dumps(row))}}, {})
    assert out["node01"].blocked_by == BlockedBy("node02", "launch")
    assert _stale_lock_seen({"dirs": [{"lock": {"path": "/x/lock"}, "holders": []}]})
    assert not _stale_lock_seen({"dirs": [{"lock": {"path": "/x/lock"}, "holders": [{"pid": 1}]}]})
    assert not _stale_lock_seen(None)
