"""Printed fixes are safe to paste: every path or value is one shell word (shlex.quote), and no fix writes to a fixed
name in a directory others can write to (the dd test uses mktemp)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from preflight.checks import iperf3, launcher_ssh, libaio, nvme
from preflight.hostside.outcome import Status
from preflight.config import load_defaults
from tests.test_nvme import entry

T = load_defaults()
EVIL = "/mnt/a b;touch /tmp/pwned-$(id -u)`x`"

NVME_CASES = {
    "missing": dict(exists=False, is_dir=False, writable=False, error="does not exist", kind=None),
    "block_device": dict(is_dir=False, kind="block device", device_mounts=[EVIL + "-mnt"]),
    "block_unmounted": dict(is_dir=False, kind="block device"),
    "unwritable": dict(writable=False, error="Permission denied", test_bytes=0),
    "readonly": dict(writable=False, error="Read-only file system", test_bytes=0, mountpoint=EVIL),
    "no_direct": dict(direct_error="Invalid argument", write_Bps=None),
    "skipped": dict(measure_skipped="too little space", free_bytes=1 << 20),
    "io_error": dict(error="Input/output error"),
    "other_error": dict(error="dd: something odd"),
    "slow": dict(write_Bps=1e8, read_Bps=1e8),
}


def words(fix):
    """The shell words of a fix (its ';', '&&', '|' separated commands flattened)."""
    lex = shlex.shlex(fix, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    return list(lex)


@pytest.mark.parametrize("case", sorted(NVME_CASES))
def test_nvme_fix_keeps_an_odd_path_one_word(case):
    out = nvme.evaluate({"paths": [entry(path=EVIL, **NVME_CASES[case])]}, T)
    assert out.status != Status.PASS and out.fix
    toks = words(out.fix)
    assert "touch" not in toks, out.fix
    assert any(EVIL in t for t in toks), out.fix
    assert not any(t.startswith("/tmp/pwned") for t in toks)


def test_nvme_dd_fix_uses_mktemp_not_a_fixed_name():
    out = nvme.evaluate({"paths": [entry(path="/scratch", **NVME_CASES["other_error"])]}, T)
    assert "mktemp" in out.fix and not re.search(r"\.preflight-ddtest(\s|;|$)", out.fix), out.fix


def test_nvme_dd_fix_leaves_a_planted_symlink_alone(tmp_path):
    """Run the printed fix in a world-writable dir where someone planted the old fixed name as a symlink."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (shared / ".preflight-ddtest").symlink_to(victim)
    fix = nvme.evaluate({"paths": [entry(path=str(shared), **NVME_CASES["other_error"])]}, T).fix
    fix = fix.replace("count=256", "count=1").replace("oflag=direct,nofollow", "oflag=nofollow")  # tmpfs: no O_DIRECT
    subprocess.run(["sh", "-c", fix], capture_output=True, timeout=60)
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in shared.iterdir()) == [".preflight-ddtest"]  # and the fix cleaned up after itself


def test_libaio_fix_quotes_the_library_path():
    bad = {"path": "/opt/x y;id/libaio.so.1", "realpath": "/opt/x y;id/libaio.so.1.0.2", "loadable": False,
           "load_error": "invalid ELF header", "size": 0, "exists": True, "name": "libaio.so.1"}
    facts = {"runtime": [bad], "dev_links": [], "headers": [], "compiler": {"argv": ["cc"], "path": "/usr/bin/cc"},
             "search_dirs": ["/usr/lib"], "os_release": {"ID": "debian"}}
    out = libaio.evaluate(facts, T)
    assert f"ls -lL {shlex.quote(bad['path'])};" in out.fix, out.fix
    assert words(out.fix)[:3] == ["ls", "-lL", bad["path"]]
    mounted = libaio.evaluate(dict(facts, runtime=[dict(bad, mounted_over=True)]), T)
    assert words(mounted.fix)[:2] == ["umount", bad["realpath"]], mounted.fix


@pytest.mark.parametrize("kind", ["auth", "host_key_unknown", "host_key_changed"])
def test_launcher_ssh_fix_quotes_the_host(kind):
    _, fix = launcher_ssh.explain(kind, "a;reboot", "master", "Permission denied (publickey).")
    commands = re.findall(r"(?:ssh-copy-id|ssh-keyscan -H|ssh-keygen -R) (\S+)", fix)
    assert commands and all(c == "'a;reboot'" for c in commands), fix


def test_iperf3_fix_never_prints_an_odd_device():
    fix = iperf3._fix_slow("node1", "$(reboot)")
    assert "$(reboot)" not in fix and "<nic>" in fix


def test_gpu_fixes_quote_the_host_reported_index_and_bus_id():
    from preflight.checks import gpu
    fake = {"index": "0;reboot", "uuid": "GPU-x", "pci_bus_id": "00:01.0;reboot", "handle_error": "Unknown Error"}
    fixes = " ".join(f.fix for f in gpu._gpu_findings(fake, T))
    assert "-i '0;reboot'" in fixes and not re.search(r"-i 0;reboot", fixes), fixes
