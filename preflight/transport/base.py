"""The Transport interface every transport implements, and the command machinery they share.

``transport.run(argv, timeout, stdin=b"") -> CommandResult(rc, stdout, stderr, duration)``. Every call has a
deadline, stdout and stderr are read concurrently, and a command that stops reading its stdin fails the send
instead of blocking it. ``transport.start(...)`` returns a RunningCommand for long-lived host-side services;
ProcessCommand is one on this machine (a local command, an srun client), FailedCommand one that never started.
"""
from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import (IO, TYPE_CHECKING, Any, Callable, ClassVar, List, Mapping, Optional, Protocol, Sequence,
                    Tuple)

if TYPE_CHECKING:
    from preflight.transport.hop import SSHOptions

# rc used when our own deadline killed the command (as GNU timeout does).
RC_TIMEOUT = 124


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


@dataclass(frozen=True)
class TransportOption:
    """One command-line flag a transport declares for itself (``Transport.OPTIONS``): the CLI adds it to ``run``,
    and its value reaches the transport, under ``dest``, in the run's transport options."""

    flag: str
    dest: str
    help: str
    choices: Tuple[str, ...] = ()
    default: Any = None


class SharedSession(Protocol):
    """One command that serves every host at once (a transport's ``open_shared``): ``channels`` holds each host's
    end of it, which that host's agent adopts instead of starting its own; ``close()`` ends it for all."""

    @property
    def channels(self) -> Mapping[str, RunningCommand]: ...

    def close(self) -> None: ...


class Transport:
    """The interface: name and address of the host, connect(), start() and run(), close().

    A transport that needs no connection (this machine) keeps the defaults of connect() and the connection facts
    (user, via, connect_seconds); the runner reads them of every transport alike.

    What the coordinator asks of a kind of transport is on the class: ``HELP`` (its line in ``--transport``'s
    help), ``OPTIONS`` (its own flags), ``from_options`` (a transport for one host from the run's options),
    ``unusable`` (why it cannot run here, before any host is contacted), ``IN_ALLOCATION`` (the default inside a
    scheduler's allocation), ``READS_SSH_CONFIG`` and ``open_shared`` (one session for every host, or None).
    """

    HELP: ClassVar[str] = ""
    OPTIONS: ClassVar[Tuple[TransportOption, ...]] = ()
    IN_ALLOCATION: ClassVar[bool] = False
    READS_SSH_CONFIG: ClassVar[bool] = False
    # Whether open_shared may serve its hosts: the connection facts then say which hosts' agents it started.
    SHARES_SESSIONS: ClassVar[bool] = False

    name: str = ""
    address: str = ""
    # Whether RunningCommand.kill() ends the process on the host (a local process group; an srun step, which
    # slurmd takes down). An SSH channel's close signals nothing to the remote process.
    kill_reaches_host: bool = True
    user: str = ""
    via: str = ""  # how the host is reached when not directly: "jump host bastion", "ProxyCommand", "srun"
    connect_seconds: float = 0.0

    def connect(self) -> None:
        """Reach the host (TransportError says why not); nothing to do for a transport without a connection."""

    def connect_budget_s(self) -> float:
        """The longest connect() can take (0: it does not wait on the network)."""
        return 0.0

    def network_rtt_ms(self) -> Optional[float]:
        """The round-trip time to the host as the network measures it, or None when there is no such measure."""
        return None

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        """Start argv; ``max_output`` caps the bytes buffered from it (over it: stopped, result.error says so)."""
        raise NotImplementedError

    def run(self, argv: Sequence[str], timeout: float, stdin: bytes = b"") -> CommandResult:
        return self.start(argv, stdin).wait(timeout)

    def close(self) -> None:
        pass

    @classmethod
    def from_options(cls, host: str, ssh: "SSHOptions", options: Mapping[str, Any]) -> "Transport":
        """A transport of this kind for host: ``ssh`` is the run's SSH settings (its connect timeout is every
        transport's), ``options`` the values of every transport's ``OPTIONS`` by dest (this one reads its own)."""
        raise NotImplementedError

    @classmethod
    def unusable(cls, env: Mapping[str, str]) -> str:
        """Why this kind cannot reach hosts from this environment (one line for the user, exit 2), or ""."""
        return ""

    @classmethod
    def open_shared(cls, transports: Sequence["Transport"], argv: Sequence[str], stdin: bytes,
                    options: Mapping[str, Any]) -> Optional[SharedSession]:
        """Start argv once for all these hosts (of this kind), its stdin broadcast to every one; None (the default)
        when each host starts its own."""
        return None


# ----------------------------------------------------------------------------------------- on this machine

def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: prctl(PR_SET_PDEATHSIG, SIGKILL) in the child (Linux; elsewhere nothing), and an exit if the
    parent is already gone (it died between the fork and the prctl). Only for a process started by a thread that
    lives as long as the process is wanted: the signal comes when that thread ends."""
    def preexec() -> None:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(1)
    return preexec


class ProcessCommand(RunningCommand):
    """A process on this machine with piped stdin, stdout and stderr: a local command, or an srun client."""

    def __init__(self, argv: Sequence[str], stdin: bytes, keep_stdin_open: bool, max_output: Optional[int],
                 die_with_parent: bool = False):
        super().__init__(max_output)
        # Own process group, so a timeout kills the whole tree the command started. die_with_parent: the kernel
        # SIGKILLs the process (itself only: not inherited across its forks) when the thread that started it ends,
        # so a kill -9 of the coordinator leaves it no more than a close() would (see _die_with_parent).
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True,
                                      preexec_fn=_die_with_parent(os.getpid()) if die_with_parent else None)
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

    def _pump(self, stream: Any, is_err: bool) -> None:  # a binary pipe (read1)
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


class FailedCommand(RunningCommand):
    """A command that did not start (no such program, no connection): its rc and stderr say why."""

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
