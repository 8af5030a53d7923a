"""Printed fixes are safe to paste: every path or value is one shell word (shlex.quote), and no fix writes to a fixed
name in a directory others can write to (the dd test uses mktemp)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

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
    fix = iperf3.fix_slow("node1", "$(reboot)")
    assert "$(reboot)" not in fix and "<nic>" in fix


def test_gpu_fixes_quote_the_host_reported_index_and_bus_id():
    from preflight.checks import gpu
    fake = {"index": "0;reboot", "uuid": "GPU-x", "pci_bus_id": "00:01.0;reboot", "handle_error": "Unknown Error"}
    fixes = " ".join(f.fix for f in gpu._gpu_findings(fake, T))
    assert "-i '0;reboot'" in fixes and not re.search(r"-i 0;reboot", fixes), fixes


# --- firewall fixes for the tool the host runs, from its recorded outputs (issue 30) --------------------------

# What each tool prints, recorded from its documented output formats (firewalld/ufw do not run in a namespace
# here). `nft -j list ruleset` of a host whose iptables-nft manages the filter table (xt expressions).
NFT_EMPTY = '{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", ' \
            '"json_schema_version": 1}}]}'
NFT_IPTABLES_NFT = json.dumps({"nftables": [
    {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
    {"table": {"family": "ip", "name": "filter", "handle": 1}},
    {"chain": {"family": "ip", "table": "filter", "name": "INPUT", "handle": 1, "type": "filter", "hook": "input",
               "prio": 0, "policy": "drop"}},
    {"rule": {"family": "ip", "table": "filter", "chain": "INPUT", "handle": 4,
              "expr": [{"xt": {"type": "match", "name": "conntrack"}}, {"counter": {"packets": 0, "bytes": 0}},
                       {"accept": None}]}}]})
OUTPUTS = {
    "firewalld": {"firewall-cmd --state": (0, "running\n"),
                  "firewall-cmd --get-zone-of-interface=eth0": (0, "internal\n"),
                  "firewall-cmd --get-default-zone": (0, "public\n"),
                  "ip -o addr show": (0, "2: eth0    inet 10.0.0.3/24 brd 10.0.0.255 scope global eth0\\       "
                                         "valid_lft forever preferred_lft forever\n"),
                  "nft -j list ruleset": (0, NFT_EMPTY)},
    "ufw": {"firewall-cmd --state": (252, "not running\n"),
            "ufw status": (0, "Status: active\n\nTo                         Action      From\n"
                              "--                         ------      ----\n22/tcp                     ALLOW       "
                              "Anywhere\n"),
            "nft -j list ruleset": (0, NFT_EMPTY)},
    "iptables-legacy": {"nft -j list ruleset": (0, NFT_EMPTY), "iptables --version": (0, "iptables v1.8.9 (legacy)\n"),
                        "iptables -S INPUT": (0, "-P INPUT DROP\n-A INPUT -i lo -j ACCEPT\n"
                                                 "-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT\n")},
    "iptables-nft": {"nft -j list ruleset": (0, NFT_IPTABLES_NFT),
                     "iptables --version": (0, "iptables v1.8.9 (nf_tables)\n"),
                     "iptables -S INPUT": (0, "-P INPUT DROP\n-A INPUT -m conntrack --ctstate ESTABLISHED -j ACCEPT\n")},
    "unreadable": {"nft -j list ruleset": (1, "Error: Operation not permitted\n")},
}
EXPECTED = {
    "firewalld": ["firewall-cmd --zone=internal --add-port=1024-65535/tcp",
                  "firewall-cmd --zone=internal --permanent --add-port=1024-65535/tcp"],
    "ufw": ["ufw allow from 10.0.0.0/24 proto tcp to any port 1024:65535"],
    "iptables-legacy": ["iptables -I INPUT -p tcp -s 10.0.0.0/24 --dport 1024:65535 -j ACCEPT"],
    "iptables-nft": ["iptables -I INPUT -p tcp -s 10.0.0.0/24 --dport 1024:65535 -j ACCEPT"],
}


def fake_tools(folder, outputs, log):
    """Each tool of ``outputs`` as a script that prints its recorded output for its argv and logs the argv it got
    (one line of shell words), so that a pasted fix can be checked word for word; every other argv fails."""
    folder.mkdir(exist_ok=True)
    by_tool = {}
    for argv, (rc, out) in outputs.items():
        by_tool.setdefault(argv.split()[0], {})[argv] = (rc, out)
    for tool in set(by_tool) | {"firewall-cmd", "ufw", "nft", "iptables", "ip"}:
        cases = "\n".join(f"    {shlex.quote(argv)}) printf %s {shlex.quote(out)}; exit {rc};;"
                          for argv, (rc, out) in by_tool.get(tool, {}).items())
        script = (f"#!/bin/bash\nprintf '%q ' {tool} \"$@\" >> {shlex.quote(str(log))}; echo >> "
                  f"{shlex.quote(str(log))}\ncase \"{tool} $*\" in\n{cases}\n    *) exit 3;;\nesac\n")
        (folder / tool).write_text(script)
        (folder / tool).chmod(0o755)
    return folder


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_firewall_fix_for_the_tool_the_host_runs(kind, tmp_path, monkeypatch):
    from preflight.hostside import fixes
    bin_dir = fake_tools(tmp_path / "bin", OUTPUTS[kind], tmp_path / "argv.log")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    state = fixes.read_firewall(["10.0.0.3"])
    fix = fixes.firewall_fix("node03", state, ["10.0.0.0/24"], "1024-65535")
    lines = [ln[2:] for ln in fix.splitlines() if ln.startswith("  ")]
    if kind == "unreadable":
        assert "could not be read" in fix and "Operation not permitted" in fix, fix
        assert not [ln for ln in lines if ln.startswith("nft ")], fix  # no nft line naming a chain it never saw
        return
    assert lines == EXPECTED[kind], fix
    # Pasted: each line is one command whose tool gets exactly the intended words.
    (tmp_path / "argv.log").write_text("")
    for line in lines:
        subprocess.run(["bash", "-c", line], env=dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin"), timeout=30)
    logged = [shlex.split(x) for x in (tmp_path / "argv.log").read_text().splitlines()]
    assert logged == [shlex.split(line) for line in lines]


def test_firewall_fix_never_pastes_a_host_reported_name():
    from preflight.hostside import fixes
    odd = {"root": True, "nft": {"read": True, "drops": [
        {"family": "inet", "table": "x;reboot", "chain": "input", "compat": False},
        {"family": "inet", "table": "fw", "chain": "in put", "compat": False},
        {"family": "inet", "table": "site", "chain": "inbound", "compat": False}]}}
    fix = fixes.firewall_fix("node03", odd, ["10.0.0.0/24"], "1024-65535")
    assert "  nft insert rule inet site inbound ip saddr 10.0.0.0/24 tcp dport 1024-65535 accept" in fix.splitlines()
    assert "reboot" not in [w for line in fix.splitlines() if line.startswith("  nft") for w in words(line)]
    zone = {"root": True, "firewalld": {"running": True, "zone": "$(reboot)"}}
    fix = fixes.firewall_fix("node03", zone, ["10.0.0.0/24"], "29500")
    assert "--zone" not in fix and "firewall-cmd --add-port=29500/tcp" in fix, fix
    # A non-root agent read it with sudo: the lines say sudo.
    assert fixes.firewall_fix("n", {"root": False, "ufw": {"active": True}}, ["10.0.0.1"], "29500").endswith(
        "\n  sudo ufw allow from 10.0.0.1 proto tcp to any port 29500")


def test_nft_chains_that_drop_from_the_real_ruleset_shape():
    """A recorded `nft -j list ruleset`: a site table whose chain drops by rule, an iptables-nft table by policy,
    an ip6 table (not for IPv4 sources), a regular chain (no hook)."""
    from preflight.hostside.fixes import dropping_input_chains
    ruleset = json.loads((Path(__file__).parent / "fixtures" / "nft-ruleset.json").read_text())
    got = [(c["family"], c["table"], c["chain"]) for c in dropping_input_chains(ruleset)]
    assert got == [("inet", "site_fw", "inbound"), ("ip", "filter", "INPUT")]
    got6 = [(c["family"], c["table"], c["chain"]) for c in dropping_input_chains(ruleset, v6=True)]
    assert got6 == [("inet", "site_fw", "inbound"), ("ip6", "v6", "inp")]


def test_a_non_root_agent_reads_the_ruleset_through_sudo_n_and_the_lines_say_sudo(tmp_path, monkeypatch):
    """nft needs root to list the ruleset: a non-root agent asks `sudo -n` (never a password prompt); the fix's
    lines then start with sudo."""
    from preflight.hostside import fixes
    ruleset = (Path(__file__).parent / "fixtures" / "nft-ruleset.json").read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nft").write_text("#!/bin/bash\nif [ \"$PF_AS_ROOT\" != 1 ]; then echo 'Error: Operation not "
                                 f"permitted' >&2; exit 1; fi\nprintf %s {shlex.quote(ruleset)}\n")
    (bin_dir / "sudo").write_text("#!/bin/bash\n[ \"$1\" = -n ] || exit 9\nshift\nPF_AS_ROOT=1 exec \"$@\"\n")
    for tool in ("nft", "sudo"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    state = fixes.read_firewall()
    assert state["root"] is False and state["nft"]["read"], state
    fix = fixes.firewall_fix("node03", state, ["10.0.0.0/24"], "1024-65535")
    assert [ln for ln in fix.splitlines() if ln.startswith("  ")] == [
        "  sudo nft insert rule inet site_fw inbound ip saddr 10.0.0.0/24 tcp dport 1024-65535 accept",
        "  sudo nft insert rule ip filter INPUT ip saddr 10.0.0.0/24 tcp dport 1024-65535 accept"], fix


def test_prebuild_install_pins_a_valid_version_and_quotes_every_word():
    """The pre-build fix reinstalls the host's DeepSpeed version (issue 30); a version or variable a host reported
    that is not one is left out of the command, never pasted into a shell."""
    from preflight.hostside.fixes import prebuild_install, prebuild_phrase
    opts = "-m pip install --force-reinstall --no-deps --no-cache-dir"
    assert prebuild_install("/opt/v/bin/python", ["DS_BUILD_OPS"], "0.14.0+cu121") == \
        f"DS_BUILD_OPS=1 /opt/v/bin/python {opts} deepspeed==0.14.0+cu121"
    assert prebuild_install("/opt/my venv/python", ["DS_BUILD_CPU_ADAM", "DS_BUILD_CPU_ADAM"], None) == \
        f"DS_BUILD_CPU_ADAM=1 '/opt/my venv/python' {opts} deepspeed"
    assert prebuild_install("/p", ["DS_BUILD_OPS"], "0.19.8; rm -rf ~") == f"DS_BUILD_OPS=1 /p {opts} deepspeed"
    assert prebuild_install("/p", ["$(id)", "DS_BUILD_FUSED_ADAM"], "1.0rc1") == \
        f"DS_BUILD_FUSED_ADAM=1 /p {opts} deepspeed==1.0rc1"
    assert prebuild_phrase("relative/python", ["DS_BUILD_OPS"], "0.19.8") == \
        "DS_BUILD_OPS=1 the job's interpreter's `-m pip install --force-reinstall --no-deps --no-cache-dir " \
        "deepspeed==0.19.8`"
