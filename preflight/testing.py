"""Test doubles for preflight's seams, shipped with the package (as fabric ships ``fabric.testing`` and httpx its
``MockTransport``): a check's ``coordinate`` and the coordinator's agent code can be tested without a cluster.

- ``FakeCluster`` is a ``ClusterView`` (hostside/seams.py): hosts ``node01..`` at 198.18.0.N. ``call``,
  ``call_all`` and ``start`` run the named host-side function in this process, as the agent would on a host,
  unless the test plants a handler ``(host, params, timeout) -> value`` for that function (or raises in it).
  Every call is recorded in ``calls`` as ``Call(host, func, params)``.
- ``FakeService`` is a ``ServiceHandle``: scripted (``FakeService(ready={"port": 5201})``, or
  ``FakeService(error="iperf3 is not installed")``), or a host function running in a thread of this process
  (what ``FakeCluster.start`` returns by default). It records ``stopped`` and ``killed``.
- ``FakeTransport`` is a ``Transport`` (preflight.transport) whose commands a handler answers: it gets each
  ``FakeCommand`` (argv, stdin so far) and returns a ``CommandResult``, or None to leave the command running
  and answer it later (``reply``/``exit``, ``on_send`` for what the coordinator writes to its stdin).
- ``fake_check`` builds a cluster check module in memory, as the registry's ``load`` returns one.

A sample (tests/project/test_testing.py runs it): the ports check between two hosts that are this machine, then with
one host's listener failing, then an agent whose host has no Python::

    from preflight.checks import ports
    from preflight.config import load_defaults
    from preflight.remote import Agent
    from preflight.testing import FakeCluster, FakeService, FakeTransport
    from preflight.transport import CommandResult

    here = {"node01": "127.0.0.1", "node02": "127.0.0.1"}  # ports.listen and ports.probe run in this process
    cluster = FakeCluster(["node01", "node02"], thresholds=load_defaults(), addresses=here)
    facts = ports.coordinate(cluster)
    assert sorted(facts["listeners"]) == ["node01", "node02"] and facts["probes"] and not facts["probe_errors"]

    def listen(host, params, timeout):
        if host == "node02":
            return FakeService(error="OSError: [Errno 13] Permission denied", host=host, func="ports.listen")
        return FakeService.running("ports.listen", params, timeout, host)

    cluster = FakeCluster(["node01", "node02"], thresholds=load_defaults(), addresses=here,
                          handlers={"ports.listen": listen})
    facts = ports.coordinate(cluster)
    assert "Permission denied" in facts["listener_errors"]["node02"]
    assert sorted(c.host for c in cluster.calls if c.func == "ports.listen") == ["node01", "node02"]

    transport = FakeTransport(lambda command: CommandResult(127, "", "bash: python3: command not found", 0.0))
    assert Agent(transport).open(timeout=5) is None
    assert transport.commands[0].argv[0] == "python3"
"""
from __future__ import annotations

import importlib
import threading
import time
import types
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from preflight.hostside.outcome import Outcome, Status
from preflight.hostside.proc import parallel_map
from preflight.hostside.seams import CheckOptions, CheckSpec, ClusterView, HostContext, ServiceHandle
from preflight.transport import CommandResult, RunningCommand, Transport

__all__ = ["Call", "FakeCluster", "FakeCommand", "FakeHost", "FakeProgress", "FakeService", "FakeTransport",
           "fake_check", "run_host_function"]

Handler = Callable[[str, Dict[str, Any], float], Any]  # (host, params, timeout) -> value, or raise
# (func, params_by_host, timeout), in the caller's thread before a call_all: may assert on the round, or raise.
RoundHook = Callable[[str, Dict[str, Dict[str, Any]], float], None]


def run_host_function(func: str, params: Dict[str, Any], timeout: float,
                      ready: Optional[Callable[[Dict[str, Any]], None]] = None,
                      wait_stop: Optional[Callable[[float], bool]] = None) -> Any:
    """What the agent does for a ``"module.attr"`` request, in this process: ``"iperf3.client"`` is a check's
    function (preflight.checks.iperf3.client), ``"hostside.agent.reap"`` one of the host-side support's."""
    module_name, _, attr = func.rpartition(".")
    package = "preflight" if module_name.startswith("hostside.") else "preflight.checks"
    fn = getattr(importlib.import_module(package + "." + module_name), attr)
    ctx = HostContext(params=params, deadline=time.monotonic() + timeout, ready=ready, wait_stop=wait_stop)
    return fn(params, ctx)


class Call(NamedTuple):
    """One request a FakeCluster received (``call``, each host of a ``call_all``, or ``start``)."""

    host: str
    func: str
    params: Dict[str, Any]


@dataclass
class FakeHost:
    """A host as a ``ClusterView`` lists it (hostside.seams.HostRef): the hostfile's name, slots and GPU ids."""

    name: str
    slots: int = 1
    gpus: Optional[List[int]] = None
    index: int = 0


class FakeProgress:
    """A ``ProgressSink`` that records what a check reported: ("phase", name, total), ("advance", name, detail),
    ("note", text)."""

    def __init__(self) -> None:
        self.events: List[Tuple[Any, ...]] = []

    def phase(self, name: str, total: int) -> None:
        self.events.append(("phase", name, total))

    def advance(self, name: str, detail: str = "") -> None:
        self.events.append(("advance", name, detail))

    def note(self, text: str) -> None:
        self.events.append(("note", text))


class FakeService:
    """A ``ServiceHandle`` (hostside.seams): a long-lived host-side function as ``ClusterView.start`` returns it.

    Scripted: ready (the info ``wait_ready`` returns, default {}) and, once stopped, ``result`` (default: the
    ready info); or ``error``: the function failed on the host, so ``wait_ready``, ``stop`` and ``result``
    raise RuntimeError("<func> failed on the host: <error>"), as the coordinator's service does.
    ``FakeService.running(func, params, timeout)`` runs the host function itself in a thread of this process,
    with the agent's ``ctx.ready`` and ``ctx.wait_stop``. ``stopped``/``killed`` say what the check did to it.
    """

    def __init__(self, ready: Optional[Dict[str, Any]] = None, error: str = "", result: Any = None,
                 host: str = "", func: str = "service", timeout: float = 60.0) -> None:
        self.host, self.func, self.timeout = host, func, timeout
        self.stopped = False
        self.killed = False
        self._cond = threading.Condition()
        self._stop = threading.Event()  # the service's lifeline: set by stop() and kill()
        self._info: Optional[Dict[str, Any]] = None if error else dict(ready or {})
        self._error = error
        self._value = result if result is not None or error else dict(ready or {})
        self._ended = bool(error)
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def running(cls, func: str, params: Dict[str, Any], timeout: float, host: str = "") -> "FakeService":
        """The host-side function ``func`` started in a thread, as the agent starts it on a host."""
        service = cls(host=host, func=func, timeout=timeout)
        service._info, service._value = None, None
        service._thread = threading.Thread(target=service._run, args=(params,), daemon=True,
                                           name=f"fake service {func} on {host or '?'}")
        service._thread.start()
        return service

    def _run(self, params: Dict[str, Any]) -> None:
        value, error = None, ""
        try:
            value = run_host_function(self.func, params, self.timeout, self._ready, self._stop.wait)
        except BaseException as exc:  # noqa: BLE001 - the agent reports every failure as the request's error
            error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            self._value, self._error, self._ended = value, error, True
            self._cond.notify_all()

    def _ready(self, info: Dict[str, Any]) -> None:
        with self._cond:
            self._info = dict(info)
            self._cond.notify_all()

    def _end_scripted(self) -> None:
        if self._thread is None:  # a scripted service ends when told to stop
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _failed(self) -> RuntimeError:
        return RuntimeError(f"{self.func} failed on the host: {self._error}")

    def wait_ready(self, timeout: float) -> Dict[str, Any]:
        with self._cond:
            self._cond.wait_for(lambda: self._info is not None or self._ended, timeout)
            if self._info is not None:
                return dict(self._info)
            if self._error:
                raise self._failed()
        raise RuntimeError(f"{self.func} did not become ready within {timeout:.0f}s")

    def stop(self, timeout: float = 15.0) -> Any:
        self.stopped = True
        self._stop.set()
        self._end_scripted()
        return self.result(timeout)

    def result(self, timeout: Optional[float] = None) -> Any:
        wait = self.timeout + 15 if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._ended, wait):
                raise RuntimeError(f"{self.func} timed out after {wait:.0f}s")
            if self._error:
                raise self._failed()
            return self._value

    def kill(self) -> None:
        # A thread cannot be killed: the lifeline closes, which a well-behaved host function obeys.
        self.killed = True
        self._stop.set()
        self._end_scripted()


def check_options(**values: Any) -> CheckOptions:
    """A ``cluster.options`` for a FakeCluster: the shared fields by name, every other name one of the check's
    inputs (its Option's dest): ``check_options(deepspeed_config="ds.json", checkpoint_dir="/ckpt")``."""
    shared = {f.name for f in fields(CheckOptions)} - {"inputs"}
    return CheckOptions(**{k: v for k, v in values.items() if k in shared},
                        inputs={k: v for k, v in values.items() if k not in shared})


@dataclass
class FakeCluster:
    """A ``ClusterView`` without SSH: hosts ``node01..`` (or the given names), every one reachable unless listed
    in ``unreachable``; host N's address is 198.18.0.N unless ``addresses`` names it.

    ``call``/``call_all``/``start`` run the host-side function in this process unless ``handlers`` has one for
    it; ``on_round`` sees every ``call_all`` before it runs. ``facts`` is used as given (not copied), with an
    entry added for every host that has none.
    """

    hosts_or_count: Union[int, Sequence[str]] = 2
    slots: int = 1
    thresholds: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    facts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    options: CheckOptions = field(default_factory=CheckOptions)
    handlers: Dict[str, Handler] = field(default_factory=dict)
    unreachable: Sequence[str] = ()
    addresses: Dict[str, str] = field(default_factory=dict)
    on_round: Optional[RoundHook] = None
    parallel: int = 32
    local: bool = False
    progress: Any = field(default_factory=FakeProgress)
    calls: List[Call] = field(default_factory=list)
    shells: Dict[str, Any] = field(default_factory=dict)  # host -> its HostShell (a FakeTransport), for shell()
    all_hosts: List[Any] = field(init=False)
    hosts: List[Any] = field(init=False)
    master: Any = field(init=False)
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        names = ([f"node{i + 1:02d}" for i in range(self.hosts_or_count)]
                 if isinstance(self.hosts_or_count, int) else list(self.hosts_or_count))
        self.all_hosts = [FakeHost(n, self.slots, index=i) for i, n in enumerate(names)]
        self.hosts = [h for h in self.all_hosts if h.name not in set(self.unreachable)]
        self.master = self.all_hosts[0]
        self.world_size = sum(h.slots for h in self.all_hosts)
        for h in self.all_hosts:
            self.facts.setdefault(h.name, {})

    def address(self, host: str) -> str:
        if host in self.addresses:
            return self.addresses[host]
        index = [h.name for h in self.all_hosts].index(host)
        return f"198.18.0.{1 + index}"

    def call(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any:
        self.calls.append(Call(host, func, params))
        handler = self.handlers.get(func)
        if handler is not None:
            return handler(host, params, timeout)
        return run_host_function(func, params, timeout)

    def call_all(self, func: str, params_by_host: Dict[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]:
        """Each host's result, or the exception its call raised (as the coordinator's Cluster returns them)."""
        if self.on_round is not None:
            self.on_round(func, params_by_host, timeout)
        names = list(params_by_host)
        out = parallel_map(lambda h: self.call(h, func, params_by_host[h], timeout), names, self.parallel,
                           timeout + 30)
        return dict(zip(names, out))

    def start(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> ServiceHandle:
        self.calls.append(Call(host, func, params))
        handler = self.handlers.get(func)
        if handler is not None:
            service: ServiceHandle = handler(host, params, timeout)
            return service
        return FakeService.running(func, params, timeout, host)

    def shell(self, host: str) -> Any:
        """The host's command line (``seams.HostShell``): ``shells[host]``, e.g. a ``FakeTransport``."""
        return self.shells[host]

    def wait_for(self, check: str) -> bool:
        """Nothing runs beside a fake cluster's check: whether ``check``'s cluster facts are in ``facts``."""
        return check in (self.facts.get("*") or {})


# ---------------------------------------------------------------------------------------------- transport

class FakeCommand(RunningCommand):
    """A command started on a ``FakeTransport``: ``argv``, ``stdin`` (every byte written to it so far),
    ``stdin_closed``, ``killed``. The test answers with ``reply(stdout, stderr)`` and ``exit(rc)``; ``on_send``,
    if set, is called with each later write (the agent's requests, one JSON line each)."""

    def __init__(self, argv: Sequence[str], stdin: bytes, keep_stdin_open: bool, max_output: Optional[int]):
        super().__init__(max_output)
        self.argv = list(argv)
        self.stdin = bytearray(stdin)
        self.stdin_closed = threading.Event()
        self.killed = False
        self.on_send: Optional[Callable[[bytes], None]] = None
        self._begin_stdin(b"", keep_stdin_open)  # the first bytes are in self.stdin already: nothing to wait for

    def reply(self, stdout: Union[bytes, str] = b"", stderr: Union[bytes, str] = b"") -> None:
        """Output from the command, as if the host had printed it."""
        for data, is_err in ((stdout, False), (stderr, True)):
            if data:
                self._feed(data.encode() if isinstance(data, str) else data, is_err)

    def exit(self, rc: int = 0, error: str = "") -> None:
        """The command ends with rc; ``error``: why the transport stopped it (CommandResult.error)."""
        if error:
            self._note_error(error)
        self._finish(rc)

    def _write_stdin(self, data: bytes, stall: Optional[float]) -> None:
        if self.stdin_closed.is_set() or self.done:
            raise OSError("the command's stdin is closed")
        self.stdin.extend(data)
        if self.on_send is not None:
            self.on_send(data)

    def _close_stdin_now(self) -> None:
        self.stdin_closed.set()

    def kill(self) -> None:
        self.killed = True
        self._killed = True  # ends as a command the caller stopped: rc 124 (RC_TIMEOUT)
        self.stdin_closed.set()
        self._finish(-9)


CommandHandler = Callable[[FakeCommand], Optional[CommandResult]]


class FakeTransport(Transport):
    """A ``Transport`` whose commands ``handler(command)`` answers in this process: a ``CommandResult`` ends the
    command at once with that output; None leaves it running for the test to answer (``FakeCommand.reply`` and
    ``exit``), or to time out. Every command started is in ``commands``; ``close`` ends those still running."""

    def __init__(self, handler: CommandHandler, name: str = "node01", address: str = "198.18.0.1",
                 kill_reaches_host: bool = True) -> None:
        self.handler = handler
        self.name = name
        self.address = address
        self.kill_reaches_host = kill_reaches_host
        self.commands: List[FakeCommand] = []
        self.closed = False

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        command = FakeCommand(argv, stdin, keep_stdin_open, max_output)
        self.commands.append(command)
        answer = self.handler(command)
        if answer is not None:
            if not isinstance(answer, CommandResult):
                raise TypeError("FakeTransport handler must return a CommandResult or None, "
                                f"not {type(answer).__name__}")
            command.reply(answer.stdout, answer.stderr)
            command.exit(answer.rc, answer.error)
        return command

    def close(self) -> None:
        self.closed = True
        for command in self.commands:
            if not command.done:
                command.exit(255, f"the connection to {self.name} was closed")


# -------------------------------------------------------------------------------------------------- checks

def _pass_when_ok(facts: Dict[str, Any], thresholds: Dict[str, Dict[str, Any]]) -> Outcome:
    return Outcome(Status.PASS if facts.get("ok") else Status.FAIL, str(facts))


def fake_check(name: str, coordinate: Callable[[ClusterView], Dict[str, Any]],
               evaluate: Optional[Callable[[Dict[str, Any], Dict[str, Dict[str, Any]]], Any]] = None,
               quiet: bool = False, description: str = "a test check", **spec_fields: Any) -> types.ModuleType:
    """A cluster check module made in memory (NAME, SPEC, coordinate, evaluate), as ``preflight.checks.load``
    returns one; evaluate defaults to PASS when the facts hold a true "ok", FAIL otherwise, the facts as message.
    spec_fields: more ``CheckSpec`` fields (measures, loads, early, waits, reads)."""
    judge = evaluate or _pass_when_ok
    module = types.ModuleType("preflight.testing.fake_checks." + name, description)
    spec = CheckSpec(name, description, "cluster", True, judge, coordinate=coordinate, quiet=quiet, **spec_fields)
    module.__dict__.update(NAME=name, SPEC=spec, coordinate=coordinate, evaluate=judge)
    return module
