"""Dead-peer detection for SSH connections (OpenSSH's ServerAliveInterval / ServerAliveCountMax), one thread
for every connection.

A connection is watched from connect to close; the thread asks each one when it next needs a look
(``check_alive(now) -> seconds``), and keepalives go out through a few prober threads (``send_keepalive``).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from preflight.transport.ssh import SSHTransport

# ServerAliveCountMax: unanswered keepalives before a host is declared dead. With the interval at
# connect_timeout / KEEPALIVE_COUNT_MAX, a silent host is dead after ~(1 + 1/3) x the connect timeout of
# silence, and found within ~2x (OpenSSH's default count is 3 too).
KEEPALIVE_COUNT_MAX = 3
# A prober thread busy this long on one send is presumed stuck; the next keepalive starts another.
_PROBE_STUCK_S = 0.25


class Liveness:
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

    def probe(self, conn: "SSHTransport", transport: Any) -> None:
        """Queue one keepalive; a prober thread sends it (conn.send_keepalive ends that probe)."""
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
            conn.send_keepalive(transport)

    def _run(self) -> None:
        while True:
            with self._lock:
                conns = list(self._conns.values())
            now = time.monotonic()
            sleep = 3600.0
            for conn in conns:
                try:
                    sleep = min(sleep, conn.check_alive(now))
                except Exception:  # one connection's trouble must not stop the watch over the others
                    continue
            with self._lock:
                self._start_prober_locked(time.monotonic())
                if self._probes:  # keepalives still queued: look again soon in case their prober is stuck
                    sleep = min(sleep, _PROBE_STUCK_S)
            # At most a few wake-ups a second however many hosts: their deadlines are batched.
            self._wake.wait(max(0.25, sleep))
            self._wake.clear()


LIVENESS = Liveness()
