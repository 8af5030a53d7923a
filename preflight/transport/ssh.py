"""Run commands on a host: one small interface with a local and an SSH (paramiko) implementation.

``transport.run(argv, timeout, stdin=b"") -> CommandResult(rc, stdout, stderr, duration)``. Every call has a
deadline, stdout and stderr are read concurrently, and argv is always quoted with shlex before it reaches a
remote shell. ``transport.start(...)`` returns a RunningCommand for long-lived host-side services.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import logging
import os
import resource
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from preflight.sshconfig import Hop

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
    # Why the transport stopped the command itself (output over the cap, dead peer); "" when it did not.
    error: str = ""

    @property
    def timed_out(self) -> bool:
        return self.rc == RC_TIMEOUT


class TransportError(Exception):
    """Could not reach or authenticate to a host. ``status`` is "error" or "fail"; ``fix`` says what to do."""

    def __init__(self, message: str, fix: str = "", status: str = "error"):
        super().__init__(message)
        self.fix = fix
        self.status = status


# How long one send() may wait for a command that has stopped reading its stdin (a frozen host, an srun whose
# step stopped taking input). A request line is a few hundred bytes and a live agent reads its stdin at once,
# so a wait this long means the channel is stuck: the command is failed and killed instead of hanging the sender
# (and, for a shared srun step, every node's sender behind it).
SEND_STALL_S = 30.0


class StdinStalled(OSError):
    """The command did not take its stdin within SEND_STALL_S."""


class RunningCommand:
    """A started command whose output is collected by background readers.

    Subclasses feed bytes with _feed and report the exit code with _finish.
    """

    def __init__(self, max_output: Optional[int] = None) -> None:
        self._out = bytearray()
        self._err = bytearray()
        self._cond = threading.Condition()
        self._rc: Optional[int] = None
        self._started = time.monotonic()
        self._killed = False
        # A host is untrusted: past this many bytes (stdout + stderr) the command is stopped, not buffered.
        self._max_output = max_output
        self._error = ""
        self._sink: Optional[Callable[[bytes, bool], None]] = None
        self._on_done: List[Callable[[], None]] = []

    # -- fed by readers
    def _feed(self, data: bytes, is_err: bool) -> None:
        overflow = False
        with self._cond:
            sink = self._sink
            if sink is None and self._error:
                return
        if sink is not None:  # streamed: the consumer keeps what it needs (the agent session's frames)
            sink(data, is_err)
            return
        with self._cond:
            buf = self._err if is_err else self._out
            if self._max_output is not None and len(self._out) + len(self._err) + len(data) > self._max_output:
                self._error = (f"the host sent more than {self._max_output / 2**20:g} MiB of output for one "
                               "request; stopped reading (raise [agent] max_output_mib if that is expected)")
                overflow = True
            else:
                buf.extend(data)
            self._cond.notify_all()
        if overflow:
            self.kill()

    def _note_error(self, error: str) -> None:
        with self._cond:
            if not self._error:
                self._error = error

    def _fail(self, error: str) -> None:
        """The transport gave up on the command (e.g. the peer is dead): record why, then stop it."""
        with self._cond:
            if not self._error:
                self._error = error
        self.kill()

    def _finish(self, rc: int) -> None:
        with self._cond:
            if self._rc is None:
                self._rc = RC_TIMEOUT if self._killed else rc
            self._cond.notify_all()
            callbacks, self._on_done = self._on_done, []
        for callback in callbacks:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call callback() once the command has ended (now, if it has), on the thread that ends it.

        What only waits for a command to end needs no thread of its own: at a thousand hosts a waiting
        thread per host was a third of the coordinator's threads. callback must not block nor raise.
        """
        with self._cond:
            if self._rc is None:
                self._on_done.append(callback)
                return
        callback()

    # -- used by callers
    def stream_to(self, sink: Callable[[bytes, bool], None]) -> None:
        """Hand all output, from now on and what came so far, to sink(data, is_err) instead of buffering it."""
        with self._cond:
            out, err = bytes(self._out), bytes(self._err)
            self._out.clear()
            self._err.clear()
            if out:
                sink(out, False)
            if err:
                sink(err, True)
            self._sink = sink

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait until the command ends, without killing it; True when it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._rc is not None, timeout=timeout)

    @property
    def rc(self) -> Optional[int]:
        return self._rc

    @property
    def error(self) -> str:
        return self._error

    # -- stdin: subclasses that own a pipe or channel implement _write_stdin and _close_stdin_now
    def _begin_stdin(self, data: bytes, keep_open: bool) -> None:
        """Hand the command its first stdin bytes, then close stdin unless keep_open.

        Written by a thread of its own: a command that does not read (a hung interpreter, an srun still waiting
        for its step, a host that never opens its SSH window) leaves them in a full pipe or window, and a
        constructor stuck there could never be killed by the caller's deadline. kill() breaks the write; send()
        waits for it, so the bytes keep their order.
        """
        self._send_lock = threading.Lock()
        self._stdin_state = threading.Lock()
        self._close_requested = not keep_open
        self._writing = bool(data)
        if data:
            self._send_lock.acquire()
            threading.Thread(target=self._write_first, args=(data,), daemon=True).start()
        elif not keep_open:
            self._close_quietly()

    def _write_first(self, data: bytes) -> None:
        try:
            self._write_stdin(data, None)  # no stall limit: the caller's deadline kills a command that never reads
        except (OSError, ValueError, EOFError):
            pass
        finally:
            with self._stdin_state:
                self._writing = False
                close = self._close_requested
            if close:
                self._close_quietly()
            self._send_lock.release()

    def _close_quietly(self) -> None:
        try:
            self._close_stdin_now()
        except (OSError, ValueError, EOFError):
            pass

    def _write_stdin(self, data: bytes, stall: Optional[float]) -> None:
        """Write all of data; StdinStalled when the command takes none of it for stall seconds (None: no limit)."""
        raise NotImplementedError

    def _close_stdin_now(self) -> None:
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        """Write to the command's stdin (kept open); OSError when it is gone, or when it stopped reading (then it
        is failed and killed: a line cut in the middle would garble the stream anyway)."""
        with self._send_lock:
            try:
                self._write_stdin(data, SEND_STALL_S)
                return
            except StdinStalled as exc:
                stalled = exc
        self._fail(str(stalled))  # outside the lock: kill() may close stdin, which takes it
        raise stalled

    def close_stdin(self, wait: bool = True) -> None:
        """EOF on the command's stdin (its lifeline), once its first bytes are written. wait=False: not now if a
        send is under way (a kill that follows breaks that send instead)."""
        with self._stdin_state:
            if self._writing:  # the first write's thread closes it when done, or when a kill breaks the write
                self._close_requested = True
                return
        if not self._send_lock.acquire(blocking=wait):
            return
        try:
            self._close_quietly()
        finally:
            self._send_lock.release()

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
            self._finish(RC_TIMEOUT)  # when the kill did not end it; the done-callbacks run either way
        with self._cond:
            assert self._rc is not None  # set by _finish above
            return CommandResult(self._rc, self._out.decode(errors="replace"),
                                 self._err.decode(errors="replace"), time.monotonic() - self._started,
                                 self._error)

    @property
    def done(self) -> bool:
        return self._rc is not None

    def kill(self) -> None:
        raise NotImplementedError


class Transport:
    """The interface: name and address of the host, run() and start()."""

    name: str = ""
    address: str = ""
    # Whether RunningCommand.kill() ends the process on the host (a local process group; an srun step, which
    # slurmd takes down). An SSH channel's close signals nothing to the remote process.
    kill_reaches_host: bool = True

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        """Start argv; ``max_output`` caps the bytes buffered from it (over it: stopped, result.error says so)."""
        raise NotImplementedError

    def run(self, argv: Sequence[str], timeout: float, stdin: bytes = b"") -> CommandResult:
        return self.start(argv, stdin).wait(timeout)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------- local

class _LocalCommand(RunningCommand):
    def __init__(self, argv: Sequence[str], stdin: bytes, keep_stdin_open: bool, max_output: Optional[int]):
        super().__init__(max_output)
        # Own process group, so a timeout kills the whole tree the command started.
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        readers = [threading.Thread(target=self._pump, args=(self._proc.stdout, False), daemon=True),
                   threading.Thread(target=self._pump, args=(self._proc.stderr, True), daemon=True)]
        for t in readers:
            t.start()
        threading.Thread(target=self._reap, args=(readers,), daemon=True).start()
        stdin_pipe = self._proc.stdin
        assert stdin_pipe is not None  # stdin=PIPE above
        self._stdin: IO[bytes] = stdin_pipe
        # Written straight to the descriptor (the buffered writer stays empty), non-blocking, so that a stall
        # can time out (_write_stdin).
        os.set_blocking(stdin_pipe.fileno(), False)
        self._stdin_poll = select.poll()
        self._stdin_poll.register(stdin_pipe.fileno(), select.POLLOUT)
        self._begin_stdin(stdin, keep_stdin_open)

    def _pump(self, stream, is_err: bool) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            self._feed(chunk, is_err)

    def _reap(self, readers: List[threading.Thread]) -> None:
        rc = self._proc.wait()
        for t in readers:
            t.join(timeout=2)
        self._finish(rc)

    def _write_stdin(self, data: bytes, stall: Optional[float]) -> None:
        if self._stdin.closed:
            raise OSError("the command's stdin is closed")
        fd, poller = self._stdin.fileno(), self._stdin_poll
        view = memoryview(data)
        since = time.monotonic()
        while view:
            try:
                view = view[os.write(fd, view):]
                since = time.monotonic()
                continue
            except BlockingIOError:
                pass
            if stall is None:
                poller.poll()  # a kill closes the reading end: POLLERR, and the next write raises EPIPE
                continue
            left = since + stall - time.monotonic()
            if left <= 0:
                raise StdinStalled(f"the command stopped reading its stdin ({len(view)} bytes not taken in "
                                   f"{stall:g}s); it was stopped")
            poller.poll(left * 1000)

    def _close_stdin_now(self) -> None:
        self._stdin.close()

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

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        try:
            return _LocalCommand(argv, stdin, keep_stdin_open, max_output)
        except FileNotFoundError:
            cmd = _FailedCommand(127, f"{argv[0]}: not found on this machine")
            return cmd


class _FailedCommand(RunningCommand):
    def __init__(self, rc: int, stderr: str, error: str = ""):
        super().__init__()
        self._feed(stderr.encode(), True)
        self._error = error
        self._finish(rc)

    def send(self, data: bytes) -> None:
        raise OSError("the command did not start")

    def close_stdin(self, wait: bool = True) -> None:
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


# After the exit status, output still in flight is read until the channel's EOF. Only a process the command
# left behind can hold the output open that long; past this many quiet seconds the command counts as done.
_EOF_GRACE_S = 5.0
# The most a reader sleeps without an event: a safety net, not polling (data, EOF and close wake it at once).
_IDLE_WAKE_S = 30.0


class _SSHCommand(RunningCommand):
    def __init__(self, channel, stdin: bytes, keep_stdin_open: bool, max_output: Optional[int] = None,
                 owner: Optional["SSHTransport"] = None):
        super().__init__(max_output)
        self._chan = channel
        self._owner = owner
        threading.Thread(target=self._pump, daemon=True).start()
        self._begin_stdin(stdin, keep_stdin_open)

    def _drain(self) -> bool:
        chan = self._chan
        got = False
        while chan.recv_ready():
            data = chan.recv(65536)
            if not data:
                break
            self._feed(data, False)
            got = True
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            if not data:
                break
            self._feed(data, True)
            got = True
        return got

    def _pump(self) -> None:
        """Read stdout and stderr until the channel's EOF *and* the exit status (or the channel closing).

        The exit status can arrive before the last of the output: stopping at it loses the end of a large
        result. poll(), not select(): descriptors above 1023 are normal at a thousand hosts.
        """
        chan = self._chan
        poller = select.poll()
        # The channel's fileno() becomes readable on stdout or stderr data, on EOF and on close.
        poller.register(chan.fileno(), select.POLLIN)
        quiet_since: Optional[float] = None
        try:
            while True:
                got = self._drain()
                eof = chan.eof_received and not chan.recv_ready() and not chan.recv_stderr_ready()
                if chan.exit_status_ready() and (eof or chan.closed):
                    break
                if chan.closed and not got:
                    break
                if eof:
                    # EOF keeps the descriptor readable: wait on the exit status itself (close sets it too).
                    chan.status_event.wait(_IDLE_WAKE_S)
                    continue
                if chan.exit_status_ready():
                    now = time.monotonic()
                    if got or quiet_since is None:
                        quiet_since = now
                    elif now - quiet_since > _EOF_GRACE_S:
                        break
                    poller.poll(1000)
                    continue
                poller.poll(_IDLE_WAKE_S * 1000)
            self._drain()
            rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
        except Exception:  # the connection dropped under us: report it as a failed command
            rc = -1
        finally:
            if self._owner is not None:
                self._owner._forget(self)
            # Closing frees the channel's wake-up pipe now; left to paramiko it waits for the garbage collector.
            try:
                chan.close()
            except Exception:
                pass
        self._finish(rc)

    def _write_stdin(self, data: bytes, stall: Optional[float]) -> None:
        # The channel's window is the pipe here: sshd opens 2 MiB and re-opens it as the command reads. A host
        # whose agent stopped reading (frozen, SIGSTOPped) leaves it shut while its sshd still answers keepalives.
        # The channel's timeout bounds each wait for window; only this writer (under the send lock) waits on it:
        # the reader thread calls recv only when data is there.
        chan = self._chan
        if chan.closed:
            raise OSError("the SSH channel is closed")
        chan.settimeout(stall)
        done = 0
        while done < len(data):
            try:
                sent = chan.send(data[done:done + 262144])  # bytes (paramiko's packets take at most 32 KiB)
            except socket.timeout:
                raise StdinStalled(f"the host stopped reading its stdin ({len(data) - done} bytes not taken in "
                                   f"{stall:g}s); its command was stopped") from None
            if sent == 0:
                raise OSError("the SSH channel is closed")
            done += sent

    def _close_stdin_now(self) -> None:
        self._chan.shutdown_write()

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

    kill_reaches_host = False

    def __init__(self, name: str, options: SSHOptions):
        self.name = name
        self.options = options
        self.address = name
        self._client = None
        self.user = options.user or ""
        self.connect_seconds = 0.0
        self._commands: Dict[int, _SSHCommand] = {}
        self._lock = threading.Lock()
        self._last_rx = 0.0
        self._last_probe = 0.0
        self._probing = False
        self.dead = ""  # why the connection was declared dead ("" while alive)
        self._proxy: Optional[_ProxySocket] = None  # the ProxyCommand this connection runs over
        self.via = ""  # "jump host bastion", "ProxyCommand": how the connection is made, when not direct
        self._jump: Optional[_Jump] = None  # the jump host connection it runs over (shared, ref-counted)

    def route(self) -> List["Hop"]:
        """The hops to this host from the ssh config (ProxyJump chains), first jump host first, this host last;
        --ssh-user/--ssh-port/--ssh-key apply to this host only, as ssh's -l/-p/-i do."""
        from preflight import sshconfig
        try:
            hops = sshconfig.load(self.options.config_path).route(self.name, self.options.user, self.options.port)
        except sshconfig.SSHConfigError as exc:
            raise TransportError(f"ssh config: {exc}", "fix the file or pass --ssh-config /dev/null") from None
        if self.options.key:
            hops[-1] = replace(hops[-1], identity_files=(str(Path(self.options.key).expanduser()),))
        return hops

    def connect_budget_s(self) -> float:
        """The longest connect() can take: each hop has the connect timeout (TCP, banner, auth) of its own."""
        try:
            return self.options.connect_timeout * len(self.route())
        except TransportError:
            return self.options.connect_timeout

    def connect(self) -> None:
        start = time.monotonic()
        route = self.route()
        target = route[-1]
        self.address = target.hostname
        self.user = target.user
        _check_keys(target)
        jump: Optional[_Jump] = None
        proxy: Optional[_ProxySocket] = None
        hop_start = start
        try:
            if len(route) > 1:
                jump = _JUMPS.acquire(tuple(route[:-1]), self.options)
                hop_start = time.monotonic()  # each hop has the whole connect timeout of its own
                sock: Any = _open_channel(jump, target, self.options.connect_timeout)
            elif target.command is not None:
                sock = proxy = _ProxySocket(target.command)
            else:
                sock = _tcp_connect(target, self.options.connect_timeout)
            _wait_banner(sock, target, self.options.connect_timeout, hop_start, proxy)
            client = _handshake(target, sock, self.options, hop_start, proxy)
        except _HopError as exc:
            raise TransportError(_hop_message(exc, route), exc.error.fix, exc.error.status) from None
        except TransportError as exc:
            if proxy is not None:
                proxy.close()
            if jump is None:
                raise
            _JUMPS.release(jump)
            text = str(exc) if str(exc).startswith("jump host") else f"{exc} (through jump host {route[-2].name})"
            raise TransportError(text, exc.fix, exc.status) from None
        self._proxy = proxy
        self._jump = jump
        if len(route) > 1:
            self.via = ("jump host " if len(route) == 2 else "jump hosts ") + ", ".join(h.name for h in route[:-1])
        elif proxy is not None:
            self.via = "ProxyCommand"
        transport = client.get_transport()
        # paramiko's reader thread wakes every 0.1 s by default; an idle connection should cost nothing.
        # Closing still stops it at once (close() shuts the socket down), and dead peers are found by the
        # keepalives below, not by this timeout.
        try:
            transport.sock.settimeout(_TRANSPORT_WAKE_S)
        except OSError:
            pass
        self._client = client
        self._watch(transport)
        self.connect_seconds = time.monotonic() - start

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        if self.dead:
            return _FailedCommand(255, self.dead, self.dead)
        if self._client is None:
            return _FailedCommand(255, "not connected")
        command = " ".join(shlex.quote(a) for a in argv)
        try:
            chan = self._client.get_transport().open_session(timeout=self.options.connect_timeout)
            chan.exec_command(command)
        except Exception as exc:
            return _FailedCommand(255, f"cannot open an SSH channel: {exc}", self.dead)
        cmd = _SSHCommand(chan, b"", True, max_output, self)
        with self._lock:
            self._commands[id(cmd)] = cmd
        try:
            if stdin:
                chan.sendall(stdin)
            if not keep_stdin_open:
                chan.shutdown_write()
        except OSError:
            pass
        return cmd

    def network_rtt_ms(self) -> Optional[float]:
        """The connection's smoothed round-trip time as the kernel measures it (TCP_INFO tcpi_rtt), or None.

        Measured from ACK timing in the kernels at both ends, so a coordinator busy with other hosts does
        not inflate it the way timing a command through paramiko does.
        """
        info = self._tcp_info()
        if info is None:
            # Through a jump host or a ProxyCommand there is no TCP socket of ours to this host: time SSH-level
            # round trips instead (the best of a few, so one scheduling hiccup does not count).
            return self._ssh_rtt_ms()
        # struct tcp_info (linux/tcp.h): 8 bytes of u8 fields, then u32s; tcpi_rtt (microseconds) is at 68.
        return int.from_bytes(info[68:72], sys.byteorder) / 1000.0

    def _ssh_rtt_ms(self, rounds: int = 3) -> Optional[float]:
        client = self._client
        if client is None or self.dead:
            return None
        transport = client.get_transport()
        best: Optional[float] = None
        try:
            from paramiko.common import cMSG_GLOBAL_REQUEST
            from paramiko.message import Message
            for _ in range(rounds):
                # A global request that wants a reply (OpenSSH answers unknown ones with a failure); paramiko
                # sets completion_event on either answer. Bounded here, unlike paramiko's global_request().
                event = threading.Event()
                transport.completion_event = event
                m = Message()
                m.add_byte(cMSG_GLOBAL_REQUEST)
                m.add_string("keepalive@openssh.com")
                m.add_boolean(True)
                sent = time.monotonic()
                transport._send_user_message(m)
                if not event.wait(self.options.connect_timeout):
                    return best
                took = (time.monotonic() - sent) * 1000.0
                best = took if best is None else min(best, took)
        except Exception:
            return best
        return best

    def _tcp_info(self) -> Optional[bytes]:
        try:
            sock = self._client.get_transport().sock  # type: ignore[union-attr,attr-defined]
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        except (AttributeError, OSError):
            return None
        return info if len(info) >= 76 else None

    def _kernel_silence_s(self) -> Optional[float]:
        """Seconds since the kernel last received data or an ACK from the server (TCP_INFO), or None."""
        info = self._tcp_info()
        if info is None:
            return None
        # struct tcp_info: tcpi_last_data_recv at 52, tcpi_last_ack_recv at 56 (milliseconds ago).
        data = int.from_bytes(info[52:56], sys.byteorder)
        ack = int.from_bytes(info[56:60], sys.byteorder)
        return min(data, ack) / 1000.0

    def _forget(self, cmd: "_SSHCommand") -> None:
        with self._lock:
            self._commands.pop(id(cmd), None)

    # -- dead-peer detection (OpenSSH's ServerAliveInterval / ServerAliveCountMax)
    def _watch(self, transport) -> None:
        self._last_rx = time.monotonic()
        packetizer = transport.packetizer
        read_message = packetizer.read_message

        def counting_read_message():  # every packet from the server proves it alive
            msg = read_message()
            self._last_rx = time.monotonic()
            return msg

        packetizer.read_message = counting_read_message
        _LIVENESS.watch(self)

    def _keepalive_interval(self) -> float:
        return max(0.5, self.options.connect_timeout / KEEPALIVE_COUNT_MAX)

    def _check_alive(self, now: float) -> float:
        """Probe a silent server, declare it dead after KEEPALIVE_COUNT_MAX unanswered probes; returns the
        seconds until this connection next needs a look."""
        client = self._client
        if client is None or self.dead:
            return 3600.0
        interval = self._keepalive_interval()
        silent = now - self._last_rx
        limit = interval * (KEEPALIVE_COUNT_MAX + 1)  # ~2x the connect timeout with the defaults below
        if silent >= limit:
            # Nothing parsed from the server for that long. Before declaring it dead, ask the kernel: a
            # coordinator thread starved by hundreds of busy connections parses late, but the kernel saw the
            # server's ACKs and data arrive. A cut cable or a dead host leaves both silent.
            kernel = self._kernel_silence_s()
            if kernel is not None and kernel < limit:
                return max(0.25, limit - kernel)
            self._declare_dead(f"the host stopped answering: no reply to {KEEPALIVE_COUNT_MAX} SSH keepalives "
                               f"in {silent:.0f}s (host down, network cut, or sshd hung)")
            return 3600.0
        if silent < interval:
            return interval - silent
        if now - self._last_probe >= interval and not self._probing:
            self._last_probe = now
            self._probing = True
            _LIVENESS.probe(self, client.get_transport())
        return min(self._last_probe + interval - now, limit - silent)

    def _probe(self, transport) -> None:
        # A global request that wants a reply (OpenSSH answers unknown ones with a failure), sent without
        # waiting for it: any packet back resets the silence clock. Sent by _LIVENESS's prober threads: a
        # send to a dead peer can block until paramiko's own socket timeout.
        try:
            from paramiko.common import cMSG_GLOBAL_REQUEST
            from paramiko.message import Message
            m = Message()
            m.add_byte(cMSG_GLOBAL_REQUEST)
            m.add_string("keepalive@openssh.com")
            m.add_boolean(True)
            transport._send_user_message(m)
        except Exception:
            pass
        finally:
            self._probing = False

    def _declare_dead(self, reason: str) -> None:
        self.dead = reason
        _LIVENESS.forget(self)
        with self._lock:
            commands = list(self._commands.values())
        for cmd in commands:
            cmd._fail(reason)
        client = self._client
        if client is not None:
            # Closing can wait on a send stuck in the kernel: never hold up the caller for it.
            _wake_reader(client)
            threading.Thread(target=client.close, daemon=True).start()

    def close(self) -> None:
        _LIVENESS.forget(self)
        if self._client is not None:
            _close_client(self._client, through_jump=self._jump is not None)
            self._client = None
        # After the client: its socket (the jump host's channel, the proxy command's pipe) closes first.
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.close()
        jump, self._jump = self._jump, None
        if jump is not None:
            _JUMPS.release(jump)


def _close_client(client, through_jump: bool) -> None:
    """Close a paramiko client, its reader thread woken at once (_wake_reader).

    Through a jump host its socket is a channel of the jump host's connection, which must outlive the reader
    thread's own close of that channel: released first, the thread died on EOFError with a traceback on stderr
    (1 run in 6 of tests/test_proxyjump.py). So wait for the thread; it ends at once, the bound is a backstop.
    """
    thread = client.get_transport()
    _wake_reader(client)
    client.close()
    if through_jump and thread is not None and thread is not threading.current_thread():
        thread.join(_READER_EXIT_S)


def _wake_reader(client) -> None:
    """Shut the connection's socket down, so that paramiko's reader thread, asleep in recv() for up to
    _TRANSPORT_WAKE_S, gets EOF and ends now (closing the descriptor alone does not wake a blocked recv)."""
    try:
        client.get_transport().sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass


class _UnknownHostKey(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


class _HostKeyPolicy:
    """Refuse unknown keys (like StrictHostKeyChecking=yes) unless accept-new was asked for."""

    _lock = threading.Lock()

    def __init__(self, accept_new: bool, known_hosts: Path, index: Optional["KnownHosts"] = None):
        self.accept_new = accept_new
        self.known_hosts = known_hosts
        self.index = index

    def missing_host_key(self, client, hostname: str, key) -> None:
        fp = key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()
        revoked = self.index.revoked(hostname, key.get_name(), key.get_base64()) if self.index else ""
        if revoked:
            raise _UnknownHostKey(revoked, f"the host's key is revoked in {self.known_hosts}; check the host")
        if not self.accept_new:
            ca = (" known_hosts trusts a @cert-authority for this host, but host certificates cannot be "
                  "verified here (paramiko);" if self.index and self.index.has_ca(hostname) else "")
            raise _UnknownHostKey(
                f"unknown SSH host key for {hostname} ({key.get_name()} {fp}); refusing to connect{ca}",
                f"verify the key, then rerun with --accept-new-host-keys to record it in {self.known_hosts} "
                f"(or: ssh-keyscan {hostname} >> {self.known_hosts})")
        # Append, never rewrite: other tools may be writing the same file.
        with self._lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.known_hosts, "a") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            if self.index is not None:
                self.index.add(hostname, key.get_name(), key.get_base64())
        client.get_host_keys().add(hostname, key.get_name(), key)


# ------------------------------------------------------------------------------- connecting, hop by hop

def _check_keys(hop: "Hop") -> None:
    for k in hop.identity_files:
        if not Path(k).is_file():
            raise TransportError(f"SSH key {k} not found", "pass an existing key with --ssh-key (or fix IdentityFile "
                                 "in the ssh config)", "error")


def _tcp_connect(hop: "Hop", timeout: float) -> socket.socket:
    host, port = hop.hostname, hop.port
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
                             "check the network path to the host (a ProxyJump in the ssh config if it is only "
                             "reachable through a jump host)") from None
    return sock


def _open_channel(jump: "_Jump", hop: "Hop", timeout: float):
    """A direct-tcpip channel from the jump host to hop's sshd: the socket hop's own SSH connection runs over."""
    import paramiko
    name = jump.chain[-1].name
    try:
        # The address is a field of the SSH message, resolved by the jump host: never a shell word.
        return jump.transport.open_channel("direct-tcpip", (hop.hostname, hop.port), ("127.0.0.1", 0),
                                           timeout=timeout)
    except paramiko.ChannelException as exc:
        if exc.code == 1:  # SSH_OPEN_ADMINISTRATIVELY_PROHIBITED
            raise TransportError(f"jump host {name} refused to forward to {hop.address}: {exc.text}",
                                 f"allow TCP forwarding on {name} (sshd_config: AllowTcpForwarding yes, "
                                 "PermitOpen) or use another jump host") from None
        raise TransportError(f"jump host {name} could not connect to {hop.address}: {exc.text} (refused, "
                             "unreachable or timed out as seen from the jump host)",
                             f"check that {hop.hostname} runs sshd on port {hop.port} and is reachable from "
                             f"{name}") from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        text = str(exc) or type(exc).__name__
        if "timeout" in text.lower():
            text = f"no answer within {timeout:g}s (host down or firewalled, as seen from the jump host)"
        raise TransportError(f"jump host {name} did not open a connection to {hop.address}: {text}",
                             f"check that {hop.hostname} is up and reachable from {name}; raise "
                             "--connect-timeout for slow links") from None


class _ProxySocket:
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


def _wait_banner(sock, hop: "Hop", timeout: float, start: float, proxy: Optional[_ProxySocket] = None) -> None:
    """Wait for the server's first bytes ourselves, without consuming them (paramiko still reads the banner): a
    port that accepts TCP but never speaks SSH gets a precise error instead of paramiko's racy timeouts.
    ``timeout`` counts from ``start`` (the hop's TCP connect included)."""
    host, port = hop.hostname, hop.port
    left = max(1.0, timeout - (time.monotonic() - start))
    where = f"{host}:{port}"
    if isinstance(sock, (socket.socket, _ProxySocket)):
        try:
            sock.settimeout(left)
            if not sock.recv(4, socket.MSG_PEEK):
                raise ConnectionResetError("closed before the SSH banner")
            return
        except socket.timeout:
            sock.close()
            if proxy is not None:
                raise TransportError(f"no SSH banner from {where} within {timeout:g}s through the proxy command "
                                     f"({proxy.describe()})", "run the ProxyCommand by hand to check it") from None
            raise TransportError(f"{where} accepted TCP but sent no SSH banner within {timeout:g}s "
                                 "(hung sshd, overloaded host, or not an SSH server on this port)",
                                 "check sshd on the host (systemctl status ssh; MaxStartups) and the port") from None
        except OSError as exc:
            sock.close()
            if proxy is not None:
                raise TransportError(f"the proxy command closed the connection to {where} before the SSH banner "
                                     f"({proxy.describe()})", "run the ProxyCommand by hand to check it") from None
            raise TransportError(f"{where} closed the connection before the SSH banner: {exc}",
                                 "check sshd on the host (hosts.deny, MaxStartups, sshd logs)") from None
    # A channel through a jump host: its fileno() becomes readable on data, EOF and close.
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.poll(left * 1000)
    if sock.recv_ready():
        return
    sock.close()
    if sock.closed or sock.eof_received:
        raise TransportError(f"{where} closed the connection before the SSH banner",
                             "check sshd on the host (hosts.deny, MaxStartups, sshd logs)")
    raise TransportError(f"{where} accepted TCP but sent no SSH banner within {timeout:g}s "
                         "(hung sshd, overloaded host, or not an SSH server on this port)",
                         "check sshd on the host (systemctl status ssh; MaxStartups) and the port")


def _handshake(hop: "Hop", sock, options: SSHOptions, start: float, proxy: Optional[_ProxySocket] = None):
    """Key exchange, host key policy (known_hosts index, accept-new, changed and revoked keys) and auth over sock;
    the authenticated SSHClient. Every hop goes through here, so all have the same policy and deadlines."""
    import paramiko
    host, port, user = hop.hostname, hop.port, hop.user
    keys = list(hop.identity_files)
    timeout = options.connect_timeout
    client = paramiko.SSHClient()
    _share_key_files(client)
    known = Path(options.known_hosts).expanduser()
    lookup_name = host if port == 22 else f"[{host}]:{port}"  # the name paramiko looks the key up by
    try:
        index = KnownHosts.shared(known)
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot read known_hosts {known}: {exc.strerror or exc}",
                             "fix or move the file") from None
    # Only this host's keys: paramiko's own load re-parses the whole file per host, O(lines^2) each.
    index.fill(client.get_host_keys(), lookup_name)
    client.set_missing_host_key_policy(_HostKeyPolicy(options.accept_new_host_keys, known, index))
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
        revoked = index.revoked(lookup_name, exc.key.get_name(), exc.key.get_base64())
        if revoked:
            raise TransportError(revoked, f"remove the host's key from {known} and check the host",
                                 "fail") from None
        raise TransportError(
            f"host key of {host} CHANGED (got {exc.key.get_name()} {exc.key.get_fingerprint().hex()}); "
            "refusing to connect: this may be a man-in-the-middle or a reinstalled host",
            f"if the host was reinstalled, remove its old key: ssh-keygen -R {host} -f {known}", "fail") from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise TransportError(f"authentication as {user!r} failed: {exc}",
                             "install your public key in ~/.ssh/authorized_keys on the host, or pass "
                             "--ssh-user/--ssh-key (User/IdentityFile in the ssh config for a jump host)",
                             "fail") from None
    except paramiko.SSHException as exc:
        client.close()
        text = str(exc)
        if "banner" in text.lower():
            text = (f"{host}:{port} accepted TCP but sent no SSH banner within {left:.0f}s "
                    "(hung sshd, or not an SSH server on this port)")
        if proxy is not None:
            text += f" ({proxy.describe()})"
        raise TransportError(f"SSH handshake with {host}:{port} failed: {text}",
                             "check sshd on the host (systemctl status ssh) and the port") from None
    except (socket.timeout, OSError, EOFError) as exc:
        client.close()
        text = f"{exc or type(exc).__name__}" + (f" ({proxy.describe()})" if proxy is not None else "")
        raise TransportError(f"SSH session with {host}:{port} failed: {text}", "check sshd on the host") from None
    transport = client.get_transport()
    server_key = transport.get_remote_server_key()
    revoked = index.revoked(lookup_name, server_key.get_name(), server_key.get_base64())
    if revoked:  # a known key that is also @revoked: OpenSSH refuses it, and so do we (no command ran yet)
        client.close()
        raise TransportError(revoked, f"remove the host's key from {known} and check the host", "fail")
    return client


class _HopError(Exception):
    """A jump host of a route could not be reached: which one (0-based index into the route) and why."""

    def __init__(self, index: int, hop: "Hop", error: TransportError):
        super().__init__(str(error))
        self.index = index
        self.hop = hop
        self.error = error


def _hop_message(exc: _HopError, route: List["Hop"]) -> str:
    return f"jump host {exc.hop.name} (hop {exc.index + 1} of {len(route)} to {route[-1].name}): {exc.error}"


class _Jump:
    """One authenticated connection to a jump host, shared by every target behind it in this run."""

    def __init__(self, key: tuple, chain: Tuple["Hop", ...]):
        self.key = key
        self.chain = chain  # the hops to this jump host, itself last
        self.refs = 0
        self.lock = threading.Lock()  # held while connecting: the targets behind it wait for one attempt
        self.client: Any = None
        self.error: Optional[_HopError] = None
        self.parent: Optional[_Jump] = None
        self.proxy: Optional[_ProxySocket] = None

    @property
    def transport(self):
        return self.client.get_transport()

    def alive(self) -> bool:
        return self.client is None or bool(self.transport and self.transport.is_active())


class _JumpPool:
    """Jump host connections by route: targets behind one jump host multiplex their channels over one SSH
    connection (one login on the bastion per run, not one per target: MaxStartups), closed with the last target.

    A failed connect is shared by the targets that waited for it (one timeout, not one per target); once they have
    all let go of it, the next acquire tries again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: Dict[tuple, _Jump] = {}

    @staticmethod
    def _key(chain: Tuple["Hop", ...], options: SSHOptions) -> tuple:
        return (chain, str(Path(options.known_hosts).expanduser()), options.accept_new_host_keys,
                options.connect_timeout)

    def acquire(self, chain: Tuple["Hop", ...], options: SSHOptions) -> _Jump:
        key = self._key(chain, options)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.alive():
                entry = self._entries[key] = _Jump(key, chain)  # a dead one closes with its last user
            entry.refs += 1
        with entry.lock:
            if entry.client is None and entry.error is None:
                try:
                    self._connect(entry, options)
                except _HopError as exc:
                    entry.error = exc
        if entry.error is not None:
            self.release(entry)
            raise entry.error
        return entry

    def _connect(self, entry: _Jump, options: SSHOptions) -> None:
        chain = entry.chain
        hop, index = chain[-1], len(chain) - 1
        start = time.monotonic()
        parent: Optional[_Jump] = None
        proxy: Optional[_ProxySocket] = None
        try:
            _check_keys(hop)
            if len(chain) > 1:
                parent = self.acquire(chain[:-1], options)
                start = time.monotonic()  # each hop has the whole connect timeout of its own
                sock: Any = _open_channel(parent, hop, options.connect_timeout)
            elif hop.command is not None:
                sock = proxy = _ProxySocket(hop.command)
            else:
                sock = _tcp_connect(hop, options.connect_timeout)
            _wait_banner(sock, hop, options.connect_timeout, start, proxy)
            client = _handshake(hop, sock, options, start, proxy)
        except _HopError:
            raise  # an earlier hop's: it names itself
        except TransportError as exc:
            if proxy is not None:
                proxy.close()
            if parent is not None:
                self.release(parent)
            if exc.fix.startswith("verify the key") or "ssh-keyscan" in exc.fix:
                exc.fix += " (on a host that can reach it)" if index else ""
            raise _HopError(index, hop, exc) from None
        try:
            client.get_transport().sock.settimeout(_TRANSPORT_WAKE_S)
        except OSError:
            pass
        entry.client, entry.parent, entry.proxy = client, parent, proxy

    def release(self, entry: _Jump) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
        if entry.client is not None:
            _close_client(entry.client, through_jump=entry.parent is not None)
        if entry.proxy is not None:
            entry.proxy.close()
        if entry.parent is not None:
            self.release(entry.parent)

    def open_count(self) -> int:
        """Jump host connections open now (tests: none after a run)."""
        with self._lock:
            return len(self._entries)


_JUMPS = _JumpPool()


# ------------------------------------------------------------------------------------------- key files

_KEY_CACHE: Dict[tuple, object] = {}
_KEY_CACHE_LOCK = threading.Lock()


def _share_key_files(client) -> None:
    """Load each private key file once per run instead of once per host.

    paramiko's SSHClient tries every key class on every key file for every connection (an ed25519 key is
    read and parsed three times per host). This keeps paramiko's order and outcome per (file, class,
    passphrase), the failures included, and reloads when the file (or its certificate) changes.
    """
    load = getattr(client, "_key_from_filepath", None)
    if load is None:  # another paramiko: keep its own loading
        return

    def cached(filename, klass, password):
        cert = filename if filename.endswith("-cert.pub") else filename + "-cert.pub"
        key = (filename, klass, password, _file_signature(Path(filename)), _file_signature(Path(cert)))
        with _KEY_CACHE_LOCK:
            hit = _KEY_CACHE.get(key)
        if hit is None:
            import paramiko
            try:
                hit = load(filename, klass, password)
            except paramiko.SSHException as exc:  # wrong class for this file, or it needs a passphrase
                hit = exc
            with _KEY_CACHE_LOCK:
                _KEY_CACHE[key] = hit
        if isinstance(hit, Exception):
            raise hit.with_traceback(None)  # a fresh traceback each time, not one that grows per host
        return hit

    client._key_from_filepath = cached


# ------------------------------------------------------------------------------------------- known_hosts

class KnownHosts:
    """A known_hosts file read once per run and indexed by host name.

    Sample lines it reads (OpenSSH's format):

        node01,198.18.0.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI...
        |1|F1E1KeoE/eEWhi10WpGv4OdiO6Y=|3988QV0VE8wmZL7suNrYQLITLCg= ssh-ed25519 AAAA...
        @revoked * ssh-rsa AAAAB3NzaC1yc2E...
        @cert-authority *.example.com ssh-ed25519 AAAA...

    Plain names are a dict lookup; hashed (``|1|salt|hash``) names cost one HMAC per distinct salt. Keys stay
    base64 text until a host needs them. Same matching as paramiko's HostKeys (exact names, hashes), plus the
    markers paramiko cannot parse: ``@revoked`` keys are refused, ``@cert-authority`` is noted in the error.
    """

    _cache: Dict[str, Tuple[Tuple[int, int, int], "KnownHosts"]] = {}
    _cache_lock = threading.Lock()

    def __init__(self) -> None:
        self._plain: Dict[str, List[Tuple[str, str]]] = {}
        self._hashed: Dict[bytes, Dict[bytes, List[Tuple[str, str]]]] = {}
        self._revoked: List[Tuple[List[str], str, str]] = []
        self._ca: List[List[str]] = []
        self._lock = threading.Lock()
        self._path: Optional[str] = None  # set for the shared index of a file

    @classmethod
    def shared(cls, path: Path) -> "KnownHosts":
        """The index of path, loaded on first use and kept for the run (our own appends update it)."""
        key = str(path)
        with cls._cache_lock:
            sig = _file_signature(path)
            cached = cls._cache.get(key)
            if cached is not None and cached[0] == sig:
                return cached[1]
            index = cls.parse(path.read_text(errors="replace") if sig != (0, 0, 0) else "")
            index._path = key
            cls._cache[key] = (sig, index)
            return index

    @classmethod
    def parse(cls, text: str) -> "KnownHosts":
        index = cls()
        for line in text.splitlines():
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            marker = fields.pop(0) if fields[0].startswith("@") else ""
            if len(fields) < 3:
                continue  # malformed: OpenSSH skips it too
            names, keytype, b64 = fields[0].split(","), fields[1], fields[2]
            if marker == "@revoked":
                index._revoked.append((names, keytype, b64))
            elif marker == "@cert-authority":
                index._ca.append(names)
            elif not marker:
                for name in names:
                    index._add_name(name, keytype, b64)
        return index

    def _add_name(self, name: str, keytype: str, b64: str) -> None:
        if name.startswith("|1|"):
            try:
                _, _, salt, digest = name.split("|", 3)
                key = (base64.b64decode(salt), base64.b64decode(digest))
            except (ValueError, TypeError):
                return
            self._hashed.setdefault(key[0], {}).setdefault(key[1], []).append((keytype, b64))
        else:
            self._plain.setdefault(name, []).append((keytype, b64))

    def add(self, name: str, keytype: str, b64: str) -> None:
        """Record a key we appended to the file ourselves (accept-new), without re-reading the file."""
        with self._lock:
            self._add_name(name, keytype, b64)
        if self._path is not None:
            with KnownHosts._cache_lock:
                KnownHosts._cache[self._path] = (_file_signature(Path(self._path)), self)

    def keys(self, name: str) -> List[Tuple[str, str]]:
        """(keytype, base64) of every line naming this host, in file order (hashed lines after plain)."""
        with self._lock:
            found = list(self._plain.get(name, []))
            for salt, digests in self._hashed.items():
                hit = digests.get(hmac.new(salt, name.encode(), hashlib.sha1).digest())
                if hit:
                    found.extend(hit)
        return found

    def fill(self, host_keys, name: str) -> None:
        """Put this host's keys (the first per key type, as paramiko's lookup returns) into a HostKeys."""
        from paramiko import PKey
        seen = set()
        for keytype, b64 in self.keys(name):
            if keytype in seen:
                continue
            try:
                key = PKey.from_type_string(keytype, base64.b64decode(b64))
            except Exception:  # unknown key type or bad base64: paramiko skips such lines as well
                continue
            seen.add(keytype)
            host_keys.add(name, keytype, key)

    @staticmethod
    def _matches(patterns: List[str], name: str) -> bool:
        bare = name[1:].split("]:", 1)[0] if name.startswith("[") else name
        for pattern in patterns:
            if pattern.startswith("|1|"):
                try:
                    _, _, salt, digest = pattern.split("|", 3)
                    if hmac.compare_digest(hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest(),
                                           base64.b64decode(digest)):
                        return True
                except (ValueError, TypeError):
                    continue
            elif fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(bare, pattern):
                return True
        return False

    def revoked(self, name: str, keytype: str, b64: str) -> str:
        """The refusal message when this key is marked @revoked for this host, else ""."""
        for patterns, rtype, rb64 in self._revoked:
            if rtype == keytype and rb64 == b64 and self._matches(patterns, name):
                return (f"host key of {name} ({keytype}) is marked @revoked in known_hosts; "
                        "refusing to connect")
        return ""

    def has_ca(self, name: str) -> bool:
        return any(self._matches(patterns, name) for patterns in self._ca)


def _file_signature(path: Path) -> Tuple[int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# --------------------------------------------------------------------------------------- dead peers

# ServerAliveCountMax: unanswered keepalives before a host is declared dead. With the interval at
# connect_timeout / KEEPALIVE_COUNT_MAX, a silent host is dead after ~(1 + 1/3) x the connect timeout of
# silence, and found within ~2x (OpenSSH's default count is 3 too).
KEEPALIVE_COUNT_MAX = 3
# A prober thread busy this long on one send is presumed stuck; the next keepalive starts another.
_PROBE_STUCK_S = 0.25
# How often paramiko's reader thread wakes on an idle connection (paramiko's default is 0.1 s). Each wake costs
# about 100 us of Python (52 us per connection-second at 2 s): at 1,000 hosts that was 50 ms of CPU every second.
# Nothing waits on it: close() shuts the socket down (the reader wakes at once), and dead peers are found by
# the keepalives.
_TRANSPORT_WAKE_S = 30.0
# How long close() waits for a connection's reader thread to finish closing its socket (it takes milliseconds).
_READER_EXIT_S = 2.0


class _Liveness:
    """One thread that keeps an eye on every open SSH connection, instead of a timer per host."""

    def __init__(self) -> None:
        self._conns: Dict[int, SSHTransport] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # Keepalives go out through a few long-lived prober threads, not a new thread per probe (that cost
        # more than the probe itself: at a thousand hosts, one probe per host every few seconds). A
        # prober stuck on a send (a dead peer with a full socket buffer) is replaced, not waited for.
        self._probes: List[Tuple["SSHTransport", object]] = []
        self._probe_cond = threading.Condition(self._lock)
        self._probers: Dict[int, float] = {}  # prober thread id -> when its current send began (0: idle)

    def watch(self, conn: "SSHTransport") -> None:
        with self._lock:
            self._conns[id(conn)] = conn
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="preflight-keepalive", daemon=True)
                self._thread.start()
        self._wake.set()

    def forget(self, conn: "SSHTransport") -> None:
        with self._lock:
            self._conns.pop(id(conn), None)

    def probe(self, conn: "SSHTransport", transport) -> None:
        """Queue one keepalive; a prober thread sends it (conn._probe clears conn._probing when done)."""
        with self._lock:
            self._probes.append((conn, transport))
            self._start_prober_locked(time.monotonic())
            self._probe_cond.notify()

    def _start_prober_locked(self, now: float) -> None:
        # Another prober only when keepalives wait, none is idle, and every one is stuck on a send: a
        # blocked send to one dead host must not hold up the other hosts' keepalives.
        if not self._probes or any(t == 0.0 or now - t < _PROBE_STUCK_S for t in self._probers.values()):
            return
        thread = threading.Thread(target=self._prober, name="preflight-keepalive-send", daemon=True)
        thread.start()
        self._probers[thread.ident or 0] = 0.0

    def _prober(self) -> None:
        me = threading.get_ident()
        while True:
            with self._lock:
                self._probers[me] = 0.0
                if not self._probe_cond.wait_for(lambda: bool(self._probes), timeout=60.0):
                    self._probers.pop(me, None)  # idle for a minute (and nothing queued): let it go
                    return
                conn, transport = self._probes.pop(0)
                self._probers[me] = time.monotonic()
            conn._probe(transport)

    def _run(self) -> None:
        while True:
            with self._lock:
                conns = list(self._conns.values())
            now = time.monotonic()
            sleep = 3600.0
            for conn in conns:
                try:
                    sleep = min(sleep, conn._check_alive(now))
                except Exception:  # one connection's trouble must not stop the watch over the others
                    continue
            with self._lock:
                self._start_prober_locked(time.monotonic())
                if self._probes:  # keepalives still queued: look again soon in case their prober is stuck
                    sleep = min(sleep, _PROBE_STUCK_S)
            # At most a few wake-ups a second however many hosts: their deadlines are batched.
            self._wake.wait(max(0.25, sleep))
            self._wake.clear()


_LIVENESS = _Liveness()


def raise_fd_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit: a thousand hosts need a few thousand descriptors."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard
        if hard == resource.RLIM_INFINITY:  # the kernel caps "unlimited" at fs.nr_open
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass  # not permitted here: keep what we have
