"""Bounded host-side processes: commands with deadlines, tracked children, forked Python, and a bounded fan-out.

Runs on the hosts (shipped by the agent) and on the coordinator; standard library only, Python 3.9. Every child
a check starts is in ``LIVE`` so that the agent can kill them all on a deadline, Ctrl-C or a dropped channel::

    sh(["ldconfig", "-p"], timeout=5) -> Cmd(rc=0, out="... libaio.so.1 (libc6,x86-64) => ...", err="", ...)
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], limit: int, timeout: float) -> List[Any]:
    """Run fn over items with at most ``limit`` at once; an item not done by the deadline yields TimeoutError.

    ``limit`` worker threads take the items in order (an item not started by the deadline is not started):
    a thread per item, most of them waiting for a slot, was 1,000 threads to connect 1,000 hosts 32 at a
    time. Daemon threads, not an executor: a thread stuck in a C call (DNS, a dead socket) must not block exit.
    """
    results: List[Any] = [TimeoutError(f"no answer within {timeout:.0f}s")] * len(items)
    deadline = time.monotonic() + timeout
    todo = iter(enumerate(items))
    take = threading.Lock()

    def work() -> None:
        while time.monotonic() < deadline:
            with take:
                i, item = next(todo, (-1, None))
            if i < 0:
                return
            try:
                results[i] = fn(item)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes that item's result
                results[i] = exc

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(limit, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return list(results)


# --- host side -------------------------------------------------------------------------------

@dataclass
class Cmd:
    """Result of a bounded host-side command. rc 127: not installed; rc 124: timed out."""

    rc: int
    out: str
    err: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.rc == 0


# The agent's own code (a zip of this package) when running under the agent; None on the coordinator.
AGENT_CODE: Optional[bytes] = None

# Every child process a check starts, so the agent can kill them all on timeout, Ctrl-C or a dropped channel.
LIVE: "set[subprocess.Popen[bytes]]" = set()


def spawn(argv: Sequence[str], env: Optional[Dict[str, str]] = None, stdin: Any = subprocess.DEVNULL,
          stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE,
          cwd: Optional[str] = None) -> "subprocess.Popen[bytes]":
    """Start a long-lived child (iperf3 server, worker) in its own process group, tracked for cleanup."""
    full_env = dict(os.environ)
    full_env.update({"LC_ALL": "C", "LANG": "C"})
    if env:
        full_env.update(env)
    proc = subprocess.Popen(list(argv), stdin=stdin, stdout=stdout, stderr=stderr, env=full_env, cwd=cwd,
                            start_new_session=True)
    LIVE.add(proc)
    return proc


def stop(proc: "subprocess.Popen[bytes]", grace: float = 2.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after grace seconds, and forget it."""
    import signal
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    LIVE.discard(proc)


def kill_all() -> None:
    for proc in list(LIVE):
        stop(proc, grace=0.5)


def sh(argv: Sequence[str], timeout: float = 10.0, env: Optional[Dict[str, str]] = None,
       input_text: Optional[str] = None, cwd: Optional[str] = None) -> Cmd:
    """Run argv (never a shell string) with a deadline, C locale, stdout/stderr captured concurrently."""
    start = time.monotonic()
    try:
        proc = spawn(argv, env=env, cwd=cwd,
                     stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL)
    except FileNotFoundError:
        return Cmd(127, "", f"{argv[0]}: command not found", 0.0)
    except PermissionError as exc:
        return Cmd(126, "", f"{argv[0]}: {exc}", 0.0)
    try:
        out, err = proc.communicate(input_text.encode() if input_text is not None else None, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        stop(proc, grace=0)
        out, err = proc.communicate()
        rc = 124
        err = err + f"\n{argv[0]}: timed out after {timeout:.0f}s".encode()
    finally:
        if proc.poll() is None:  # an exception (agent deadline, SIGTERM) interrupted communicate()
            stop(proc, grace=0)
        LIVE.discard(proc)
    return Cmd(rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - start)


class Forked:
    """A forked child seen as much of a Popen as stop() and LIVE need (pid, poll, wait)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def forked_child_stdio(stdin_fd: int, stdout_fd: int, stderr_fd: int, session: bool = False,
                       keep: int = -1) -> tuple:
    """In a child just forked: its own process group (session=True: its own session), these descriptors as its
    0/1/2 and no other of the parent's (but ``keep``, when given: a worker's pipe to its agent's temp-file ledger),
    default handlers for the signals the agent catches, and new sys.std* objects. Returns the old stream objects:
    the caller keeps them until os._exit, because freeing one takes its lock, which a thread that did not survive
    the fork may hold (a worker's lifeline thread, blocked in read)."""
    import signal
    import sys
    if session:
        os.setsid()
    else:
        os.setpgid(0, 0)
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    # The parent's channel, and its other children's pipes and lifelines.
    if keep > 2:
        os.closerange(3, keep)
        os.closerange(keep + 1, 65536)
    else:
        os.closerange(3, 65536)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    held = (sys.stdin, sys.stdout, sys.stderr)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    return held


def _forked_child(script: str, out_w: int, err_w: int) -> NoReturn:
    """fork_python's child: run script with its stdout/stderr on these pipes, exit with its code (1 when it
    raised, its traceback on stderr)."""
    import sys
    rc = 1
    try:
        held = forked_child_stdio(os.open(os.devnull, os.O_RDONLY), out_w, err_w)  # noqa: F841
        exec(compile(script, "<forked>", "exec"), {"__name__": "__main__"})
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def fork_python(script: str, timeout: float = 10.0) -> Cmd:
    """Run a Python script in a forked child of this process, like ``sh([sys.executable, "-c", script])``
    but inheriting what this process already imported: after the python check imported torch in the same
    worker, ds_report's DeepSpeed probe skips a second torch import (1.5-3 s a host). Own process group,
    a deadline, stdout/stderr read concurrently, tracked in LIVE like a spawned child."""
    import selectors
    start = time.monotonic()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        _forked_child(script, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    child = Forked(pid)
    LIVE.add(child)  # type: ignore[arg-type]  # stop() and kill_all() need only pid, poll and wait
    chunks: Dict[int, List[bytes]] = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    code: Optional[int] = None
    try:
        deadline = start + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(min(left, 1.0)):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
        if not sel.get_map():
            try:
                code = child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
    finally:
        if code is None or child.poll() is None:
            stop(child, grace=0)  # type: ignore[arg-type]
        LIVE.discard(child)
        sel.close()
        os.close(out_r)
        os.close(err_r)
    err = b"".join(chunks[err_r])
    if code is None:
        code = 124
        err += b"\nforked python: timed out after %.0fs" % timeout
    return Cmd(code, b"".join(chunks[out_r]).decode(errors="replace"), err.decode(errors="replace"),
               time.monotonic() - start)


def read_text(path: str, default: Optional[str] = None) -> Optional[str]:
    """Read a small /proc or /sys file; None (or default) when absent or unreadable."""
    try:
        with open(path, "r", errors="replace") as fh:
            return fh.read()
    except OSError:
        return default

