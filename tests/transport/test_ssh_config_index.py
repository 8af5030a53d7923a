"""The ssh_config is parsed once per run, and a host's lookup visits only the sections that can match it.

Every answer must equal the lookup over the whole file (which visits every section for every host).
"""
from __future__ import annotations

import os

import pytest

from preflight import sshconfig
from preflight.transport import SSHOptions, SSHTransport, TransportError

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


def whole(config: sshconfig.SSHConfigFile):
    """The same config with its index turned off: every lookup visits every section."""
    config._whole = True
    return config


@pytest.mark.parametrize("name", NAMES)
def test_lookup_equals_the_whole_files_lookup(tmp_path, name):
    path = write(tmp_path, CONFIG)
    indexed = sshconfig.load(str(path))
    assert not indexed._whole
    assert indexed.resolve(name) == whole(sshconfig.SSHConfigFile(str(path), CONFIG)).resolve(name)
    reference = whole(sshconfig.SSHConfigFile(str(path), CONFIG))
    assert indexed.resolve(name, "u", 2022) == reference.resolve(name, "u", 2022)


def test_index_skips_the_other_hosts_sections(tmp_path):
    # 500 literal sections: a lookup hands paramiko its own section and the wildcard ones only.
    text = "".join(f"Host n{i:04d}\n    HostName 10.0.{i // 250}.{i % 250}\n" for i in range(500))
    text += "Host *\n    User root\n"
    indexed = sshconfig.load(str(write(tmp_path, text)))
    assert indexed._by_name["n0123"] == [124]  # section 0 is paramiko's implicit global block
    assert len(indexed._always) == 2
    assert len(indexed._config_for("n0123")._config) == 3
    reference = whole(sshconfig.SSHConfigFile("x", text))
    for name in ("n0000", "n0123", "n0499", "n9999"):
        assert indexed.resolve(name) == reference.resolve(name)
    assert indexed.resolve("n0123").hostname == "10.0.0.123"


def test_canonicalization_uses_the_whole_file(tmp_path):
    text = ("Host node01\n    HostName 198.18.0.1\nHost *.example\n    User canon\n"
            "Host *\n    CanonicalizeHostname yes\n    CanonicalDomains example\n")
    indexed = sshconfig.load(str(write(tmp_path, text)))
    assert indexed._whole
    assert indexed._config_for("node01") is indexed._config


def test_parsed_once_and_again_when_the_file_changes(tmp_path):
    path = write(tmp_path, "Host a\n    Port 1\n")
    first = sshconfig.load(str(path))
    assert sshconfig.load(str(path)) is first
    path.write_text("Host a\n    Port 2\n# longer, so the size differs even within one mtime tick\n")
    os.utime(path, ns=(1, 1))
    second = sshconfig.load(str(path))
    assert second is not first
    assert second.resolve("a").port == 2


def test_route_uses_the_index_and_a_bad_config_is_one_clear_error(tmp_path):
    path = write(tmp_path, CONFIG)
    hop = SSHTransport("node02", SSHOptions(config_path=str(path))).route()[-1]
    assert (hop.hostname, hop.port, hop.user) == ("198.18.0.2", 2222, "second-section")  # first value obtained wins
    assert hop.identity_files[0].endswith("/.ssh/node02-b")
    bad = write(tmp_path, "Host a\n  =novalue\n")
    with pytest.raises(TransportError) as err:
        SSHTransport("a", SSHOptions(config_path=str(bad))).route()
    assert "ssh config" in str(err.value)
