"""Jump hosts (ssh config ProxyJump): one shared, ref-counted connection per route of jump hosts, and the
direct-tcpip channels the targets behind them connect through.

Sample of what it serves (~/.ssh/config): every node behind one bastion shares one login on it.

    Host node*
        ProxyJump bastion
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from preflight.transport.base import TransportError
from preflight.transport.hop import (TRANSPORT_WAKE_S, SSHOptions, check_keys, close_client, handshake,
                                     tcp_connect, wait_banner)
from preflight.transport.proxy import ProxySocket

if TYPE_CHECKING:
    from preflight.sshconfig import Hop


def open_channel(jump: "Jump", hop: "Hop", timeout: float) -> Any:  # a paramiko Channel
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


class HopError(Exception):
    """A jump host of a route could not be reached: which one (0-based index into the route) and why."""

    def __init__(self, index: int, hop: "Hop", error: TransportError):
        super().__init__(str(error))
        self.index = index
        self.hop = hop
        self.error = error


def hop_message(exc: HopError, route: List["Hop"]) -> str:
    return f"jump host {exc.hop.name} (hop {exc.index + 1} of {len(route)} to {route[-1].name}): {exc.error}"


class Jump:
    """One authenticated connection to a jump host, shared by every target behind it in this run."""

    def __init__(self, key: tuple, chain: Tuple["Hop", ...]):
        self.key = key
        self.chain = chain  # the hops to this jump host, itself last
        self.refs = 0
        self.lock = threading.Lock()  # held while connecting: the targets behind it wait for one attempt
        self.client: Any = None
        self.error: Optional[HopError] = None
        self.parent: Optional[Jump] = None
        self.proxy: Optional[ProxySocket] = None

    @property
    def transport(self) -> Any:  # the jump host's paramiko Transport
        return self.client.get_transport()

    def alive(self) -> bool:
        return self.client is None or bool(self.transport and self.transport.is_active())


class JumpPool:
    """Jump host connections by route: targets behind one jump host multiplex their channels over one SSH
    connection (one login on the bastion per run, not one per target: MaxStartups), closed with the last target.

    A failed connect is shared by the targets that waited for it (one timeout, not one per target); once they have
    all let go of it, the next acquire tries again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: Dict[tuple, Jump] = {}

    @staticmethod
    def _key(chain: Tuple["Hop", ...], options: SSHOptions) -> tuple:
        return (chain, str(Path(options.known_hosts).expanduser()), options.accept_new_host_keys,
                options.connect_timeout)

    def acquire(self, chain: Tuple["Hop", ...], options: SSHOptions) -> Jump:
        key = self._key(chain, options)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.alive():
                entry = self._entries[key] = Jump(key, chain)  # a dead one closes with its last user
            entry.refs += 1
        with entry.lock:
            if entry.client is None and entry.error is None:
                try:
                    self._connect(entry, options)
                except HopError as exc:
                    entry.error = exc
        if entry.error is not None:
            self.release(entry)
            raise entry.error
        return entry

    def _connect(self, entry: Jump, options: SSHOptions) -> None:
        chain = entry.chain
        hop, index = chain[-1], len(chain) - 1
        start = time.monotonic()
        parent: Optional[Jump] = None
        proxy: Optional[ProxySocket] = None
        try:
            check_keys(hop)
            if len(chain) > 1:
                parent = self.acquire(chain[:-1], options)
                start = time.monotonic()  # each hop has the whole connect timeout of its own
                sock: Any = open_channel(parent, hop, options.connect_timeout)
            elif hop.command is not None:
                sock = proxy = ProxySocket(hop.command)
            else:
                sock = tcp_connect(hop, options.connect_timeout)
            wait_banner(sock, hop, options.connect_timeout, start, proxy)
            client = handshake(hop, sock, options, start, proxy)
        except HopError:
            raise  # an earlier hop's: it names itself
        except TransportError as exc:
            if proxy is not None:
                proxy.close()
            if parent is not None:
                self.release(parent)
            if index and "ssh-keyscan" in exc.fix:
                # Behind a jump host the scan must run where the host is reachable: said in the prose line, never
                # after a command line, where a paste would run it as words of the command.
                prose, _, commands = exc.fix.partition("\n")
                exc.fix = prose.rstrip(":") + " (run the commands on a host that can reach it):" + \
                    ("\n" + commands if commands else "")
            raise HopError(index, hop, exc) from None
        try:
            client.get_transport().sock.settimeout(TRANSPORT_WAKE_S)
        except OSError:
            pass
        entry.client, entry.parent, entry.proxy = client, parent, proxy

    def release(self, entry: Jump) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
        if entry.client is not None:
            close_client(entry.client, through_jump=entry.parent is not None)
        if entry.proxy is not None:
            entry.proxy.close()
        if entry.parent is not None:
            self.release(entry.parent)

    def open_count(self) -> int:
        """Jump host connections open now (tests: none after a run)."""
        with self._lock:
            return len(self._entries)


JUMPS = JumpPool()
