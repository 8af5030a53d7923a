"""Parse DeepSpeed hostfiles (plus Slurm-style ranges) and apply DeepSpeed's --include/--exclude.

Sample input (DeepSpeed's format, deepspeed/launcher/runner.py):

    # comments and blank lines are skipped
    worker-1 slots=8
    node[01-04] slots=8        # Slurm-style range: node01 node02 node03 node04
    gpu-[1,3,5-7] slots=4
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from preflight.inputs import MAX_HOSTFILE_BYTES, read_text_limited

# DeepSpeed: re.search(r"^(\S+)\s+slots=(\d+)", line); we also allow a trailing comment.
_ENTRY = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*(?:#.*)?$")
_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<suffix>[^\[\]]*)$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9_.:-]+$")
# A hostfile of more than this many hosts is almost certainly a typo in a range (node[1-100000]).
MAX_HOSTS = 100_000


class HostfileError(Exception):
    """Bad hostfile or include/exclude spec; the message names file:line and what to do."""


@dataclass
class HostSpec:
    name: str
    slots: int
    index: int = 0
    # GPU indices DeepSpeed would use on this host after --include/--exclude.
    gpus: List[int] = field(default_factory=list)
    line: int = 0

    @property
    def address(self) -> str:
        return self.name


def expand_range(name: str, where: str) -> List[str]:
    """node[01-03] -> node01 node02 node03; zero padding follows the lower bound's width."""
    if "[" not in name and "]" not in name:
        return [name]
    m = _RANGE.match(name)
    if not m:
        raise HostfileError(f"{where}: bad host range {name!r}; "
                            "use one bracket group like node[01-04] or gpu-[1,3,5-7]")
    names: List[str] = []
    for part in m.group("body").split(","):
        part = part.strip()
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            names.append(f"{m.group('prefix')}{bounds[0]}{m.group('suffix')}")
            continue
        if len(bounds) != 2 or not bounds[0].isdigit() or not bounds[1].isdigit():
            raise HostfileError(f"{where}: bad range item {part!r} in {name!r}; use numbers like 1-4 or 01-04")
        lo, hi = int(bounds[0]), int(bounds[1])
        if lo > hi:
            raise HostfileError(f"{where}: range {part!r} in {name!r} runs backwards; write it as {hi}-{lo}")
        if hi - lo + 1 > MAX_HOSTS:
            raise HostfileError(f"{where}: range {part!r} in {name!r} expands to more than {MAX_HOSTS} hosts")
        width = len(bounds[0]) if bounds[0].startswith("0") else 0
        names.extend(f"{m.group('prefix')}{i:0{width}d}{m.group('suffix')}" for i in range(lo, hi + 1))
    return names


def parse_hostfile(text: str, path: str = "hostfile") -> List[HostSpec]:
    """DeepSpeed's fetch_hostfile, with its three errors (bad entry, duplicate host, empty) made precise."""
    hosts: List[HostSpec] = []
    seen: Dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        m = _ENTRY.match(line)
        if not m:
            raise HostfileError(
                f"{where}: bad entry {line!r}; each line must be 'HOSTNAME slots=N' (e.g. 'worker-1 slots=8')")
        slots = int(m.group("slots"))
        if slots < 1:
            raise HostfileError(f"{where}: slots=0 for {m.group('host')}; a host needs at least one slot")
        for name in expand_range(m.group("host"), where):
            if not _HOSTNAME.match(name):
                raise HostfileError(f"{where}: bad host name {name!r}; use letters, digits, '.', '-', '_'")
            if name in seen:
                raise HostfileError(f"{where}: duplicate host {name!r} (first listed on line {seen[name]}); "
                                    "list each host once")
            seen[name] = lineno
            hosts.append(HostSpec(name=name, slots=slots, index=len(hosts), gpus=list(range(slots)), line=lineno))
            if len(hosts) > MAX_HOSTS:
                raise HostfileError(f"{where}: more than {MAX_HOSTS} hosts")
    if not hosts:
        raise HostfileError(f"{path}: no hosts found; add lines like 'worker-1 slots=8'")
    return hosts


def load_hostfile(path: str) -> List[HostSpec]:
    try:
        text = read_text_limited(path, "--hostfile", MAX_HOSTFILE_BYTES)  # not /dev/zero, not 10 GB
    except FileNotFoundError:
        raise HostfileError(f"{path}: no such file; pass an existing hostfile with --hostfile") from None
    except IsADirectoryError:
        raise HostfileError(f"{path}: is a directory, not a hostfile") from None
    except UnicodeDecodeError:
        raise HostfileError(f"{path}: not a text file (bad UTF-8); "
                            "a hostfile has lines like 'worker-1 slots=8'") from None
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_hostfile(text, path)


def _parse_filter(spec: str, option: str, hosts: Dict[str, HostSpec]) -> Dict[str, Optional[List[int]]]:
    """'host1:0,1@host2' -> {host1: [0, 1], host2: None (whole host)}; DeepSpeed's parse_resource_filter syntax."""
    result: Dict[str, Optional[List[int]]] = {}
    for node in spec.split("@"):
        node = node.strip()
        if not node:
            raise HostfileError(f"{option} {spec!r}: empty host entry; the syntax is 'host1:0,1@host2'")
        name, _, slots = node.partition(":")
        if name not in hosts:
            raise HostfileError(f"{option} {spec!r}: host {name!r} is not in the hostfile "
                                f"(hosts: {', '.join(list(hosts)[:8])}{' ...' if len(hosts) > 8 else ''})")
        if not slots:
            result[name] = None
            continue
        try:
            ids = [int(s) for s in slots.split(",")]
        except ValueError:
            raise HostfileError(f"{option} {spec!r}: slots of {name!r} must be numbers like {name}:0,1") from None
        bad = [i for i in ids if i not in hosts[name].gpus]
        if bad:
            raise HostfileError(f"{option} {spec!r}: {name} has slots 0-{hosts[name].slots - 1}, not {bad}")
        result[name] = ids
    return result


def apply_filters(hosts: List[HostSpec], include: str = "", exclude: str = "") -> List[HostSpec]:
    """DeepSpeed's include/exclude semantics: include keeps only what it names; exclude removes it."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive (as in DeepSpeed's launcher)")
    by_name = {h.name: h for h in hosts}
    if include:
        keep = _parse_filter(include, "--include", by_name)
        selected = []
        for h in hosts:
            if h.name in keep:
                gpus = keep[h.name] if keep[h.name] is not None else list(h.gpus)
                selected.append(HostSpec(h.name, len(gpus), 0, sorted(set(gpus)), h.line))
    elif exclude:
        drop = _parse_filter(exclude, "--exclude", by_name)
        selected = []
        for h in hosts:
            if h.name in drop and drop[h.name] is None:
                continue
            gpus = [g for g in h.gpus if g not in (drop.get(h.name) or [])]
            if gpus:
                selected.append(HostSpec(h.name, len(gpus), 0, gpus, h.line))
    else:
        selected = [HostSpec(h.name, h.slots, 0, list(h.gpus), h.line) for h in hosts]
    if not selected:
        raise HostfileError("no hosts left after --include/--exclude; nothing to check")
    for i, h in enumerate(selected):
        h.index = i
    return selected


def local_cluster(slots: int = 1) -> List[HostSpec]:
    """No hostfile: the cluster is this machine alone, like DeepSpeed's launcher without a hostfile."""
    return [HostSpec(name="localhost", slots=slots, index=0, gpus=list(range(slots)), line=0)]


def split_csv(value: str) -> Tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())
