"""Read an OpenSSH client config the way ``ssh`` does for what preflight uses, and plan the hops to a host.

Sample of what it parses (``~/.ssh/config``, or ``--ssh-config``):

    Host bastion
        HostName bastion.example.com
        User ops
        Port 2222
    Host node*
        ProxyJump bastion                  # or a chain: ops@outer:2200,bastion   (or: ProxyJump none)
        IdentityFile ~/.ssh/cluster_ed25519
    Host legacy-*
        ProxyCommand ssh -W %h:%p bastion  # run with /bin/sh -c, tokens %h %n %p %r %% expanded first
    Match localnetwork 10.0.0.0/8          # -> one warning naming file:line; its block is ignored
    Include ~/.ssh/config.d/*              # -> one warning naming file:line; the files are not read

paramiko's ``SSHConfig`` does the Host/Match matching (``Match all/canonical/final/host/originalhost/user/
localuser``). This module adds what OpenSSH does and paramiko does not: which of ProxyJump and ProxyCommand wins
(the first one obtained, as ``ssh -G`` shows), their %-tokens expanded with the *final* port and user (after
``--ssh-port``/``--ssh-user``), ProxyJump chains parsed (``user@host:port``, ``ssh://``, ``[v6]:port``), and a line
number for what it cannot read or honour. ``route()`` turns that into the list of hops, first jump host first.
"""
from __future__ import annotations

import copy
import getpass
import os
import pwd
import re
import shlex
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# Match criteria paramiko evaluates as OpenSSH does. `exec` is left out on purpose: paramiko would run it through
# a shell with %h replaced by a hostfile name, unchecked; localnetwork, tagged, command, sessiontype, version
# (and anything newer) paramiko does not know, and it would treat the block as matching.
_MATCH_SUPPORTED = {"all", "canonical", "final", "host", "originalhost", "user", "localuser"}
_MATCH_NO_ARGUMENT = {"all", "canonical", "final"}
_SETTING = re.compile(r"(\w+)(?:\s*=\s*|\s+)(.+)")  # paramiko's own line syntax
# A jump host, or a chain, longer than this is a loop in the config (a: ProxyJump b, b: ProxyJump a).
MAX_HOPS = 16
# What may be put into a ProxyCommand (a shell command) in place of %h, %n, %r: OpenSSH 9.6 refuses the same
# shell metacharacters in host and user names it expands there.
_SHELL_SAFE = re.compile(r"^[A-Za-z0-9_.:@%+\[\]-]+$")


class SSHConfigError(Exception):
    """The config cannot be read, or a ProxyJump/ProxyCommand in it cannot be used; names file:line or the key."""


@dataclass(frozen=True)
class Jump:
    """One element of a ProxyJump value: ``[user@]host[:port]``."""

    host: str
    user: Optional[str] = None
    port: Optional[int] = None


@dataclass(frozen=True)
class Hop:
    """Where and how to log in to one host of a route, as ``ssh -G`` would resolve it."""

    name: str  # as written in the hostfile or in a ProxyJump
    hostname: str
    port: int
    user: str
    identity_files: Tuple[str, ...] = ()
    proxy_jump: Optional[str] = None  # the value that applies, as written ("none" never kept)
    proxy_command: Optional[str] = None  # the value that applies, as written
    jumps: Tuple[Jump, ...] = ()
    command: Optional[str] = None  # proxy_command with its tokens expanded: what /bin/sh -c runs

    @property
    def address(self) -> str:
        return f"{self.hostname}:{self.port}"


@dataclass
class SSHConfigFile:
    """One parsed config file; ``warnings`` are one line each, "<file>:<line>: ..."."""

    display: str
    text: str = ""
    warnings: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        import paramiko
        cleaned = self._scan(self.text)

        two_passes = self._two_passes

        class _Config(paramiko.SSHConfig):
            # Leave ProxyCommand/ProxyJump unexpanded: paramiko would use the config's port and user, not the
            # --ssh-port/--ssh-user that win over them, and knows neither %n nor %%.
            def _allowed_tokens(self, key):  # type: ignore[no-untyped-def]
                return [] if key in ("proxycommand", "proxyjump") else super()._allowed_tokens(key)

            def lookup_with(self, hostname: str, seed: Dict[str, str]):  # type: ignore[no-untyped-def]
                # The seed is what the command line set (ssh -l/-p): first obtained, so it wins, and `Match user`
                # sees it. paramiko always reads the file twice, so a `Match host` above the block that sets
                # HostName matches the second time; ssh reads it once, unless it canonicalizes or the file has
                # `Match final`/`canonical` (then paramiko's two passes are what ssh does).
                options = paramiko.SSHConfigDict(seed)
                if two_passes:
                    options = self._lookup(hostname, options)
                    options.setdefault("hostname", hostname)
                    if options.get("canonicalizehostname", None) in ("yes", "always"):
                        return {**self.lookup(hostname), **seed}  # paramiko's canonicalization (DNS), then -l/-p
                    return self._lookup(hostname, options, canonical=False, final=True)
                options = self._lookup(hostname, options, canonical=False, final=True)
                options.setdefault("hostname", hostname)
                return options

        try:
            self._config = _Config.from_text(cleaned)
        except Exception as exc:  # paramiko's ConfigParseError and friends: _scan names most of them by line
            raise SSHConfigError(f"{self.display}: {exc}") from None
        self._lock = threading.Lock()
        self._index_sections()

    def _index_sections(self) -> None:
        """Index the ``Host`` sections by name, so that a lookup visits only the sections that can match it.

        A section whose patterns are all literal names (no ``*``, ``?``, ``[``, ``!``) can only match those names:
        a lookup hands paramiko the sections indexed under the host's name plus every other one (wildcards,
        negations, ``Match``), in file order, and gets the same answer as from the whole file. paramiko's own
        lookup visits every section, twice, per host: O(hosts x sections), 80 ms a host with 1,000 ``Host``
        entries. With CanonicalizeHostname the name can change between the passes, so every lookup is whole.
        """
        sections = list(getattr(self._config, "_config", []))
        self._sections = sections
        self._by_name: Dict[str, List[int]] = {}
        self._always: List[int] = []
        self._whole = not sections or any("canonicalizehostname" in s.get("config", {}) for s in sections)
        for i, section in enumerate(sections):
            hosts = section.get("host")
            if "matches" not in section and isinstance(hosts, list) and hosts and all(
                    isinstance(h, str) and not h.startswith("!") and not any(c in h for c in "*?[") for h in hosts):
                for name in set(hosts):
                    self._by_name.setdefault(name, []).append(i)
            else:
                self._always.append(i)

    def _config_for(self, name: str):  # type: ignore[no-untyped-def]
        """The parsed config restricted to the sections that can match ``name`` (see _index_sections)."""
        if self._whole:
            return self._config
        sub = copy.copy(self._config)  # shallow: the sections themselves are shared, and only read
        sub._config = [self._sections[i] for i in sorted(self._always + self._by_name.get(name, []))]
        return sub

    def _scan(self, text: str) -> str:
        """Check each line, note what preflight cannot honour, and return the text paramiko gets (same lines)."""
        import paramiko
        self._two_passes = False
        out: List[str] = []
        block_has_proxycommand = False
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            where = f"{self.display}:{lineno}"
            if not line or line.startswith("#"):
                out.append(raw)
                continue
            m = _SETTING.match(line)
            if not m:
                raise SSHConfigError(f"{where}: cannot parse {line[:80]!r} (expected 'Keyword value')")
            key, value = m.group(1).lower(), m.group(2).strip()
            if key == "include":
                self.warnings.append(f"{where}: 'Include' is not supported by preflight; {value} is not read")
                out.append("# " + raw)
                continue
            if key == "proxyusefdpass" and value.lower() == "yes":
                self.warnings.append(f"{where}: 'ProxyUseFdpass yes' is not supported by preflight; a ProxyCommand's "
                                     "stdin/stdout carry the connection")
            if key in ("host", "match"):
                block_has_proxycommand = False
            if key == "canonicalizehostname" and value.lower() in ("yes", "always"):
                self._two_passes = True
            if key == "match":
                try:
                    words = shlex.split(value)
                    paramiko.SSHConfig()._get_matches(value)  # its own validation, here with a line number
                except Exception as exc:
                    raise SSHConfigError(f"{where}: Match {value[:80]!r}: {exc}") from None
                unsupported = []
                expect_argument = False
                for word in words:
                    if expect_argument:
                        expect_argument = False
                        continue
                    criterion = word.lstrip("!").lower()
                    expect_argument = criterion not in _MATCH_NO_ARGUMENT
                    if criterion not in _MATCH_SUPPORTED:
                        unsupported.append(criterion)
                if {w.lstrip("!").lower() for w in words} & {"final", "canonical"}:
                    self._two_passes = True
                if unsupported:
                    self.warnings.append(f"{where}: 'Match {' '.join(unsupported)}' is not supported by preflight; "
                                         "its block is ignored")
                    out.append("Host !*")  # a block that matches no host, same line count
                    continue
            if key == "proxycommand":
                # paramiko lets a later "ProxyCommand none" in the same block replace an earlier command;
                # in OpenSSH the first one stands.
                if value.lower() == "none" and block_has_proxycommand:
                    out.append("# " + raw)
                    continue
                block_has_proxycommand = True
            out.append(raw)
        return "\n".join(out) + "\n"

    # ------------------------------------------------------------------------------------------------ lookups

    def resolve(self, name: str, user: Optional[str] = None, port: Optional[int] = None) -> Hop:
        """HostName, Port, User, IdentityFile and the proxy that applies to ``name``; ``user``/``port`` win over
        the config (``ssh -l``/``-p``)."""
        seed = {k: v for k, v in (("user", user), ("port", str(port) if port else None)) if v}
        config = self._config_for(name)
        with self._lock:  # paramiko's lookup is not documented as thread-safe
            cfg = config.lookup_with(name, seed)
        hostname = cfg.get("hostname", name).lower()  # as ssh does: Host patterns see the name as given, the
        # connection (and the known_hosts lookup, and %h) the lowercased HostName
        if port is None:
            try:
                port = int(cfg.get("port", 22))
            except ValueError:
                raise SSHConfigError(f"{self.display}: Port {cfg.get('port')!r} for {name} is not a number") from None
        if not 0 < port < 65536:
            raise SSHConfigError(f"{self.display}: Port {port} for {name} is out of range")
        user = user or cfg.get("user") or _local_user()
        keys = tuple(str(Path(k).expanduser()) for k in cfg.get("identityfile", []))
        # ssh_config is first-match: of ProxyJump and ProxyCommand the first one obtained applies (ssh -G).
        # paramiko keeps the options in the order they were first obtained; ProxyCommand none is None.
        order = list(cfg)
        jump_raw = cfg.get("proxyjump")
        jump: Optional[str] = None
        command: Optional[str] = None
        if "proxycommand" in cfg and ("proxyjump" not in cfg or order.index("proxycommand") < order.index("proxyjump")):
            command = cfg["proxycommand"]  # None for "ProxyCommand none", which also turns a later ProxyJump off
        elif jump_raw is not None and jump_raw.strip().lower() != "none":
            jump = jump_raw.strip()
        elif "proxycommand" in cfg:  # after "ProxyJump none" a ProxyCommand still applies (ssh -G agrees)
            command = cfg["proxycommand"]
        hop = Hop(name=name, hostname=hostname, port=port, user=user, identity_files=keys,
                  proxy_jump=jump, proxy_command=command)
        tokens = {"h": hostname, "n": name, "p": str(port), "r": user}
        if jump is not None:
            hop = replace(hop, jumps=tuple(parse_jump(expand_tokens(jump, tokens, "ProxyJump"), self.display)))
        if command is not None:
            for token, value in (("h", hostname), ("n", name), ("r", user)):
                if f"%{token}" in command.replace("%%", "") and not _SHELL_SAFE.match(value):
                    raise SSHConfigError(f"{self.display}: ProxyCommand for {name}: refusing to put {value!r} (%"
                                         f"{token}) into a shell command: it contains shell metacharacters")
            hop = replace(hop, command=expand_tokens(command, tokens, "ProxyCommand"))
        return hop

    def route(self, name: str, user: Optional[str] = None, port: Optional[int] = None) -> List[Hop]:
        """The hops to ``name``, first jump host first and ``name`` last, as OpenSSH chains them.

        ``ProxyJump a,b`` reaches the target through b, b through a: b's own ProxyJump/ProxyCommand do not apply
        (ssh runs ``ssh -J a -W .. b``), a's own config does, recursively.
        """
        return self._route(name, user, port, None, 0)

    def _route(self, name: str, user: Optional[str], port: Optional[int], forced: Optional[Tuple[Jump, ...]],
               depth: int) -> List[Hop]:
        if depth >= MAX_HOPS:
            raise SSHConfigError(f"{self.display}: more than {MAX_HOPS} jump hosts on the way to {name}: is "
                                 "there a ProxyJump loop?")
        hop = self.resolve(name, user, port)
        if forced is not None:
            hop = replace(hop, jumps=forced, proxy_command=None, command=None,
                          proxy_jump=",".join(_jump_text(j) for j in forced))
        if hop.command is not None or not hop.jumps:
            return [hop]
        last, before = hop.jumps[-1], hop.jumps[:-1]
        return self._route(last.host, last.user, last.port, before or None, depth + 1) + [hop]


def _jump_text(jump: Jump) -> str:
    host = f"[{jump.host}]" if ":" in jump.host else jump.host
    return (f"{jump.user}@" if jump.user else "") + host + (f":{jump.port}" if jump.port else "")


def expand_tokens(value: str, tokens: Dict[str, str], key: str) -> str:
    """OpenSSH's percent_expand for ProxyCommand/ProxyJump: %h %n %p %r and %%; any other %x is an error."""
    def one(m: "re.Match[str]") -> str:
        letter = m.group(1)
        if letter == "%":
            return "%"
        if letter in tokens:
            return tokens[letter]
        raise SSHConfigError(f"{key} {value!r}: unknown token %{letter} (ProxyCommand and ProxyJump accept "
                             "%%, %h, %n, %p and %r)")
    return re.sub(r"%(.?)", one, value)


def parse_jump(value: str, where: str = "ssh config") -> List[Jump]:
    """``[user@]host[:port]``, ``ssh://[user@]host[:port]`` and ``[v6addr]:port``, comma-separated."""
    jumps = []
    for part in value.split(","):
        spec = part.strip()
        if spec.startswith("ssh://"):
            spec = spec[len("ssh://"):].rstrip("/")
        user: Optional[str] = None
        if "@" in spec:
            user, spec = spec.rsplit("@", 1)
        port_text = ""
        if spec.startswith("["):
            host, sep, rest = spec[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise SSHConfigError(f"{where}: invalid ProxyJump {value!r}: bad address {part.strip()!r}")
            port_text = rest[1:]
        elif spec.count(":") == 1:
            host, port_text = spec.split(":")
        else:
            host = spec
        if not host or (user is not None and not user) or any(c.isspace() for c in host):
            raise SSHConfigError(f"{where}: invalid ProxyJump {value!r}: {part.strip()!r} names no host")
        port: Optional[int] = None
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise SSHConfigError(f"{where}: invalid ProxyJump {value!r}: bad port in {part.strip()!r}")
            port = int(port_text)
        jumps.append(Jump(host=host, user=user, port=port))
    return jumps


def _local_user() -> str:
    # ssh takes the login name from the password database (not $USER/$LOGNAME, which getpass reads first).
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        pass
    try:
        return getpass.getuser()
    except Exception:
        return "root"


# ----------------------------------------------------------------------------------------------------- loading

_CACHE: Dict[str, Tuple[Tuple[int, int, int], SSHConfigFile]] = {}
_CACHE_LOCK = threading.Lock()


def load(path: Optional[str]) -> SSHConfigFile:
    """The parsed config at ``path`` (as the user wrote it, ``~`` allowed), read once per run; none or a
    missing file is an empty config. SSHConfigError when it cannot be read or parsed."""
    if not path:
        return SSHConfigFile("(no ssh config)")
    full = os.path.expanduser(path)
    try:
        st = os.stat(full)
    except FileNotFoundError:
        return SSHConfigFile(path)
    except OSError as exc:
        raise SSHConfigError(f"{path}: cannot read: {exc.strerror}") from None
    sig = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _CACHE_LOCK:
        cached = _CACHE.get(full)
        if cached is not None and cached[0] == sig:
            return cached[1]
        try:
            text = Path(full).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SSHConfigError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        parsed = SSHConfigFile(path, text)
        _CACHE[full] = (sig, parsed)
        return parsed
