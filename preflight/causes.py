"""What to fix, one entry per cause: the report's results grouped by cause, each naming the hosts it affects.

Pure, over a ``results.Report``; the terminal, the JSON (``causes``), JUnit, the HTML and the history read it, and it
names no check: a host's connection is the registered check whose ``SPEC.scope`` is "connection", and what depends
on what is the checks' ``SPEC.reads`` and each result's ``blocked_by``. A cause as the terminal prints it (the hosts
compressed as ClusterShell's NodeSet; a value that differs per host on an indented line of its own)::

    node[03,07]::ssh ERROR - connection to <address>:22 refused: no SSH server listening (blocks 12 other checks
        on each; also launcher_ssh FAILED); fix: start sshd on the host or pass the right --ssh-port
        node03: address 198.18.0.3
        node07: address 198.18.0.7
    node02::rehearse FAILED - cannot open the DeepSpeed config ... (blocks rehearse on node[01,03]); fix: ...
    launch shell::launcher_ssh FAILED - NCCL_SOCKET_IFNAME=bogus0 ... (seen on node[01-03],cluster); fix: ...

and the verdict that ends the report (root causes only; one fixed in no host says where)::

    NOT READY: fix in the launch shell (launcher_ssh: NCCL_SOCKET_IFNAME=bogus0 ...); 3 hosts need fixing
        (node02 rehearse, node[03,07] unreachable)

Grouping: a victim (a result whose ``blocked_by`` names the (host, check) whose fault it follows from, and
``Report.victims`` holds) is in its blocker's cause, on any host or the cluster row, counted as blocked; an
unreachable host's failed connection check is one cause with its other cells; a host's cell whose check reads
another check that FAILed or ERRORed on the same host belongs to that one's cause; a result fixed in no host
(``Result.where``) is one cause per (where, check, status, words), its hosts and the cluster row together; the rest
group by (check, status, message, fix): the same words on several hosts, or the same words apart from each host's
own name, address and SSH key fingerprint, which the line then prints per host; and groups that say the same of the
same hosts from several checks are one.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from preflight.hostside.outcome import Status
from preflight.results import CLUSTER, CLUSTER_NAME, Report, Result
from preflight.text import plain

BAD = (Status.FAIL, Status.ERROR)
# The order causes are printed in: what stops the job first; skips last (they are not printed before the FAILs).
ORDER = {Status.FAIL: 0, Status.ERROR: 0, Status.WARN: 1, Status.SKIP: 2, Status.PASS: 3}
# What a message shares with its group instead of each host's own words, while grouping: never printed (text.py's
# plain() would show a NUL escaped). The host's name becomes the group's NodeSet; an address or a fingerprint is
# "<address>" / "<fingerprint>" and the line lists each host's value under it.
HOST, ADDRESS, FINGERPRINT = "\x00host\x00", "\x00address\x00", "\x00fingerprint\x00"
_SHOWN = {ADDRESS: "<address>", FINGERPRINT: "<fingerprint>"}
_KIND = {ADDRESS: "address", FINGERPRINT: "fingerprint"}
# An SSH key's fingerprint differs per host: SHA256 as OpenSSH prints it, or MD5 as colon-separated hex.
_FINGERPRINTS = re.compile(r"SHA256:[A-Za-z0-9+/]{43}=?|\b(?:[0-9a-f]{2}:){15}[0-9a-f]{2}\b")
# A host name or IPv4 address as a message writes it: dots only between word characters (node02's, node02.).
_WORD = re.compile(r"[\w-]+(?:\.[\w-]+)*")
VERDICT_NAMES = 4  # causes named in the verdict line; the rest are "..."
VERDICT_NODESET = 40  # a longer NodeSet (hosts scattered over a large cluster) is counted instead: "334 hosts"
VERDICT_GIST = 60  # characters of a where-cause's message the verdict quotes
# Where a cause fixed in no host is fixed, as the verdict says it (outcome.WHERE).
WHERE_WORDS = {"launch shell": "in the launch shell", "coordinator": "on the coordinator",
               "every host": "on every host"}
# How many hosts' own values (and own command lines of a shared fix) a line lists before "-v prints the others".
FIX_HOSTS_SHOWN = 8


# --------------------------------------------------------------------------------------- the registry's view

@functools.lru_cache(maxsize=None)
def _specs() -> Dict[str, Any]:
    from preflight import checks as registry
    return {name: registry.spec(name) for name in registry.ORDER}


def connection_checks() -> FrozenSet[str]:
    """The checks that say whether a host can be reached at all (scope "connection"): ssh."""
    return frozenset(name for name, spec in _specs().items() if spec.scope == "connection")


def connection_check() -> str:
    """The one connection check, whose failure blocks a host's other checks."""
    return sorted(connection_checks())[0]


def reads(check: str) -> Tuple[str, ...]:
    spec = _specs().get(check)
    return tuple(spec.reads) if spec is not None else ()


def blocked_message(check: str, connection: str, host: str) -> str:
    """The message of a cell that its host's failed connection kept from running (runner.py writes it)."""
    if host == CLUSTER:
        return f"blocked: no host's {connection} check passed, so {check} had no host to run on"
    return f"blocked: {check} was left out, as the {connection} check of {host} did not pass"


# --------------------------------------------------------------------------------------- host sets

def nodeset(hosts: Sequence[str]) -> str:
    """``node[03-05,17]``: the hosts folded as ClusterShell's NodeSet; names as they are when folding would not give
    back exactly these hosts. The cluster-wide row is ``cluster``."""
    names = [h for h in dict.fromkeys(hosts) if h != CLUSTER]
    parts = [CLUSTER_NAME] if CLUSTER in hosts else []
    if names:
        parts.insert(0, _fold(names))
    return ",".join(parts)


def _fold(names: List[str]) -> str:
    if len(names) == 1:
        return names[0]
    try:
        from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet
        folded = str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP))
        if set(NodeSet(folded, resolver=RESOLVER_NOGROUP)) == set(names):
            return folded
    except Exception:  # a name NodeSet cannot parse: listed as it is
        pass
    return ",".join(names)


# --------------------------------------------------------------------------------------- causes

@dataclass
class Also:
    """Another check that noticed the same cause on (some of) its hosts."""

    check: str
    status: Status
    hosts: List[str] = field(default_factory=list)


@dataclass(eq=False)  # one object per cause: compared and hashed by identity
class Cause:
    """One thing to fix, and the results it stands for.

    id: ``check:n`` (stable for one report); status: that of its own results; checks: the checks whose results say it
    (the first names it); hosts: in the report's order, CLUSTER for the cluster-wide row; message and fix: one
    host's words, or with several hosts their shared words (the group's NodeSet for each host's own name,
    ``<address>`` and ``<fingerprint>`` where ``details`` lists each host's); results: indices into
    ``report.results`` of every cell it covers (its own, the others that noticed it, and its victims); blocked: how
    many of them are victims; also: the other checks' non-pass results; fixed_in: one of outcome.WHERE for a cause
    fixed in no host (its hosts are where it was seen).
    """

    id: str
    status: Status
    checks: List[str]
    hosts: List[str]
    message: str
    fix: str
    results: List[int] = field(default_factory=list)
    blocked: int = 0
    blocked_per_host: Dict[str, int] = field(default_factory=dict)  # victims on the cause's own hosts, same host
    blocked_elsewhere: Dict[str, List[str]] = field(default_factory=dict)  # check -> hosts of victims elsewhere
    also: List[Also] = field(default_factory=list)
    connection: bool = False
    shared: Tuple[str, str] = ("", "")  # message and fix without the host's own words: what several hosts share
    exact: bool = True  # every host of the cause has the very same message and fix
    values: Dict[str, List[Tuple[str, str]]] = field(default_factory=dict)  # host -> its own (placeholder, word)
    details: List[str] = field(default_factory=list)  # "node03: address 198.18.0.3", one per distinct value
    fixed_in: Optional[str] = None

    @property
    def check(self) -> str:
        return self.checks[0]

    @property
    def where(self) -> str:
        """The cause's hosts as a NodeSet (the JSON's ``nodeset``)."""
        return nodeset(self.hosts)

    @property
    def label(self) -> str:
        """What the verdict calls it beside a host's name: ``unreachable``, or the check (``libaio``)."""
        return "unreachable" if self.connection and self.status == Status.ERROR else self.check

    def _notes(self) -> List[str]:
        notes = []
        if self.fixed_in:
            notes.append(f"seen on {nodeset(self.hosts)}")
        same_host = sum(self.blocked_per_host.values())
        if same_host:
            counts = set(self.blocked_per_host.values())
            hosts = [h for h in self.hosts if h != CLUSTER]
            if len(counts) == 1 and len(self.blocked_per_host) == len(hosts):
                n = counts.pop()
                notes.append(f"blocks {n} other check{'s' if n != 1 else ''}{' on each' if len(hosts) > 1 else ''}")
            else:
                notes.append(f"blocks {same_host} result{'s' if same_host != 1 else ''}")
        by_hosts: Dict[str, List[str]] = {}  # victims elsewhere: "blocks launch on node[01,03]"
        for check, hosts in self.blocked_elsewhere.items():
            by_hosts.setdefault(nodeset(hosts), []).append(check)
        for hosts_text, checks in by_hosts.items():
            notes.append(f"blocks {', '.join(checks)} on {hosts_text}")
        for also in self.also:
            on = "" if set(also.hosts) == set(self.hosts) else f" on {nodeset(also.hosts)}"
            notes.append(f"also {also.check} {also.status.word}{on}")
        return notes

    def line(self) -> str:
        """``node[03-04]::ssh ERROR - message (blocks ...; also ...); fix: ...``: plain text, one line (a fix
        with alternatives keeps them on lines of their own, and each host's own values follow, indented). A cause
        fixed in no host starts with where it is fixed: ``launch shell::launcher_ssh FAILED - ...``."""
        text = f"{self.fixed_in or self.where}::{','.join(self.checks)} {self.status.word} - {self.message}"
        notes = self._notes()
        if notes:
            text += f" ({'; '.join(notes)})"
        if self.fix and self.status != Status.PASS:
            text += f"; fix: {self.fix}"
        for detail in self.details:
            text += f"\n    {detail}"
        return plain(text)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON report's ``causes`` entry (docs/json-contract.md)."""
        out: Dict[str, Any] = {
            "id": self.id, "status": self.status.value, "check": self.check,
            "checks": self.checks + [a.check for a in self.also if a.check not in self.checks],
            "hosts": list(self.hosts), "nodeset": self.where, "message": self.message, "fix": self.fix,
            "blocked": self.blocked}
        if self.blocked_elsewhere:
            out["blocked_hosts"] = sorted({h for hosts in self.blocked_elsewhere.values() for h in hosts})
        if self.details:
            out["details"] = list(self.details)
        if self.fixed_in:
            out["where"] = self.fixed_in
        return out


class _Tokens:
    """Each host's own words (name, address, the hostname it answered with), to take out of its messages."""

    def __init__(self, report: Report, connection: FrozenSet[str]):
        self._words: Dict[str, Dict[str, str]] = {}
        for h in report.hosts:
            self._add(h.name, h.name, HOST)
            self._add(h.name, h.address, ADDRESS)
        for r in report.results:
            if r.check in connection:
                self._add(r.host, str(r.metrics.get("hostname") or ""), HOST)
                self._add(r.host, str(r.metrics.get("address") or ""), ADDRESS)

    def _add(self, host: str, word: str, placeholder: str) -> None:
        if host != CLUSTER and len(word) >= 2:
            self._words.setdefault(host, {}).setdefault(word, placeholder)  # a name that is its address: HOST

    def template(self, host: str, text: str, found: List[Tuple[str, str]]) -> str:
        """``text`` with the host's own words as placeholders; ``found`` gets each (placeholder, word) taken out."""
        words = self._words.get(host)
        if not text:
            return text
        if words:
            # Whole words only (one pattern for every host; a pattern per host cost 0.7 s at 1,000 hosts): node1 is
            # not in node10, nor in node1.example.com.
            def own(m: "re.Match[str]") -> str:
                placeholder = words.get(m.group(0))
                if placeholder is None:
                    return m.group(0)
                found.append((placeholder, m.group(0)))
                return placeholder
            text = _WORD.sub(own, text)

        def fingerprint(m: "re.Match[str]") -> str:
            found.append((FINGERPRINT, m.group(0)))
            return FINGERPRINT
        return _FINGERPRINTS.sub(fingerprint, text)


def causes(report: Report) -> List[Cause]:
    """Every non-pass result in exactly one cause; causes in the order to read them: FAIL and ERROR (in the
    report's order), then WARN, then SKIP."""
    results = report.results
    connection = connection_checks()
    tokens = _Tokens(report, connection)
    victims = report.victims()
    groups: Dict[Tuple[Any, ...], Cause] = {}
    home: Dict[int, Cause] = {}  # result index -> the cause that holds it
    at = {(r.host, r.check): i for i, r in enumerate(results)}
    # Each unreachable host's failed connection: the cause its other cells go to. (A connection check may also
    # FAIL a host that it reached, e.g. two names of one machine: that host's other cells ran, and stand apart.)
    reachable = {h.name: h.reachable for h in report.hosts}
    down: Dict[str, Cause] = {}
    for i, r in enumerate(results):
        if r.check in connection and r.status in BAD and i not in victims and not reachable.get(r.host, False):
            cause = _join(groups, ("connection", r.check, r.status), tokens, i, r)
            cause.connection = True
            home[i] = down[r.host] = cause
    # In the checks' order, so that what a check reads has its cause before the check itself is placed.
    rank = {name: n for n, name in enumerate(_specs())}
    for i in sorted(range(len(results)), key=lambda i: (rank.get(results[i].check, len(rank)), i)):
        r = results[i]
        if i in home or i in victims or r.status == Status.PASS:
            continue
        owner = down.get(r.host)
        if owner is None and r.host != CLUSTER and r.where is None:
            # a FAIL or ERROR of a check this one reads, on the same host
            owner = next((home[j] for j in (at.get((r.host, d)) for d in reads(r.check))
                          if j is not None and j in home and results[j].status in BAD), None)
        if owner is not None:
            _fold_in(owner, i, r, results)
            home[i] = owner
        elif r.where is not None:
            home[i] = _join(groups, ("where", r.where, r.check, r.status), tokens, i, r)
            home[i].fixed_in = r.where
        else:
            home[i] = _join(groups, ("result", r.check, r.host == CLUSTER, r.status), tokens, i, r)
    for i, root in sorted(victims.items()):  # each victim in its blocker's cause
        owner = home.get(root)
        if owner is None:  # its root passed placement (cannot happen: a root is no PASS); its own cause then
            owner = home[i] = _join(groups, ("result", results[i].check, results[i].host == CLUSTER,
                                             results[i].status), tokens, i, results[i])
            continue
        _fold_in(owner, i, results[i], results)
        home[i] = owner
    found = _merge_checks(list(dict.fromkeys(home.values())))
    for cause in found:
        _words(cause, results)
    found.sort(key=lambda c: (ORDER[c.status], min(c.results)))
    seen: Dict[str, int] = {}
    for cause in found:
        seen[cause.check] = seen.get(cause.check, 0) + 1
        cause.id = f"{cause.check}:{seen[cause.check]}"
    return found


def _words(cause: Cause, results: List[Result]) -> None:
    """The cause's message and fix: its one host's own, the very same words of every host, or the shared words
    with the group's NodeSet for each host's name and each host's address and fingerprint on a line of its own."""
    if cause.exact or len([h for h in cause.hosts if h != CLUSTER]) <= 1:
        return
    named = [h for h in cause.hosts if h != CLUSTER]
    folded = nodeset(named)
    message, fix = cause.shared
    cause.message = _shown(message, folded)
    cause.fix = _shown(_pasteable(cause, results), folded)
    kinds = [p for p in (ADDRESS, FINGERPRINT) if p in message or p in fix.split("\n")[0]]
    if not kinds:
        return
    # One line per distinct set of values (two names of one address share it), in the hosts' order.
    lines: Dict[Tuple[Tuple[str, str], ...], List[str]] = {}
    for host in named:
        own = tuple(dict.fromkeys((_KIND[p], w) for p, w in cause.values.get(host, []) if p in kinds))
        lines.setdefault(own, []).append(host)
    shown = list(lines.items())[:FIX_HOSTS_SHOWN]
    cause.details = [f"{nodeset(hosts)}: " + ", ".join(f"{kind} {word}" for kind, word in own)
                     for own, hosts in shown if own]
    more = sum(len(hosts) for _, hosts in list(lines.items())[FIX_HOSTS_SHOWN:])
    if more:
        cause.details.append(f"(and {more} more host{'s' if more != 1 else ''}: -v prints each host's line)")


def _shown(text: str, folded: str) -> str:
    """Shared words as printed: the group's NodeSet for a host's own name, ``<address>`` and ``<fingerprint>``
    (their values are the cause's details)."""
    text = text.replace(HOST, folded)
    for placeholder, word in _SHOWN.items():
        text = text.replace(placeholder, word)
    return text


def _pasteable(cause: Cause, results: List[Result]) -> str:
    """A shared fix whose command lines would hold a host's own word (``ssh-keyscan -p 22 <address>``) lists each
    host's own command lines instead, under the shared prose: a fix is pasted as it is."""
    shared = cause.shared[1]
    prose, *commands = shared.split("\n")
    if not any(word in line for line in commands for word in (HOST, ADDRESS, FINGERPRINT)):
        return shared
    own: Dict[str, str] = {}
    for i in cause.results:
        r = results[i]
        if r.check in cause.checks and r.host in cause.hosts and not r.blocked and r.fix:
            own.setdefault(r.host, r.fix)
    lines: List[str] = []
    shown = [h for h in cause.hosts if h in own][:FIX_HOSTS_SHOWN]
    for host in shown:
        for line in own[host].split("\n")[1:]:
            if line not in lines:
                lines.append(line)
    more = len([h for h in cause.hosts if h in own]) - len(shown)
    if more > 0:
        lines.append(f"  (and the same for {more} more host{'s' if more != 1 else ''}: -v prints each host's fix)")
    return "\n".join([prose] + lines)


def _join(groups: Dict[Tuple[Any, ...], Cause], kind: Tuple[Any, ...], tokens: _Tokens, i: int, r: Result) -> Cause:
    """Add a cell to the cause that says the very same, or the same apart from the host's own words."""
    own: List[Tuple[str, str]] = []
    shared = (tokens.template(r.host, r.message, own), tokens.template(r.host, r.fix, own))
    exact_key = kind + ("exact", r.message, r.fix)
    cause = groups.get(exact_key)
    if cause is None:
        cause = groups.get(kind + shared)
        if cause is None:
            cause = Cause("", r.status, [r.check], [], r.message, r.fix, shared=shared)
            groups[kind + shared] = groups[exact_key] = cause
        else:  # the same words apart from this host's own: the line prints the shared words
            cause.exact = False
    if r.host not in cause.hosts:
        cause.hosts.append(r.host)
        cause.values[r.host] = own
    cause.results.append(i)
    return cause


def _fold_in(cause: Cause, i: int, r: Result, results: List[Result]) -> None:
    """A cell that its cause's failure blocked (a victim), or that noticed the same failure."""
    cause.results.append(i)
    if r.blocked:
        cause.blocked += 1
        if r.host in cause.hosts and r.blocked_host is None:
            cause.blocked_per_host[r.host] = cause.blocked_per_host.get(r.host, 0) + 1
        else:
            hosts = cause.blocked_elsewhere.setdefault(r.check, [])
            if r.host not in hosts:
                hosts.append(r.host)
        return
    also = next((a for a in cause.also if a.check == r.check and a.status == r.status), None)
    if also is None:
        also = Also(r.check, r.status)
        cause.also.append(also)
    if r.host not in also.hosts:
        also.hosts.append(r.host)


def _merge_checks(found: List[Cause]) -> List[Cause]:
    """Causes that say the same (status, message, fix) of the same hosts from several checks: one cause."""
    merged: Dict[Tuple[Any, ...], Cause] = {}
    out = []
    for cause in found:
        if cause.connection or cause.blocked or cause.also:
            out.append(cause)
            continue
        key = (cause.status, cause.fixed_in, cause.message, cause.fix, cause.shared, tuple(sorted(cause.hosts)))
        same = merged.get(key)
        if same is None:
            merged[key] = cause
            out.append(cause)
        else:
            same.checks.extend(c for c in cause.checks if c not in same.checks)
            same.results.extend(cause.results)
    return out


# --------------------------------------------------------------------------------------- the verdict

def verdict(report: Report, found: Optional[List[Cause]] = None) -> str:
    """``READY``, ``READY with 2 warnings (...)`` or ``NOT READY: 3 hosts need fixing (node02 ports, ...)``: what
    the exit code says, in words, with the root causes: a cause fixed in no host says where (``fix in the launch
    shell (...)``) and names no host; a victim is never named. With --strict, warnings make it NOT READY and say
    so."""
    found = causes(report) if found is None else found
    counts = report.counts()
    bad = [c for c in found if c.status in BAD]
    warned = [c for c in found if c.status == Status.WARN]
    warnings = f"{len(warned)} warning{'s' if len(warned) != 1 else ''}"
    if report.exit_code == 0:
        return f"READY with {warnings} ({_named(warned)})" if warned else "READY"
    if not bad and counts["warn"]:
        return f"NOT READY: {warnings}, and --strict fails on warnings ({_named(warned)})"
    parts = []
    placed: Dict[str, List[Cause]] = {}
    for cause in bad:
        if cause.fixed_in:
            placed.setdefault(cause.fixed_in, []).append(cause)
    for where, these in placed.items():
        gists = [f"{c.label}: {_gist(c.message)}" for c in these]
        parts.append(f"fix {WHERE_WORDS.get(where, 'in the ' + where)} ({plain('; '.join(gists))})")
    hosted = [c for c in bad if not c.fixed_in]
    hosts = {h for c in hosted for h in c.hosts if h != CLUSTER}
    if hosts:
        parts.append(f"{len(hosts)} host{'s need' if len(hosts) != 1 else ' needs'} fixing "
                     f"({_named(hosted, cluster=False)})")
    cluster = [c.label for c in hosted if CLUSTER in c.hosts]
    if cluster:
        parts.append("cluster-wide: " + ", ".join(dict.fromkeys(cluster)))
    text = "NOT READY: " + ("; ".join(parts) or "the run could not check the hosts")
    if report.strict and warned:
        text += f"; and {warnings}, which --strict fails on"
    return text


def _gist(message: str) -> str:
    """The start of a message, to its first ``;`` and at most VERDICT_GIST characters (cut at a space)."""
    first = message.split(";")[0].split("\n")[0].strip()
    if len(first) <= VERDICT_GIST:
        return first
    cut = first[:VERDICT_GIST].rsplit(" ", 1)[0]
    return cut + " ..."


def _named(found: List[Cause], cluster: bool = True) -> str:
    """``node02 ports, node[03-04] unreachable, cluster iperf3, ...``: what the causes are and where, the hosts of
    causes of one kind together (two dead hosts, one refusing and one silent, are both unreachable)."""
    hosts: Dict[str, List[str]] = {}
    for cause in found:
        if cause.fixed_in:
            continue
        hosts.setdefault(cause.label, []).extend(h for h in cause.hosts if h != CLUSTER)
    names = [f"{_hosts(where)} {label}" for label, where in hosts.items() if where]
    if cluster:
        names += list(dict.fromkeys(f"{CLUSTER_NAME} {c.label}" for c in found
                                    if CLUSTER in c.hosts and not c.fixed_in))
        names += list(dict.fromkeys(f"{c.fixed_in}: {c.label}" for c in found if c.fixed_in))
    shown = names[:VERDICT_NAMES] + (["..."] if len(names) > VERDICT_NAMES else [])
    return plain(", ".join(shown))


def _hosts(hosts: List[str]) -> str:
    """``node[03-05]``, or ``334 hosts`` where the NodeSet would fill the line (the causes' lines name them)."""
    folded = nodeset(hosts)
    return folded if len(folded) <= VERDICT_NODESET else f"{len(set(hosts))} hosts"
