"""libaio: parsers on the recorded H100 host, evaluate on recorded and hand-made facts, collect for real here.

The runtime-only and unloadable hosts are made real, without touching this machine, inside a private mount
namespace (``unshare -m``): an overlay hides libaio.so/libaio.h, or an empty file is bind-mounted over the library.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from preflight.checks import libaio
from preflight.hostside.seams import HostContext
from preflight.hostside.outcome import Status
from preflight.config import load_defaults

REPO = Path(__file__).resolve().parents[3]
from tests.h100 import read as fixture
T = load_defaults()


def ctx(params=None, seconds=60.0) -> HostContext:
    return HostContext(dict(params or {}), time.monotonic() + seconds)


def base_facts(**over):
    """A healthy Debian host, field by field as collect() writes them; tests break one thing at a time."""
    facts = {
        "os_release": {"ID": "debian", "VERSION_ID": "12"},
        "ldconfig": [{"name": "libaio.so.1", "arch": "libc6,x86-64", "path": "/lib/x86_64-linux-gnu/libaio.so.1"},
                     {"name": "libaio.so", "arch": "libc6,x86-64", "path": "/lib/x86_64-linux-gnu/libaio.so"}],
        "find_library": "libaio.so.1", "soname_error": None,
        "runtime": [{"path": "/lib/x86_64-linux-gnu/libaio.so.1", "realpath": "/usr/lib/x86_64-linux-gnu/libaio.so.1.0.2",
                     "name": "libaio.so.1", "size": 14184, "exists": True, "mounted_over": False,
                     "loadable": True, "load_error": None}],
        "dev_links": [{"path": "/lib/x86_64-linux-gnu/libaio.so", "realpath": "/usr/lib/x86_64-linux-gnu/libaio.so.1.0.2",
                       "exists": True}],
        "headers": ["/usr/include/libaio.h"], "search_dirs": ["/lib/x86_64-linux-gnu", "/lib"],
        "include_dirs": ["/usr/include"],
        "compiler": {"argv": ["gcc"], "path": "/usr/bin/gcc", "tried": ["gcc"]},
        "cflags": "", "ldflags": "",
        "link_probe": {"argv": ["gcc"], "rc": 0, "ok": True, "stderr": "", "timed_out": False},
        "header_probe": {"argv": ["gcc"], "rc": 0, "ok": True, "stderr": "", "timed_out": False},
        "errors": [],
    }
    facts.update(over)
    return facts


LD_MISSING = ("/usr/bin/ld: cannot find -laio: No such file or directory\n"
              "collect2: error: ld returned 1 exit status\n")
NO_HEADER = ("/tmp/x/header.c:1:10: fatal error: libaio.h: No such file or directory\n"
             "    1 | #include <libaio.h>\n      |          ^~~~~~~~~~\ncompilation terminated.\n")


def failed(stderr):
    return {"argv": ["gcc"], "rc": 1, "ok": False, "stderr": stderr, "timed_out": False}


# --- parsers ---------------------------------------------------------------------------------

def test_parse_ldconfig_on_recorded_cache_listing():
    text = fixture("ldconfig-nccl.txt")
    nccl = libaio.parse_ldconfig(text, "libnccl.so")
    assert [e["name"] for e in nccl] == ["libnccl.so.2", "libnccl.so"]
    assert nccl[0]["path"] == "/lib/x86_64-linux-gnu/libnccl.so.2" and nccl[0]["arch"] == "libc6,x86-64"
    # The recorded host has no libaio, and the parser must not mistake other libraries for it.
    assert libaio.parse_ldconfig(text) == []
    assert len(libaio.parse_ldconfig(text, "lib")) == len([ln for ln in text.splitlines() if "=>" in ln])


def test_parse_ldconfig_t64_name():
    text = "\tlibaio.so.1t64 (libc6,x86-64) => /lib/x86_64-linux-gnu/libaio.so.1t64\n"
    assert libaio.parse_ldconfig(text) == [{"name": "libaio.so.1t64", "arch": "libc6,x86-64",
                                            "path": "/lib/x86_64-linux-gnu/libaio.so.1t64"}]


def test_parse_os_release_recorded_host_is_ubuntu_apt():
    osr = libaio.parse_os_release(fixture("os-release.txt"))
    assert osr["ID"] == "ubuntu" and osr["ID_LIKE"] == "debian" and osr["VERSION_ID"] == "24.04"
    assert osr["PRETTY_NAME"] == "Ubuntu 24.04.3 LTS"
    hint = libaio.package_hint(osr, ["libaio.so.1t64"])
    assert hint["manager"] == "apt" and hint["dev"] == "libaio-dev" and hint["runtime"] == "libaio1t64"


@pytest.mark.parametrize("osr,manager,dev", [
    ({"ID": "rocky", "ID_LIKE": "rhel centos fedora", "VERSION_ID": "9.3"}, "dnf", "libaio-devel"),
    ({"ID": "centos", "ID_LIKE": "rhel fedora", "VERSION_ID": "7"}, "yum", "libaio-devel"),
    ({"ID": "amzn", "ID_LIKE": "centos rhel fedora", "VERSION_ID": "2"}, "yum", "libaio-devel"),
    ({"ID": "arch"}, "pacman", "libaio"),
    ({"ID": "opensuse-leap", "ID_LIKE": "suse opensuse", "VERSION_ID": "15.5"}, "zypper", "libaio-devel"),
    ({"ID": "pop", "ID_LIKE": "ubuntu debian"}, "apt", "libaio-dev"),
])
def test_package_hint_per_distribution(osr, manager, dev):
    hint = libaio.package_hint(osr)
    assert hint["manager"] == manager and hint["dev"] == dev
    assert dev in hint["install_dev"] and hint["install_dev"].split()[0] in (manager, "apt-get")


def test_first_error_line_and_flag_dirs():
    assert libaio.first_error_line(LD_MISSING) == "/usr/bin/ld: cannot find -laio: No such file or directory"
    assert "libaio.h: No such file" in libaio.first_error_line(NO_HEADER)
    assert libaio.first_error_line("") == ""
    assert libaio.flag_dirs("-O2 -L/opt/aio/lib -L /x/lib64 -lfoo", "-L") == ["/opt/aio/lib", "/x/lib64"]
    assert libaio.flag_dirs("-I/opt/aio/include", "-I") == ["/opt/aio/include"]


def test_parse_mountpoints_decodes_escapes():
    text = "36 35 98:0 /mnt1 /mnt/with\\040space rw - ext3 /dev/root rw\n"
    assert libaio.parse_mountpoints(text) == ["/mnt/with space"]


# --- evaluate --------------------------------------------------------------------------------

def h100_facts():
    """The recorded H100 host: Ubuntu 24.04, no libaio in the ldconfig cache, gcc present (DeepSpeed JIT works)."""
    return base_facts(os_release=libaio.parse_os_release(fixture("os-release.txt")),
                      ldconfig=libaio.parse_ldconfig(fixture("ldconfig-nccl.txt")), find_library=None,
                      runtime=[], dev_links=[], headers=[], link_probe=failed(LD_MISSING),
                      header_probe=failed(NO_HEADER))


def test_h100_fixture_host_without_libaio_fails():
    # The recorded ds_report on that host agrees: async_io is not compatible for lack of libaio.
    report = re.sub(r"\x1b\[[0-9;]*m", "", fixture("ds_report.txt"))
    assert re.search(r"^async_io \.+ \[NO\] \.+ \[NO\]$", report, re.M)
    o = libaio.evaluate(h100_facts(), T)
    assert o.status == Status.FAIL
    assert "not installed" in o.message and "libaio-dev" in o.message
    assert "apt-get" in o.fix and "libaio-dev" in o.fix


def test_runtime_only_is_the_async_io_no_case():
    rt = [{"path": "/lib/x86_64-linux-gnu/libaio.so.1t64", "realpath": "/usr/lib/x86_64-linux-gnu/libaio.so.1t64.0.2",
           "name": "libaio.so.1t64", "size": 14200, "exists": True, "mounted_over": False, "loadable": True,
           "load_error": None}]
    f = base_facts(os_release={"ID": "ubuntu", "ID_LIKE": "debian", "VERSION_ID": "24.04"}, runtime=rt,
                   find_library="libaio.so.1t64", dev_links=[], headers=[], link_probe=failed(LD_MISSING),
                   header_probe=failed(NO_HEADER))
    o = libaio.evaluate(f, T)
    assert o.status == Status.FAIL
    assert "installed but async_io [NO]" in o.message
    assert "/lib/x86_64-linux-gnu/libaio.so.1t64" in o.message
    assert "no libaio.so link" in o.message and "no libaio.h" in o.message
    assert "cannot find -laio" in o.message
    assert "apt-get install -y libaio-dev" in o.fix


def test_runtime_only_without_compiler_fails_and_names_both_packages():
    f = base_facts(dev_links=[], headers=[], compiler={"argv": None, "path": None, "tried": ["cc", "gcc", "clang"]},
                   link_probe=None, header_probe=None, os_release={"ID": "rocky", "VERSION_ID": "9"})
    o = libaio.evaluate(f, T)
    assert o.status == Status.FAIL and "installed but async_io [NO]" in o.message
    assert "dnf install -y libaio-devel" in o.fix and "gcc" in o.fix


def test_dangling_dev_link_counts_as_missing():
    f = base_facts(dev_links=[{"path": "/usr/lib/libaio.so", "realpath": "/usr/lib/libaio.so.1.0.1",
                               "exists": False}], link_probe=failed(LD_MISSING))
    o = libaio.evaluate(f, T)
    assert o.status == Status.FAIL and "no libaio.so link" in o.message and "no libaio.h" not in o.message


def test_present_but_unloadable_library_fails():
    rt = dict(base_facts()["runtime"][0], size=0, mounted_over=True, loadable=False,
              load_error="/lib/x86_64-linux-gnu/libaio.so.1: file too short")
    f = base_facts(runtime=[rt], link_probe=failed("/usr/bin/ld: /lib/x86_64-linux-gnu/libaio.so: file too short\n"
                                                   "collect2: error: ld returned 1 exit status\n"))
    o = libaio.evaluate(f, T)
    assert o.status == Status.FAIL
    assert "cannot be loaded" in o.message and "file too short" in o.message and "0 bytes" in o.message
    assert "umount /usr/lib/x86_64-linux-gnu/libaio.so.1.0.2" in o.fix and "--reinstall -y libaio1" in o.fix


def test_wrong_elf_class_copy_is_ignored():
    bad32 = {"path": "/usr/lib/i386-linux-gnu/libaio.so.1", "realpath": "/usr/lib/i386-linux-gnu/libaio.so.1.0.2",
             "name": "libaio.so.1", "size": 13000, "exists": True, "mounted_over": False, "loadable": False,
             "load_error": "/usr/lib/i386-linux-gnu/libaio.so.1: wrong ELF class: ELFCLASS32"}
    f = base_facts(runtime=base_facts()["runtime"] + [bad32])
    assert libaio.evaluate(f, T).status == Status.PASS


def test_dev_present_but_link_fails_shows_compiler_line():
    err = "/usr/bin/ld: skipping incompatible /opt/aio/lib/libaio.so when searching for -laio\n" + LD_MISSING
    f = base_facts(link_probe=failed(err), ldflags="-L/opt/aio/lib")
    o = libaio.evaluate(f, T)
    assert o.status == Status.FAIL
    assert "does not link with -laio" in o.message and "cannot find -laio" in o.message
    assert "CFLAGS|LDFLAGS" in o.fix and "-laio" in o.fix and "CFLAGS/LDFLAGS" in o.message


def test_header_present_but_broken_fails():
    f = base_facts(header_probe=failed("/usr/include/libaio.h:40:1: error: unknown type name 'x'\n"))
    o = libaio.evaluate(f, T)
    assert o.status == Status.FAIL and "<libaio.h>" in o.message and "unknown type name" in o.message


def test_no_compiler_warns_cannot_confirm():
    f = base_facts(compiler={"argv": None, "path": None, "tried": ["cc", "gcc", "clang"]}, link_probe=None,
                   header_probe=None)
    o = libaio.evaluate(f, T)
    assert o.status == Status.WARN
    assert "cannot confirm" in o.message and "JIT" in o.message and "cc, gcc, clang" in o.message
    assert o.fix == "apt-get install -y gcc"


def test_compiler_timeout_is_error_not_fail():
    f = base_facts(link_probe={"argv": ["gcc"], "rc": 124, "ok": False, "stderr": "gcc: timed out",
                               "timed_out": True})
    o = libaio.evaluate(f, T)
    assert o.status == Status.ERROR and "timed out" in o.message


def test_all_good_passes_with_paths():
    o = libaio.evaluate(base_facts(), T)
    assert o.status == Status.PASS
    assert "/lib/x86_64-linux-gnu/libaio.so.1" in o.message and "/usr/include/libaio.h" in o.message
    assert o.metrics["link_probe_ok"] is True and o.metrics["package"] == "libaio-dev"


# --- collect on this machine -----------------------------------------------------------------

def _system_has_libaio_dev():
    return (shutil.which("gcc") or shutil.which("cc")) and any(
        os.path.exists(os.path.join(d, "libaio.h")) for d in ("/usr/include", "/usr/local/include"))


def test_collect_here_passes_and_is_json():
    if not _system_has_libaio_dev():
        pytest.skip("this machine lacks libaio-dev or a C compiler")
    facts = libaio.collect(ctx())
    json.loads(json.dumps(facts))
    assert facts["runtime"] and all(r["loadable"] for r in facts["runtime"] if "ELFCLASS32" not in
                                    (r["load_error"] or ""))
    assert facts["link_probe"]["ok"] and facts["header_probe"]["ok"]
    assert any(os.path.samefile(h, "/usr/include/libaio.h") for h in facts["headers"]) or \
        not os.path.exists("/usr/include/libaio.h")
    # No probe directory may outlive collect.
    assert not os.path.exists(os.path.dirname(facts["link_probe"]["argv"][-4]))
    o = libaio.evaluate(facts, T)
    assert o.status == Status.PASS, o.message


@pytest.fixture
def slow_compiler(tmp_path, monkeypatch):
    """CC is a compiler that hangs 30 s first; tempfile's directory is a fresh one. Returns (compiler, directory)."""
    if not _system_has_libaio_dev():
        pytest.skip("this machine lacks libaio-dev or a C compiler")
    slow = tmp_path / "slow-cc"
    slow.write_text("#!/bin/sh\nsleep 30\nexec gcc \"$@\"\n")
    slow.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return slow, scratch


def test_collect_compile_timeout_leaves_nothing(slow_compiler):
    _, scratch = slow_compiler
    start = time.monotonic()
    facts = libaio.collect(ctx(seconds=0.1))  # every command gets the 0.5 s floor
    assert time.monotonic() - start < 15
    assert facts["link_probe"]["timed_out"] and facts["header_probe"]["timed_out"]
    assert os.listdir(scratch) == []
    assert libaio.evaluate(facts, T).status == Status.ERROR


def _children_running(word: str):
    me = str(os.getpid())
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            st = Path(f"/proc/{p}/stat").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = st.rsplit(")", 1)[1].split()
        if fields[1] == me and fields[0] != "Z" and word in cmd:
            found.append(p)
    return found


@pytest.mark.parametrize("signame", ["SIGALRM", "SIGTERM"])
def test_collect_signal_during_compile_leaves_nothing(slow_compiler, signame):
    slow, scratch = slow_compiler

    class Stop(Exception):
        pass

    def raise_stop(signum, frame):
        raise Stop(signum)

    sig = getattr(signal, signame)
    old = signal.signal(sig, raise_stop)
    try:
        if sig == signal.SIGALRM:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
        else:
            import threading
            threading.Timer(1.0, os.kill, (os.getpid(), sig)).start()
        with pytest.raises(Stop):
            libaio.collect(ctx())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(sig, old)
    assert os.listdir(scratch) == []
    assert _children_running(str(slow)) == []


# --- real broken hosts in a private mount namespace ------------------------------------------

def _mount_ns_ok() -> str:
    if os.geteuid() != 0:
        return "needs root for a private mount namespace"
    if not shutil.which("unshare"):
        return "needs unshare(1)"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if r.returncode != 0:
        return f"unshare -m not permitted here: {r.stderr.decode().strip()}"
    return ""


def _real_libaio():
    """(runtime library realpath, its directory, libaio.h directory) of this machine's libaio-dev."""
    facts = libaio.collect(ctx())
    rt = [r for r in facts["runtime"] if r["loadable"]]
    if not rt or not facts["dev_links"] or not facts["headers"] or not facts["link_probe"] \
            or not facts["link_probe"]["ok"]:
        pytest.skip("needs libaio-dev and a C compiler on this machine")
    real = rt[0]["realpath"]
    return real, os.path.dirname(real), os.path.dirname(os.path.realpath(facts["headers"][0])), facts


def _collect_in_ns(setup: str, tmp: Path) -> dict:
    reason = _mount_ns_ok()
    if reason:
        pytest.skip(reason)
    script = ("import json, sys, time\n"
              f"sys.path.insert(0, {str(REPO)!r})\n"
              "from preflight.checks import libaio\n"
              "from preflight.hostside.seams import HostContext\n"
              "print('FACTS=' + json.dumps(libaio.collect(HostContext({}, time.monotonic() + 60))))\n")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-ec",
                        setup + '\nexec "$0" -c "$1"', sys.executable, script],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, T=str(tmp)))
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FACTS=")][-1]
    return json.loads(line[len("FACTS="):])


def test_runtime_only_host_for_real(tmp_path):
    real, libdir, incdir, before = _real_libaio()
    hide = [n for n in os.listdir(libdir) if n in ("libaio.so", "libaio.a")]
    setup = "\n".join([
        'mount -t tmpfs preflight-test "$T"',
        'mkdir "$T/lu" "$T/lw" "$T/iu" "$T/iw"',
        *[f'mknod "$T/lu/{n}" c 0 0' for n in hide],
        'mknod "$T/iu/libaio.h" c 0 0',
        f'mount -t overlay preflight-lib -o lowerdir={libdir},upperdir="$T/lu",workdir="$T/lw" {libdir}',
        f'mount -t overlay preflight-inc -o lowerdir={incdir},upperdir="$T/iu",workdir="$T/iw" {incdir}',
    ])
    facts = _collect_in_ns(setup, tmp_path)
    assert facts["runtime"] and all(r["loadable"] for r in facts["runtime"])
    assert not [d for d in facts["dev_links"] if d["exists"]] and facts["headers"] == []
    assert not facts["link_probe"]["ok"] and "-laio" in facts["link_probe"]["stderr"]
    o = libaio.evaluate(facts, T)
    assert o.status == Status.FAIL and "installed but async_io [NO]" in o.message
    assert libaio.package_hint(before["os_release"])["install_dev"] in o.fix
    # The machine itself is untouched.
    assert os.path.exists(os.path.join(libdir, "libaio.so")) and os.path.exists(os.path.join(incdir, "libaio.h"))
    assert os.listdir(tmp_path) == []


def test_library_bind_mounted_over_with_empty_file_for_real(tmp_path):
    real, libdir, incdir, before = _real_libaio()
    size = os.stat(real).st_size
    setup = "\n".join([
        'mount -t tmpfs preflight-test "$T"',
        ': > "$T/empty"',
        f'mount --bind "$T/empty" {real}',
    ])
    facts = _collect_in_ns(setup, tmp_path)
    broken = [r for r in facts["runtime"] if r["realpath"] == real]
    assert broken and broken[0]["size"] == 0 and broken[0]["loadable"] is False and broken[0]["mounted_over"]
    assert "too short" in broken[0]["load_error"]
    o = libaio.evaluate(facts, T)
    assert o.status == Status.FAIL and "cannot be loaded" in o.message and f"umount {real}" in o.fix
    assert os.stat(real).st_size == size and stat.S_ISREG(os.stat(real).st_mode)
