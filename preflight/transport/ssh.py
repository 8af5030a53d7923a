"""A host over SSH (paramiko): one authenticated connection per host, commands as channels on it.

argv is always quoted with shlex before it reaches the remote shell. The connection follows ~/.ssh/config (HostName,
User, Port, IdentityFile, ProxyJump, ProxyCommand; see preflight.sshconfig), checks known_hosts, and is watched for
a dead peer. Sample of a host it reaches (``Host`` block of ~/.ssh/config):

    Host node01
        HostName 198.18.0.1
        User ops
"""
from __future__ import annotations

import select
import shlex
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

from preflight.transport.base import (RC_TIMEOUT, FailedCommand, RunningCommand, StdinStalled, Transport,
                                      TransportError)
from preflight.transport.hop import (TRANSPORT_WAKE_S, SSHOptions, check_keys, close_client, handshake,
                                     tcp_connect, wait_banner, wake_reader)
from preflight.transport.jump import JUMPS, HopError, Jump, hop_message, open_channel
from preflight.transport.liveness import KEEPALIVE_COUNT_MAX, LIVENESS
from preflight.transport.proxy import ProxySocket

if TYPE_CHECKING:
    from preflight.sshconfig import Hop

__all__ = ["SSHOptions", "SSHTransport"]

# After the exit status, output still in flight is read until the channel's EOF. Only a process the command
# left behind can hold the output open that long; past this many quiet seconds the command counts as done.
_EOF_GRACE_S = 5.0
# The most a reader sleeps without an event: a safety net, not polling (data, EOF and close wake it at once).
_IDLE_WAKE_S = 30.0


class _SSHCommand(RunningCommand):
    def __init__(self, channel: Any, stdin: bytes, keep_stdin_open: bool, max_output: Optional[int] = None,
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
        quiet_since: Optional[float] = None
        try:
            # The channel's fileno() becomes readable on stdout or stderr data, on EOF and on close; it is a pipe
            # made now, which fails when this process has no descriptor left.
            poller.register(chan.fileno(), select.POLLIN)
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
        except Exception as exc:  # the connection dropped under us: report it as a failed command
            rc = -1
            if isinstance(exc, OSError):  # e.g. no descriptor left for the channel's wake-up pipe (EMFILE)
                self._note_error(f"reading the command's output failed: {exc}")
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
    HELP = "SSH to each host (the default with --hostfile)"
    READS_SSH_CONFIG = True

    @classmethod
    def from_options(cls, host: str, ssh: SSHOptions, options: Mapping[str, Any]) -> Transport:
        return cls(host, ssh)

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
        self._proxy: Optional[ProxySocket] = None  # the ProxyCommand this connection runs over
        self.via = ""  # "jump host bastion", "ProxyCommand": how the connection is made, when not direct
        self._jump: Optional[Jump] = None  # the jump host connection it runs over (shared, ref-counted)

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
        check_keys(target)
        jump: Optional[Jump] = None
        proxy: Optional[ProxySocket] = None
        hop_start = start
        try:
            if len(route) > 1:
                jump = JUMPS.acquire(tuple(route[:-1]), self.options)
                hop_start = time.monotonic()  # each hop has the whole connect timeout of its own
                sock: Any = open_channel(jump, target, self.options.connect_timeout)
            elif target.command is not None:
                sock = proxy = ProxySocket(target.command)
            else:
                sock = tcp_connect(target, self.options.connect_timeout)
            wait_banner(sock, target, self.options.connect_timeout, hop_start, proxy)
            client = handshake(target, sock, self.options, hop_start, proxy)
        except HopError as exc:
            raise TransportError(hop_message(exc, route), exc.error.fix, exc.error.status) from None
        except TransportError as exc:
            if proxy is not None:
                proxy.close()
            if jump is None:
                raise
            JUMPS.release(jump)
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
            transport.sock.settimeout(TRANSPORT_WAKE_S)
        except OSError:
            pass
        self._client = client
        self._watch(transport)
        self.connect_seconds = time.monotonic() - start

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        if self.dead:
            return FailedCommand(255, self.dead, self.dead)
        if self._client is None:
            return FailedCommand(255, "not connected")
        command = " ".join(shlex.quote(a) for a in argv)
        try:
            chan = self._client.get_transport().open_session(timeout=self.options.connect_timeout)
            chan.exec_command(command)
        except Exception as exc:
            return FailedCommand(255, f"cannot open an SSH channel: {exc}", self.dead)
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
        client = self._client
        if client is None:
            return None
        try:
            sock = client.get_transport().sock
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
    def _watch(self, transport: Any) -> None:  # the connection's paramiko Transport
        self._last_rx = time.monotonic()
        packetizer = transport.packetizer
        read_message = packetizer.read_message

        def counting_read_message() -> Any:  # every packet from the server proves it alive
            msg = read_message()
            self._last_rx = time.monotonic()
            return msg

        packetizer.read_message = counting_read_message
        LIVENESS.watch(self)

    def _keepalive_interval(self) -> float:
        return max(0.5, self.options.connect_timeout / KEEPALIVE_COUNT_MAX)

    def check_alive(self, now: float) -> float:
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
            LIVENESS.probe(self, client.get_transport())
        return min(self._last_probe + interval - now, limit - silent)

    def send_keepalive(self, transport: Any) -> None:
        # A global request that wants a reply (OpenSSH answers unknown ones with a failure), sent without
        # waiting for it: any packet back resets the silence clock. Sent by LIVENESS's prober threads: a
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
        LIVENESS.forget(self)
        with self._lock:
            commands = list(self._commands.values())
        for cmd in commands:
            cmd._fail(reason)
        client = self._client
        if client is not None:
            # Closing can wait on a send stuck in the kernel: never hold up the caller for it.
            wake_reader(client)
            threading.Thread(target=client.close, daemon=True).start()

    def close(self) -> None:
        LIVENESS.forget(self)
        if self._client is not None:
            close_client(self._client, through_jump=self._jump is not None)
            self._client = None
        # After the client: its socket (the jump host's channel, the proxy command's pipe) closes first.
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.close()
        jump, self._jump = self._jump, None
        if jump is not None:
            JUMPS.release(jump)
