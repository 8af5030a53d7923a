"""preflight/inputs.py: input files are regular, bounded and UTF-8, and never block or exhaust memory."""
import os

import pytest

from preflight.inputs import InputError, read_text_limited


def test_reads_a_small_file(tmp_path):
    p = tmp_path / "f"
    p.write_text("a slots=1\n")
    assert read_text_limited(str(p), "--hostfile", 100) == "a slots=1\n"


@pytest.mark.parametrize("path, kind", [("/dev/zero", "character device"), ("/dev/urandom", "character device")])
def test_devices_are_refused_by_name(path, kind):
    with pytest.raises(InputError, match=f"--config {path}: not a regular file \\(a {kind}\\)"):
        read_text_limited(path, "--config", 1 << 20)


def test_the_null_device_reads_as_empty_as_openssh_reads_dash_F_dev_null(tmp_path):
    assert read_text_limited("/dev/null", "--ssh-config", 1 << 20) == ""
    twin = tmp_path / "null"  # another node of the same device is the null device too; a name proves nothing
    os.mknod(twin, 0o600 | __import__("stat").S_IFCHR, os.stat("/dev/null").st_rdev)
    assert read_text_limited(str(twin), "--ssh-config", 1 << 20) == ""


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "p")  # no writer: a plain open() would wait forever
    with pytest.raises(InputError, match="FIFO"):
        read_text_limited(str(tmp_path / "p"), "--hostfile", 1 << 20)


def test_size_cap(tmp_path):
    p = tmp_path / "big"
    p.write_bytes(b"x" * 2049)
    with pytest.raises(InputError, match="2049 bytes"):
        read_text_limited(str(p), "--deepspeed-config", 2048)
    assert len(read_text_limited(str(p), "--deepspeed-config", 4096)) == 2049


def test_open_errors_stay_oserrors_for_the_callers_wording(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_text_limited(str(tmp_path / "nope"), "--hostfile", 10)
    with pytest.raises(IsADirectoryError):
        read_text_limited(str(tmp_path), "--hostfile", 10)
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(UnicodeDecodeError):
        read_text_limited(str(tmp_path / "bin"), "--hostfile", 10)
