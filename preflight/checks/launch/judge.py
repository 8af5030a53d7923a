"""The launch rehearsal's verdicts: the launch host's output (the ranks' ``@@PF-REHEARSE {json}`` events, pdsh's
lines by host, the launcher's own), read back into one ``launch`` outcome per host and the cluster row. Pure, standard
library only: the coordinator side of ``preflight rehearse`` and of the ``launch`` check of ``preflight run``.

    node02: @@PF-REHEARSE {"run": "preflight-rehearse-0123", "event": "init_begin", "rank": 1, "advertise": ...}
    pdsh@node01: node03: ssh exited with exit code 255
    RuntimeError: launcher 'pdsh' not installed.
    -> node02: FAIL "rank 1 (local 0) advertised the loopback address 127.0.1.1 ..."; node03: FAIL "never started (ssh)"
"""
from __future__ import annotations

import collections
import json
import os
import re
import shlex
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from ...hostside import rehearsal as host_side
from ...hostside.fixes import firewall_fix, prebuild_phrase
from ...hostside.jit import age_text
from ...hostside.outcome import BlockedBy, Outcome, Status

CLUSTER = "*"  # the host of the cluster row
CHECK = "launch"  # the check name of the rehearsal's results (one per host, and the cluster row)
LOCAL = "this machine"  # the launch host's name when launching from here (--launch-from local)
TOKEN_PREFIX = host_side.TOKEN_PREFIX
pattern_of = host_side.pattern_of
SCRIPT = "preflight_rehearse.py"
HOSTFILE = "hostfile"
ENV_FILE_NAME = ".deepspeed_env"
GRACE_S = 10.0  # after a rank raised, how long the others have to report theirs before the rehearsal stops
STOP_S = 40.0  # the launch host's supervisor: its pdsh reap (30 s) and a margin
REAP_S = 15.0  # one host's clean-up command
MAX_LINES = 200  # kept per host (and for the launcher) of the output that is not an event
MAX_EVENTS = 20000
MAX_LINE = 4096


@dataclass
class LaunchPlan:
    """What is rehearsed: the hosts after -i/-e (name, slots, gpus), and how to launch."""

    hostfile: str
    hosts: List[Any]  # hostside.seams.HostRef: name, slots, gpus
    deepspeed_config: str  # the path every rank opens (absolute)
    include: str = ""
    exclude: str = ""
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    launcher_ssh_port: Optional[int] = None
    launch_from: str = "first"  # "first", "local" (this machine) or a host of the hostfile
    deepspeed: str = "deepspeed"  # the launcher command on the launch host
    deepspeed_beside: bool = False  # run the `deepspeed` beside --python on the launch host when there is one
    python: str = "python3"  # the launch host's interpreter for the supervisor
    steps: int = 2
    model_params: float = 1e6
    init_timeout: float = 60.0
    timeout: float = 300.0
    build_budget: float = 900.0  # how long a rank may JIT-build ops ([launch] jit_build_budget_s)
    workdir: str = "/tmp"  # the launch directory's parent on every host
    env_file: Optional[str] = None  # ./.deepspeed_env of the directory preflight runs in, if there is one
    parallel: int = 32
    strict: bool = False


@dataclass
class Slot:
    rank: int
    host: str  # the hostfile's name
    local_rank: int


def expected_ranks(hosts: Sequence[Any]) -> List[Slot]:
    """DeepSpeed's rank layout (deepspeed/launcher/launch.py): global ranks in hostfile order, each host's slots in
    the order of its selected slots, local ranks counting from 0 on each host."""
    slots: List[Slot] = []
    for host in hosts:
        for local in range(len(host.gpus) if host.gpus else host.slots):
            slots.append(Slot(len(slots), host.name, local))
    return slots


# ------------------------------------------------------------------------------------------ what comes back

class EventLog:
    """The launch host's output as it arrives: the rehearsal's events, and the other lines by host (pdsh's
    ``node02: ...`` prefix, or its own ``pdsh@node01: node02: ...``), or the launcher's own."""

    def __init__(self, token: str, hosts: Sequence[str]) -> None:
        self.token = token
        self.hosts = set(hosts)
        self.cond = threading.Condition()
        self.events: List[Dict[str, Any]] = []
        self.lines: Dict[str, Deque[str]] = {h: collections.deque(maxlen=MAX_LINES) for h in hosts}
        self.launcher: Deque[str] = collections.deque(maxlen=MAX_LINES)
        self._partial = {False: b"", True: b""}
        self.arrived = time.monotonic()

    def feed(self, data: bytes, is_err: bool = False) -> None:
        with self.cond:
            buf = self._partial[is_err] + data
            *complete, rest = buf.split(b"\n")
            self._partial[is_err] = rest[-MAX_LINE:]
            for raw in complete:
                self._line(raw[:MAX_LINE].decode("utf-8", errors="replace").rstrip("\r"))
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            for is_err in (False, True):
                if self._partial[is_err]:
                    self._line(self._partial[is_err].decode("utf-8", errors="replace"))
                    self._partial[is_err] = b""
            self.cond.notify_all()

    def _line(self, line: str) -> None:
        at = line.find(host_side.TAG + " ")
        if at >= 0:
            try:
                payload = json.loads(line[at + len(host_side.TAG) + 1:])
            except ValueError:
                payload = None
            if isinstance(payload, dict) and payload.get("run") == self.token:
                if len(self.events) < MAX_EVENTS:
                    payload["arrived"] = round(time.monotonic() - self.arrived, 3)
                    self.events.append(payload)
                return
        pdsh = re.match(r"^pdsh@[^:\s]+: ([^:\s]+): (.*)$", line)
        if pdsh and pdsh.group(1) in self.hosts:
            self.lines[pdsh.group(1)].append("pdsh: " + pdsh.group(2))
            return
        own = re.match(r"^([^:\s]+): (.*)$", line)
        if own and own.group(1) in self.hosts:
            self.lines[own.group(1)].append(own.group(2))
            return
        if line.strip():
            self.launcher.append(line)

    def snapshot(self) -> List[Dict[str, Any]]:
        with self.cond:
            return list(self.events)


@dataclass
class RankView:
    """One rank as its events tell it."""

    slot: Slot
    seen: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # the last event of each kind
    steps: List[Dict[str, Any]] = field(default_factory=list)
    op_running: Optional[str] = None
    op_since: Optional[float] = None
    op_arrived: Optional[float] = None  # when the op now loading began, on the events' clock
    op_cold: bool = False  # the op now loading is JIT-built from nothing (its build directory has no library)
    loads: List[Dict[str, Any]] = field(default_factory=list)  # each op_end: name, jit, s, cold, build_var, ...

    def add(self, event: Dict[str, Any]) -> None:
        kind = str(event.get("event"))
        self.seen[kind] = event
        if kind == "step":
            self.steps.append(event)
        elif kind == "op_begin":
            self.op_running, self.op_since = str(event.get("op")), event.get("t")
            self.op_arrived, self.op_cold = event.get("arrived"), False
        elif kind == "op_jit":
            self.op_cold = bool(event.get("cold"))
        elif kind == "op_end":
            self.op_running = None
            self.loads.append(event)

    def builds(self) -> List[Dict[str, Any]]:
        """The ops this rank JIT-built from nothing (cold), each with its seconds."""
        return [e for e in self.loads if e.get("jit") and e.get("cold")]

    @property
    def building(self) -> bool:
        """In a JIT load of an op (compiling, or waiting for the lock of another rank's build)."""
        return self.op_running is not None and not self.ended

    @property
    def started(self) -> bool:
        return "start" in self.seen

    @property
    def ended(self) -> bool:
        return any(k in self.seen for k in ("done", "error", "deadline"))

    @property
    def phase(self) -> str:
        """Where the rank is (or stopped): the last phase it began."""
        for kind, phase in (("done", "done"), ("error", "error"), ("step", "step"), ("initialize", "step"),
                            ("init", "initialize"), ("init_begin", "init"), ("imported", "config"),
                            ("start", "import")):
            if kind in self.seen:
                return phase
        return "never started"

    def timings(self) -> Dict[str, Any]:
        seen = self.seen
        out: Dict[str, Any] = {"rank": self.slot.rank, "local_rank": self.slot.local_rank, "host": self.slot.host,
                               "state": self.phase}
        if "start" in seen:
            out["hostname"] = seen["start"].get("host")
        for kind, key in (("imported", "import_s"), ("init", "init_s"), ("initialize", "initialize_s")):
            if kind in seen and seen[kind].get("s") is not None:
                out[key] = seen[kind]["s"]
        if self.steps:
            out["step_s"] = [s.get("s") for s in self.steps]
        last = seen.get("done") or seen.get("error")
        if last:
            for key in ("peak_rss_mib", "peak_device_mib", "ops"):
                if key in last:
                    out[key] = last[key]
        if "initialize" in seen:
            for key in ("zero_stage", "micro_batch", "gradient_accumulation", "train_batch", "params"):
                out[key] = seen["initialize"].get(key)
        if "init_begin" in seen:
            out["backend"] = seen["init_begin"].get("backend")
            if seen["init_begin"].get("advertise"):
                out["advertise"] = seen["init_begin"]["advertise"]
        return out


def rank_views(slots: Sequence[Slot], events: Sequence[Dict[str, Any]]) -> Tuple[List[RankView], List[Dict[str, Any]]]:
    """(a view per expected rank, the launch host's supervisor events)."""
    views = [RankView(s) for s in slots]
    by_rank = {s.rank: v for s, v in zip(slots, views)}
    launcher = []
    for event in events:
        if event.get("role") == "launcher":
            launcher.append(event)
            continue
        rank = event.get("rank")
        if isinstance(rank, int) and rank in by_rank:
            by_rank[rank].add(event)
    return views, launcher


# ------------------------------------------------------------------------------------------------ analysis

def secs(value: Any) -> str:
    try:
        return f"{float(value):.3g} s"
    except (TypeError, ValueError):
        return "?"


def _rank_name(view: RankView) -> str:
    return f"rank {view.slot.rank} (local {view.slot.local_rank})"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else ""


# A template: filled in with .format(hostfile=..., host=...) where a loopback rank is found.
IFNAME_FIX = ("set GLOO_SOCKET_IFNAME (gloo) and NCCL_SOCKET_IFNAME (NCCL) to the cluster interface in "
              "./.deepspeed_env, which DeepSpeed's launcher exports to every rank: `preflight run --hostfile "
              "{hostfile} --env-file .deepspeed_env` writes both from the hosts' measured network; or make "
              "{host}'s hostname resolve to its cluster address (a Debian-style '127.0.1.1 {host}' line in /etc/hosts "
              "is the usual cause)")


@dataclass
class Context:
    """What a rank's verdict needs beyond its own events."""

    options: LaunchPlan
    launch_host: str
    stop_reason: str
    elapsed: float
    loopback: List[RankView]  # ranks that advertised a loopback address to a multi-host gloo world
    first_error: Optional[RankView]
    views: List[RankView] = field(default_factory=list)
    output: Dict[str, List[str]] = field(default_factory=dict)  # each host's last lines that are not events


def _init_error(view: RankView, ctx: Context, text: str) -> Tuple[str, str, str]:
    """(kind, message, fix) of a rank that raised in init_process_group: a loopback address, a peer it could not
    reach, the rendezvous."""
    message = str(view.seen["error"].get("message", ""))
    rank, said = _rank_name(view), _last_line(message)
    if view in ctx.loopback:
        return _loopback(view, ctx)
    if ctx.loopback:
        other = ctx.loopback[0]
        return ("rendezvous", f"{rank} failed at init: {said[:300]} (the loopback address "
                f"{_advertised(other)} that {_rank_name(other)} on {other.slot.host} advertised)",
                IFNAME_FIX.format(hostfile=ctx.options.hostfile, host=other.slot.host))
    peers = _peers_named(message, ctx)
    if peers:
        owners = sorted({v.slot.host for v in _peer_views(message, ctx)})
        hosts = ", ".join(owners)
        return ("rendezvous", f"{text} ({peers})",
                f"the rank on {view.slot.host} could not connect to {hosts}: allow inbound TCP from the other "
                f"hosts to {hosts} (gloo and NCCL listen on ephemeral ports, 1024-65535, besides the master "
                "port); `preflight run --checks ports` names the blocked pairs")
    return ("rendezvous", text, _rendezvous_fix(view, ctx))


def classify_error(view: RankView, ctx: Context) -> Tuple[str, str, str]:
    """(kind, message, fix) of a rank that raised: config, op build, OOM, rendezvous, ..."""
    err = view.seen["error"]
    phase, kind_name = str(err.get("phase", "")), str(err.get("type", "Exception"))
    message = str(err.get("message", ""))
    rank, said = _rank_name(view), _last_line(message)
    text = f"{rank} raised {kind_name} in {phase}: {said[:400] or kind_name}"
    host = view.slot.host
    config = ctx.options.deepspeed_config
    stale = err.get("stale_lock")
    if isinstance(stale, dict) and stale.get("path"):
        path = str(stale["path"])
        return ("stale lock", f"{rank} waits forever on a stale torch extensions lock {path} (op {stale.get('op')}, "
                f"{age_text(stale.get('age_s'))} old): no process on {host} holds it, a JIT build killed before it "
                "removed its lock (torch/utils/file_baton.py FileBaton.wait; pytorch issue 189245); not a build in "
                "progress", f"rm -f {shlex.quote(path)}")
    if err.get("op"):
        tail = compiler_lines(ctx.output.get(host, []))
        compiler = f"; the build's last lines: {' | '.join(tail)}" if tail else ""
        return ("op build", f"{rank} raised while loading DeepSpeed op {err['op']}: {kind_name}: {said[:400]}"
                f"{compiler}",
            f"the op is JIT-built at the first use: install its build tools on {host} (a C++ compiler, ninja; nvcc "
            "matching torch's CUDA for CUDA ops) or pre-build it ("
            f"{prebuild_phrase(_rank_python(view, ctx), [_build_var(err['op'])], _rank_ds(view))}, "
            f"or DS_BUILD_OPS=1 for every op); `ds_report` on {host} lists the ops")
    if kind_name in ("OutOfMemoryError", "MemoryError") or "out of memory" in message.lower():
        return ("OOM", text, f"the rehearsal's model is small (--rehearse-model-params): memory is short on {host} "
                "before the real model loads; lower train_micro_batch_size_per_gpu, or use ZeRO-3 / offload; "
                "`preflight run --model-params N` estimates the full model")
    if phase == "config":
        if kind_name == "FileNotFoundError":
            return ("config missing", f"{rank} cannot open the DeepSpeed config {config} on {host}: {said}",
                f"the launcher passes the path, and every rank opens it on its own host: copy {config} to the same "
                f"path on {host} (or put it on a shared filesystem)")
        return ("config", text, f"the config {config} on {host} is not the JSON this machine read: copy the same file "
                "to every host")
    if phase == "import":
        return ("import", text, f"install torch and DeepSpeed in the interpreter the launcher starts on {host} (the "
                "launch host's sys.executable, at the same path on every host)")
    if phase == "init":
        return _init_error(view, ctx, text)
    if phase == "initialize":
        if "batch" in message.lower():
            return ("config", text, "train_batch_size must equal train_micro_batch_size_per_gpu x "
                    f"gradient_accumulation_steps x the data-parallel size ({_world(ctx)} ranks here); fix {config}")
        return ("config", text, f"deepspeed.initialize refused {config} with this world: fix the key it names "
                f"(`preflight run --deepspeed-config {config}` checks it against the cluster)")
    return ("raised", text, "see the traceback in the JSON report (launch metrics) or with -v")


def _owners(address: str, ctx: Context) -> List[RankView]:
    """The ranks that advertised ``address`` (their init_begin event), at most 4: more is not a name."""
    owners = [v for v in ctx.views
              if ((v.seen.get("init_begin") or {}).get("advertise") or {}).get("address") == address]
    return owners if len(owners) <= 4 else []


def _addresses(message: str) -> List[str]:
    return list(dict.fromkeys(re.findall(r"remote=\[([^\]]+)\]", message)))


def _peer_views(message: str, ctx: Context) -> List[RankView]:
    return [v for address in _addresses(message) for v in _owners(address, ctx)]


def _peers_named(message: str, ctx: Context) -> str:
    """The ranks behind the addresses a gloo error names (``remote=[198.18.0.3]:41234``), by the address each
    advertised: 'remote 198.18.0.3 is rank 2 (local 0) on node03'."""
    found = []
    for address in _addresses(message):
        owners = _owners(address, ctx)
        if owners:
            ranks = ", ".join(f"{_rank_name(v)} on {v.slot.host}" for v in owners)
            found.append(f"remote {address} is {ranks}")
    return "; ".join(found)


def _world(ctx: Context) -> int:
    return len(expected_ranks(ctx.options.hosts))


def _advertised(view: RankView) -> str:
    advertise = (view.seen.get("init_begin") or {}).get("advertise") or {}
    return str(advertise.get("address") or "a loopback address")


def _loopback(view: RankView, ctx: Context) -> Tuple[str, str, str]:
    advertise = (view.seen.get("init_begin") or {}).get("advertise") or {}
    return ("loopback", f"{_rank_name(view)} advertised the loopback address {advertise.get('address')} to the "
            f"other ranks ({advertise.get('source', '')}; GLOO_SOCKET_IFNAME is not set): gloo's connectFullMesh "
            "cannot reach it from another host",
            IFNAME_FIX.format(hostfile=ctx.options.hostfile, host=view.slot.host))


def _build_var(op: Any) -> str:
    """DeepSpeed's install-time switch for one op (setup.py: DS_BUILD_<OP>)."""
    return f"DS_BUILD_{str(op).upper()}"


def _rank_ds(view: RankView) -> Any:
    """The DeepSpeed version the rank imported (its imported event), which a pre-build reinstalls; None unknown."""
    return (view.seen.get("imported") or {}).get("deepspeed")


def _rank_python(view: RankView, ctx: Context) -> Any:
    """The interpreter the rank ran (its sys.executable, as its start event said), else --python: its pip is the
    one a fix runs."""
    return (view.seen.get("start") or {}).get("python") or ctx.options.python


def _rendezvous_fix(view: RankView, ctx: Context) -> str:
    env = (view.seen.get("start") or {}).get("env") or {}
    addr, port = env.get("MASTER_ADDR", "?"), env.get("MASTER_PORT", "?")
    # The addresses the ranks advertised (and MASTER_ADDR): firewall_fix keeps the literal IPs among them. Which
    # host drops, and its firewall, the rehearsal does not know: the ports check reads both.
    sources = sorted({str(a) for a in [addr] + [((v.seen.get("init_begin") or {}).get("advertise") or {})
                                                .get("address") for v in ctx.views] if a})
    return (f"every rank meets at MASTER_ADDR:MASTER_PORT ({addr}:{port}) and then connects to every other rank on "
            f"its own port: launch with --master_addr set to an address every host reaches if {addr} is not one; "
            "`preflight run --checks ports,interfaces` names the blocked host and reads its firewall; "
            + firewall_fix("every host", None, sources, "1024-65535"))


def verdict_of(view: RankView, ctx: Context) -> Tuple[Status, str, str, str]:
    """(status, message, fix, kind) of one rank."""
    if "done" in view.seen:
        t = view.timings()
        steps = "/".join(secs(s).replace(" s", "") for s in t.get("step_s", [])) + " s"
        peak = f", peak {t['peak_rss_mib']:.0f} MiB" if t.get("peak_rss_mib") else ""
        return (Status.PASS, f"{_rank_name(view)}: init {secs(t.get('init_s'))}, initialize "
                f"{secs(t.get('initialize_s'))}, steps {steps}{peak}", "", "ok")
    if "error" in view.seen:
        kind, message, fix = classify_error(view, ctx)
        return Status.FAIL, message, fix, kind
    if "deadline" in view.seen:
        lifetime = secs(view.seen["deadline"].get("lifetime"))
        return (Status.FAIL, f"{_rank_name(view)} ended itself at its lifetime ({lifetime}) in {view.phase}",
            "raise --timeout, or see why the rank was slow", "deadline")
    if not view.started:
        return Status.FAIL, f"{_rank_name(view)} never started", "", "never started"
    where = view.phase
    arrivals = [float(e["arrived"]) for e in view.seen.values() if isinstance(e.get("arrived"), (int, float))]
    since = max(arrivals) if arrivals else None  # when it began what it was still doing
    waited = secs(ctx.elapsed - since) if isinstance(since, (int, float)) else "a while"
    if view.op_running:
        return _still_building(view, ctx)
    if where == "init":
        if view in ctx.loopback:
            _, message, fix = _loopback(view, ctx)
            return (Status.FAIL, f"{message}; it was still in init_process_group after {waited}", fix,
                    "loopback")
        if ctx.loopback:
            other = ctx.loopback[0]
            return (Status.FAIL, f"{_rank_name(view)} was still in init_process_group after {waited}, waiting on the "
                    f"loopback address {_advertised(other)} that {_rank_name(other)} on {other.slot.host} advertised",
                    IFNAME_FIX.format(hostfile=ctx.options.hostfile, host=other.slot.host), "rendezvous")
        return (Status.FAIL, f"{_rank_name(view)} hung in init_process_group for {waited} ({ctx.stop_reason})",
                _rendezvous_fix(view, ctx), "hung at init")
    return (Status.FAIL, f"{_rank_name(view)} was still in {where} after {waited} when the rehearsal stopped "
            f"({ctx.stop_reason})",
        "a rank waits for the others in every collective: see the other hosts' results", "hung")


def compiler_lines(lines: Sequence[str], n: int = 6) -> List[str]:
    """The last lines a host's ranks printed that are not events (ninja's and the compiler's, through pdsh)."""
    return [line.strip()[:300] for line in lines if line.strip()][-n:]


def _still_building(view: RankView, ctx: Context) -> Tuple[Status, str, str, str]:
    """A rank that was still in a JIT load when the rehearsal stopped: out of the build budget (FAIL, with the
    compiler's last lines), or stopped for another reason (the build was cut short)."""
    op = view.op_running
    since = view.op_arrived if isinstance(view.op_arrived, (int, float)) else None
    spent = secs(ctx.elapsed - since) if since is not None else "a while"
    budget = ctx.options.build_budget
    tail = compiler_lines(ctx.output.get(view.slot.host, []))
    compiler = f"; the build's last lines: {' | '.join(tail)}" if tail else ""
    what = "JIT-building" if view.op_cold else "loading (a JIT load: building, or waiting for the build lock)"
    build_var = str((view.seen.get("op_begin") or {}).get("build_var") or "DS_BUILD_OPS")
    fix = (f"pre-build the op into DeepSpeed on every host ("
           f"{prebuild_phrase(_rank_python(view, ctx), [build_var], _rank_ds(view))}), or warm a host-local "
           "TORCH_EXTENSIONS_DIR; or "
           "give the build more time: [launch] "
           f"jit_build_budget_s (now {budget:g} s), `preflight rehearse --jit-build-budget` with more seconds")
    if "jit_build_budget_s" in ctx.stop_reason:
        return (Status.FAIL, f"{_rank_name(view)} was still {what} DeepSpeed op {op} after {spent}: the JIT build "
                f"budget ran out{compiler}", fix, "op build")
    # Stopped for another reason (another rank's failure, --timeout, Ctrl-C): the build was cut short, not failed.
    return (Status.FAIL, f"{_rank_name(view)} was still {what} DeepSpeed op {op} ({spent} so far) when the rehearsal "
            f"stopped ({ctx.stop_reason})", fix, "build cut short")


# Why a host's ranks never started, from pdsh's lines for that host (first match wins).
NEVER_STARTED: List[Tuple[str, str, str]] = [
    (r"No module named '?(deepspeed|torch)", "python",
     "install torch and DeepSpeed in {python} on {host}: DeepSpeed starts every host with the launch host's "
     "interpreter"),
    (r"(python[\w.]*|\S*/python\S*)\W.*(not found|No such file or directory)", "python",
     "DeepSpeed starts every host with the launch host's interpreter ({python}): install the same environment at "
     "the same path on {host}, or use a shared one"),
    (r"\bcd\b.*(No such file|can't cd)", "cwd",
     "DeepSpeed cds into the launch directory on every host: it must exist on {host} at the same path"),
    (r"Permission denied|Host key verification failed|Could not resolve hostname|connect to host|Connection "
     r"(refused|timed out|closed)|No route to host|ssh exited with exit code 255", "ssh",
     "pdsh reaches {host} with plain ssh from {launch}: make `ssh {host} hostname` work there without a prompt "
     "(`preflight run --checks launcher_ssh` names the cause)"),
]

# Why the launcher itself failed before any rank started, from its own output on the launch host.
LAUNCHER_FAILED: List[Tuple[str, str, str]] = [
    (r"launcher 'pdsh' not installed", "no pdsh",
     "install pdsh on {launch} (apt install pdsh, dnf install pdsh), or launch with another --launcher (openmpi, "
     "mvapich, slurm, ...) and check that one instead"),
    (r"not enough values to unpack \(expected 2", "env file",
     "DeepSpeed's runner reads KEY=VALUE lines from .deepspeed_env and raises on any other line (a blank line too): "
     "fix {env_lines}"),
    (r"was not reachable via ssh", "ssh",
     "DeepSpeed first runs `ssh {first} hostname` on {launch}: make passwordless ssh work there"),
    (r"Unable to detect suitable master address|hostname -I", "master address",
     "pass --master-addr with the first host's cluster address"),
    (r"Hostfile contains|Hostfile is empty|Unable to find hostfile", "hostfile",
     "DeepSpeed reads 'HOST slots=N' lines only (no ranges or other text): `preflight hostfile --expand "
     "{hostfile}` writes one it reads"),
    (r"No module named '?deepspeed", "no deepspeed",
     "install DeepSpeed on {launch}, or pass --deepspeed with the launcher's path"),
    (r"(not found|No such file or directory)", "no launcher",
     "install DeepSpeed on {launch}, or pass --deepspeed with the launcher command (e.g. /opt/venv/bin/deepspeed)"),
]


def _match(table: List[Tuple[str, str, str]], lines: Sequence[str]) -> Optional[Tuple[str, str, str]]:
    for pattern, kind, fix in table:
        for line in lines:
            if re.search(pattern, line):
                return kind, line.strip()[:400], fix
    return None


# The kinds of a rank's failure that only follow from another rank's: it waited at a rendezvous or a collective.
VICTIM_KINDS = ("hung at init", "hung", "rendezvous", "deadline", "build cut short")


def _cache_of(builds: Mapping[str, Mapping[str, Any]]) -> str:
    dirs = sorted({os.path.dirname(str(b.get("build_dir"))) for b in builds.values() if b.get("build_dir")})
    return ", ".join(dirs) or "(unknown)"


class Outcomes:
    """The rehearsal's results: a ``launch`` row per host and the cluster row."""

    def __init__(self, options: LaunchPlan, launch_host: str, log: EventLog, stop_reason: str,
                 elapsed: float, launched: Dict[str, Any]) -> None:
        self.o = options
        self.launch_host = launch_host
        self.log = log
        self.stop_reason = stop_reason
        self.elapsed = elapsed
        self.launched = launched
        self.slots = expected_ranks(options.hosts)
        self.views, self.launcher = rank_views(self.slots, log.snapshot())

    def _launcher_event(self, kind: str) -> Dict[str, Any]:
        return next((e for e in reversed(self.launcher) if e.get("event") == kind), {})

    def env_lines(self) -> str:
        files = self._launcher_event("launcher").get("env_files") or []
        bad = [f"{f.get('path')} line {', '.join(str(n) for n in f['bad_lines'])}" for f in files
               if f.get("bad_lines")]
        return "; ".join(bad) or "the .deepspeed_env files it read"

    def context(self) -> Context:
        multi_host = len({s.host for s in self.slots}) > 1
        loopback = [v for v in self.views if multi_host and (v.seen.get("init_begin") or {}).get("backend") == "gloo"
                    and ((v.seen["init_begin"].get("advertise") or {}).get("loopback"))
                    and "init" not in v.seen and any("init" not in w.seen for w in self.views)]
        errors = sorted((v for v in self.views if "error" in v.seen), key=lambda v: v.seen["error"].get("arrived", 0))
        return Context(self.o, self.launch_host, self.stop_reason, self.elapsed, loopback,
                       errors[0] if errors else None, self.views,
                       {h: list(lines) for h, lines in self.log.lines.items()})

    def launcher_failure(self) -> Optional[Tuple[str, str, str]]:
        """(kind, line, fix) when the launcher failed before any rank started, else None."""
        if any(v.started for v in self.views):
            return None
        if not self.launcher and self.launched.get("rc") not in (None, 0):
            # Not even the supervisor said a word: its interpreter (--python) or the launch directory is missing.
            # Its output came through the log (the channel streams both of its streams there).
            said = "\n".join(list(self.log.launcher) + [str(self.launched.get("stderr") or "")])
            line = _last_line(said) or f"exit code {self.launched.get('rc')}"
            # The fix is a template: host_rows fills in {launch} with .format.
            return ("no supervisor", line[:400], "pass --python with an interpreter that exists on {launch} "
                    "(it runs the rehearsal's supervisor, standard library only)")
        exit_event = self._launcher_event("launcher_exit")
        lines = list(self.log.launcher)
        if exit_event.get("error"):
            lines.insert(0, str(exit_event["error"]))
        if not self.launcher and self.launched.get("stderr"):
            lines += str(self.launched["stderr"]).splitlines()
        found = _match(LAUNCHER_FAILED, lines)
        if found:
            return found
        if exit_event or self.launched.get("rc") not in (None, 0):
            tail = _last_line("\n".join(lines)) or "no output"
            return "launcher", tail[:400], f"run the launch by hand on {self.launch_host} and read its output"
        return None

    def host_rows(self) -> Dict[str, Outcome]:
        ctx = self.context()
        failed_launch = self.launcher_failure()
        rows: Dict[str, Outcome] = {}
        for host in self.o.hosts:
            mine = [v for v in self.views if v.slot.host == host.name]
            metrics: Dict[str, Any] = {"ranks": [v.timings() for v in mine],
                                       "output": list(self.log.lines.get(host.name, []))[-20:]}
            errors = [v.seen["error"] for v in mine if "error" in v.seen]
            if errors:
                metrics["traceback"] = "\n\n".join(str(e.get("traceback", "")) for e in errors)[-8000:]
            if failed_launch is not None:
                kind, line, fix = failed_launch
                # The tables' fixes are templates, filled in here (LAUNCHER_FAILED, launcher_failure).
                fix = fix.format(launch=self.launch_host, hostfile=self.o.hostfile, env_lines=self.env_lines(),
                                 first=self.o.hosts[0].name)
                if host.name == self.launch_host:
                    rows[host.name] = Outcome(Status.FAIL, f"DeepSpeed's launcher on {self.launch_host} failed "
                                              f"before any rank started ({kind}): {line}", fix,
                                              dict(metrics, cause=kind))
                else:
                    # Nothing of its own was tried: a victim of the launch host's failure.
                    rows[host.name] = Outcome(Status.FAIL, f"its {len(mine)} rank(s) never started: the launcher on "
                                              f"{self.launch_host} failed ({kind})", fix,
                                              dict(metrics, cause=kind),
                                              blocked_by=BlockedBy(self.launch_host, CHECK))
                continue
            verdicts = [verdict_of(v, ctx) for v in mine]
            if all(v[0] == Status.PASS for v in verdicts):
                rows[host.name] = self._passed(host.name, mine, verdicts, metrics)
                continue
            if any(kind == "never started" for _, _, _, kind in verdicts):
                cause = _match(NEVER_STARTED, list(self.log.lines.get(host.name, [])))
                never = [v for v, (_, _, _, k) in zip(mine, verdicts) if k == "never started"]
                names = ", ".join(str(v.slot.rank) for v in never)
                if cause:
                    kind, line, fix = cause
                    text = f"rank(s) {names} never started ({kind}): {line}"
                    # NEVER_STARTED's fixes are templates, filled in here.
                    fix = fix.format(host=host.name, launch=self.launch_host, python=self._python())
                else:
                    text = (f"rank(s) {names} never started; pdsh said nothing about {host.name} "
                            f"({self.stop_reason})")
                    fix = f"run the launch by hand on {self.launch_host} and read {host.name}'s lines"
                verdicts = [(Status.FAIL, text, fix, "never started")] + \
                    [v for v in verdicts if v[3] != "never started"]
            bad = [v for v in verdicts if v[0] != Status.PASS]
            # The root cause first: a loopback advertisement or a raise before a rank that only waited.
            order = {"loopback": 0, "config missing": 1, "never started": 1, "op build": 1, "OOM": 1, "config": 1}
            bad.sort(key=lambda v: order.get(v[3], 2))
            metrics["cause"] = bad[0][3]
            rows[host.name] = Outcome(Status.FAIL, "; ".join(v[1] for v in bad), bad[0][2], metrics)
        self._blocked(rows)
        return rows

    def _passed(self, host: str, mine: Sequence[RankView], verdicts: Sequence[Tuple[Status, str, str, str]],
                metrics: Dict[str, Any]) -> Outcome:
        """Every rank of the host took its steps: PASS, or a WARN when its start JIT-built ops from nothing (each
        op's build time; a measurement of what the first job start costs, not a failure) or waited for another
        host's build in a shared extensions directory."""
        text = "; ".join(v[1] for v in verdicts)
        built: Dict[str, Dict[str, Any]] = {}
        for view in mine:
            for load in view.builds():
                name = str(load.get("name"))
                if name not in built or float(load.get("s") or 0) > float(built[name].get("s") or 0):
                    built[name] = load
        if not built:
            return Outcome(Status.PASS, text, metrics=metrics)
        metrics["jit_builds"] = {n: {"s": b.get("s"), "build_dir": b.get("build_dir"), "build_var": b.get("build_var"),
                                     "built_here": bool(b.get("acquired")), "waited": bool(b.get("waited"))}
                                 for n, b in built.items()}
        here = {n: b for n, b in built.items() if any(x.get("acquired") for v in mine for x in v.builds()
                                                      if x.get("name") == n)}
        elsewhere = {n: b for n, b in built.items() if n not in here}
        parts, fixes = [], []
        if here:
            spent = ", ".join(f"{secs(b.get('s'))} building {n}" for n, b in here.items())
            parts.append(f"the first job start spends {spent} on {host} (a JIT build: the torch extensions cache "
                         f"{_cache_of(here)} had no library of it)")
            pre = [str(b.get('build_var') or 'DS_BUILD_OPS') for b in here.values()]
            python = next((_rank_python(v, self.context()) for v in mine), self.o.python)
            version = next((_rank_ds(v) for v in mine if _rank_ds(v)), None)
            fixes.append(f"pre-build it into DeepSpeed on every host ({prebuild_phrase(python, pre, version)}), "
                         "or keep a warm, host-local TORCH_EXTENSIONS_DIR that every job start reuses")
        if elsewhere:
            waited = ", ".join(f"{n} ({secs(b.get('s'))})" for n, b in elsewhere.items())
            parts.append(f"its ranks waited for another host's build of {waited} in the shared torch extensions "
                         f"directory {_cache_of(elsewhere)}: the hosts build into one directory and queue on one lock")
            fixes.append("give every host its own cache: add the line TORCH_EXTENSIONS_DIR=/var/tmp/torch_extensions "
                         "(a host-local path) to .deepspeed_env, which DeepSpeed's launcher exports to every rank")
        metrics["cause"] = "jit build"
        return Outcome(Status.WARN, "; ".join(parts) + f"; {text}", "; ".join(fixes), metrics)

    def _blocked(self, rows: Dict[str, Outcome]) -> None:
        """A host whose ranks only waited (hung in init_process_group, or raised there when a peer went away) for a
        rank that raised or never started on another host is that host's victim: blocked_by (that host, launch)."""
        causes = [h for h, o in rows.items() if o.status == Status.FAIL and o.blocked_by is None
                  and o.metrics.get("cause") not in VICTIM_KINDS]
        if not causes:
            return
        first = self.context().first_error
        blocker = first.slot.host if first is not None and first.slot.host in causes else causes[0]
        for host, outcome in rows.items():
            if outcome.status == Status.FAIL and outcome.blocked_by is None and host not in causes:
                outcome.blocked_by = BlockedBy(blocker, CHECK)

    def env_text(self, files: Sequence[Dict[str, Any]]) -> str:
        """The .deepspeed_env files the launcher read, with their keys; the launch directory's copy under the name
        of the file it was copied from."""
        def name(path: str) -> str:
            if self.o.env_file and os.path.basename(os.path.dirname(path)).startswith(TOKEN_PREFIX):
                return self.o.env_file
            return path
        return ", ".join(f"{name(str(f.get('path')))} ({', '.join(f.get('keys') or []) or 'empty'})"
                         for f in files) or "no .deepspeed_env"

    def _python(self) -> str:
        argv = self._launcher_event("launcher").get("argv") or []
        return "the launch host's interpreter" if not argv else f"the interpreter of {argv[0]}"

    def _launch_metrics(self, done: List[RankView]) -> Dict[str, Any]:
        """The cluster row's metrics of the launch: its command, master, launcher, the slowest phases and step."""
        command = self.launched.get("command", "")
        metrics: Dict[str, Any] = {
            "launch_host": self.launch_host, "command": command, "world_size": len(self.slots),
            "hosts": len(self.o.hosts), "stopped": self.stop_reason, "elapsed_s": round(self.elapsed, 3),
            "env_files": self._launcher_event("launcher").get("env_files") or [],
            "launcher_rc": self._launcher_event("launcher_exit").get("rc"),
            "launcher_output": list(self.log.launcher)[-30:]}
        start = next((v.seen["start"] for v in self.views if "start" in v.seen), {})
        master = (start.get("env") or {}) if isinstance(start, dict) else {}
        if master.get("MASTER_ADDR"):
            metrics["master"] = f"{master.get('MASTER_ADDR')}:{master.get('MASTER_PORT', '')}"
        for key in ("import_s", "init_s", "initialize_s"):
            values = [float(v.timings()[key]) for v in self.views if v.timings().get(key) is not None]
            if values:
                metrics["max_" + key] = max(values)
        steps = [s for v in self.views for s in (v.timings().get("step_s") or []) if isinstance(s, (int, float))]
        if steps:
            metrics["max_step_s"] = max(steps)
        last = max((v.seen["done"].get("arrived", 0) for v in done), default=None)
        if last is not None:
            metrics["launch_to_last_step_s"] = last
        return metrics

    def cluster_row(self, rows: Dict[str, Outcome]) -> Outcome:
        ctx = self.context()
        done = [v for v in self.views if "done" in v.seen]
        metrics = self._launch_metrics(done)
        first = next((v for v in done), None)
        shape = ""
        if first is not None:
            t = first.timings()
            shape = (f"ZeRO-{t.get('zero_stage')}, micro batch {t.get('micro_batch')} x "
                     f"{t.get('gradient_accumulation')} accumulation x {len(self.slots)} ranks = "
                     f"{t.get('train_batch')}; ")
        env = self.env_text(metrics["env_files"])
        launcher, other_python = self.launcher_text()
        metrics["launcher"] = {k: self._launcher_event("launcher").get(k)
                               for k in ("launcher_path", "launcher_python", "python", "launcher_from")}
        if len(done) == len(self.slots) and all(o.status in (Status.PASS, Status.WARN) for o in rows.values()):
            def slowest(key: str) -> str:
                values = [(v.timings().get(key) or 0, v.slot.rank) for v in self.views]
                value, rank = max(values)
                return f"{secs(value)} (rank {rank})"
            step, to_last = secs(metrics.get("max_step_s")), secs(metrics.get("launch_to_last_step_s"))
            message = (f"{len(self.slots)} ranks on {len(self.o.hosts)} hosts started by `deepspeed --launcher pdsh` "
                       f"from {self.launch_host} ({launcher}; {env}; master {metrics.get('master', '?')}): {shape}"
                       f"slowest init {slowest('init_s')}, initialize {slowest('initialize_s')}, step {step}; "
                       f"{to_last} from launch to the last step")
            warnings, fixes = [], []
            built = self.build_summary(rows)
            if built:
                metrics["jit_builds"] = built
                warnings.append("the first job start spends " + "; ".join(
                    f"{secs(b['max_s'])} building {op} on {b['where']}" for op, b in built.items()))
                fixes.append(next(o.fix for o in rows.values() if o.status == Status.WARN and o.fix))
            if other_python:
                warnings.append(other_python)
                fixes.append(f"pass --deepspeed with the launcher of the job's environment (e.g. the deepspeed beside "
                             f"{self.o.python}), or put that environment first on the launch host's PATH")
            if warnings:
                return Outcome(Status.WARN, "; ".join(warnings) + f"; {message}", "; ".join(fixes), metrics)
            return Outcome(Status.PASS, message, metrics=metrics)
        failing = {h: o for h, o in rows.items() if o.status == Status.FAIL}
        root = self._root_cause(ctx, failing)
        message = f"the launch failed ({self.stop_reason}; {launcher}; {env}): {root[0]}"
        if other_python:
            message += f"; {other_python}"
        blocker = root[3]
        return Outcome(Status.FAIL, message, root[1], dict(metrics, cause=root[2]),
                       blocked_by=BlockedBy(blocker, CHECK) if blocker else None)

    def launcher_text(self) -> Tuple[str, str]:
        """(which launcher and interpreter the launch used, as the launch host's supervisor found them; a warning
        when that interpreter is not --python's, or "")."""
        event = self._launcher_event("launcher")
        path, python = event.get("launcher_path"), event.get("launcher_python")
        ours = event.get("python") or self.o.python
        where = {"beside": f"beside {ours}", "path": "first on the launch host's PATH",
                 "given": "as given"}.get(str(event.get("launcher_from")), "")
        text = f"launcher {path or self.o.deepspeed}" + (f" ({where})" if where else "")
        text += f", interpreter {python}" if python else ", interpreter unknown (not a Python script)"
        if path and python and event.get("same_python") is False:
            return text, (f"the launcher {path} runs {python}, not --python {ours}: DeepSpeed starts every rank with "
                          f"its launcher's interpreter (sys.executable, multinode_runner.py:109), so the ranks ran "
                          f"under an interpreter the checks did not look at")
        return text, ""

    def build_summary(self, rows: Dict[str, Outcome]) -> Dict[str, Dict[str, Any]]:
        """{op: {"hosts": {host: seconds}, "max_s", "where"}}: the ops the hosts' starts JIT-built from nothing."""
        out: Dict[str, Dict[str, Any]] = {}
        for host, outcome in rows.items():
            for op, b in (outcome.metrics.get("jit_builds") or {}).items():
                if b.get("built_here"):
                    out.setdefault(op, {"hosts": {}})["hosts"][host] = b.get("s")
        names = [h.name for h in self.o.hosts]
        for b in out.values():
            b["max_s"] = max(float(v or 0) for v in b["hosts"].values())
            each = ", ".join(f"{h} {secs(v)}" for h, v in b["hosts"].items())
            b["where"] = (f"every host ({each})" if set(b["hosts"]) == set(names) and len(names) > 1
                          else each)
        return out

    def _root_cause(self, ctx: Context, failing: Dict[str, Outcome]) -> Tuple[str, str, str, Optional[str]]:
        if ctx.loopback:
            names = ", ".join(f"{_rank_name(v)} on {v.slot.host} ({_advertised(v)})" for v in ctx.loopback)
            return (f"gloo ranks advertised a loopback address: {names}",
                    IFNAME_FIX.format(hostfile=self.o.hostfile, host=ctx.loopback[0].slot.host), "loopback",
                    ctx.loopback[0].slot.host)
        order = ["config missing", "stale lock", "no pdsh", "no supervisor", "env file", "never started", "python",
                 "ssh", "op build", "OOM", "config", "rendezvous", "hung at init"]
        def rank_of(item: Tuple[str, Outcome]) -> int:
            cause = str(item[1].metrics.get("cause", ""))
            return order.index(cause) if cause in order else len(order)
        ranked = sorted(failing.items(), key=rank_of)
        if not ranked:
            return "not every rank finished", "", "incomplete", None
        host, outcome = ranked[0]
        # The cluster row restates that host's cause: it is blocked by it (unless that host is itself a victim).
        blocker: Optional[str] = outcome.blocked_by.host if outcome.blocked_by is not None else host
        if str(outcome.metrics.get("cause", "")) in VICTIM_KINDS and outcome.blocked_by is None:
            blocker = None
        return f"{host}: {outcome.message}", outcome.fix, str(outcome.metrics.get("cause", "")), blocker
