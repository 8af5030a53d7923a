"""Read the user's input files (hostfile, --config, --deepspeed-config) bounded: a regular file, at most N bytes, UTF-8.

``read_text_limited("/dev/zero", "--hostfile", 16 << 20)`` raises InputError("--hostfile /dev/zero: not a regular
file (a character device)") instead of reading forever into a MemoryError; a FIFO is refused without blocking.
"""
from __future__ import annotations

import os
import stat

# Sane maxima: a 100 000-host hostfile is ~2 MB; a thresholds TOML is a few kB; real DeepSpeed configs are kB.
MAX_HOSTFILE_BYTES = 16 << 20
MAX_CONFIG_BYTES = 1 << 20
MAX_DEEPSPEED_CONFIG_BYTES = 16 << 20
# ~/.ssh/config and known_hosts: a known_hosts of 100 000 hashed entries is ~40 MB.
MAX_SSH_FILE_BYTES = 64 << 20


class InputError(Exception):
    """A user-supplied file that cannot be used; the message names the option and the path."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _is_null_device(st: os.stat_result) -> bool:
    """Whether st is the null device (/dev/null or any other node of it), by device number, not by name."""
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and stat.S_ISCHR(null.st_mode) and st.st_rdev == null.st_rdev


def read_text_limited(path: str, what: str, max_bytes: int) -> str:
    """The file's text. Raises InputError (naming ``what``, e.g. '--hostfile', and the path) for anything but a
    regular file of at most max_bytes; like open() it raises OSError (FileNotFoundError, IsADirectoryError,
    PermissionError) when the file cannot be opened and UnicodeDecodeError for bad UTF-8, so that callers keep
    their own wording for those."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOCTTY: a tty must not become ours.
    fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", path)
        if _is_null_device(st):
            return ""  # OpenSSH's `-F /dev/null` idiom: no file, read as empty
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} {path}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise InputError(f"{what} {path}: {st.st_size} bytes, larger than the {max_bytes >> 20} MiB an input "
                             "file may have")
        chunks = []
        left = max_bytes + 1  # a file that grows while read is still bounded
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as exc:
                raise InputError(f"{what} {path}: cannot read: {exc.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:
            raise InputError(f"{what} {path}: larger than the {max_bytes >> 20} MiB an input file may have")
    finally:
        os.close(fd)
    return data.decode("utf-8")
