"""known_hosts read once per run and indexed: hashed entries, @revoked and @cert-authority lines on real sshd hosts.

paramiko's own loader re-parses the whole file for every host and gives up on marker lines; preflight's
index (preflight.transport.known_hosts.KnownHosts) must keep the same accept / refuse / changed-key answers.
"""
from __future__ import annotations

import json
import subprocess

import paramiko

from preflight.transport import KnownHosts
from tests.test_cli_cluster import preflight


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
