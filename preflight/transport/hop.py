"""One SSH hop: TCP connect (or a ProxyCommand's socket), the server's banner, the handshake with its host key
policy and authentication, and closing. A direct connection is one hop; a ProxyJump chain is one per jump host.

Sample of what it needs of a hop (preflight.sshconfig.Hop, from ``ProxyJump bastion`` in ~/.ssh/config):

    Hop(name="node01", hostname="198.18.0.1", port=22, user="ops", identity_files=("~/.ssh/id_ed25519",))
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

from preflight.transport.base import TransportError
from preflight.transport.known_hosts import (HostKeyPolicy, KnownHosts, UnknownHostKey, changed_key_fix, file_signature,
                                             fingerprint)
from preflight.transport.proxy import ProxySocket

if TYPE_CHECKING:
    from preflight.sshconfig import Hop

# paramiko's transport thread logs tracebacks of failed handshakes to stderr; each failure already
# becomes a precise TransportError, so its log would only be noise in front of the report.
_paramiko_log = logging.getLogger("paramiko")
_paramiko_log.addHandler(logging.NullHandler())
_paramiko_log.propagate = False


@dataclass
class SSHOptions:
    """How to reach hosts over SSH: the run's --ssh-user, --ssh-port, --ssh-key, --ssh-config, --known-hosts,
    --accept-new-host-keys and --connect-timeout (user, port and key apply to the target, not its jump hosts)."""

    user: Optional[str] = None
    port: Optional[int] = None
    key: Optional[str] = None
    config_path: Optional[str] = "~/.ssh/config"
    known_hosts: str = "~/.ssh/known_hosts"
    accept_new_host_keys: bool = False
    connect_timeout: float = 10.0


# How often paramiko's reader thread wakes on an idle connection (paramiko's default is 0.1 s). Each wake costs
# about 100 us of Python (52 us per connection-second at 2 s): at 1,000 hosts that was 50 ms of CPU every second.
# Nothing waits on it: close() shuts the socket down (the reader wakes at once), and dead peers are found by
# the keepalives.
TRANSPORT_WAKE_S = 30.0
# How long close() waits for a connection's reader thread to finish closing its socket (it takes milliseconds).
_READER_EXIT_S = 2.0


def close_client(client: Any, through_jump: bool) -> None:  # a paramiko SSHClient
    """Close a paramiko client, its reader thread woken at once (wake_reader).

    Through a jump host its socket is a channel of the jump host's connection, which must outlive the reader
    thread's own close of that channel: released first, the thread died on EOFError with a traceback on stderr
    (1 run in 6 of tests/transport/test_proxyjump.py). So wait for the thread; it ends at once, the bound is a backstop.
    """
    thread = client.get_transport()
    wake_reader(client)
    client.close()
    if through_jump and thread is not None and thread is not threading.current_thread():
        thread.join(_READER_EXIT_S)


def wake_reader(client: Any) -> None:
    """Shut the connection's socket down, so that paramiko's reader thread, asleep in recv() for up to
    TRANSPORT_WAKE_S, gets EOF and ends now (closing the descriptor alone does not wake a blocked recv)."""
    try:
        client.get_transport().sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass


def check_keys(hop: "Hop") -> None:
    for k in hop.identity_files:
        if not Path(k).is_file():
            raise TransportError(f"SSH key {k} not found", "pass an existing key with --ssh-key (or fix IdentityFile "
                                 "in the ssh config)", "error")


def tcp_connect(hop: "Hop", timeout: float) -> socket.socket:
    host, port = hop.hostname, hop.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TransportError(f"DNS lookup of {host!r} failed: {exc.strerror}",
                             "check the hostfile name, /etc/hosts or DNS "
                             "(or set HostName in ~/.ssh/config)") from None
    except OSError as exc:  # the resolver's own system error (EAI_SYSTEM), e.g. no descriptor left to read /etc/hosts
        raise TransportError(f"DNS lookup of {host!r} failed: {exc.strerror or exc}",
                             "see the coordinator's own limits in the report") from None
    family, _, _, _, sockaddr = infos[0]
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:  # no descriptor left (EMFILE) or no memory: this machine's limit, named by the runner
        raise TransportError(f"cannot connect to {host}:{port}: {exc.strerror or exc}",
                             "see the coordinator's own limits in the report") from None
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


def wait_banner(sock: Any, hop: "Hop", timeout: float, start: float, proxy: Optional[ProxySocket] = None) -> None:
    """Wait for the server's first bytes ourselves, without consuming them (paramiko still reads the banner): a
    port that accepts TCP but never speaks SSH gets a precise error instead of paramiko's racy timeouts.
    ``timeout`` counts from ``start`` (the hop's TCP connect included)."""
    host, port = hop.hostname, hop.port
    left = max(1.0, timeout - (time.monotonic() - start))
    where = f"{host}:{port}"
    if isinstance(sock, (socket.socket, ProxySocket)):
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


def _other_key(exc: Any, index: KnownHosts, lookup_name: str, known: Path) -> TransportError:
    """The error for a host that presented a key other than known_hosts' (paramiko's BadHostKeyException): revoked,
    or CHANGED."""
    revoked = index.revoked(lookup_name, exc.key.get_name(), exc.key.get_base64())
    if revoked:
        return TransportError(revoked, f"remove the host's key from {known} and check the host", "fail")
    got = f"{exc.key.get_name()} {fingerprint(exc.key)}"
    had = f"{exc.expected_key.get_name()} {fingerprint(exc.expected_key)}" if exc.expected_key else "another"
    return TransportError(
        f"host key of {lookup_name} CHANGED (got {got}, {known} has {had}); "
        "refusing to connect: this may be a man-in-the-middle or a reinstalled host",
        changed_key_fix(lookup_name, known, exc.key.get_name(), fingerprint(exc.key)), "fail")


def _handshake_failed(exc: Exception, host: str, port: int, left: float,
                      proxy: Optional[ProxySocket]) -> TransportError:
    """The error for an SSH handshake paramiko gave up on (no banner in time, a protocol error)."""
    text = str(exc)
    if "banner" in text.lower():
        text = (f"{host}:{port} accepted TCP but sent no SSH banner within {left:.0f}s "
                "(hung sshd, or not an SSH server on this port)")
    if proxy is not None:
        text += f" ({proxy.describe()})"
    return TransportError(f"SSH handshake with {host}:{port} failed: {text}",
                          "check sshd on the host (systemctl status ssh) and the port")


def handshake(hop: "Hop", sock: Any, options: SSHOptions, start: float,
              proxy: Optional[ProxySocket] = None) -> Any:
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
    client.set_missing_host_key_policy(HostKeyPolicy(options.accept_new_host_keys, known, index))
    left = max(1.0, timeout - (time.monotonic() - start))
    try:
        client.connect(host, port=port, username=user, key_filename=keys or None, sock=sock,
                       timeout=left, banner_timeout=left, auth_timeout=left, allow_agent=True,
                       look_for_keys=not keys)
    except UnknownHostKey as exc:
        client.close()
        raise TransportError(str(exc), exc.fix, "fail") from None
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise _other_key(exc, index, lookup_name, known) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise TransportError(f"authentication as {user!r} failed: {exc}",
                             "install your public key in ~/.ssh/authorized_keys on the host, or pass "
                             "--ssh-user/--ssh-key (User/IdentityFile in the ssh config for a jump host)",
                             "fail") from None
    except paramiko.SSHException as exc:
        client.close()
        raise _handshake_failed(exc, host, port, left, proxy) from None
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


# ------------------------------------------------------------------------------------------- key files

_KEY_CACHE: Dict[tuple, object] = {}
_KEY_CACHE_LOCK = threading.Lock()


def _share_key_files(client: Any) -> None:
    """Load each private key file once per run instead of once per host.

    paramiko's SSHClient tries every key class on every key file for every connection (an ed25519 key is
    read and parsed three times per host). This keeps paramiko's order and outcome per (file, class,
    passphrase), the failures included, and reloads when the file (or its certificate) changes.
    """
    load = getattr(client, "_key_from_filepath", None)
    if load is None:  # another paramiko: keep its own loading
        return

    def cached(filename: str, klass: Any, password: Any) -> Any:
        cert = filename if filename.endswith("-cert.pub") else filename + "-cert.pub"
        key = (filename, klass, password, file_signature(Path(filename)), file_signature(Path(cert)))
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
