"""A ssh config ProxyCommand run as the socket an SSH connection goes over.

Sample of what it runs (a line of ~/.ssh/config, %h %n %p %r %% already expanded by preflight.sshconfig):

    ProxyCommand nc -X connect -x proxy.example.com:3128 node01 22
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from typing import Optional

from preflight.transport.base import TransportError


class ProxySocket:
    """A ProxyCommand as a socket: the command's stdin and stdout are one end of a socketpair.

    The command is the user's own ssh config string, run as OpenSSH runs it: ``/bin/sh -c 'exec COMMAND'`` after
    %h %n %p %r %% are expanded (sshconfig refuses names with shell metacharacters in %h/%n/%r). Not
    paramiko.ProxyCommand: its recv() spins on a command that has exited, it select()s (descriptors above 1023
    fail at scale), never drains stderr, and does not reap the command.
    """

    _STDERR_KEEP = 4096

    def __init__(self, command: str) -> None:
        self.command = command
        ours, theirs = socket.socketpair()
        self._sock = ours
        try:
            self._proc = subprocess.Popen(["/bin/sh", "-c", f"exec {command}"], stdin=theirs.fileno(),
                                          stdout=theirs.fileno(),
                                          stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except OSError as exc:
            ours.close()
            raise TransportError(f"cannot start ProxyCommand {command!r}: {exc.strerror or exc}",
                                 "fix ProxyCommand in the ssh config") from None
        finally:
            theirs.close()
        self._stderr = bytearray()
        self._reader = threading.Thread(target=self._drain, name="preflight-proxycommand", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        stream = self._proc.stderr
        assert stream is not None
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            self._stderr.extend(chunk)
            del self._stderr[:-self._STDERR_KEEP]
        stream.close()

    def describe(self) -> str:
        """The command's state for an error message: its exit status and the end of its stderr."""
        rc = self._proc.poll()
        if rc is None:
            try:
                rc = self._proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        self._reader.join(0.5)
        err = bytes(self._stderr).decode(errors="replace").strip().splitlines()
        state = "still running" if rc is None else f"exited with status {rc}"
        return f"ProxyCommand {self.command!r} {state}" + (f": {err[-1][:300]}" if err else "")

    # -- the socket interface paramiko's Transport uses
    def send(self, data: bytes) -> int:
        return self._sock.send(data)

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)

    def recv(self, size: int, flags: int = 0) -> bytes:
        return self._sock.recv(size, flags)

    def settimeout(self, timeout: Optional[float]) -> None:
        self._sock.settimeout(timeout)

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def _closed(self) -> bool:  # paramiko's Transport.stop_thread reads it
        return self._sock._closed  # type: ignore[attr-defined]

    def close(self) -> None:
        self._sock.close()  # the command sees EOF on its stdin, as when ssh closes it
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self._proc.wait(5)
        self._reader.join(2)
