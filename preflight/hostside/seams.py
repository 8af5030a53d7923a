"""The seams between the checks and the coordinator: what a check receives (HostContext, ClusterView) and is.

Standard library only (runs on the hosts). The checks never import the coordinator (``preflight.*`` outside
``preflight.checks`` and ``preflight.hostside``); a cluster check gets what it needs through ``ClusterView``,
which the coordinator's ``runner.Cluster`` satisfies.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import (Any, Callable, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    Union, runtime_checkable)

from .outcome import Evaluation


@dataclass
class HostContext:
    """What ``collect(ctx)`` receives on the host.

    params: per-host options from the coordinator: {"host": name, "slots": N, "master": address,
            "master_name": name, "nvme_paths": [...], "required_ops": [...], "gpus_expected": bool, ...}
            (never every host's address: that would be O(N^2) bytes over a run)
    deadline: time.monotonic() value by which collect must return (the agent enforces it too).
    """

    params: Dict[str, Any]
    deadline: float
    # Set by the agent for long-lived host-side functions (listeners, iperf3 servers, workers):
    # ready(info) tells the coordinator the service is up (and e.g. which port it bound);
    # wait_stop(max_s) blocks until the coordinator says stop, the deadline passes, or the SSH channel drops.
    ready: Any = None
    wait_stop: Any = None

    def remaining(self, cap: float) -> float:
        return max(0.5, min(cap, self.deadline - time.monotonic()))


# --- the seams -------------------------------------------------------------------------------

# The values a check module's SCOPE may take:
#   "host"        collect(ctx) runs on every host through the agent; evaluate(facts, thresholds) -> Outcome.
#   "cluster"     coordinate(cluster: ClusterView) runs on the coordinator, drives host-side functions of the
#                 module through the agent, and returns facts; evaluate(facts, thresholds) ->
#                 {host name or "*": Outcome} (or one Outcome for the cluster row).
#   "connection"  the coordinator itself gathers the facts while connecting (the ``ssh`` check): no collect
#                 and no coordinate; evaluate(facts, thresholds) -> Outcome for one host.
SCOPES = ("host", "cluster", "connection")


class HostRef(Protocol):
    """A host as the coordinator knows it: its hostfile name, slot count and GPU ids."""

    name: str
    slots: int
    gpus: Optional[List[int]]


class ProgressSink(Protocol):
    def phase(self, name: str, total: int) -> None: ...

    def advance(self, name: str, detail: str = "") -> None: ...

    def note(self, text: str) -> None: ...


class ServiceHandle(Protocol):
    """A long-lived host-side function started with ``ClusterView.start`` (listener, iperf3 server, rank)."""

    def wait_ready(self, timeout: float) -> Dict[str, Any]: ...

    def stop(self, timeout: float = 15.0) -> Any: ...

    def result(self, timeout: Optional[float] = None) -> Any: ...

    def kill(self) -> None: ...


class HostShell(Protocol):
    """The coordinator's own command line to a host (its transport), for a check that runs a program there under
    its own supervision rather than as a function of the agent (the ``launch`` check: DeepSpeed's launcher).

    run(argv, timeout, stdin) -> a result with rc, stdout, stderr, error; start(argv, stdin, keep_stdin_open) -> a
    running command (stream_to, close_stdin, join, kill, wait, done) whose stdin stays open as its lifeline."""

    address: str

    def run(self, argv: Sequence[str], timeout: float, stdin: bytes = b"") -> Any: ...

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> Any: ...


def positive(kind: Callable[[str], Any], noun: str, most: float) -> Callable[[str], Any]:
    """An ``Option.type``: a finite number of ``kind`` with 0 < value <= most; the command names the option."""
    def parse(text: str) -> Any:
        import argparse  # the coordinator's alone: a host's agent imports this module too
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value <= 0 or value > most:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; expected 0 < x <= {most:g}")
        return value
    return parse


def number(text: str) -> float:
    """An ``Option.type`` for a threshold override: any finite number (the key's own range rule bounds it)."""
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


# The commands that can offer a check's Option: "run" (and the pytest plugin's --preflight- form of it) and
# "node-check" (the per-host checks on one node). `preflight rehearse` runs no check: it shares run's SSH group.
COMMANDS = ("run", "node-check")
OPTION_ACTIONS = ("store", "append", "store_true")


@dataclass(frozen=True)
class Option:
    """One command-line input, declared once: a check lists its own as ``CheckSpec.options``, and the coordinator
    generates from it the option of each command that offers it, the pytest plugin's ``--preflight-`` form, the
    check's entry in docs/checks.md and, for a threshold, the override of that threshold.

    flag: the long option (``--checkpoint-dir``), its value reached as ``dest`` (``checkpoint_dir``); help: one
    sentence, the same in --help, the plugin and the docs; type: the text -> the value (ValueError or argparse's
    ArgumentTypeError with a short reason: the command's exit 2 names the option); metavar; default: the value when
    the flag is not given. threshold: the key of the check's own thresholds section the flag overrides (``[allreduce]
    min_busbw``): the value is held to that key's rule lines like a --config value, and the check reads it through
    ``limits()`` only (it is not in ``cluster.options``). action: "store", "append" (repeatable: a list) or
    "store_true" (a switch). commands: the commands that offer it (``COMMANDS``). aliases: other spellings.
    """

    flag: str
    help: str
    type: Callable[[str], Any] = str
    metavar: Optional[str] = None
    default: Any = None
    threshold: Optional[str] = None
    action: str = "store"
    commands: Tuple[str, ...] = ("run",)
    aliases: Tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def value(self, options: "CheckOptions") -> Any:
        """This input's value in a check's ``cluster.options`` (its default when not given)."""
        return options.inputs.get(self.dest, self.default)

    def problems(self) -> List[str]:
        """What is wrong with this declaration, one clause each (empty: well-formed)."""
        out = []
        name = self.flag[2:]
        if not (self.flag.startswith("--") and name and name[0].isalpha() and name.replace("-", "").isalnum()
                and name == name.lower()):
            out.append(f"option {self.flag!r} must be a lowercase long option like --checkpoint-dir")
        if not self.help.strip():
            out.append(f"option {self.flag} has no help")
        if self.action not in OPTION_ACTIONS:
            out.append(f"option {self.flag}: action {self.action!r} is not one of {', '.join(OPTION_ACTIONS)}")
        if not self.commands or any(c not in COMMANDS for c in self.commands):
            out.append(f"option {self.flag}: commands must name some of {', '.join(COMMANDS)}")
        if self.threshold is not None and (self.action != "store" or not self.threshold.isidentifier()):
            out.append(f"option {self.flag}: a threshold override takes one value (action 'store') and names a key")
        if not callable(self.type):
            out.append(f"option {self.flag}: type must be a function of the text")
        return out


@dataclass
class CheckOptions:
    """The run's options that cluster checks read, as ``cluster.options``: the few the whole run shares, and the
    check's own inputs (``inputs``, read through the check's ``Option.value``).

    transport: how the coordinator reaches the hosts, "ssh" or "srun" (a run without a hostfile is local but says
    "ssh"); python: the hosts' interpreter; hostfile: the --hostfile path (the fixes name it); master_port,
    master_addr: the job's torch.distributed rendezvous (--master-port; --master-addr, without which DeepSpeed's
    launcher takes the first address of the first host's `hostname -I`); launcher_ssh_port: the port DeepSpeed's
    launcher will ssh to (--launcher-ssh-port, else --ssh-port); deepspeed_config: the job's DeepSpeed config file.
    inputs: {Option.dest: value}: the run's every check input for the coordinator (``CheckOptions.for_check``
    keeps a check's own when it is handed to the check). None: not given.
    """

    transport: str = "ssh"
    python: Optional[str] = None
    hostfile: Optional[str] = None
    master_port: int = 29500
    master_addr: Optional[str] = None
    launcher_ssh_port: Optional[int] = None
    deepspeed_config: Optional[str] = None
    inputs: Dict[str, Any] = field(default_factory=dict)

    def for_check(self, spec: "CheckSpec") -> "CheckOptions":
        """What ``spec``'s check sees: the shared fields and its own inputs (a threshold's goes through limits())."""
        own = {o.dest: self.inputs.get(o.dest, o.default) for o in spec.options if o.threshold is None}
        return replace(self, inputs=own)

    def given(self, name: str) -> bool:
        """A shared field or an input of that name holds a value (what selects an opt-in check)."""
        value = self.inputs.get(name) if name in self.inputs else getattr(self, name, None)
        return value not in (None, "", [], (), False)


@runtime_checkable
class ClusterView(Protocol):
    """What a cluster check's ``coordinate(cluster)`` receives; the coordinator's ``runner.Cluster`` is one.

    hosts: reachable hosts; all_hosts: every host of the hostfile, in order; master: the first host.
    facts: {host name: {check name: facts}} from the host checks (and "ssh"); options: the shared run options
    (CheckOptions: master_port, deepspeed_config, ...) and this check's own inputs (``Option.value``);
    thresholds: the merged config (read it with ``limits``); parallel: the fan-out limit.
    ``call``/``call_all``/``start`` run a host-side function ``"module.func"`` of this package through the agent on
    a host; ``shell`` is the coordinator's own command line to a host (``HostShell``), for a program run under the
    check's own supervision (the ``launch`` check).
    """

    hosts: List[Any]
    all_hosts: List[Any]
    master: Any
    world_size: int
    facts: Dict[str, Dict[str, Any]]
    options: CheckOptions
    thresholds: Dict[str, Dict[str, Any]]
    parallel: int
    local: bool
    progress: Any

    def address(self, host: str) -> str: ...

    def call(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any: ...

    def call_all(self, func: str, params_by_host: Dict[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]: ...

    def start(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any: ...

    def shell(self, host: str) -> HostShell: ...

    def wait_for(self, check: str) -> bool:
        """Wait until ``check`` (one of this check's ``SPEC.waits``) has finished, so that its facts are in
        ``facts`` (its cluster facts under ``facts["*"][check]``); at once when it is not selected or is done.
        Whether it ran. Call it only between measurements: while a check waits, the runner counts it as measuring
        and loading nothing (another check may start meanwhile)."""
        ...


Thresholds = Dict[str, Dict[str, Any]]


@dataclass(frozen=True)
class HtmlSection:
    """A check's own part of the HTML report: ``render(results, hosts)`` gets this check's results as JSON-shaped
    dicts (host, check, status, message, fix, metrics) and the hostfile's host names, and returns an HTML
    fragment whose every host-reported value it has escaped. ``title`` names it in the page's contents."""

    title: str
    render: Callable[[Sequence[Mapping[str, Any]], Sequence[str]], str]


class PromSample(NamedTuple):
    """One sample of a check's Prometheus metrics: ``PromSample("preflight_nvme_write_bytes_per_second", "...",
    "gauge", {"host": "node01", "path": "/local_nvme"}, 2.1e9)``; the unit is in the name, in base units where the
    name says so. preflight/render/prometheus.py validates the names and escapes the label values."""

    name: str
    help: str
    type: str
    labels: Dict[str, str]
    value: float


@dataclass(frozen=True)
class RecommendInput:
    """What a check's ``recommend`` receives, once every check has run (``preflight.recommend`` builds it).

    hosts: the reachable hosts' names in hostfile order, the master first; facts: {host name or "*": {check:
    facts}} holding this check and the checks in its ``reads`` only, where they ran; failed: {check: the hosts
    (or "*") whose result is FAIL}, for the same checks; master_address: the address the coordinator reached the
    master at (None if unknown), e.g. to tell whether the hostfile's names resolve to the recommended network.
    """

    hosts: List[str]
    facts: Dict[str, Dict[str, Any]]
    failed: Dict[str, List[str]]
    master_address: Optional[str] = None


@dataclass(frozen=True)
class EnvVar:
    """One variable of a recommendation: ``name=value``, because ``why`` (shown beside it)."""

    name: str
    value: str
    why: str


@dataclass(frozen=True)
class Recommendation:
    """What a check's ``recommend`` returns: its part of the job's environment.

    steps: in the order it decided them, an ``EnvVar`` for each variable to set and a str for each note to the
    operator (why a variable is not recommended, what to do instead); caveats: notes on how far to trust this
    part (e.g. the checks it rests on FAILed), listed after every contribution and the general notes.
    """

    steps: Tuple[Union[EnvVar, str], ...] = ()
    caveats: Tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckSpec:
    """Everything the registry knows of a check, declared once at the end of the check's own module as ``SPEC``.

    name: stable lowercase id (JSON, JUnit, ``preflight list``, the thresholds section ``[name]``);
    description: one line; scope: one of ``SCOPES``; default: runs without ``--checks``.
    evaluate: pure, recorded facts and thresholds in, outcome(s) out. collect (scope "host") runs on every host
    through the agent; coordinate (scope "cluster") runs on the coordinator with a ``ClusterView``.
    quiet: a cluster check that measures nothing load disturbs (its ``measures`` is empty or undeclared).
    measures: the resources (``RESOURCES``) whose speed its figures are, so whose load by another check would
    distort them. loads: the resources it keeps busy on the hosts while it runs. None: undeclared (``usage``).
    The runner runs two cluster checks at once (and a cluster check beside the host checks) only when neither
    loads what the other measures (runner.Schedule, ``conflicts``): compute (measures and loads "cpu", "gpu")
    beside ports (a few short connections: loads nothing), never beside launcher_ssh (the first host's SSH
    handshakes to every host: "cpu").
    early: it may start as soon as every host's agent said hello, beside the host checks (which measure "disk" and
    load "cpu" and "disk"), before the facts of any host check: it reads what it needs of the hosts itself.
    waits: checks of its ``reads`` that it does not need to start, only later: it starts without waiting for them,
    and calls ``cluster.wait_for(name)`` before it reads their facts (iperf3 measures, then waits for ports).
    uses_torch: collect imports torch, so the agent imports it once before the host checks.
    host_params: thresholds -> extra per-host params for collect (e.g. nvme's test size).
    options: the check's own command-line inputs (``Option``): its flags in every command that offers them, the
    plugin and docs/checks.md, its ``cluster.options.inputs`` (or a threshold override); an Option several checks
    read (the model's size) is the same object in each of their SPECs, offered once.
    selected_by: ``CheckOptions`` fields or the dests of its own options that, when given, select this opt-in check
    without ``--checks`` (ds_config: ``deepspeed_config``). params_from_options: the check's ``CheckOptions`` (its
    own inputs, ``CheckOptions.for_check``) -> extra per-host params for the host checks' collect (a list extends
    the same key's list, e.g. ``nvme_paths``), used when this check is selected; ValueError with one line for an
    option it cannot use (the CLI's exit 2, before any host is contacted). The CLI calls it for every check that
    has one, selected or not, so a bad option always stops.
    reads: the other checks whose facts this one reads (``cluster.facts[host][name]``): a declared dependency,
    never an import of their modules.
    html: its own section of the HTML report, if any.
    recommend: its part of the recommended job environment (NCCL/Gloo variables), if any: a pure function
    ``RecommendInput -> Recommendation``. ``preflight.recommend`` calls every registered check's, in ORDER, after
    the run, whether or not the check ran (its facts may be absent: it recommends from what there is), gives it
    the facts of this check and of its ``reads`` only, and merges the parts; it may set only the variables
    preflight owns (``preflight.recommend.OWNED_KEYS``), each value is checked again before it is printed or
    written, and a part that raises is left out with a note.
    prom_metrics: its measured figures for ``--prom-textfile``, if any: a pure function of this check's results as
    JSON-shaped dicts (host, check, status, message, fix, metrics) to ``PromSample``s; the renderer adds every
    check's status and duration itself.
    baseline: the figures worth comparing with the same host's own past runs (``preflight.history``): a metric
    key of its results (nested keys flattened as ``paths[/local_nvme].write_Bps``, a list's entries named by their
    src->dst, path, network, index, bytes, name or device; ``*`` matches any text) -> "higher" or "lower", the
    direction that is better. A host significantly worse than its own median is a WARN on its cell.
    """

    name: str
    description: str
    scope: str
    default: bool
    evaluate: Callable[[Dict[str, Any], Thresholds], Evaluation]
    collect: Optional[Callable[[HostContext], Dict[str, Any]]] = None
    coordinate: Optional[Callable[["ClusterView"], Dict[str, Any]]] = None
    quiet: bool = False
    measures: Optional[Tuple[str, ...]] = None
    loads: Optional[Tuple[str, ...]] = None
    early: bool = False
    waits: Tuple[str, ...] = ()
    uses_torch: bool = False
    host_params: Optional[Callable[[Thresholds], Dict[str, Any]]] = None
    options: Tuple[Option, ...] = ()
    selected_by: Tuple[str, ...] = ()
    params_from_options: Optional[Callable[[CheckOptions], Dict[str, Any]]] = None
    reads: Tuple[str, ...] = ()
    html: Optional[HtmlSection] = None
    recommend: Optional[Callable[[RecommendInput], Recommendation]] = None
    prom_metrics: Optional[Callable[[Sequence[Mapping[str, Any]]], List[PromSample]]] = None
    baseline: Mapping[str, str] = field(default_factory=dict)


BASELINE_DIRECTIONS = ("higher", "lower")  # which way a SPEC.baseline figure is better
# What a check's SPEC.measures and SPEC.loads name: a host's CPU cores, its GPUs, its network, its disks.
RESOURCES = ("cpu", "gpu", "network", "disk")


class Usage(NamedTuple):
    """What a check (or the host checks) measures and loads while it runs (``CheckSpec.measures``/``loads``)."""

    measures: FrozenSet[str]
    loads: FrozenSet[str]


# The host checks: the imports of torch and DeepSpeed, libaio's compile and nvme's dd load the cores and disks, and
# nvme measures the disks' write speed. A single-threaded import takes one core of a host's many: iperf3's streams,
# which need the NIC and a core each, run beside it on a real host (an early check, CheckSpec.early).
HOST_CHECKS = Usage(frozenset({"disk"}), frozenset({"cpu", "disk"}))


def usage(spec: CheckSpec) -> Usage:
    """A check's declared usage; undeclared (None): a measuring check measures and loads every resource, a quiet
    one measures nothing and loads every resource, so that it runs beside no measuring check."""
    measures = spec.measures if spec.measures is not None else (() if spec.quiet else RESOURCES)
    loads = spec.loads if spec.loads is not None else RESOURCES
    return Usage(frozenset(measures), frozenset(loads))


def conflicts(a: Usage, b: Usage) -> bool:
    """Whether one of the two loads what the other measures: then they must not run at the same time."""
    return bool(a.loads & b.measures or b.loads & a.measures)


def _schedule_problems(spec: CheckSpec) -> List[str]:
    """What is wrong with how the spec says it may share the hosts (quiet, measures, loads, early, waits)."""
    problems = []
    if spec.quiet and spec.measures:
        problems.append("a quiet check measures nothing (measures must be empty)")
    for key in ("measures", "loads"):
        value = getattr(spec, key)
        if value is not None and (not isinstance(value, tuple) or not all(r in RESOURCES for r in value)):
            problems.append(f"{key} must be None or a tuple of {', '.join(RESOURCES)}")
    if (spec.early or spec.waits or spec.measures is not None or spec.loads is not None) and spec.scope != "cluster":
        problems.append("measures, loads, early and waits apply to scope 'cluster' only")
    if not isinstance(spec.waits, tuple) or not all(w in spec.reads for w in spec.waits):
        problems.append("waits must be a tuple of names in reads")
    return problems


def validate_spec(spec: Any, where: str) -> CheckSpec:
    """The spec itself if it is a well-formed ``CheckSpec``; TypeError naming ``where`` and every problem if not."""
    if not isinstance(spec, CheckSpec):
        raise TypeError(f"check module {where}: SPEC must be a CheckSpec, not {type(spec).__name__}")
    problems = []
    if not (spec.name and spec.name.isidentifier() and spec.name.islower()):
        problems.append(f"name {spec.name!r} must be a lowercase identifier")
    if not spec.description:
        problems.append("description is empty")
    if spec.scope not in SCOPES:
        problems.append(f"scope {spec.scope!r} is not one of {', '.join(SCOPES)}")
    if not callable(spec.evaluate):
        problems.append("evaluate must be a function")
    if spec.scope == "host" and not callable(spec.collect):
        problems.append("scope 'host' needs a collect function")
    if spec.scope == "cluster" and not callable(spec.coordinate):
        problems.append("scope 'cluster' needs a coordinate function")
    if spec.scope != "host" and (spec.collect is not None or spec.host_params is not None):
        problems.append("collect and host_params belong to scope 'host' only")
    if spec.scope != "cluster" and spec.coordinate is not None:
        problems.append("coordinate belongs to scope 'cluster' only")
    if spec.quiet and spec.scope != "cluster":
        problems.append("quiet applies to scope 'cluster' only")
    problems += _schedule_problems(spec)
    if not isinstance(spec.reads, tuple) or not all(isinstance(r, str) for r in spec.reads):
        problems.append("reads must be a tuple of check names")
    elif spec.name in spec.reads:
        problems.append("reads names the check itself")
    if spec.prom_metrics is not None and not callable(spec.prom_metrics):
        problems.append("prom_metrics must be a function")
    if spec.recommend is not None and not callable(spec.recommend):
        problems.append("recommend must be a function")
    if spec.params_from_options is not None and not callable(spec.params_from_options):
        problems.append("params_from_options must be a function")
    if not isinstance(spec.baseline, Mapping) or not all(isinstance(k, str) and k and v in BASELINE_DIRECTIONS
                                                            for k, v in spec.baseline.items()):
        problems.append(f"baseline must map metric keys to {' or '.join(repr(d) for d in BASELINE_DIRECTIONS)}")
    if not isinstance(spec.options, tuple) or not all(isinstance(o, Option) for o in spec.options):
        problems.append("options must be a tuple of Option")
    else:
        for option in spec.options:
            problems += option.problems()
        flags = [o.flag for o in spec.options]
        problems += [f"option {f} is declared twice" for f in sorted(set(flags)) if flags.count(f) > 1]
    own = [o.dest for o in spec.options] if isinstance(spec.options, tuple) else []
    options = {f.name for f in fields(CheckOptions) if f.name != "inputs"} | set(own)
    if not isinstance(spec.selected_by, tuple) or not all(isinstance(o, str) and o in options
                                                           for o in spec.selected_by):
        problems.append(f"selected_by must be a tuple of CheckOptions fields or its own options' dests "
                        f"({', '.join(sorted(options))})")
    if problems:
        raise TypeError(f"check module {where}: {'; '.join(problems)}")
    return spec
