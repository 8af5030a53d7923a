"""nvme: dd/mounts parsers on the recorded H100 host, evaluate on recorded and faulty facts, collect for real here.

collect writes real (small) dd test files into pytest's temporary directories and /dev/shm, and proves that none
is left behind: after a normal run, after a dd timeout, and after SIGALRM/SIGTERM raised into collect. The O_DIRECT
fallback runs on a real ramfs (no O_DIRECT) mounted in a private mount namespace.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from preflight.checks import nvme
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

REPO = Path(__file__).resolve().parents[3]
from tests.h100 import read as fixture
T = load_defaults()
MiB = 1 << 20


def ctx(params=None, seconds=120.0) -> HostContext:
    """What the coordinator sends: the [nvme] section's host params (params_from_thresholds), then these."""
    return HostContext(dict(nvme.params_from_thresholds(T), **(params or {})), time.monotonic() + seconds)


def entry(**over):
    e = {"path": "/local_nvme", "exists": True, "is_dir": True, "writable": True, "fstype": "xfs",
         "free_bytes": 3 << 40, "write_Bps": None, "read_Bps": None, "direct": True, "test_bytes": 1 << 30,
         "error": None, "kind": "directory", "realpath": "/local_nvme", "mountpoint": "/local_nvme",
         "device": "/dev/nvme0n1", "direct_error": None, "measure_skipped": None, "timed_out": None,
         "timeout_s": 120.0, "uid": 1000}
    e.update(over)
    return e


# --- parsers ---------------------------------------------------------------------------------

def test_parse_dd_recorded_direct_write():
    d = nvme.parse_dd(fixture("dd-write.txt"))
    assert d["bytes"] == 2048 * MiB and d["seconds"] == pytest.approx(1.43745)
    assert d["Bps"] == pytest.approx(d["bytes"] / d["seconds"])
    assert d["rate_text"] == "1.5 GB/s"
    assert 1.4e9 < d["Bps"] < 1.6e9  # agrees with dd's own rounded "1.5 GB/s"


def test_parse_dd_recorded_buffered_write():
    d = nvme.parse_dd(fixture("dd-write-nodirect.txt"))
    assert d["bytes"] == 2147483648 and d["seconds"] == pytest.approx(1.39432)


def test_parse_dd_computes_rate_instead_of_trusting_the_unit():
    # Old coreutils said "seconds"; the unit of the rate varies (kB/s, MB/s, GB/s): only bytes/seconds counts.
    d = nvme.parse_dd("100+0 records in\n100+0 records out\n104857600 bytes (105 MB) copied, 0.5 seconds, 210 MB/s\n")
    assert d["Bps"] == pytest.approx(104857600 / 0.5)
    d = nvme.parse_dd("1 byte copied, 0 s, 0 kB/s")
    assert d["bytes"] == 1 and d["Bps"] is None
    assert nvme.parse_dd("dd: failed to open 'x': Invalid argument\n") is None
    assert nvme.dd_error_line("dd: failed to open 'x': Invalid argument\n") == "dd: failed to open 'x': Invalid argument"


def test_parse_mounts_recorded_and_longest_prefix():
    mounts = nvme.parse_mounts(fixture("mounts.txt"))
    assert mounts[0] == {"device": "proc", "mountpoint": "/proc", "fstype": "proc", "options": "rw,relatime"}
    assert nvme.mount_for("/dev/shm/offload", mounts)["fstype"] == "tmpfs"
    assert nvme.mount_for("/usr/local/nvidia/lib64", mounts)["fstype"] == "squashfs"
    assert nvme.mount_for("/usr/local", mounts)["fstype"] == "ext4"  # /usr/local/nvidiaX is no prefix match
    assert nvme.mount_for("/usr/local/nvidiax", mounts)["mountpoint"] == "/"
    assert nvme.mount_for("/", mounts)["device"] == "/dev/vda"
    # /dev/shm is mounted twice; the later mount (size=134217728k) is the visible one.
    assert "134217728k" in nvme.mount_for("/dev/shm", mounts)["options"]
    assert nvme.parse_mounts("a /mnt/with\\040space ext4 rw 0 0")[0]["mountpoint"] == "/mnt/with space"


def test_params_from_thresholds_are_the_nvme_section_in_bytes():
    p = nvme.params_from_thresholds(T)
    assert p == {"nvme_test_bytes": T["nvme"]["test_mib"] * MiB,
                 "nvme_max_free_fraction": T["nvme"]["max_free_fraction"],
                 "nvme_min_test_bytes": T["nvme"]["min_test_mib"] * MiB}
    assert p["nvme_test_bytes"] == 1024 * MiB and p["nvme_min_test_bytes"] == 64 * MiB  # the documented defaults
    site = dict(T, nvme=dict(T["nvme"], test_mib=8, max_free_fraction=0.25, min_test_mib=2))
    assert nvme.params_from_thresholds(site) == {"nvme_test_bytes": 8 * MiB, "nvme_max_free_fraction": 0.25,
                                                 "nvme_min_test_bytes": 2 * MiB}


def test_collect_has_no_copy_of_the_section_and_names_a_missing_param(tmp_path):
    """nvme.toml is the one source: collect without the coordinator's params is a clear error, not a default."""
    assert not [n for n in dir(nvme) if n.startswith("DEFAULT_")]
    assert nvme.collect(HostContext({}, time.monotonic() + 10)) == {"paths": []}  # nothing to measure
    with pytest.raises(ValueError, match="nvme_max_free_fraction, nvme_min_test_bytes"):
        nvme.collect(HostContext({"nvme_paths": [str(tmp_path)], "nvme_test_bytes": MiB}, time.monotonic() + 10))


# --- evaluate --------------------------------------------------------------------------------

def h100_entry():
    """The recorded H100 host: its root disk (ext4 on /dev/vda per mounts.txt/df.txt) wrote 1.5 GB/s direct."""
    mounts = nvme.parse_mounts(fixture("mounts.txt"))
    m = nvme.mount_for("/scratch/offload", mounts)
    w = nvme.parse_dd(fixture("dd-write.txt"))["Bps"]
    r = nvme.parse_dd(fixture("dd-write-nodirect.txt"))["Bps"]  # no read was recorded; the same disk's other run
    free = int(fixture("df.txt").splitlines()[2].split()[4]) * 1024
    return entry(path="/scratch/offload", fstype=m["fstype"], mountpoint=m["mountpoint"], device=m["device"],
                 free_bytes=free, write_Bps=w, read_Bps=r, test_bytes=2048 * MiB)


def test_healthy_recorded_host_passes():
    o = nvme.evaluate({"paths": [h100_entry()]}, T)
    assert o.status == Status.PASS, o.message
    assert "/scratch/offload (ext4 on /)" in o.message and "1.49 GB/s" in o.message and "(direct)" in o.message
    assert o.metrics["paths"][0]["write_Bps"] == pytest.approx(2147483648 / 1.43745)


def test_slow_300_MBps_warns_with_actual_and_expected():
    slow = nvme.parse_dd("300+0 records in\n300+0 records out\n314572800 bytes (315 MB, 300 MiB) copied, 1.04858 s,"
                         " 300 MB/s\n")["Bps"]
    o = nvme.evaluate({"paths": [entry(write_Bps=slow, read_Bps=2.5e9)]}, T)
    assert o.status == Status.WARN
    assert "sequential write 300 MB/s < 1.00 GB/s expected" in o.message and "read" not in o.message.split(";")[0]
    assert "findmnt -T /local_nvme" in o.fix


def test_threshold_is_configurable():
    t = {"nvme": dict(T["nvme"], min_write_gbps=2.0, min_read_gbps=0.1)}
    e = h100_entry()
    assert nvme.evaluate({"paths": [e]}, t).status == Status.WARN
    assert nvme.evaluate({"paths": [e]}, T).status == Status.PASS


def test_slow_read_warns():
    o = nvme.evaluate({"paths": [entry(write_Bps=2e9, read_Bps=4e8)]}, T)
    assert o.status == Status.WARN and "sequential read 400 MB/s" in o.message


def test_the_slow_fix_names_the_paths_own_nvme_device_and_no_nvme_for_another_disk():
    on_nvme = nvme.evaluate({"paths": [entry(write_Bps=2e9, read_Bps=4e8, device="/dev/nvme1n1p2")]}, T)
    assert on_nvme.fix.endswith("nvme smart-log /dev/nvme1n1")
    on_vda = nvme.evaluate({"paths": [entry(write_Bps=2e9, read_Bps=4e8, device="/dev/vda1")]}, T)
    assert "smart-log" not in on_vda.fix and "lsblk" in on_vda.fix  # issue 26: it said /dev/nvme0n1 for /dev/vda


def test_missing_path_fails_with_fix():
    e = entry(path="/local_nvme/offload", exists=False, is_dir=False, writable=False, fstype=None, free_bytes=None,
              test_bytes=0, direct=False, error="does not exist", kind=None)
    o = nvme.evaluate({"paths": [e]}, T)
    assert o.status == Status.FAIL
    assert "/local_nvme/offload: does not exist" in o.message and "expected an existing directory" in o.message
    assert "mkdir -p -- /local_nvme/offload" in o.fix


def test_unwritable_path_fails():
    e = entry(writable=False, error="cannot create a file: Read-only file system", test_bytes=0)
    o = nvme.evaluate({"paths": [e]}, T)
    assert o.status == Status.FAIL and "not writable by uid 1000" in o.message and "Read-only" in o.message
    assert o.fix == "mount -o remount,rw /local_nvme"


def test_block_device_is_refused():
    e = entry(path="/dev/nvme0n1", is_dir=False, writable=False, kind="block device", test_bytes=0,
              error="is a block device, not a directory", device_mounts=["/local_nvme"])
    o = nvme.evaluate({"paths": [e]}, T)
    assert o.status == Status.FAIL and "block device" in o.message
    assert o.fix.startswith("mkdir -p -- /local_nvme/offload,") and "--nvme-path to /local_nvme/offload" in o.fix


def test_no_path_skips_with_reason():
    o = nvme.evaluate({"paths": []}, T)
    assert o.status == Status.SKIP and o.message == nvme.NO_PATH_REASON
    assert "no --nvme-path given" in o.message


def test_too_little_space_warns_unmeasured():
    e = entry(free_bytes=300 * MiB, test_bytes=0, measure_skipped="300 MiB free; 10% of it is 30 MiB, below the 64 "
                                                                  "MiB minimum test size")
    o = nvme.evaluate({"paths": [e]}, T)
    assert o.status == Status.WARN and "not measured" in o.message and "300.0 MiB free" in o.message


def test_no_o_direct_fails_by_default_and_warns_when_allowed():
    e = entry(path="/dev/shm/x", fstype="tmpfs", direct=False, write_Bps=3e9, read_Bps=8e9,
              direct_error="dd: failed to open '/dev/shm/x/.preflight-dd-1': Invalid argument")
    o = nvme.evaluate({"paths": [e]}, T)
    assert o.status == Status.FAIL and "does not support O_DIRECT" in o.message and "not direct" in o.message
    relaxed = {"nvme": dict(T["nvme"], require_direct_io=False)}
    assert nvme.evaluate({"paths": [e]}, relaxed).status == Status.WARN


def test_timeout_is_slow_or_could_not_run():
    slow = entry(write_Bps=None, timed_out="write", timeout_s=120.0, test_bytes=1 << 30,
                 error="dd write of 1024 MiB timed out after 120.0 s")
    o = nvme.evaluate({"paths": [slow]}, T)
    assert o.status == Status.WARN and "below 9 MB/s" in o.message
    short = entry(write_Bps=None, timed_out="write", timeout_s=0.5, test_bytes=1 << 30,
                  error="dd write of 1024 MiB timed out after 0.5 s")
    assert nvme.evaluate({"paths": [short]}, T).status == Status.ERROR


def test_io_error_fails():
    e = entry(error="dd write failed (rc 1): dd: error writing '/local_nvme/.preflight-dd-1': Input/output error")
    assert nvme.evaluate({"paths": [e]}, T).status == Status.FAIL


# --- collect on this machine -----------------------------------------------------------------

def o_direct_supported(directory: str) -> bool:
    fd = None
    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
        if os.path.exists(path):
            os.unlink(path)


def test_collect_measures_real_directory_and_leaves_nothing(tmp_path):
    d = tmp_path / "offload"
    d.mkdir()
    facts = nvme.collect(ctx({"nvme_paths": [str(d)], "nvme_test_bytes": 16 * MiB}))
    json.loads(json.dumps(facts))
    (e,) = facts["paths"]
    assert set(["path", "exists", "is_dir", "writable", "fstype", "free_bytes", "write_Bps", "read_Bps", "direct",
                "test_bytes", "error"]) <= set(e)
    assert e["exists"] and e["is_dir"] and e["writable"] and e["error"] is None
    assert e["test_bytes"] == 16 * MiB and e["write_Bps"] > 0 and e["read_Bps"] > 0
    assert e["direct"] == o_direct_supported(str(d))
    sv = os.statvfs(str(d))
    assert abs(e["free_bytes"] - sv.f_bavail * sv.f_frsize) < 1 << 30
    real_fs = subprocess.run(["stat", "-f", "-c", "%T", str(d)], capture_output=True, text=True).stdout.strip()
    assert e["fstype"] and (e["fstype"] == real_fs or real_fs.startswith(e["fstype"][:3]))
    assert os.listdir(d) == []
    o = nvme.evaluate(facts, T)
    assert o.status in (Status.PASS, Status.WARN) and str(d) in o.message


def test_collect_missing_file_and_unwritable_paths(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    facts = nvme.collect(ctx({"nvme_paths": [str(tmp_path / "nope"), str(f)], "nvme_test_bytes": 4 * MiB}))
    missing, afile = facts["paths"]
    assert not missing["exists"] and missing["error"] == "does not exist"
    assert afile["exists"] and not afile["is_dir"] and "not a directory" in afile["error"]
    assert f.read_text() == "x"
    assert nvme.evaluate(facts, T).status == Status.FAIL


def test_collect_refuses_block_device():
    dev = next((os.path.join("/dev", n) for n in sorted(os.listdir("/dev"))
                if os.path.exists(os.path.join("/dev", n)) and
                __import__("stat").S_ISBLK(os.stat(os.path.join("/dev", n)).st_mode)), None)
    if dev is None:
        pytest.skip("no block device node in /dev")
    before = os.stat(dev).st_mtime
    facts = nvme.collect(ctx({"nvme_paths": [dev], "nvme_test_bytes": 4 * MiB}))
    (e,) = facts["paths"]
    assert e["kind"] == "block device" and not e["is_dir"] and e["test_bytes"] == 0 and e["write_Bps"] is None
    assert os.stat(dev).st_mtime == before
    assert nvme.evaluate(facts, T).status == Status.FAIL


def test_collect_skips_measurement_when_free_space_fraction_too_small(tmp_path):
    facts = nvme.collect(ctx({"nvme_paths": [str(tmp_path)], "nvme_test_bytes": 16 * MiB,
                              "nvme_max_free_fraction": 1e-12}))
    (e,) = facts["paths"]
    assert e["writable"] and e["measure_skipped"] and e["write_Bps"] is None and e["test_bytes"] == 0
    assert os.listdir(tmp_path) == []
    assert nvme.evaluate(facts, T).status == Status.WARN


def test_collect_on_dev_shm_tmpfs():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="preflight-test-")
    try:
        facts = nvme.collect(ctx({"nvme_paths": [d], "nvme_test_bytes": 16 * MiB}))
        (e,) = facts["paths"]
        assert e["fstype"] == "tmpfs"
        # Kernels >= 6.6 give tmpfs O_DIRECT; older ones refuse it. Either way collect must say which it measured.
        supported = o_direct_supported(d)
        assert e["direct"] == supported and (e["direct_error"] is None) == supported
        assert e["write_Bps"] > 0 and e["read_Bps"] > 0
        assert os.listdir(d) == []
        expected = Status.FAIL if not supported else Status.PASS
        o = nvme.evaluate(facts, {"nvme": dict(T["nvme"], min_write_gbps=0.0, min_read_gbps=0.0)})
        assert o.status == expected, o.message
    finally:
        shutil.rmtree(d)


def test_collect_dd_timeout_leaves_nothing(tmp_path):
    start = time.monotonic()
    facts = nvme.collect(ctx({"nvme_paths": [str(tmp_path)], "nvme_test_bytes": 4096 * MiB}, seconds=0.1))
    assert time.monotonic() - start < 20
    (e,) = facts["paths"]
    assert e["timed_out"] == "write" and "timed out" in e["error"] and e["write_Bps"] is None
    assert os.listdir(tmp_path) == []
    assert not _dd_children()
    assert nvme.evaluate(facts, T).status in (Status.ERROR, Status.WARN)


def _dd_children():
    me = str(os.getpid())
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z" and nvme.TEST_PREFIX.encode() in cmd:
                out.append(p)
    return out


@pytest.mark.parametrize("signame", ["SIGALRM", "SIGTERM"])
def test_signal_during_dd_leaves_nothing(tmp_path, signame):
    class Stop(Exception):
        pass

    def raise_stop(signum, frame):
        raise Stop(signum)

    sig = getattr(signal, signame)
    old = signal.signal(sig, raise_stop)
    seen = []

    def watch():  # proves the signal really landed while a test file existed
        end = time.monotonic() + 5
        while time.monotonic() < end and not seen:
            seen.extend(n for n in os.listdir(tmp_path) if n.startswith(nvme.TEST_PREFIX))
            time.sleep(0.01)

    w = threading.Thread(target=watch)
    w.start()
    try:
        if sig == signal.SIGALRM:
            signal.setitimer(signal.ITIMER_REAL, 0.4)
        else:
            threading.Timer(0.4, os.kill, (os.getpid(), sig)).start()
        with pytest.raises(Stop):
            nvme.collect(ctx({"nvme_paths": [str(tmp_path)], "nvme_test_bytes": 4096 * MiB}))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(sig, old)
        w.join()
    assert seen, "the test file never appeared: the signal did not interrupt a measurement"
    assert os.listdir(tmp_path) == []
    assert not _dd_children()


def test_no_o_direct_on_real_ramfs_is_detected(tmp_path):
    """ramfs has no O_DIRECT (open() says EINVAL) and reports no size: collect says so and writes no data."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -m not permitted here")
    script = ("import json, os, sys, time\n"
              f"sys.path.insert(0, {str(REPO)!r})\n"
              "from preflight.checks import nvme\n"
              "from preflight.hostside.seams import HostContext\n"
              "d = os.environ['T']\n"
              f"params = dict({nvme.params_from_thresholds(T)!r}, nvme_paths=[d], nvme_test_bytes=8 << 20)\n"
              "f = nvme.collect(HostContext(params, time.monotonic() + 60))\n"
              "print('FACTS=' + json.dumps(f))\n"
              "print('LEFT=' + json.dumps(os.listdir(d)))\n")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec",
                        'mount -t ramfs preflight-ramfs "$T"\nexec "$0" -c "$1"', sys.executable, script],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, T=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    out = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)
    (e,) = json.loads(out["FACTS"])["paths"]
    assert json.loads(out["LEFT"]) == []
    assert e["fstype"] == "ramfs" and e["writable"] and e["direct"] is False
    assert "Invalid argument" in e["direct_error"]
    assert e["free_bytes"] is None and "no size" in e["measure_skipped"] and e["write_Bps"] is None
    o = nvme.evaluate({"paths": [e]}, T)
    assert o.status == Status.FAIL and "does not support O_DIRECT" in o.message and "ramfs" in o.message
    assert "not measured" in o.message
    assert os.listdir(tmp_path) == []


def test_dd_fallback_when_dd_itself_refuses_o_direct(tmp_path, monkeypatch):
    """Where open(O_DIRECT) passes but dd's direct I/O says 'Invalid argument', collect retries buffered.

    No filesystem on this machine behaves like that (tmpfs has O_DIRECT since Linux 6.6), so dd's refusal is
    simulated by a wrapper that fails only when given oflag=/iflag=direct and runs the real dd otherwise.
    """
    real_dd = shutil.which("dd")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "dd"
    wrapper.write_text("#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in oflag=direct*|iflag=direct*)\n"
                       "  echo \"dd: failed to open 'x': Invalid argument\" >&2; exit 1;; esac; done\n"
                       f"exec {real_dd} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    d = tmp_path / "data"
    d.mkdir()
    facts = nvme.collect(ctx({"nvme_paths": [str(d)], "nvme_test_bytes": 8 * MiB}))
    (e,) = facts["paths"]
    assert e["direct"] is False and "Invalid argument" in e["direct_error"]
    assert e["write_Bps"] > 0 and e["read_Bps"] > 0 and e["test_bytes"] == 8 * MiB
    assert os.listdir(d) == []
    relaxed = {"nvme": dict(T["nvme"], require_direct_io=False, min_write_gbps=0.0, min_read_gbps=0.0)}
    o = nvme.evaluate(facts, relaxed)
    assert o.status == Status.WARN and "buffered (not direct)" in o.message
