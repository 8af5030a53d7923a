"""Parse DeepSpeed hostfiles and apply --include/--exclude exactly as DeepSpeed's launcher does, plus Slurm ranges.

Sample input (DeepSpeed's format, deepspeed/launcher/runner.py ``_parse_hostfile``)::

    # comments and blank lines are skipped
    worker-1 slots=8
    worker-2 slots=8 max_slots=8   # OpenMPI style: DeepSpeed ignores the text after slots=N (a WARN names it)
    node[01-04] slots=8            # Slurm range: expanded for the checks; DeepSpeed's launcher does NOT expand it
    rack[1-2]-node[01-02] slots=4  # several brackets (ClusterShell's NodeSet)

DeepSpeed's rules, mirrored (tests/cli/test_hostfile_differential.py runs DeepSpeed's own functions on thousands of
generated cases): lines come from ``readlines()`` (only \\n, \\r\\n and \\r end a line; a form feed or U+2028 does
not), each is ``str.strip()``-ed, ``#`` lines and blank lines are skipped, ``re.search(r"^(\\S+)\\s+slots=(\\d+)")``
must match and anything after it is ignored, a host listed twice is an error, and so is a file without hosts.
Filters: ``host[:slot,slot]@host``, the same host named twice is merged, slots are sorted and deduplicated.

Deliberate differences (DeepSpeed would crash later, misbehave or let a host name become an ssh option), each
rejected with ``file:line``: slots=0, more than MAX_SLOTS slots, a byte-order mark, a host name starting with
``-`` or holding a control character, a filter that leaves no host; and ranges, which preflight expands.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import unicodedata
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from preflight.inputs import MAX_HOSTFILE_BYTES, InputError, read_text_limited

# DeepSpeed's _parse_hostfile pattern, used with re.search on the stripped line.
_ENTRY = re.compile(r"^(\S+)\s+slots=(\d+)")
# Characters no host name, address or ssh_config alias has, that a shell, a glob or ssh's own parsing would act on
# (``node1;touch${IFS}/tmp/x``): such a name is a typo or an attack, and looking it up in DNS only turns it into a
# column of errors. DeepSpeed accepts them; refusing them is a deliberate difference.
SHELL_CHARS = frozenset(";&|$`'\"\\<>(){}*?!~#^=/")
# A line's end for readlines() on a file opened in text mode (universal newlines).
_LINE_END = re.compile(r"\r\n|\r|\n")
# No GPU server has more accelerators than this; a bigger number is a typo (or slots=99999999999999999999),
# and DeepSpeed would try to build a list of that many slot ids.
MAX_SLOTS = 1024
# A hostfile of more than this many hosts is almost certainly a typo in a range (node[1-100000000]).
MAX_HOSTS = 100_000
# ClusterShell's NodeSet operators and group syntax: not host names, and not Slurm hostlist syntax either.
_NODESET_OPERATORS = set("!&^@")


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


def split_lines(text: str) -> List[str]:
    """The lines DeepSpeed's ``open(path).readlines()`` sees (without their ends), not ``str.splitlines()``."""
    lines = _LINE_END.split(text)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _range_size(token: str) -> int:
    """An upper bound of the hosts a bracket expression names, without expanding it (NodeSet would, in memory)."""
    total = 1
    for body in re.findall(r"\[([^\[\]]*)\]", token):
        n = 0
        for part in body.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*(?:/\s*(\d+)\s*)?", part)
            if m:
                n += max(0, int(m.group(2)) - int(m.group(1))) // max(1, int(m.group(3) or 1)) + 1
            else:
                n += 1
        total *= max(1, n)
    return total


def expand_range(name: str, where: str) -> List[str]:
    """node[01-03] -> node01 node02 node03, rack[1-2]-n[1,3] -> 4 hosts: Slurm/ClusterShell syntax via NodeSet."""
    if "[" not in name and "]" not in name:
        return [name]
    bad = sorted(_NODESET_OPERATORS & set(name))
    if bad:
        raise HostfileError(f"{where}: {name!r} is not a host range ({' '.join(bad)} is not allowed in a host name); "
                            "write ranges like node[01-04] or gpu-[1,3,5-7]")
    if _range_size(name) > MAX_HOSTS:
        raise HostfileError(f"{where}: range {name!r} expands to more than {MAX_HOSTS} hosts; check the bounds")
    from ClusterShell.NodeSet import NodeSet, NodeSetException

    try:
        names = list(NodeSet(name))
    except (NodeSetException, ValueError, OverflowError) as exc:
        raise HostfileError(f"{where}: range {name!r} is not valid ({exc}); write ranges like node[01-04], "
                            "gpu-[1,3,5-7] or rack[1-2]-node[01-02]") from None
    if not names:
        raise HostfileError(f"{where}: host range {name!r} names no host")
    return names


def _check_name(name: str, where: str, token: str) -> None:
    if name.startswith("-"):
        # ssh, pdsh and mpirun would read it as an option (ssh -oProxyCommand=...): refuse, never pass it on.
        raise HostfileError(f"{where}: host name {name!r} starts with '-': ssh and pdsh would take it as an option; "
                            "fix the host name")
    odd = [c for c in name if unicodedata.category(c)[0] == "C"]
    if odd:
        raise HostfileError(f"{where}: host name {token!r} contains the invisible character U+{ord(odd[0]):04X}; "
                            "retype the host name")
    shell = sorted({c for c in name if c in SHELL_CHARS})
    if shell:
        raise HostfileError(f"{where}: host name {token[:120]!r} contains {' '.join(repr(c) for c in shell)}, which "
                            "no host name has (a shell or ssh would act on it); fix the host name")


def _slots(text: str, host: str, where: str) -> int:
    try:
        slots = int(text)  # like DeepSpeed: \d also matches other scripts' digits, which int() reads
    except ValueError:  # a number of thousands of digits: int() refuses it
        slots = MAX_SLOTS + 1
    if slots < 1:
        raise HostfileError(f"{where}: slots={text} for {host}; a host needs at least one slot (DeepSpeed would "
                            "start no process there and fail later)")
    if slots > MAX_SLOTS:
        shown = text if len(text) <= 24 else text[:20] + "..."
        raise HostfileError(f"{where}: slots={shown} for {host} is not a number of GPUs (at most {MAX_SLOTS}); "
                            "fix the number")
    return slots


def parse_hostfile(text: str, path: str = "hostfile", notes: Optional[List[str]] = None) -> List[HostSpec]:
    """DeepSpeed's _parse_hostfile with its errors made precise; ``notes`` collects the warnings to print."""
    hosts: List[HostSpec] = []
    seen: Dict[str, int] = {}
    ranges: List[Tuple[int, str, int]] = []
    for lineno, raw in enumerate(split_lines(text), start=1):
        where = f"{path}:{lineno}"
        if lineno == 1 and raw.startswith("\ufeff"):
            raise HostfileError(f"{where}: the file starts with a byte-order mark (U+FEFF); DeepSpeed would read it as "
                                "part of the first host name. Save the hostfile as UTF-8 without BOM")
        line = raw.strip()
        if line.startswith("#") or line == "":
            continue
        m = _ENTRY.search(line)
        if not m:
            raise HostfileError(f"{where}: bad entry {line[:120]!r}; each line must be 'HOSTNAME slots=N' "
                                "(e.g. 'worker-1 slots=8'), as DeepSpeed's launcher reads it")
        token = m.group(1)
        slots = _slots(m.group(2), token, where)
        rest = line[m.end():].strip()
        if rest and not rest.startswith("#") and notes is not None:
            notes.append(f"{where}: ignored {rest[:120]!r} after 'slots={m.group(2)}' (DeepSpeed reads only "
                         "'HOSTNAME slots=N' and ignores the rest of the line)")
        _check_name(token, where, token)
        names = expand_range(token, where)
        if len(names) > 1 or names[0] != token:
            ranges.append((lineno, token, len(names)))
        for name in names:
            _check_name(name, where, token)
            if name in seen:
                raise HostfileError(f"{where}: duplicate host {name!r} (first listed on line {seen[name]}); "
                                    "list each host once (DeepSpeed refuses it too)")
            seen[name] = lineno
            hosts.append(HostSpec(name=name, slots=slots, index=len(hosts), gpus=list(range(slots)), line=lineno))
            if len(hosts) > MAX_HOSTS:
                raise HostfileError(f"{where}: more than {MAX_HOSTS} hosts")
    if not hosts:
        raise HostfileError(f"{path}: no hosts found; add lines like 'worker-1 slots=8'")
    if ranges and notes is not None:
        shown = ", ".join(f"line {n} {tok} ({k} hosts)" for n, tok, k in ranges[:3])
        more = f" and {len(ranges) - 3} more" if len(ranges) > 3 else ""
        notes.append(f"{path}: ranges expanded for the checks ({shown}{more}), but DeepSpeed's launcher does not "
                     f"expand ranges: it reads {ranges[0][1]!r} as one host name. Give the job the expanded "
                     f"hostfile: preflight hostfile --expand {path} > {path}.expanded")
    return hosts


def read_hostfile(path: str) -> str:
    try:
        return read_text_limited(path, "--hostfile", MAX_HOSTFILE_BYTES)  # not /dev/zero, not 10 GB
    except InputError as exc:
        raise HostfileError(str(exc)) from None
    except FileNotFoundError:
        raise HostfileError(f"{path}: no such file; pass an existing hostfile with --hostfile") from None
    except IsADirectoryError:
        raise HostfileError(f"{path}: is a directory, not a hostfile") from None
    except UnicodeDecodeError as exc:
        raise HostfileError(f"{path}: not a text file (bad UTF-8 at byte {exc.start}); "
                            "a hostfile has lines like 'worker-1 slots=8'") from None
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read: {exc.strerror}") from None


def load_hostfile(path: str, notes: Optional[List[str]] = None) -> List[HostSpec]:
    return parse_hostfile(read_hostfile(path), path, notes)


def expanded_text(hosts: List[HostSpec], source: str) -> str:
    """A hostfile DeepSpeed's launcher reads as preflight does: one 'HOSTNAME slots=N' line per host."""
    lines = [f"# expanded by preflight from {source}: one line per host, as DeepSpeed's launcher reads it"]
    lines += [f"{h.name} slots={h.slots}" for h in hosts]
    return "\n".join(lines) + "\n"


# --- filters (parse_node_config, parse_node_config_list, parse_resource_filter) ----------------------------

def _node_configs(spec: str, option: str) -> Dict[str, List[int]]:
    """'host1:0,1@host2@host1:3' -> {host1: [0, 1, 3], host2: []}: DeepSpeed's parse_node_config_list."""
    merged: Dict[str, List[int]] = {}
    for node in spec.split("@"):
        if node.count(":") > 1:
            raise HostfileError(f"{option} {spec!r}: {node!r} has more than one ':'; the syntax is "
                                "'host1:0,1@host2'")
        name, colon, slot_text = node.partition(":")
        ids: List[int] = []
        if colon:
            for s in slot_text.split(","):
                try:
                    ids.append(int(s))  # int() as DeepSpeed: ' 1' and '+1' are 1
                except ValueError:
                    raise HostfileError(f"{option} {spec!r}: slot {s[:40]!r} of {name!r} is not a number; "
                                        f"write {name or 'host'}:0,1") from None
        merged.setdefault(name, []).extend(ids)
    return {k: sorted(set(v)) for k, v in merged.items()}


def _host_list(hosts: Dict[str, HostSpec]) -> str:
    names = list(hosts)
    return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")


def apply_filters(hosts: List[HostSpec], include: str = "", exclude: str = "") -> List[HostSpec]:
    """DeepSpeed's parse_inclusion_exclusion: include keeps only what it names; exclude removes it."""
    if include != "" and exclude != "":
        raise HostfileError("--include and --exclude are mutually exclusive (as in DeepSpeed's launcher)")
    by_name = {h.name: h for h in hosts}
    if include == "" and exclude == "":
        selected = [HostSpec(h.name, h.slots, 0, list(h.gpus), h.line) for h in hosts]
    else:
        option, spec = ("--include", include) if include != "" else ("--exclude", exclude)
        chosen: Dict[str, List[int]] = {} if include != "" else {h.name: list(h.gpus) for h in hosts}
        for name, ids in _node_configs(spec, option).items():
            if name not in by_name:
                raise HostfileError(f"{option} {spec!r}: host {name!r} is not in the hostfile "
                                    f"(hosts: {_host_list(by_name)})")
            bad = [i for i in ids if i not in by_name[name].gpus]
            if bad:
                raise HostfileError(f"{option} {spec!r}: {name} has slots 0-{by_name[name].slots - 1}, "
                                    f"not {bad[0]}")
            if include != "":
                chosen[name] = ids if ids else list(by_name[name].gpus)
            else:
                chosen[name] = [g for g in chosen[name] if g not in ids] if ids else []
        selected = [HostSpec(h.name, len(chosen[h.name]), 0, chosen[h.name], h.line) for h in hosts
                    if chosen.get(h.name)]
        if not selected:
            raise HostfileError(f"{option} {spec!r} leaves no hosts (DeepSpeed's launcher would have nothing to "
                                "run on); nothing to check")
    for i, h in enumerate(selected):
        h.index = i
    return selected


def visible_gpus(env: Optional[Dict[str, str]] = None) -> Tuple[List[int], str]:
    """The GPUs DeepSpeed's launcher would use on this machine without a hostfile, and where that came from.

    CUDA_VISIBLE_DEVICES first (DeepSpeed turns it into ``--include localhost:<ids>``; "" or -1 hide every GPU),
    then NVML's device count, then ``nvidia-smi -L`` lines ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)").
    """
    cvd = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids: List[int] = []
        for part in (p.strip() for p in cvd.split(",")):
            if not part.isdigit():  # -1, "NoDevFiles", a UUID/MIG name: the ones before it are the visible set
                break
            ids.append(int(part))
        return ids, f"CUDA_VISIBLE_DEVICES={cvd!r}"
    try:
        import pynvml  # nvidia-ml-py
        pynvml.nvmlInit()
        try:
            return list(range(int(pynvml.nvmlDeviceGetCount()))), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no module, no driver: try the next source
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL)
        if out.returncode == 0:
            return [i for i, ln in enumerate(ln for ln in out.stdout.splitlines() if ln.startswith("GPU "))], \
                "nvidia-smi -L"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return [], "no NVIDIA GPU visible (no NVML, no nvidia-smi)"


def local_cluster(slots: Optional[int] = None, notes: Optional[List[str]] = None) -> List[HostSpec]:
    """No hostfile: the cluster is this machine alone, with every visible GPU as DeepSpeed's launcher uses it.

    ``slots`` (``--slots``) overrides the detection; a machine without GPUs gets one slot (one gloo rank).
    """
    if slots is not None:
        gpus, source = list(range(slots)), f"--slots {slots}"
    else:
        gpus, source = visible_gpus()
    if notes is not None:
        notes.append(f"this machine: {max(1, len(gpus))} slot(s), from {source}")
    return [HostSpec(name="localhost", slots=max(1, len(gpus)), index=0, gpus=gpus or [0], line=0)]


def with_slots(hosts: List[HostSpec], slots: int) -> List[HostSpec]:
    """``--slots N`` on a hostfile: N GPUs per host, ids 0..N-1, as DeepSpeed's ``--num_gpus`` does."""
    return [dataclasses.replace(h, slots=slots, gpus=list(range(slots))) for h in hosts]


def first_nodes(hosts: List[HostSpec], num_nodes: int, notes: Optional[List[str]] = None) -> List[HostSpec]:
    """``--num_nodes N``: the first N hosts in hostfile order, as DeepSpeed's launcher takes them
    (deepspeed/launcher/runner.py:385-398, apply_num_nodes_and_gpus: "the top num_nodes hosts", after the hostfile
    is read, :521). More than the hostfile has is not an error there: every host is used, and a note says so."""
    if notes is not None and num_nodes > len(hosts):
        notes.append(f"--num_nodes {num_nodes}, but there are {len(hosts)} hosts: DeepSpeed's launcher uses all "
                     f"{len(hosts)}, as preflight does")
    return hosts[:num_nodes]


def split_csv(value: str) -> Tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())
