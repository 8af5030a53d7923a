"""The temporary files a check writes on a host (the NVMe dd file, the checkpoint probe), registered so that they are
removed when the request or the agent ends, however it ends: also after kill -9 of the coordinator, and also when
the worker that wrote one is itself killed. Standard library only, Python 3.9.

A check registers a path before it creates the file, and removes it with ``remove``::

    tempfiles.register("/local_nvme/.preflight-dd-3f9a0c")           # gone when this request ends
    tempfiles.register("/ckpt/.preflight-ckpt-1a2b-node01", keep=True)  # outlives its request: the agent's to remove
    tempfiles.remove("/local_nvme/.preflight-dd-3f9a0c")             # unlink and forget

In a worker of the persistent agent every registration also goes down a pipe that the agent reads (its Ledger), as
records ``+PATH\\0`` (this request's), ``kPATH\\0`` (kept) and ``-PATH\\0`` (removed): a worker that is SIGKILLed
(stopped, or stuck in C code past its grace) cannot clean up after itself, and its agent, which outlives it until
its own lifeline closes, can.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional, Set, Tuple

# Every registered file's name starts with this: whatever a worker's records say, the agent never removes a file
# of anyone else's.
PREFIX = ".preflight-"

_lock = threading.Lock()
_paths: Dict[str, bool] = {}  # path -> kept beyond this request
# (descriptor, (st_dev, st_ino) of the pipe) to the agent's Ledger, in a worker of the persistent agent.
_sink: List[Optional[Tuple[int, Tuple[int, int]]]] = [None]


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:  # already gone, or the directory went away: nothing left to remove
        return False


def _check(path: str) -> str:
    path = str(path)
    if not os.path.basename(path).startswith(PREFIX) or "\0" in path:
        raise ValueError(f"a temporary file's name must start with {PREFIX!r}: {path!r}")
    return path


def register(path: str, keep: bool = False) -> None:
    """Record path as a temporary file of this run, before creating it. keep=False: removed when this request ends,
    or its lifeline closes; keep=True: it outlives the request (a probe file another request reads) and is removed
    by ``remove`` or when the agent's own lifeline closes."""
    path = _check(path)
    with _lock:
        _paths[path] = keep
    _tell(b"k" if keep else b"+", path)


def remove(path: str) -> bool:
    """Unlink path (gone already is fine) and forget it; whether there was a file to unlink."""
    removed = _unlink(str(path))
    forget(path)
    return removed


def forget(path: str) -> None:
    """Forget path without unlinking it (its creation failed because another's file has that name)."""
    path = str(path)
    with _lock:
        _paths.pop(path, None)
    _tell(b"-", path)


def registered() -> Dict[str, bool]:
    """{path: kept} of this process's registrations."""
    with _lock:
        return dict(_paths)


def unlink_registered(kept: bool) -> List[str]:
    """The lifeline closed: unlink this process's temporary files (the kept ones too with kept=True) and keep them
    registered, so that a file its request creates after this is still removed by the request's end. Returns the
    paths that were there."""
    with _lock:
        paths = [p for p, k in _paths.items() if kept or not k]
    return [p for p in paths if _unlink(p)]


def end_request() -> List[str]:
    """The request is over: remove what it registered for itself (not the kept files). Returns the paths removed."""
    with _lock:
        paths = [p for p, k in _paths.items() if not k]
    for p in paths:
        remove(p)
    return paths


def attach(fd: int) -> None:
    """In a worker just forked by the persistent agent: tell the agent's Ledger through fd, too."""
    st = os.fstat(fd)
    _sink[0] = (fd, (st.st_dev, st.st_ino))


def attached() -> bool:
    return _sink[0] is not None


def _tell(kind: bytes, path: str) -> None:
    sink = _sink[0]
    if sink is None:
        return
    fd, ident = sink
    record = kind + os.fsencode(path) + b"\0"  # at most PIPE_BUF (4096) bytes: one write, never interleaved
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident:
            raise OSError("the agent's pipe was closed and its number reused")
        view = memoryview(record)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        _sink[0] = None  # the agent is gone: this process's own lifeline and finally blocks are all there is


def _forget_parents() -> None:
    # A forked child (a worker, a rank, a forked probe) never owns its parent's files, nor its parent's pipe.
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _paths.clear()
    _sink[0] = None


os.register_at_fork(after_in_child=_forget_parents)


class Ledger:
    """The persistent agent's side: a pipe per worker, what each worker registered for its request, and what
    workers kept. ``close(fd)`` after a worker ended removes what it left; ``close_all()`` when the agent's
    lifeline closes removes everything, the kept files too."""

    def __init__(self) -> None:
        self._open: Dict[int, Tuple[bytearray, Set[str]]] = {}  # read end -> (partial record, request's paths)
        self._kept: Set[str] = set()

    def channel(self) -> Tuple[int, int]:
        """A new worker's pipe: (read end, kept here; write end, for the worker to attach, closed here after fork)."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        self._open[r] = (bytearray(), set())
        return r, w

    def read(self, fd: int) -> None:
        """Take what the worker wrote so far (never blocks)."""
        entry = self._open.get(fd)
        if entry is None:
            return
        buf, mine = entry
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                break
            if not data:
                break
            buf.extend(data)
        while True:
            end = buf.find(b"\0")
            if end < 0:
                break
            record = bytes(buf[:end])
            del buf[:end + 1]
            if not record:
                continue
            kind, path = record[:1], os.fsdecode(record[1:])
            if not os.path.basename(path).startswith(PREFIX):
                continue  # not a temporary file of ours: never removed on a worker's word
            if kind == b"+":
                mine.add(path)
            elif kind == b"k":
                self._kept.add(path)
            elif kind == b"-":
                mine.discard(path)
                self._kept.discard(path)

    def close(self, fd: int) -> List[str]:
        """The worker has ended: remove the files it registered for its request and did not remove itself; returns
        those that were there."""
        self.read(fd)
        entry = self._open.pop(fd, None)
        try:
            os.close(fd)
        except OSError:
            pass
        if entry is None:
            return []
        return [p for p in sorted(entry[1]) if _unlink(p)]

    def close_all(self) -> List[str]:
        """The agent's lifeline closed (its workers have ended): remove every file left, the kept ones too."""
        removed: List[str] = []
        for fd in list(self._open):
            removed += self.close(fd)
        kept, self._kept = sorted(self._kept), set()
        return removed + [p for p in kept if _unlink(p)]
