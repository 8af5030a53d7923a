"""The launch still possible after a failed gate: the healthy hosts as a DeepSpeed hostfile (``--write-hostfile``),
the ``-e`` exclusion for the original hostfile, Slurm's ``--exclude`` NodeSet, and ``--min-hosts``.

Sample of what this module writes (node03 unreachable, GPU 3 of node05 failed; DeepSpeed reads ``-e`` as
``host:slot``, and its launcher sets CUDA_VISIBLE_DEVICES to a host's slots, so slot 3 is GPU 3)::

    # preflight left out: node03 (unreachable); node05 GPU 3 (gpu): launch with -e node05:3
    node01 slots=8
    node05 slots=8

A GPU-level failure is one whose every FAIL/ERROR result on the host names its GPUs in ``metrics["failed_gpus"]``
(a list of indices); any other failure leaves the whole host out. A victim (blocked by another host's fault) leaves
nothing out: its cause's own hosts are left out. One machine under several names (the connection check's
``metrics["same_machine"]["hosts"]``, the first the one its fix keeps) leaves out the other names only. A cause
fixed in no host (``Result.where``: the launch shell, the coordinator, every host) leaves no smaller launch, as
does a cluster-wide cause no host explains; neither does a launch below ``--min-hosts``.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Optional, TextIO, Tuple

from preflight.causes import BAD, Cause, causes, nodeset
from preflight.hostside.outcome import Status
from preflight.results import CLUSTER, Report
from preflight.text import plain

GPU_METRIC = "failed_gpus"


@dataclass(frozen=True)
class Context:
    """What the terminal needs beyond the report: the input hostfile (for ``-e``), the --write-hostfile path,
    whether the run is inside a Slurm allocation, and --min-hosts as given."""

    hostfile: str = ""
    written: str = ""
    slurm: bool = False
    min_hosts: str = ""


@dataclass
class Launchable:
    """The hosts a job can still start on. hosts: (name, slots) in the report's order, those with excluded GPUs
    included; slots_out: host -> excluded slots; left_out: host -> why (the cause labels); cluster_wide: the labels
    of failures no host is blamed for, and of those fixed in no host (``launcher_ssh (launch shell)``): then no
    subset is known to be healthy; placed: those fixed in no host alone."""

    hosts: List[Tuple[str, int]] = field(default_factory=list)
    slots_out: Dict[str, List[int]] = field(default_factory=dict)
    left_out: Dict[str, List[str]] = field(default_factory=dict)
    cluster_wide: List[str] = field(default_factory=list)
    total: int = 0
    left_out_gpu: Dict[str, List[str]] = field(default_factory=dict)  # host with excluded slots -> why
    placed: List[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        """Some hosts are healthy, some are not, and nothing is broken cluster-wide: a smaller launch exists."""
        return bool(self.hosts) and bool(self.left_out or self.slots_out) and not self.cluster_wide

    def exclude_spec(self) -> str:
        """DeepSpeed's ``-e``: ``node03@node05:3`` (whole hosts, then single slots); "" when nothing is left out."""
        whole = list(self.left_out)
        return "@".join(whole + [f"{h}:{','.join(map(str, s))}" for h, s in self.slots_out.items()])

    def gpu_spec(self) -> str:
        """The ``-e`` a hostfile of these hosts still needs: the excluded slots alone."""
        return "@".join(f"{h}:{','.join(map(str, s))}" for h, s in self.slots_out.items())

    def why(self) -> str:
        """``node03 (unreachable); node05 GPU 3 (gpu)``: one short clause per host left out."""
        parts = [f"{h} ({', '.join(labels)})" for h, labels in self.left_out.items()]
        for h, slots in self.slots_out.items():
            gpus = ",".join(map(str, slots))
            parts.append(f"{h} GPU{'s' if len(slots) > 1 else ''} {gpus} ({', '.join(self.left_out_gpu[h])})")
        return "; ".join(parts)


def launchable(report: Report) -> Launchable:
    """The healthy hosts of ``report``: no FAIL or ERROR (blocked cells count as their cause's); with --strict no
    WARN either, as the gate itself."""
    bad = set(BAD) | ({Status.WARN} if report.strict else set())
    out = Launchable(total=len(report.hosts))
    labels: Dict[str, List[str]] = {}
    for cause in causes(report):
        if cause.status not in bad:
            continue
        if cause.fixed_in:  # the launch shell, the coordinator or every host: no host can be left out for it
            out.cluster_wide.append(f"{cause.label} ({cause.fixed_in})")
            out.placed.append(f"{cause.label} ({cause.fixed_in})")
            continue
        named = [h for h in cause.hosts if h != CLUSTER]
        if not named:
            out.cluster_wide.append(cause.label)
        kept = _kept_name(report, cause)
        for h in named:
            if h == kept:
                continue
            labels.setdefault(h, [])
            if cause.label not in labels[h]:
                labels[h].append(cause.label)
    slots = {h.name: h.slots for h in report.hosts}
    for host in labels:
        gpus = _failed_gpus(report, host, bad, slots.get(host, 0))
        if gpus:
            out.slots_out[host], out.left_out_gpu[host] = gpus, labels[host]
        else:
            out.left_out[host] = labels[host]
    out.hosts = [(h.name, h.slots) for h in report.hosts if h.name not in out.left_out]
    return out


def _kept_name(report: Report, cause: Cause) -> str:
    """The name one machine keeps when the cause is that it is listed under several names (its fix says "keep
    node1"): the first of the connection check's ``same_machine`` hosts, when all of the cause's own results say
    so of the same names; "" otherwise."""
    kept = ""
    own = [report.results[i] for i in cause.results if report.results[i].check in cause.checks
           and report.results[i].host in cause.hosts]
    for r in own:
        same = r.metrics.get("same_machine") if isinstance(r.metrics, dict) else None
        hosts = same.get("hosts") if isinstance(same, dict) else None
        if not isinstance(hosts, list) or len(hosts) < 2 or not isinstance(hosts[0], str):
            return ""
        if kept and hosts[0] != kept:
            return ""
        kept = hosts[0]
    return kept if kept in cause.hosts else ""


def _failed_gpus(report: Report, host: str, bad: set, slots: int) -> List[int]:
    """The GPU indices every bad result of ``host`` names, when each names some and a slot stays usable; else []."""
    found: set = set()
    victims = report.victims()
    for i, r in enumerate(report.results):
        if r.host != host or r.status not in bad:
            continue
        if i in victims and report.results[victims[i]].host != host:
            continue  # another host's fault, left out with that host: no GPU of this one is to blame
        gpus = r.metrics.get(GPU_METRIC) if isinstance(r.metrics, dict) else None
        if r.blocked or not isinstance(gpus, list) or not gpus:
            return []
        if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < slots for g in gpus):
            return []  # a GPU the hostfile gives no slot for: DeepSpeed's -e could not name it
        found.update(gpus)
    return sorted(found) if len(found) < slots else []


def write(report: Report, out: TextIO, settings: object = None) -> None:
    """The --write-hostfile renderer: the comment line, then ``HOST slots=N`` per healthy host (input's slots)."""
    launch = launchable(report)
    why = launch.why() or "nothing"
    line = f"# preflight left out: {why}"
    if launch.gpu_spec():
        line += f": launch with -e {launch.gpu_spec()}"
    wide = [label for label in launch.cluster_wide if label not in launch.placed]
    if wide:
        line += f"; failed cluster-wide, no host named: {', '.join(dict.fromkeys(wide))}"
    if launch.placed:
        line += f"; to fix in no host, whichever hosts run: {', '.join(dict.fromkeys(launch.placed))}"
    out.write(" ".join(line.split()) + "\n")  # one line, whatever a cause label holds
    for name, slots in launch.hosts:
        out.write(f"{name} slots={slots}\n")


def parse_min_hosts(text: str) -> str:
    """argparse type of --min-hosts: a count (``4``) or a fraction of the hosts (``0.9``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    whole = text.strip().isdigit()
    if (whole and int(text) >= 1) or (not whole and 0 < value <= 1):
        return text.strip()
    import argparse
    raise argparse.ArgumentTypeError(f"{text!r}: give a number of hosts (4) or a fraction of them (0.9)")


def needed(min_hosts: str, total: int) -> int:
    """Hosts --min-hosts asks for out of ``total``: a count as is, a fraction rounded up."""
    if min_hosts.isdigit():
        return int(min_hosts)
    return max(1, math.ceil(float(min_hosts) * total - 1e-9))


def short_of_min_hosts(min_hosts: str, total: int) -> str:
    """``NOT READY: --min-hosts 10, and the hosts are 3``: the one line of a run that cannot pass, whatever its
    hosts say (more hosts asked for than there are); "" when --min-hosts can be met."""
    if not min_hosts or needed(min_hosts, total) <= total:
        return ""
    return (f"NOT READY: --min-hosts {min_hosts} asks for {needed(min_hosts, total)} healthy hosts, and the run has "
            f"{total} host{'s' if total != 1 else ''}; nothing was checked")


def subset_passes(report: Report, min_hosts: str) -> bool:
    """--min-hosts: the gate failed, but enough hosts are healthy (a host with excluded GPUs counts) and nothing
    failed cluster-wide."""
    if not min_hosts or report.exit_code == 0:
        return False
    launch = launchable(report)
    return not launch.cluster_wide and bool(launch.hosts) and len(launch.hosts) >= needed(min_hosts, launch.total)


def exit_code(report: Report, min_hosts: str = "") -> int:
    return 0 if subset_passes(report, min_hosts) else report.exit_code


def ready_command(report: Report, context: Context) -> str:
    """The launch to do now: ``deepspeed --hostfile healthy.txt ...``, the ``-e`` spec for the input hostfile,
    or inside Slurm ``--exclude=node[03,05]``; "" when there is no smaller launch (all good, none good, or a
    cluster-wide failure)."""
    launch = launchable(report)
    if report.exit_code == 0 or not launch.usable:
        return ""
    if context.min_hosts and len(launch.hosts) < needed(context.min_hosts, launch.total):
        return ""  # a launch below --min-hosts is no launch the user asked for
    commands = []
    if context.slurm:
        # Slurm places whole nodes: a node with a failed GPU is left out too.
        commands.append(f"--exclude={nodeset(list(launch.left_out) + list(launch.slots_out))}")
    if context.written:
        gpu = launch.gpu_spec()
        commands.append(f"deepspeed --hostfile {shlex.quote(context.written)}" + (f" -e {gpu}" if gpu else "") +
                        " ...")
    elif context.hostfile:
        commands.append(f"deepspeed --hostfile {shlex.quote(context.hostfile)} -e {launch.exclude_spec()} ...")
    return " or ".join(commands)


def verdict_line(report: Report, context: Optional[Context], line: str) -> str:
    """The verdict line (``line``, already plain) with the launch still possible: ``NOT READY: ...; launch now:
    deepspeed --hostfile healthy.txt ...``; with --min-hosts met it reads ``READY on 4 of 6 hosts (--min-hosts 4),
    without 2 hosts that need fixing (...); launch now: ...``."""
    if context is None:
        return line
    launch = launchable(report)
    command = ready_command(report, context)
    if context.min_hosts and report.exit_code:
        if subset_passes(report, context.min_hosts):
            rest = line[len("NOT READY: "):] if line.startswith("NOT READY: ") else line
            rest = rest.replace(" need fixing", " that need fixing").replace(" needs fixing", " that needs fixing")
            line = (f"READY on {len(launch.hosts)} of {launch.total} hosts (--min-hosts {context.min_hosts}), "
                    f"without {rest}")
        elif not launch.cluster_wide:
            line += (f"; {len(launch.hosts)} of {launch.total} hosts healthy, fewer than --min-hosts "
                     f"{context.min_hosts} ({needed(context.min_hosts, launch.total)})")
    if command:
        line += f"; launch now: {plain(command)}"
    return line
