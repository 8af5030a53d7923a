"""known_hosts: the file read once per run and indexed by host name, and the host key policy built on it.

Sample lines it reads (OpenSSH's format):

    node01,198.18.0.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI...
    |1|F1E1KeoE/eEWhi10WpGv4OdiO6Y=|3988QV0VE8wmZL7suNrYQLITLCg= ssh-ed25519 AAAA...
    @revoked * ssh-rsa AAAAB3NzaC1yc2E...
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import shlex
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


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
            sig = file_signature(path)
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
                KnownHosts._cache[self._path] = (file_signature(Path(self._path)), self)

    def keys(self, name: str) -> List[Tuple[str, str]]:
        """(keytype, base64) of every line naming this host, in file order (hashed lines after plain)."""
        with self._lock:
            found = list(self._plain.get(name, []))
            for salt, digests in self._hashed.items():
                hit = digests.get(hmac.new(salt, name.encode(), hashlib.sha1).digest())
                if hit:
                    found.extend(hit)
        return found

    def fill(self, host_keys: Any, name: str) -> None:  # a paramiko HostKeys
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


def file_signature(path: Path) -> Tuple[int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def fingerprint(key: Any) -> str:  # a paramiko PKey
    """A host key's fingerprint as OpenSSH prints it (ssh, ssh-keygen -l, ssh-keyscan | ssh-keygen -lf -):
    ``SHA256:`` and the unpadded base64 of the SHA-256 of the key's wire form."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def split_name(name: str, port: Optional[int] = None) -> Tuple[str, int]:
    """(host, port) of a known_hosts name: ``[198.18.0.2]:2222`` is (198.18.0.2, 2222); a bare name has port
    (default 22). paramiko hands the policy the bracketed form for a port other than 22."""
    if name.startswith("[") and "]:" in name:
        host, _, tail = name[1:].partition("]:")
        if tail.isdigit():
            return host, int(tail)
    return name, port or 22


def entry_name(host: str, port: int) -> str:
    """The name under which OpenSSH (and paramiko) records a host's key: ``host``, or ``[host]:port`` off 22."""
    return host if port == 22 else f"[{host}]:{port}"


def keyscan_command(host: str, port: int, known_hosts: Path) -> str:
    """One pasteable command that records host's keys in known_hosts, once: ssh-keyscan writes the ``[host]:port``
    form itself for a port other than 22, and ssh-keygen -F skips the scan when the name is already there (so a
    second paste appends nothing)."""
    name, path = shlex.quote(entry_name(host, port)), shlex.quote(str(known_hosts))
    port_option = "" if port == 22 else f"-p {port} "
    scan = f"ssh-keyscan {port_option}{shlex.quote(host)}"
    return f"ssh-keygen -F {name} -f {path} >/dev/null || {scan} >> {path}"


def remove_command(host: str, port: int, known_hosts: Path) -> str:
    """One pasteable command that removes every key recorded for host (at port) from known_hosts: ssh-keygen -R
    matches names exactly, so off port 22 the name is ``'[host]:port'``, as the file has it."""
    return f"ssh-keygen -R {shlex.quote(entry_name(host, port))} -f {shlex.quote(str(known_hosts))}"


def _host_key_file(keytype: str) -> str:
    """Where sshd keeps the public half of a key of this type (Debian, RHEL, SUSE alike)."""
    kind = "ed25519" if "ed25519" in keytype else "ecdsa" if "ecdsa" in keytype else "rsa"
    return f"/etc/ssh/ssh_host_{kind}_key.pub"


def verify_hint(keytype: str, fp: str) -> str:
    """How to check a key out of band: on the host's own console, not over the network being checked."""
    return f"on the host, ssh-keygen -lf {_host_key_file(keytype)} must print {fp}"


def unknown_key_fix(name: str, known_hosts: Path, keytype: str, fp: str) -> str:
    """The fix of an unknown host key: verify it, then record it (with --accept-new-host-keys, or the command on
    its own line, pasteable as it is)."""
    host, port = split_name(name)
    return (f"verify the key ({verify_hint(keytype, fp)}), then rerun with --accept-new-host-keys to record it in "
            f"{known_hosts}, or record it with:\n  {keyscan_command(host, port, known_hosts)}")


def changed_key_fix(name: str, known_hosts: Path, keytype: str, fp: str) -> str:
    """The fix of a changed host key: once the host is known to be reinstalled, the two commands, in order, that
    drop its old key and record the new one."""
    host, port = split_name(name)
    return (f"if the host was reinstalled (verify the new key: {verify_hint(keytype, fp)}), replace its old key, "
            f"running these in order:\n  {remove_command(host, port, known_hosts)}"
            f"\n  {keyscan_command(host, port, known_hosts)}")


class UnknownHostKey(Exception):
    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


class HostKeyPolicy:
    """Refuse unknown keys (like StrictHostKeyChecking=yes) unless accept-new was asked for."""

    _lock = threading.Lock()

    def __init__(self, accept_new: bool, known_hosts: Path, index: Optional["KnownHosts"] = None):
        self.accept_new = accept_new
        self.known_hosts = known_hosts
        self.index = index

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:  # paramiko's policy hook
        # hostname is the known_hosts name paramiko looked the key up by: [host]:port off port 22.
        fp = fingerprint(key)
        revoked = self.index.revoked(hostname, key.get_name(), key.get_base64()) if self.index else ""
        if revoked:
            raise UnknownHostKey(revoked, f"the host's key is revoked in {self.known_hosts}; check the host")
        if not self.accept_new:
            ca = (" known_hosts trusts a @cert-authority for this host, but host certificates cannot be "
                  "verified here (paramiko);" if self.index and self.index.has_ca(hostname) else "")
            raise UnknownHostKey(
                f"unknown SSH host key for {hostname} ({key.get_name()} {fp}); refusing to connect{ca}",
                unknown_key_fix(hostname, self.known_hosts, key.get_name(), fp))
        # Append, never rewrite: other tools may be writing the same file.
        with self._lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.known_hosts, "a") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            if self.index is not None:
                self.index.add(hostname, key.get_name(), key.get_base64())
        client.get_host_keys().add(hostname, key.get_name(), key)
