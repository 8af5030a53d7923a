"""Orchestrate a run: connect to every host, run host checks through the agent, then cluster checks.

The coordinator always reports the full matrix: a host that cannot be reached, a check that crashes or a
host that hangs becomes ERROR cells for that host, and every wait is bounded by the configured timeouts.
"""
from __future__ import annotations

import copy
import datetime as _dt
import functools
import shlex
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

from preflight import checks as registry
from preflight.hostside.outcome import Outcome, Status
from preflight.hostside.seams import HOST_CHECKS, CheckOptions, CheckSpec, conflicts, usage
from preflight.answer import evaluate_safely, host_outcome
from preflight.hostside.proc import parallel_map
from preflight.hostfile import HostSpec
from preflight.causes import blocked_message, connection_check
from preflight.results import CLUSTER, HostRecord, Report, Result
from preflight.selfcheck import COORDINATOR, Admission, Kernel, SelfCheck
from preflight.remote import (DEFAULT_MAX_OUTPUT, DEFAULT_START_S, INTERPRETER_MISSING, Agent, AgentError, Service,
                             collect_budget, serve_input)
from preflight import transport as transports
from preflight.transport import (CommandResult, SharedSession, SSHOptions, Transport, TransportError,
                                 raise_fd_limit)


@dataclass
class RunOptions:
    """The coordinator's settings for a run. What the cluster checks read is ``check_options`` alone (it is their
    ``cluster.options``); the rest stays here."""

    hosts: List[HostSpec]
    checks: List[str]
    thresholds: Dict[str, Dict[str, Any]]
    local: bool = False             # this machine, without a transport to connect ("local" in the registry)
    python: str = "python3"
    ssh: SSHOptions = field(default_factory=SSHOptions)
    timeout: float = 120.0          # per check on a host
    parallel: int = 32
    strict: bool = False
    transport: str = "ssh"          # how remote hosts are reached: a name in preflight.transport.TRANSPORTS
    # Each transport's own flags by dest (preflight.transport.options(), e.g. how its agents start); a transport
    # reads its own, and an absent one is at its default.
    transport_options: Dict[str, Any] = field(default_factory=transports.defaults)
    # Added to every host's collect params (nvme_paths, required_ops): what the host-side checks read.
    host_params: Dict[str, Any] = field(default_factory=dict)
    # For the user, before the run: where the hosts came from, what preflight decided, warnings about the input.
    host_source: str = ""
    info_notes: List[str] = field(default_factory=list)
    input_notes: List[str] = field(default_factory=list)
    check_options: CheckOptions = field(default_factory=CheckOptions)
    # This machine's limits as the self-check reads them (preflight.selfcheck.Kernel); None: read this machine's.
    kernel: Optional[Kernel] = None


class Progress:
    """What the runner tells the user while it works; the terminal reporter draws it."""

    def phase(self, name: str, total: int) -> None:
        pass

    def advance(self, name: str, detail: str = "") -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def warning(self, text: str) -> None:
        """Something the user should know before the run goes on (this machine's limits): one line, kept."""

    def done(self) -> None:
        pass


@dataclass
class Node:
    """A host during the run: its spec, its transport, its agent, and what it told us."""

    spec: HostSpec
    transport: Transport
    agent: Agent
    ssh_facts: Dict[str, Any] = field(default_factory=dict)
    hello: bool = False  # its agent said hello at connect
    preloading: Optional[Any] = None  # the agent's preload request (a RunningCommand), when one was sent

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def reachable(self) -> bool:
        return bool(self.ssh_facts.get("connected"))


class Cluster:
    """What a cluster check's ``coordinate(cluster)`` sees: hosts, facts, options, and the agents."""

    def __init__(self, nodes: List[Node], options: RunOptions, facts: Dict[str, Dict[str, Any]],
                 progress: Progress):
        self._nodes = {n.name: n for n in nodes}
        self.all_hosts = [n.spec for n in nodes]
        self.hosts = [n.spec for n in nodes if n.reachable]
        self.master = self.all_hosts[0]
        self.world_size = sum(h.slots for h in self.all_hosts)
        self.facts = facts
        self.options = options.check_options
        self.thresholds = options.thresholds
        self.parallel = options.parallel
        self.local = options.local
        self.progress = progress
        self.waiter: Optional[Callable[[str], bool]] = None  # the run's Schedule.wait_for

    def wait_for(self, check: str) -> bool:
        """Wait until ``check`` has finished (seams.ClusterView.wait_for); whether it ran."""
        return self.waiter(check) if self.waiter is not None else check in (self.facts.get(CLUSTER) or {})

    def address(self, host: str) -> str:
        """The address the coordinator reached the host at (after ~/.ssh/config's HostName)."""
        return self._nodes[host].transport.address

    def call(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any:
        return self._nodes[host].agent.call(func, params, timeout)

    def call_all(self, func: str, params_by_host: Dict[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]:
        """Call func on several hosts at once; each value is the result or the exception."""
        names = list(params_by_host)
        # Not limited by --parallel: a call only waits on its host, and a round of calls (iperf3 pairs,
        # ports probes) must run all at once or every round grows with the number of hosts.
        out = parallel_map(lambda h: self.call(h, func, params_by_host[h], timeout), names,
                           max(1, len(names)), timeout + 30)
        return dict(zip(names, out))

    def start(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Service:
        return self._nodes[host].agent.start(func, params, timeout)

    def for_check(self, spec: CheckSpec) -> "Cluster":
        """This cluster as one check sees it: ``options`` holds the shared fields and that check's own inputs."""
        view = copy.copy(self)
        view.options = self.options.for_check(spec)
        return view

    def shell(self, host: str) -> Transport:
        """The host's connection itself (seams.HostShell), for a program a check runs under its own supervision
        (the launch check's DeepSpeed launcher): each command is a channel of its own beside the agent's."""
        return self._nodes[host].transport


def _select_specs(names: Sequence[str]) -> List[CheckSpec]:
    return [registry.spec(n) for n in names]


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def _connection_outcome(facts: Dict[str, Any], thresholds: Dict[str, Dict[str, Any]]) -> Outcome:
    """The connection check's one outcome for a host, from its connect facts."""
    outcome = evaluate_safely(registry.spec("ssh"), facts, thresholds)
    return outcome if isinstance(outcome, Outcome) else Outcome(
        Status.ERROR, "preflight internal error: the connection check returned more than one outcome",
        "please report this with the JSON report attached")


class Runner:
    QUIET_BACKSTOP_S: Optional[float] = None  # deadline of a group of quiet cluster checks; None: from --timeout

    def __init__(self, options: RunOptions, progress: Optional[Progress] = None):
        self.o = options
        self.progress = progress or Progress()
        self.token = f"preflight-{uuid.uuid4().hex[:12]}"
        self.results: List[Result] = []
        self.facts: Dict[str, Dict[str, Any]] = {}
        self.nodes: List[Node] = []
        self.sessions: List[SharedSession] = []  # the transports' shared sessions (open_shared)
        self.preload = False  # whether a selected check imports torch on the hosts (USES_TORCH)
        # Hosts where --python is not there (reached, but the agent could not start): {host: the check whose
        # cell says so}. Their other cells, and the cluster checks' cells of them, are that cell's victims.
        self.no_python: Dict[str, str] = {}
        self.t0 = time.monotonic()
        self.timeline: List[Dict[str, Any]] = []  # Report.timeline: when each phase ran

    def _span(self, phase: str, start: float) -> None:
        """Record that ``phase`` ran from ``start`` (time.monotonic()) until now (from the checks' threads too:
        a list's append is atomic)."""
        self.timeline.append({"phase": phase, "start_s": round(start - self.t0, 3),
                              "end_s": round(time.monotonic() - self.t0, 3)})

    # ------------------------------------------------------------------------------------------ phases
    def _make_node(self, spec: HostSpec) -> Node:
        transport = transports.create("local" if self.o.local else self.o.transport, spec.name, self.o.ssh,
                                      self.o.transport_options)
        mib = self.o.thresholds.get("agent", {}).get("max_output_mib")
        max_output = int(mib * 2**20) if mib else DEFAULT_MAX_OUTPUT
        return Node(spec, transport, Agent(transport, self.o.python, self.token, max_output, self.start_deadline_s))

    @property
    def start_deadline_s(self) -> float:
        """How long a host's agent has from its start to its hello: the connect timeout (opening its channel, or an
        shared session's launch) plus [agent] start_s (the interpreter's start-up). Past it, the host is one ERROR ("the
        agent never started") and the run goes on without it, instead of waiting out every request's budget."""
        start = self.o.thresholds.get("agent", {}).get("start_s")
        return self.o.ssh.connect_timeout + (DEFAULT_START_S if start is None else float(start))

    def _connect(self, node: Node) -> None:
        if self.o.local:
            node.ssh_facts = {"connected": True, "local": True, "hostname": socket.gethostname(),
                              "address": "127.0.0.1"}
            node.hello = True  # its agent starts with the first request (the preload's, or the host checks')
            self._preload(node)  # starts this machine's agent
            return
        transport = node.transport
        try:
            transport.connect()
        except TransportError as exc:
            node.ssh_facts = {"connected": False, "error": str(exc), "fix": exc.fix, "status": exc.status,
                              "address": transport.address}
            return
        # The host's agent starts here, once for the run; its hello proves that a command runs and names the
        # host. Only when it does not come up (no such --python, say) does a plain command probe the host,
        # so that the ssh check stays about SSH and the python check reports the interpreter.
        started = time.monotonic()
        hello = node.agent.open(self.o.ssh.connect_timeout)
        if hello is None and node.agent.adopted:
            # Its end of the shared session did not come up: an agent of its own. (When the whole session failed
            # before this, open() has already started one.)
            node.agent.close()
            started = time.monotonic()
            hello = node.agent.open(self.o.ssh.connect_timeout)
        step = "shared" if node.agent.adopted else "own"
        if hello is not None:
            node.hello = True
            probe = CommandResult(0, str(hello.get("hostname", ""))[:255], "", time.monotonic() - started)
            self._preload(node)
        else:
            probe = transport.run(["uname", "-n"], timeout=self.o.ssh.connect_timeout)
        # The kernel's RTT of the connection, not the probe's duration: with hundreds of hosts connecting
        # at once the coordinator's own queueing would show up as a slow host.
        rtt_ms = transport.network_rtt_ms()
        node.ssh_facts = {"connected": probe.rc == 0, "hostname": probe.stdout.strip(),
                          "address": transport.address, "connect_s": round(transport.connect_seconds, 3),
                          "rtt_ms": round(probe.duration * 1000 if rtt_ms is None else rtt_ms, 3),
                          "probe_ms": round(probe.duration * 1000, 1), "user": transport.user}
        if hello is not None and isinstance(hello.get("machine"), dict):
            node.ssh_facts["machine"] = hello["machine"]  # which machine it is (agent.machine_identity)
        if transport.via:
            node.ssh_facts["via"] = transport.via
        if transport.SHARES_SESSIONS:
            node.ssh_facts["step"] = step
        if probe.rc != 0:
            node.ssh_facts.update(error=f"authenticated, but running a command failed (rc={probe.rc}): "
                                        f"{(probe.stderr.strip() or probe.error)[:200]}",
                                  fix="check the user's login shell and ForceCommand on the host",
                                  status="error")

    def _preload(self, node: Node) -> None:
        """When a selected check uses torch: torch once per host, at connect. It imports while the other hosts
        connect, and every worker the agent forks from then on has it (see agent.py); the host checks' request
        queues behind it."""
        if not self.preload:
            return
        try:
            node.preloading = node.agent.preload(["torch"], self.o.timeout)
        except Exception:  # the host checks' request will meet the same broken channel and say so
            pass

    def _open_shared_sessions(self) -> None:
        """A transport that serves all its hosts with one session (Transport.open_shared) starts every one of
        their agents at once; each node's agent adopts its end. A node whose end does not come up gets an agent of
        its own in _connect."""
        kinds: Dict[Type[Transport], List[Node]] = {}
        for node in self.nodes:
            kinds.setdefault(type(node.transport), []).append(node)
        for cls, nodes in kinds.items():
            session = cls.open_shared([n.transport for n in nodes], nodes[0].agent.argv(), serve_input(step=True),
                                      self.o.transport_options)
            if session is None:
                continue
            self.sessions.append(session)
            for node in nodes:
                if node.name in session.channels:
                    node.agent.adopt(session.channels[node.name])

    def _connect_all(self, admission: Optional[Admission] = None) -> None:
        start = time.monotonic()
        try:
            self._connect_all_nodes(admission)
        finally:
            self._span("connecting", start)

    def _connect_all_nodes(self, admission: Optional[Admission]) -> None:
        self.progress.phase("connecting", len(self.nodes))
        self._open_shared_sessions()
        # Each host's connect and probe are bounded (connect timeout each); hosts beyond --parallel wait for
        # a slot, so the phase's budget grows with the number of waves.
        # Admitted by descriptors, as many at once as this process's open files hold.
        at_once = min(self.o.parallel, admission.hosts_at_once() if admission else self.o.parallel)
        waves = -(-len(self.nodes) // max(1, at_once))
        # A host behind jump hosts has the connect timeout once per hop (ProxyJump chains).
        connect = max([n.transport.connect_budget_s() for n in self.nodes] + [self.o.ssh.connect_timeout])
        per_host = connect + self.o.ssh.connect_timeout + 10
        timeout = per_host * max(1, waves)
        # A host waiting for its share gives up before the phase's backstop, in words that name this machine.
        give_up = time.monotonic() + timeout - per_host

        def one(node: Node) -> None:
            if admission is None:
                self._connect(node)
            elif not admission.take(node.name, max(0.0, give_up - time.monotonic())):
                node.ssh_facts = {"connected": False, "status": "error", "error": admission.refusal(),
                                  "address": node.transport.address}
            else:
                try:
                    self._connect(node)
                finally:
                    if not node.reachable:
                        # Its socket and channel pipe are this run's to give to the next host, now, not at the end.
                        node.agent.close()
                        node.transport.close()
                    admission.done(node.name, kept=node.reachable)
            self.progress.advance(node.name, "ok" if node.reachable else "unreachable")

        for node, res in zip(self.nodes, parallel_map(one, self.nodes, self.o.parallel, timeout)):
            if isinstance(res, BaseException):
                node.ssh_facts = {"connected": False, "status": "error",
                                  "error": f"connecting did not finish: {res}", "fix": "check the host"}

    def _host_params(self, node: Node, specs: List[CheckSpec]) -> Dict[str, Any]:
        master = self.nodes[0]
        # What this host needs, and no list of every host: that went to every host, O(N^2) bytes a run
        # (1,000 addresses to each of 1,000 hosts), and no host-side check read it. A check that needs the
        # others gets them in its own call from its coordinate() (launcher_ssh's probe, on one host).
        params = {"host": node.name, "slots": node.spec.slots, "gpus": node.spec.gpus,
                  "master": master.transport.address, "master_name": master.name}
        # A check whose host side needs thresholds (e.g. nvme's test size) derives its params from them.
        for spec in specs:
            if spec.host_params:
                params.update(spec.host_params(self.o.thresholds))
        params.update(self.o.host_params)
        return params

    def _host_checks(self, specs: List[CheckSpec]) -> None:
        reachable = [n for n in self.nodes if n.reachable]
        self.progress.phase("host checks", len(reachable))
        start = time.monotonic()
        by_host = self._collect(reachable, specs)
        self._span("host checks", start)
        self._leave_out_unstarted(reachable)
        self._note_missing_python(reachable, by_host, specs)
        for node in self.nodes:
            self.facts[node.name] = {"ssh": node.ssh_facts}
            out = by_host.get(node.name)
            for spec in specs:
                if not node.reachable:  # its connection check failed: a blocked cell, its cause printed once
                    self._add_blocked(node.name, spec.name)
                elif node.name in self.no_python and spec.name != self.no_python[node.name]:
                    self._add_blocked(node.name, spec.name, by=self.no_python[node.name])
                elif out is None or isinstance(out, BaseException):
                    detail = out.detail if isinstance(out, AgentError) else ""
                    text = str(out) if out is not None else "no answer"
                    outcome = Outcome(Status.ERROR, f"not run: {text}", _agent_fix(text + detail, self.o.python))
                    if node.name in self.no_python:  # the one cause: where to fix it when no host has it
                        python = shlex.quote(self.o.python)
                        everywhere = len(self.no_python) == len(reachable)
                        outcome.message = (f"the job's interpreter {python} (--python) was not "
                                           f"found{_after_missing(text)}")
                        outcome.fix = (f"pass --python with the path of the interpreter the job runs, or install the "
                                       f"job's environment at {python} on {'every host' if everywhere else node.name}")
                        outcome.where = "every host" if everywhere else None
                    self._add(node.name, spec.name, outcome)
                else:
                    answer = host_outcome(spec, out, self.o.thresholds)
                    if answer.facts is not None:
                        self.facts[node.name][spec.name] = answer.facts
                    self._add(node.name, spec.name, answer.outcome, answer.duration_s)

    def _note_missing_python(self, nodes: List[Node], by_host: Dict[str, Any], specs: List[CheckSpec]) -> None:
        """Hosts reached whose --python does not exist: the python check's cell (else the first host check's) is
        the cause there, and every other check of the host, host-side or cluster-wide, is blocked by it."""
        names = [s.name for s in specs]
        holder = "python" if "python" in names else (names[0] if names else "")
        for node in nodes:
            out = by_host.get(node.name)
            if holder and node.reachable and isinstance(out, AgentError) and INTERPRETER_MISSING in str(out):
                self.no_python[node.name] = holder

    def _leave_out_unstarted(self, nodes: List[Node]) -> None:
        """A host whose agent gave no hello by its start-up deadline (its interpreter hangs before it runs the agent)
        is as good as unreachable: its connection result says why, once, its other cells are blocked, and the
        cluster checks go on without it. The wait is the deadline's at most (the host checks' requests waited it)."""
        for node in nodes:
            if not node.agent.starting or node.agent.wait_started() or not node.agent.never_started:
                continue
            text = node.agent.never_started_text()
            node.ssh_facts.update(connected=False, status="error", error=f"authenticated, but {text}",
                                  fix=_agent_fix(text, self.o.python))
            self.results = [r for r in self.results if (r.host, r.check) != (node.name, "ssh")]
            self._add(node.name, "ssh", _connection_outcome(node.ssh_facts, self.o.thresholds))

    def _collect(self, nodes: List[Node], specs: List[CheckSpec]) -> Dict[str, Any]:
        """Every host's collect at once (--parallel limits connection set-up, not waiting), and no thread per
        host: the requests all go out, each answer arrives on its connection's reader, and the progress advances
        then. {host: collect value, or the exception}."""
        names = [s.name for s in specs]
        # The request may wait behind the agent's preload of torch (sent at connect)
        budget = collect_budget(names, self.o.timeout) + (self.o.timeout if self.preload else 0.0)
        sent: List[Tuple[Node, Any, float]] = []
        for node in nodes:
            try:
                request = node.agent.collect_start(names, self._host_params(node, specs), self.o.timeout)
            except Exception as exc:  # that host's ERROR, below
                sent.append((node, exc, 0.0))
                self.progress.advance(node.name)
                continue
            request.add_done_callback(functools.partial(self._advance_quietly, node.name))
            sent.append((node, request, time.monotonic()))
        by_host: Dict[str, Any] = {}
        for node, request, started in sent:
            if isinstance(request, BaseException):
                by_host[node.name] = request
                continue
            try:  # each request has its own budget from when it went out
                by_host[node.name] = node.agent.collect_result(request, names,
                                                               started + budget - time.monotonic())
            except Exception as exc:
                by_host[node.name] = exc
        return by_host

    def _advance_quietly(self, name: str) -> None:
        """progress.advance from a connection's reader thread: whatever the terminal does, never raise there."""
        try:
            self.progress.advance(name)
        except Exception:
            pass

    def _cluster_checks(self, specs: List[CheckSpec]) -> Cluster:
        """Every cluster check, after the host checks (the early ones too: nothing runs beside them here)."""
        schedule = self._schedule(specs)
        schedule.host_checks_done(self.no_python)
        schedule.finish()
        return schedule.cluster

    def _schedule(self, specs: List[CheckSpec]) -> "Schedule":
        cluster = Cluster(self.nodes, self.o, self.facts, self.progress)
        return Schedule(self, cluster, specs)

    def _wait_preloaded(self) -> None:
        """Until every host's agent has imported torch (its preload), within the preload's own timeout: an early
        check's calls would queue behind that import on each host, on the clock of their own deadlines."""
        until = time.monotonic() + self.o.timeout
        for node in self.nodes:
            if node.preloading is not None:
                node.preloading.join(max(0.0, until - time.monotonic()))

    def _early_ok(self) -> bool:
        """Whether early checks may start beside the host checks: every reachable host's agent said hello (so the
        host checks will not take a host out of the run: a host whose hello is late, or whose --python is missing,
        is known only after them)."""
        return all(n.hello for n in self.nodes if n.reachable) and not any(n.agent.starting for n in self.nodes)

    def _cluster_check(self, cluster: Cluster, spec: CheckSpec) -> Tuple[Dict[str, Outcome], float]:
        """One cluster check: ({host or "*": outcome}, seconds). Never raises."""
        start = time.monotonic()
        if not cluster.hosts:
            return {CLUSTER: Outcome(Status.ERROR, "not run: no host is reachable")}, 0.0
        try:
            if spec.coordinate is None:
                raise TypeError(f"{spec.name} has scope {spec.scope!r} and no coordinate function")
            facts = spec.coordinate(cluster.for_check(spec))
            self.facts.setdefault(CLUSTER, {})[spec.name] = facts
            evaluation = evaluate_safely(spec, facts, self.o.thresholds)
            outcomes = {CLUSTER: evaluation} if isinstance(evaluation, Outcome) else evaluation
        except Exception as exc:  # a coordination failure is this check's ERROR, never the run's crash
            outcomes = {CLUSTER: Outcome(Status.ERROR, f"could not run: {type(exc).__name__}: {exc}",
                                         "rerun with -v for details")}
        self._advance_quietly(spec.name)
        self._span(spec.name, start)
        return outcomes, time.monotonic() - start

    def _add_outcomes(self, spec: CheckSpec, outcomes: Dict[str, Outcome], elapsed: float) -> None:
        connection = connection_check()
        down: Dict[str, Tuple[str, Optional[str]]] = {n.name: (connection, None) for n in self.nodes
                                                       if not n.reachable}
        down.update((h, (check, None)) for h, check in self.no_python.items())
        if not any(n.reachable and n.name not in self.no_python for n in self.nodes):
            # no host to run on: the cluster-wide cell is blocked as well, by the first host's cause
            first = next(iter(self.no_python.items()), None)
            down[CLUSTER] = (first[1], first[0]) if first else (connection, None)
        for host, outcome in outcomes.items():
            if host in down and outcome.status == Status.ERROR:  # a cluster check's "not run" on a host it lacks
                self._add_blocked(host, spec.name, elapsed, *down[host])
            else:
                self._add(host, spec.name, outcome, elapsed)

    def _add(self, host: str, check: str, outcome: Outcome, duration: float = 0.0) -> None:
        self.results.append(Result.from_outcome(host, check, outcome, duration))

    def _add_blocked(self, host: str, check: str, duration: float = 0.0, by: Optional[str] = None,
                     by_host: Optional[str] = None) -> None:
        """A cell its host's failed connection kept from running: ERROR, blocked by the connection check (a
        check of scope "connection" in the registry), so that the report counts and prints it under that cause;
        or blocked by ``by`` (of ``by_host``: another host's cell) when that is what kept it from running."""
        by = by or connection_check()
        self.results.append(Result(host, check, Status.ERROR, blocked_message(check, by, host),
                                   duration_s=duration, blocked_by=by, blocked_host=by_host))

    def _check_self(self, check: SelfCheck) -> None:
        """This machine's limits against the run's, before the first connect: each one the run would exceed is a
        WARN of the coordinator's row with its fix, and is printed now, while the run can still be stopped."""
        try:
            found = check.before()
        except Exception:  # a look at this machine must never cost the run
            return
        for finding in found:
            self.progress.warning(f"{COORDINATOR}: {finding.line()}")
            self._add(CLUSTER, COORDINATOR, Outcome(Status.WARN, finding.message, finding.fix, finding.metrics))

    def _name_local_causes(self, check: SelfCheck) -> None:
        """Connects that failed for a reason of this machine (its neighbour table, open files, local ports): every
        host one such cause hit gets its one message, naming how many hosts it hit, so the report says it once."""
        failed = {n.name: str(n.ssh_facts.get("error", "")) for n in self.nodes if not n.reachable}
        try:
            found = check.after_connect(failed)
        except Exception:
            return
        nodes = {n.name: n for n in self.nodes}
        for cause in found:
            for host in cause.hosts:
                facts = nodes[host].ssh_facts
                facts.update(connect_error=facts.get("error", ""), error=cause.message, fix=cause.fix, status="error",
                             local_cause=cause.kind)

    def _cleanup(self) -> None:
        """Stop everything of this run on every host, then close the connections."""
        started = time.monotonic()
        # The reap requests go out to every host at once and are answered on each connection's reader: no
        # thread per host that only waits. Best effort: agents also stop themselves when their channel closes.
        requests = []
        for node in self.nodes:
            # An agent that never said hello would only queue the request; closing it below kills it.
            if node.reachable and not node.agent.starting:
                try:
                    requests.append(node.agent.call_start("hostside.agent.reap", {"token": self.token}, 10))
                except Exception:
                    pass
        for request in requests:
            request.wait(max(0.0, started + 25 - time.monotonic()))  # stopped if still running by then

        def close(node: Node) -> None:
            node.agent.close()
            node.transport.close()

        # Closing does not wait on the hosts; --parallel at a time is plenty.
        parallel_map(close, self.nodes, max(1, self.o.parallel), max(5.0, started + 30 - time.monotonic()))
        for session in self.sessions:
            session.close()

    # ------------------------------------------------------------------------------------------ entry
    def run(self) -> Report:
        started = _now_iso()
        t0 = self.t0 = time.monotonic()
        raise_fd_limit()  # a descriptor or two per host: the default soft limit of 1024 is too few
        self.nodes = [self._make_node(spec) for spec in self.o.hosts]
        specs = _select_specs(self.o.checks)
        self.preload = any(s.uses_torch for s in specs)
        check = SelfCheck([n.transport for n in self.nodes], self.o.kernel)
        # Imported now, while descriptors are free: a run at this machine's open-file limit has none left later.
        from preflight.recommend import add_to_inherited_row, advise
        try:
            self._check_self(check)
            self._connect_all(check.admission())
            self._name_local_causes(check)
            mark_same_machines(self.nodes)
            for node in self.nodes:
                outcome = _connection_outcome(node.ssh_facts, self.o.thresholds)
                if "connect_error" in node.ssh_facts:  # the host's own error, under this machine's cause
                    outcome.metrics["connect_error"] = node.ssh_facts["connect_error"]
                self._add(node.name, "ssh", outcome)
            # The cluster checks that may (SPEC.early) start now, beside the host checks; the others after them.
            schedule = self._schedule([s for s in specs if s.scope == "cluster"])
            if self._early_ok():
                schedule.start_early(self._wait_preloaded)
            try:
                self._host_checks([s for s in specs if s.scope == "host"])
            except BaseException:  # (Ctrl-C): no check starts from now on, and the clean-up stops the running ones
                schedule.cancel()
                raise
            schedule.host_checks_done(self.no_python)
            schedule.finish()
            cluster = schedule.cluster
            # The recommendation, and how it differs from what the launcher passes the ranks today.
            advice = advise(cluster, self.results)
            env, reasons, notes = advice.env, advice.reasons, advice.notes
            add_to_inherited_row(self.results, advice.findings)
        finally:
            self.progress.note("cleaning up on the hosts")
            cleanup = time.monotonic()
            self._cleanup()
            self._span("cleanup", cleanup)
            self.progress.done()
        hosts = [HostRecord(n.name, n.transport.address, n.spec.slots, n.reachable) for n in self.nodes]
        order = {name: i for i, name in enumerate(["ssh"] + list(self.o.checks))}
        order[COORDINATOR] = -1  # what limits this machine comes first in the cluster-wide row
        host_order = {n.name: i for i, n in enumerate(self.nodes)}
        host_order[CLUSTER] = len(self.nodes)
        self.results.sort(key=lambda r: (host_order.get(r.host, len(self.nodes)), order.get(r.check, 99)))
        return Report(started, time.monotonic() - t0, hosts, self.results, ["ssh"] + list(self.o.checks),
                      env, reasons, notes, self.o.strict, advice.diff,
                      sorted(self.timeline, key=lambda t: (t["start_s"], t["end_s"])))


class Schedule:
    """The cluster checks of a run, each in a thread of its own, started as soon as (1) the checks it reads have
    finished (SPEC.reads: their facts are there; those of SPEC.waits it waits for itself, cluster.wait_for), (2)
    the host checks have finished, unless it is SPEC.early and start_early was called, and (3) no running check
    loads what it measures or measures what it loads (seams.conflicts of SPEC.measures/loads): a measuring check
    never shares the hosts with load that would distort its figures, while what disturbs nothing runs beside it.
    compute (CPU and GPU speed) runs beside ports (a few short connections) but not beside launcher_ssh (the first
    host's SSH handshakes to every host load its CPU); iperf3 (the network) runs beside the host checks' imports
    (one core of a real host) and beside the quiet checks. Checks start in ORDER when several can.

    The outcomes are added in ORDER once every check has finished (finish). A quiet check that has not finished
    within the backstop is an ERROR of its own cell, and the others go on without it."""

    def __init__(self, runner: Runner, cluster: Cluster, specs: List[CheckSpec]):
        self.runner = runner
        self.cluster = cluster
        cluster.waiter = self.wait_for
        self.specs = list(specs)
        self.usage = {s.name: usage(s) for s in specs}
        self.pending = list(specs)
        self.running: Dict[str, float] = {}  # name: its start (time.monotonic())
        self.waiting: Dict[str, str] = {}  # a running check in wait_for: the check it waits for
        self.done: Dict[str, Tuple[Dict[str, Outcome], float]] = {}
        self.host_phase = True
        self.early = False
        self.cancelled = False
        self.cond = threading.Condition()

    def cancel(self) -> None:
        """Start nothing more (the run is ending)."""
        with self.cond:
            self.cancelled = True
            self.pending = []

    def start_early(self, after: Optional[Callable[[], None]] = None) -> None:
        """Let the early checks start beside the host checks: now, or in a thread once ``after()`` returns (the
        hosts' torch imports: runner._wait_preloaded)."""
        def start() -> None:
            if after is not None:
                after()
            with self.cond:
                self.early = True
                self._start_ready()

        if after is None:
            start()
        else:
            threading.Thread(target=start, name="early checks", daemon=True).start()

    def host_checks_done(self, no_python: Dict[str, str]) -> None:
        """The host checks have finished: a host without the job's interpreter runs nothing from now on (its cells
        are blocked), and every check may start."""
        with self.cond:
            self.cluster.hosts = [h for h in self.cluster.hosts if h.name not in no_python]
            self.host_phase = False
            self._start_ready()

    def finish(self) -> None:
        """Wait for every check (a quiet one until its backstop), then add the outcomes in ORDER."""
        backstop = self.runner.QUIET_BACKSTOP_S or 4 * self.runner.o.timeout + 60
        quiet = {s.name for s in self.specs if s.quiet}
        with self.cond:
            self._start_ready()
            while self.pending or self.running:
                now = time.monotonic()
                late = [n for n in self.running if n in quiet and now - self.running[n] > backstop]
                for name in late:  # its thread is left; its cell says so
                    del self.running[name]
                    self.done[name] = ({CLUSTER: Outcome(Status.ERROR,
                                                         f"could not run: did not finish within {backstop:.0f}s",
                                                         "rerun with -v for details")}, backstop)
                if late:
                    self.cond.notify_all()
                    self._start_ready()
                    continue
                if self.pending and not self.running:  # nothing runs and nothing can start: a cycle of reads
                    for spec in self.pending:
                        self.done[spec.name] = ({CLUSTER: Outcome(Status.ERROR, "could not run: its reads never "
                                                                  "finished", "please report this")}, 0.0)
                    self.pending = []
                    break
                self.cond.wait(0.5)
        for spec in self.specs:
            self.runner._add_outcomes(spec, *self.done[spec.name])

    def wait_for(self, check: str) -> bool:
        """ClusterView.wait_for, from the calling check's own thread (named after it)."""
        me = threading.current_thread().name
        with self.cond:
            names = {s.name for s in self.specs}
            if check not in names:
                return False
            if check in self.done:
                return True
            start = time.monotonic()  # before anything it kept out starts: the timeline shows it waiting first
            self.waiting[me] = check
            self._start_ready()  # what waits loads nothing: a check it kept out may start
            try:
                while check not in self.done:
                    self.cond.wait(0.5)
            finally:
                self.waiting.pop(me, None)
                self.runner._span(f"{me} waits for {check}", start)
            return True

    def _can_start(self, spec: CheckSpec) -> bool:
        if self.host_phase and not (self.early and spec.early):
            return False
        names = {s.name for s in self.specs}
        if any(r in names and r not in self.done and r not in spec.waits for r in spec.reads):
            return False
        mine = self.usage[spec.name]
        busy = [self.usage[n] for n in self.running if n not in self.waiting]
        if self.host_phase:
            busy.append(HOST_CHECKS)
        return not any(conflicts(mine, other) for other in busy)

    def _start_ready(self) -> None:
        """Start every pending check that can start now, in ORDER (called with the lock held)."""
        if self.cancelled:
            return
        for spec in list(self.pending):
            if not self._can_start(spec):
                continue
            self.pending.remove(spec)
            self.running[spec.name] = time.monotonic()
            self.runner.progress.phase(spec.name, 1)
            threading.Thread(target=self._run, args=(spec,), name=spec.name, daemon=True).start()

    def _run(self, spec: CheckSpec) -> None:
        done = self.runner._cluster_check(self.cluster, spec)
        with self.cond:
            if spec.name in self.running:  # not already given up on (backstop)
                del self.running[spec.name]
                self.done[spec.name] = done
            self.cond.notify_all()
            self._start_ready()


def mark_same_machines(nodes: Sequence[Node]) -> None:
    """Hostfile names that are one machine (two addresses of a host, a name and an alias): their hellos' machine
    id and boot id agree and they share an address. Each such host's connection facts get ``same_machine``, the
    names of the machine's group in hostfile order with their slots and GPU ids and the machine's GPU count; the
    connection check judges it (DeepSpeed would start every name's ranks on the one machine)."""
    keyed: Dict[Tuple[str, str], List[Node]] = {}
    position = {id(n): i for i, n in enumerate(nodes)}
    for node in nodes:
        machine = node.ssh_facts.get("machine") if node.reachable else None
        if isinstance(machine, dict) and (machine.get("machine_id") or machine.get("boot_id")):
            keyed.setdefault((str(machine.get("machine_id", "")), str(machine.get("boot_id", ""))), []).append(node)
    for candidates in keyed.values():
        # Containers on one kernel share the boot id (and often the image's machine-id): the same network namespace,
        # seen in a shared address, is what makes two names one machine. Joined transitively, in hostfile order.
        groups: List[List[Node]] = []
        for node in candidates:
            mine = set(node.ssh_facts["machine"].get("addresses") or [])
            joined = [g for g in groups if any(mine & set(n.ssh_facts["machine"].get("addresses") or [])
                                               or not mine and not n.ssh_facts["machine"].get("addresses")
                                               for n in g)]
            merged = [n for g in joined for n in g] + [node]
            groups = [g for g in groups if g not in joined] + [merged]
        for group in groups:
            if len(group) < 2:
                continue
            group.sort(key=lambda n: position[id(n)])
            machine = group[0].ssh_facts["machine"]
            same = {"hosts": [n.name for n in group], "slots": [n.spec.slots for n in group],
                    "gpu_ids": [list(n.spec.gpus) for n in group], "gpus": machine.get("gpus"),
                    "machine_id": machine.get("machine_id", ""), "boot_id": machine.get("boot_id", "")}
            for n in group:
                n.ssh_facts["same_machine"] = same


def _after_missing(text: str) -> str:
    """What an agent error says after INTERPRETER_MISSING: " on the host (bash: line 1: /opt/venv/bin/python: No such
    file or directory)"."""
    at = text.find(INTERPRETER_MISSING)
    return text[at + len(INTERPRETER_MISSING):] if at >= 0 else f": {text}"


def _agent_fix(text: str, python: str) -> str:
    if "not found" in text:
        return f"install Python >= 3.9 on the host or pass --python with its path (tried {python!r})"
    if "gave no hello" in text:
        return (f"run {shlex.quote(python)} -c 'print(1)' on the host and see where it hangs (NFS home or "
                "site-packages, sitecustomize, a login script that waits for input)")
    if "timed out" in text:
        return "the host is slow or hung; raise --timeout, or look at the host (load, D-state processes)"
    return "rerun with -v to see the host-side error"
