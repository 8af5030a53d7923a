"""Run commands on a host: one small interface with a local and an SSH (paramiko) implementation.

``transport.run(argv, timeout, stdin=b"") -> CommandResult(rc, stdout, stderr, duration)``. Every call has a
deadline, stdout and stderr are read concurrently, and argv is always quoted with shlex before it reaches a
remote shell. ``transport.start(...)`` returns a RunningCommand for long-lived host-side services.
"""
from __future__ import annotations

import logging
import os
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

# rc used when our own deadline killed the command (as GNU timeout does).
RC_TIMEOUT = 124

# paramiko's transport thread logs tracebacks of failed handshakes to stderr; each failure already
# becomes a precise TransportError, so its log would only be noise in front of the report.
_paramiko_log = logging.getLogger("paramiko")
_paramiko_log.addHandler(logging.NullHandler())
_paramiko_log.propagate = False


@dataclass
class CommandResult:
    rc: int
    stdout: str
    stderr: str
    duration: float

    @property
    def timed_out(self) -> bool:
        return self.rc == RC_TIMEOUT


class TransportError(Exception):
    """Could not reach or authenticate to a host. ``status`` is "error" or "fail"; ``fix`` says what to do."""

    def __init__(self, message: str, fix: str = "", status: str = "error"):
        super().__init__(message)
        self.fix = fix
        self.status = status


class RunningCommand:
    """A started command whose output is collected by background readers.

    Subclasses feed bytes with _feed and report the exit code with _finish.
    """

    def __init__(self) -> None:
        self._out = bytearray()
        self._err = bytearray()
        self._cond = threading.Condition()
        self._rc: Optional[int] = None
        self._started = time.monotonic()
        self._killed = False

    # -- fed by readers
    def _feed(self, data: bytes, is_err: bool) -> None:
        with self._cond:
            (self._err if is_err else self._out).extend(data)
            self._cond.notify_all()

    def _finish(self, rc: int) -> None:
        with self._cond:
            if self._rc is None:
                self._rc = RC_TIMEOUT if self._killed else rc
            self._cond.notify_all()

    # -- used by callers
    def wait_for_output(self, marker: bytes, timeout: float) -> Optional[str]:
        """Wait until stdout holds a line containing marker; return that line, or None on exit/timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                idx = self._out.find(marker)
                if idx >= 0:
                    end = self._out.find(b"\n", idx)
                    if end >= 0:
                        return self._out[idx:end].decode(errors="replace")
                if self._rc is not None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.5))

    def wait(self, timeout: float) -> CommandResult:
        """Wait for exit; past the deadline, kill the command and return rc 124."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._rc is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
        if self._rc is None:
            self.kill()
            with self._cond:
                self._cond.wait_for(lambda: self._rc is not None, timeout=5)
                if self._rc is None:
                    self._rc = RC_TIMEOUT
        with self._cond:
            return CommandResult(self._rc, self._out.decode(errors="replace"),
                                 self._err.decode(errors="replace"), time.monotonic() - self._started)

    @property
    def done(self) -> bool:
        return self._rc is not None

    def close_stdin(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


class Transport:
    """The interface: name and address of the host, run() and start()."""

    name: str = ""
    address: str = ""

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False) -> RunningCommand:
        raise NotImplementedError

    def run(self, argv: Sequence[str], timeout: float, stdin: bytes = b"") -> CommandResult:
        return self.start(argv, stdin).wait(timeout)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------- local

class _LocalCommand(RunningCommand):
    def __init__(self, argv: Sequence[str], stdin: bytes, keep_stdin_open: bool):
        super().__init__()
        # Own process group, so a timeout kills the whole tree the command started.
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        readers = [threading.Thread(target=self._pump, args=(self._proc.stdout, False), daemon=True),
                   threading.Thread(target=self._pump, args=(self._proc.stderr, True), daemon=True)]
        for t in readers:
            t.start()
        threading.Thread(target=self._reap, args=(readers,), daemon=True).start()
        try:
            if stdin:
                self._proc.stdin.write(stdin)
                self._proc.stdin.flush()
            if not keep_stdin_open:
                self._proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def _pump(self, stream, is_err: bool) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            self._feed(chunk, is_err)

    def _reap(self, readers: List[threading.Thread]) -> None:
        rc = self._proc.wait()
        for t in readers:
            t.join(timeout=2)
        self._finish(rc)

    def close_stdin(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def kill(self) -> None:
        self._killed = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class LocalTransport(Transport):
    """This machine, without SSH (the default cluster when no hostfile is given)."""

    def __init__(self, name: str = "localhost"):
        self.name = name
        self.address = "127.0.0.1"

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False) -> RunningCommand:
        try:
            return _LocalCommand(argv, stdin, keep_stdin_open)
        except FileNotFoundError:
            cmd = _FailedCommand(127, f"{argv[0]}: not found on this machine")
            return cmd


class _FailedCommand(RunningCommand):
    def __init__(self, rc: int, stderr: str):
        super().__init__()
        self._feed(stderr.encode(), True)
        self._finish(rc)

    def close_stdin(self) -> None:
        pass

    def kill(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------------- ssh

@dataclass
class SSHOptions:
    user: Optional[str] = None
    port: Optional[int] = None
    key: Optional[str] = None
    config_path: Optional[str] = "~/.ssh/config"
    known_hosts: str = "~/.ssh/known_hosts"
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0


class _SSHCommand(RunningCommand):
    def __init__(self, channel, stdin: bytes, keep_stdin_open: bool):
        super().__init__()
        self._chan = channel
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            if stdin:
                channel.sendall(stdin)
            if not keep_stdin_open:
                channel.shutdown_write()
        except OSError:
            pass

    def _pump(self) -> None:
        chan = self._chan
        # The channel's fileno() becomes readable when stdout *or* stderr has data: one select drains both.
        try:
            while True:
                select.select([chan], [], [], 1.0)
                got = False
                while chan.recv_ready():
                    self._feed(chan.recv(65536), False)
                    got = True
                while chan.recv_stderr_ready():
                    self._feed(chan.recv_stderr(65536), True)
                    got = True
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if chan.closed and not got:
                    break
            rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
        except Exception:  # the connection dropped under us: report it as a failed command
            rc = -1
        self._finish(rc)

    def close_stdin(self) -> None:
        try:
            self._chan.shutdown_write()
        except OSError:
            pass

    def kill(self) -> None:
        # Closing the channel gives the remote agent EOF on stdin; its watchdog then kills what it started.
        self._killed = True
        try:
            self._chan.close()
        except Exception:
            pass
        self._finish(RC_TIMEOUT)


class SSHTransport(Transport):
    """One authenticated paramiko connection; commands run as channels on it."""

    def __init__(self, name: str, options: SSHOptions):
        self.name = name
        self.options = options
        self.address = name
        self._client = None
        self.user = options.user or ""
        self.connect_seconds = 0.0

    def _resolve(self):
        """Apply ~/.ssh/config (HostName, User, Port, IdentityFile) and the CLI overrides."""
        import paramiko
        cfg = {}
        path = self.options.config_path
        if path:
            p = Path(path).expanduser()
            if p.is_file():
                try:
                    cfg = paramiko.SSHConfig.from_path(str(p)).lookup(self.name)
                except Exception as exc:  # paramiko raises various errors on bad configs
                    raise TransportError(f"cannot read ssh config {p}: {exc}",
                                         "fix the file or pass --ssh-config /dev/null") from None
        host = cfg.get("hostname", self.name)
        port = self.options.port or int(cfg.get("port", 22))
        user = self.options.user or cfg.get("user") or _local_user()
        keys = [self.options.key] if self.options.key else list(cfg.get("identityfile", []))
        keys = [str(Path(k).expanduser()) for k in keys]
        return host, port, user, keys

    def connect(self) -> None:
        import paramiko
        host, port, user, keys = self._resolve()
        self.address = host
        self.user = user
        timeout = self.options.connect_timeout
        start = time.monotonic()
        for k in keys:
            if not Path(k).is_file():
                raise TransportError(f"SSH key {k} not found", "pass an existing key with --ssh-key", "error")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise TransportError(f"DNS lookup of {host!r} failed: {exc.strerror}",
                                 "check the hostfile name, /etc/hosts or DNS "
                                 "(or set HostName in ~/.ssh/config)") from None
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(sockaddr)
        except socket.timeout:
            sock.close()
            raise TransportError(f"TCP connect to {host}:{port} timed out after {timeout:g}s",
                                 "is the host up and port reachable? (firewall, wrong address); "
                                 "raise --connect-timeout for slow links") from None
        except ConnectionRefusedError:
            sock.close()
            raise TransportError(f"connection to {host}:{port} refused: no SSH server listening",
                                 "start sshd on the host or pass the right --ssh-port") from None
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to {host}:{port}: {exc.strerror or exc}",
                                 "check the network path to the host") from None
        # Wait for the server's first bytes ourselves (peeking, so paramiko still reads the banner): a port
        # that accepts TCP but never speaks SSH gets a precise error instead of paramiko's racy timeouts.
        try:
            sock.settimeout(max(1.0, timeout - (time.monotonic() - start)))
            if not sock.recv(4, socket.MSG_PEEK):
                raise ConnectionResetError("closed before the SSH banner")
        except socket.timeout:
            sock.close()
            raise TransportError(f"{host}:{port} accepted TCP but sent no SSH banner within {timeout:g}s "
                                 "(hung sshd, overloaded host, or not an SSH server on this port)",
                                 "check sshd on the host (systemctl status ssh; MaxStartups) and the port") from None
        except OSError as exc:
            sock.close()
            raise TransportError(f"{host}:{port} closed the connection before the SSH banner: {exc}",
                                 "check sshd on the host (hosts.deny, MaxStartups, sshd logs)") from None
        client = paramiko.SSHClient()
        known = Path(self.options.known_hosts).expanduser()
        if known.is_file():
            try:
                client.load_host_keys(str(known))
            except Exception as exc:
                sock.close()
                raise TransportError(f"cannot read known_hosts {known}: {exc}", "fix or move the file") from None
        client.set_missing_host_key_policy(_HostKeyPolicy(self.options.accept_new_host_keys, known))
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            client.connect(host, port=port, username=user, key_filename=keys or None, sock=sock,
                           timeout=left, banner_timeout=left, auth_timeout=left, allow_agent=True,
                           look_for_keys=not keys)
        except _UnknownHostKey as exc:
            client.close()
            raise TransportError(str(exc), exc.fix, "fail") from None
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise TransportError(
                f"host key of {host} CHANGED (got {exc.key.get_name()} {exc.key.get_fingerprint().hex()}); "
                "refusing to connect: this may be a man-in-the-middle or a reinstalled host",
                f"if the host was reinstalled, remove its old key: ssh-keygen -R {host} -f {known}", "fail") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise TransportError(f"authentication as {user!r} failed: {exc}",
                                 "install your public key in ~/.ssh/authorized_keys on the host, or pass "
                                 "--ssh-user/--ssh-key", "fail") from None
        except paramiko.SSHException as exc:
            client.close()
            text = str(exc)
            if "banner" in text.lower():
                text = (f"{host}:{port} accepted TCP but sent no SSH banner within {left:.0f}s "
                        "(hung sshd, or not an SSH server on this port)")
            raise TransportError(f"SSH handshake with {host}:{port} failed: {text}",
                                 "check sshd on the host (systemctl status ssh) and the port") from None
        except (socket.timeout, OSError, EOFError) as exc:
            client.close()
            raise TransportError(f"SSH session with {host}:{port} failed: {exc or type(exc).__name__}",
                                 "check sshd on the host") from None
        transport = client.get_transport()
        transport.set_keepalive(15)
        self._client = client
        self.connect_seconds = time.monotonic() - start

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False) -> RunningCommand:
        if self._client is None:
            return _FailedCommand(255, "not connected")
        command = " ".join(shlex.quote(a) for a in argv)
        try:
            chan = self._client.get_transport().open_session(timeout=self.options.connect_timeout)
            chan.exec_command(command)
        except Exception as exc:
            return _FailedCommand(255, f"cannot open an SSH channel: {exc}")
        return _SSHCommand(chan, stdin, keep_stdin_open)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _UnknownHostKey(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


class _HostKeyPolicy:
    """Refuse unknown keys (like StrictHostKeyChecking=yes) unless accept-new was asked for."""

    _lock = threading.Lock()

    def __init__(self, accept_new: bool, known_hosts: Path):
        self.accept_new = accept_new
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname: str, key) -> None:
        fp = key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()
        if not self.accept_new:
            raise _UnknownHostKey(
                f"unknown SSH host key for {hostname} ({key.get_name()} {fp}); refusing to connect",
                f"verify the key, then rerun with --accept-new-host-keys to record it in {self.known_hosts} "
                f"(or: ssh-keyscan {hostname} >> {self.known_hosts})")
        # Append, never rewrite: other tools may be writing the same file.
        with self._lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.known_hosts, "a") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _local_user() -> str:
    import getpass
    try:
        return getpass.getuser()
    except Exception:
        return "root"
