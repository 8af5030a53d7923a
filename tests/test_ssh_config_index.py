"""SSHConfigIndex: ssh_config parsed once per run, a host's lookup visits only the sections that can match it.

Every answer must equal paramiko's own full lookup (which visits every section for every host).
"""
from __future__ import annotations

import os

import paramiko
import pytest

from preflight.transport import SSHConfigIndex, SSHOptions, SSHTransport

CONFIG = """\
# literal sections, one with two names, and a name listed twice
Host node01 node01-ib
    HostName 198.18.0.1
    IdentityFile ~/.ssh/node01
Host node02
    HostName 198.18.0.2
    Port 2222
Host node02
    User second-section
    IdentityFile ~/.ssh/node02-b
# wildcards, negation, Match: always visited
Host node0? !node03
    User ops
    IdentityFile ~/.ssh/fleet
Host node03
    HostName 198.18.0.3
Match host node04
    User matched
Host gpu-[ab]
    Port 2200
Host *
    User root
    IdentityFile ~/.ssh/default
    StrictHostKeyChecking yes
"""

NAMES = ["node01", "node01-ib", "node02", "node03", "node04", "node05", "gpu-a", "gpu-c", "other", "node0",
         "NODE01"]


def write(tmp_path, text: str):
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", NAMES)
def test_lookup_equals_paramikos_full_lookup(tmp_path, name):
    path = write(tmp_path, CONFIG)
    index = SSHConfigIndex.shared(path)
    assert dict(index.lookup(name)) == dict(paramiko.SSHConfig.from_path(str(path)).lookup(name))


def test_index_skips_the_other_hosts_sections(tmp_path):
    # 500 literal sections: a lookup hands paramiko its own section and the wildcard ones only.
    text = "".join(f"Host n{i:04d}\n    HostName 10.0.{i // 250}.{i % 250}\n" for i in range(500))
    path = write(tmp_path, text + "Host *\n    User root\n")
    index = SSHConfigIndex.shared(path)
    assert index._by_name["n0123"] == [124]  # section 0 is paramiko's implicit global block
    assert len(index._always) == 2
    for name in ("n0000", "n0123", "n0499", "n9999"):
        assert dict(index.lookup(name)) == dict(paramiko.SSHConfig.from_path(str(path)).lookup(name))


def test_canonicalization_falls_back_to_the_full_lookup(tmp_path):
    text = ("Host node01\n    HostName 198.18.0.1\nHost *.example\n    User canon\n"
            "Host *\n    CanonicalizeHostname yes\n    CanonicalDomains example\n")
    path = write(tmp_path, text)
    index = SSHConfigIndex.shared(path)
    assert index._full
    assert dict(index.lookup("node01")) == dict(paramiko.SSHConfig.from_path(str(path)).lookup("node01"))


def test_parsed_once_and_again_when_the_file_changes(tmp_path):
    path = write(tmp_path, "Host a\n    Port 1\n")
    first = SSHConfigIndex.shared(path)
    assert SSHConfigIndex.shared(path) is first
    path.write_text("Host a\n    Port 2\n# longer, so the size differs even within one mtime tick\n")
    os.utime(path, ns=(1, 1))
    second = SSHConfigIndex.shared(path)
    assert second is not first
    assert second.lookup("a")["port"] == "2"


def test_resolve_uses_the_index_and_a_bad_config_is_one_clear_error(tmp_path):
    path = write(tmp_path, CONFIG)
    host, port, user, keys = SSHTransport("node02", SSHOptions(config_path=str(path)))._resolve()
    assert (host, port, user) == ("198.18.0.2", 2222, "second-section")  # the first value obtained wins
    assert keys[0].endswith("/.ssh/node02-b")
    bad = write(tmp_path, "Host a\n  =novalue\n")
    with pytest.raises(Exception) as err:
        SSHTransport("a", SSHOptions(config_path=str(bad)))._resolve()
    assert "cannot read ssh config" in str(err.value)
