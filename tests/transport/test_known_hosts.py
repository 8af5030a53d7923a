"""known_hosts read once per run and indexed: hashed entries, @revoked and @cert-authority lines on real sshd hosts.

paramiko's own loader re-parses the whole file for every host and gives up on marker lines; preflight's
index (preflight.transport.known_hosts.KnownHosts) must keep the same accept / refuse / changed-key answers.
"""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import paramiko
import pytest

from preflight.transport import KnownHosts
from preflight.transport.known_hosts import (HostKeyPolicy, UnknownHostKey, changed_key_fix, fingerprint,
                                             keyscan_command, remove_command, split_name)
from tests.cli.test_cli_cluster import preflight


def ssh_cells(path):
    return {r["host"]: r for r in json.loads(path.read_text())["results"] if r["check"] == "ssh"}


def test_hashed_known_hosts_are_accepted(cluster3, tmp_path):
    known = tmp_path / "kh"
    known.write_text(cluster3.known_hosts.read_text())
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True)
    assert "|1|" in known.read_text() and cluster3.hosts[0].addresses[0] not in known.read_text()
    out = tmp_path / "r.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf"), "--checks", "python",
                     "--json", out, known_hosts=known)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(c["status"] == "pass" for c in ssh_cells(out).values())


def test_revoked_and_cert_authority_lines(cluster3, tmp_path):
    node01, node02, node03 = cluster3.hosts
    ca = paramiko.ECDSAKey.generate()
    ca_key = f"{ca.get_name()} {ca.get_base64()}"
    known = tmp_path / "kh"
    known.write_text(
        "# node02 is known only through a CA, node03's key is listed but revoked\n"
        f"{node01.known_hosts_line}\n"
        f"@cert-authority * {ca_key}\n"
        f"{node03.known_hosts_line}\n"
        f"@revoked {node03.addresses[0]} {node03.host_key_line}\n")
    out = tmp_path / "r.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf"), "--checks", "python",
                     "--json", out, known_hosts=known)
    assert proc.returncode == 1
    cells = ssh_cells(out)
    assert cells["node01"]["status"] == "pass"
    assert cells["node02"]["status"] == "fail"
    assert "unknown SSH host key" in cells["node02"]["message"] and "@cert-authority" in cells["node02"]["message"]
    assert cells["node03"]["status"] == "fail" and "@revoked" in cells["node03"]["message"]
    # A revoked key is refused even with --accept-new-host-keys, and is not recorded.
    known.write_text(f"@revoked * {node02.host_key_line}\n")
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf2", names=["node02"]),
                     "--checks", "python", "--accept-new-host-keys", "--json", out, known_hosts=known)
    assert proc.returncode == 1
    assert "@revoked" in ssh_cells(out)["node02"]["message"]
    assert known.read_text() == f"@revoked * {node02.host_key_line}\n"


def test_index_lookup_matches_paramiko(tmp_path):
    """Same keys for a name as paramiko's HostKeys: plain, hashed, several names per line, [host]:port."""
    key = paramiko.ECDSAKey.generate()
    text = (f"a.example,10.0.0.1 {key.get_name()} {key.get_base64()}\n"
            f"{paramiko.HostKeys.hash_host('b.example')} {key.get_name()} {key.get_base64()}\n"
            f"[c.example]:2222 {key.get_name()} {key.get_base64()}\n"
            "garbage line\n"
            f"@revoked nothing-else {key.get_name()}\n")
    index = KnownHosts.parse(text)
    for name in ("a.example", "10.0.0.1", "b.example", "[c.example]:2222", "c.example", "nothere"):
        ours = paramiko.HostKeys()
        index.fill(ours, name)
        plain = paramiko.HostKeys()
        for line in text.splitlines()[:3]:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
            for host in entry.hostnames:
                plain.add(host, entry.key.get_name(), entry.key)
        expected = plain.lookup(name)
        got = ours.lookup(name)
        assert (got is None) == (expected is None), name
        if got is not None:
            assert got[key.get_name()].asbytes() == expected[key.get_name()].asbytes()


def commands(fix):
    """The pasteable lines of a fix: those after its prose, indented by two spaces."""
    return [line[2:] for line in fix.splitlines() if line.startswith("  ")]


def test_fingerprint_is_openssh_sha256(tmp_path):
    """The same text as ssh-keygen -lf prints for the key: SHA256:, base64 without padding."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    for pkey in (paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "k")), paramiko.ECDSAKey.generate(),
                 paramiko.RSAKey.generate(bits=2048)):
        pub = tmp_path / f"{pkey.get_name()}.pub"
        pub.write_text(f"{pkey.get_name()} {pkey.get_base64()}\n")
        printed = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True)
        assert printed.stdout.split()[1] == fingerprint(pkey), printed.stdout
        assert fingerprint(pkey).startswith("SHA256:") and "=" not in fingerprint(pkey)


def test_split_name_and_the_commands_for_each_port():
    assert split_name("[198.18.0.2]:2222") == ("198.18.0.2", 2222)
    assert split_name("node01") == ("node01", 22)
    assert split_name("[fe80::1]:2200") == ("fe80::1", 2200)
    known = Path("/tmp/my known_hosts")
    scan = keyscan_command("127.0.0.1", 2222, known)
    assert scan == ("ssh-keygen -F '[127.0.0.1]:2222' -f '/tmp/my known_hosts' >/dev/null || "
                    "ssh-keyscan -p 2222 127.0.0.1 >> '/tmp/my known_hosts'")
    assert keyscan_command("node01", 22, known).endswith("|| ssh-keyscan node01 >> '/tmp/my known_hosts'")
    assert remove_command("127.0.0.2", 2222, known) == "ssh-keygen -R '[127.0.0.2]:2222' -f '/tmp/my known_hosts'"
    assert remove_command("127.0.0.2", 22, known) == "ssh-keygen -R 127.0.0.2 -f '/tmp/my known_hosts'"


def test_unknown_key_fix_names_the_port_and_sha256(tmp_path):
    """The policy as paramiko calls it off port 22 (the name is [host]:port): the fix's command scans that port,
    and the message's fingerprint is OpenSSH's."""
    key = paramiko.ECDSAKey.generate()
    policy = HostKeyPolicy(False, tmp_path / "kh")
    with pytest.raises(UnknownHostKey) as caught:
        policy.missing_host_key(paramiko.SSHClient(), "[127.0.0.1]:2222", key)
    assert fingerprint(key) in str(caught.value) and "SHA256:" in str(caught.value)
    (scan,) = commands(caught.value.fix)
    assert "ssh-keyscan -p 2222 127.0.0.1 >> " in scan and "[127.0.0.1]:2222 >>" not in scan
    assert shlex.split(scan)[-1] == str(tmp_path / "kh")
    assert "ssh-keygen -lf /etc/ssh/ssh_host_ecdsa_key.pub" in caught.value.fix
    assert not (tmp_path / "kh").exists()  # refused: nothing recorded


def test_changed_key_fix_removes_the_bracketed_entry():
    fix = changed_key_fix("[127.0.0.2]:2222", Path("/k/h"), "ssh-ed25519", "SHA256:abc")
    remove, scan = commands(fix)
    assert remove == "ssh-keygen -R '[127.0.0.2]:2222' -f /k/h"
    assert scan == "ssh-keygen -F '[127.0.0.2]:2222' -f /k/h >/dev/null || ssh-keyscan -p 2222 127.0.0.2 >> /k/h"
    assert "in order" in fix and "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub" in fix


def test_changed_host_key_message_shows_sha256_of_both_keys(cluster3, tmp_path):
    """The changed-key message printed MD5 as bare hex; now both keys' fingerprints as OpenSSH prints them."""
    node01, node02 = cluster3.hosts[0], cluster3.hosts[1]
    known = tmp_path / "kh"
    known.write_text(f"{node01.addresses[0]} {node02.host_key_line}\n")  # node01's address, node02's key
    out = tmp_path / "r.json"
    proc = preflight(cluster3, "--hostfile", cluster3.hostfile(tmp_path / "hf", names=["node01"]),
                     "--checks", "python", "--json", out, known_hosts=known)
    assert proc.returncode == 1
    cell = ssh_cells(out)["node01"]
    printed = {}
    for host in (node01, node02):
        pub = tmp_path / f"{host.name}.pub"
        pub.write_text(host.host_key_line + "\n")
        printed[host.name] = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True,
                                            check=True).stdout.split()[1]
    assert f"got ssh-ed25519 {printed['node01']}" in cell["message"], cell["message"]
    assert f"has ssh-ed25519 {printed['node02']}" in cell["message"], cell["message"]
    assert commands(cell["fix"])[0] == f"ssh-keygen -R {node01.addresses[0]} -f {known}"
