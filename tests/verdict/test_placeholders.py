"""The placeholder grep itself (tests/placeholders.py): it finds what causes.py used to print, and passes names."""
import pytest

from tests.placeholders import assert_no_placeholder, placeholders


@pytest.mark.parametrize("text", [
    "node[1-3]::ssh FAILED - unknown SSH host key for ADDRESS (ssh-ed25519 FINGERPRINT)",
    "ssh-keygen -lf <(ssh-keyscan -p 22 ADDRESS) must print FINGERPRINT",
    "node[1-2]::checkpoint FAILED - no such directory; fix: create it on HOST",
    "could not read the clock of HOST",
    "mkdir -p PATH && chmod 1777 PATH",
    "connection to ADDRESS:22 refused",
    "ssh HOST hostname",
    "pre-build it; `ds_report` on {host} lists the ops",
    "waits on {lock['path']} ({age_text(age)} old)",
    "busbw {busbw:.1f} GB/s",
])
def test_placeholders_are_found(text):
    assert placeholders(text)
    with pytest.raises(AssertionError):
        assert_no_placeholder(text)


@pytest.mark.parametrize("text", [
    "no ninja on PATH: the JIT build stops",
    "install pdsh on node01 (on the PATH of the shell that runs deepspeed)",
    "no pdsh on its PATH, so `deepspeed --launcher pdsh` stops",
    "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@",
    "pass the job's config file: --deepspeed-config PATH",
    "CUDA_HOME and CUDA_PATH are unset; NCCL_SOCKET_IFNAME=eth0; export PATH=$PATH:/opt/bin",
    "node01::ssh FAILED - unknown SSH host key for 10.0.0.1 (ssh-ed25519 SHA256:abc)",
    "the host's PATH entry",
    "export LD_LIBRARY_PATH=${CUDA_HOME}/lib64; cp a.{json,bak}",
    '"zero_optimization": {"stage": 3}; nft add rule inet t c tcp dport { 22, 80 } accept',
])
def test_names_pass(text):
    assert_no_placeholder(text)
