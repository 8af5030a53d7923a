"""Ship the host-side checks to a host and talk to the agent there, over any Transport.

The checks package travels as an in-memory zip on the agent's stdin (see checks/agent.py), so a run writes
no file on the hosts. Sample of what the agent prints and this module parses:

    @@PREFLIGHT-READY {"port": 40213}
    @@PREFLIGHT-RESULT {"ok": true, "value": {...}, "host": {"hostname": "node01", "python": "3.11.7"}}
"""
from __future__ import annotations

import importlib.util
import io
import json
import marshal
import re
import threading
import time
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from preflight.hostside.agent import BOOTSTRAP, FRAME, READY, RESULT
from preflight.transport import RC_TIMEOUT, CommandResult, RunningCommand, Transport

# What runs on a host: the checks and their host-side support (agent, processes, statistics). Both packages
# import only each other and the standard library, so they travel without the rest of preflight, under an empty
# stub ``preflight/__init__.py`` that makes the agent's BOOTSTRAP (``import preflight.hostside.agent``) resolve.
PACKAGE_ROOT = Path(__file__).resolve().parent
HOST_PACKAGES = ("checks", "hostside")


class AgentError(Exception):
    """The agent could not run or answer; ``detail`` holds stderr for the report."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


_AGENT_CODE_LOCK = threading.Lock()
# What every agent imports before its first request (hello.py before its hello), and the checks package that every
# host checks request imports; bytecode of the others (checks that run or not) would make the upload three times
# bigger for every host.
_PRECOMPILED = {"preflight/hostside/__init__.py", "preflight/hostside/agent.py", "preflight/hostside/proc.py",
                "preflight/hostside/seams.py", "preflight/hostside/outcome.py", "preflight/hostside/tempfiles.py",
                "preflight/hostside/hello.py", "preflight/checks/__init__.py"}


def agent_code() -> bytes:
    """The checks package as a zip: every .py file of it and its subpackages under ``preflight/checks/``
    beside an empty ``preflight/__init__.py``, and the coordinator's bytecode of the modules every agent
    imports under ``pyc/<magic number>/``. A host whose Python has the same magic number (the same bytecode format) runs
    that instead of compiling the sources, about 15 ms of CPU per host; any other Python compiles the
    sources (the BOOTSTRAP in checks/agent.py decides). Built once: the
    first hosts' connections all want it at the same moment, and lru_cache alone would let each of them
    build it (35 ms of CPU apiece)."""
    with _AGENT_CODE_LOCK:
        return _agent_code()


def serve_input(step: bool = False) -> bytes:
    """What a persistent agent reads on its stdin before its first request: the code's length, the code, and the
    serve request (step=True: one task of a shared srun step, see agent.serve)."""
    code = agent_code()
    return b"%d\n" % len(code) + code + (b'{"op": "serve", "step": true}\n' if step else b'{"op": "serve"}\n')


@lru_cache(maxsize=1)
def _agent_code() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("preflight/__init__.py", b"")
        magic = importlib.util.MAGIC_NUMBER.hex()
        for path in sorted(p for pkg in HOST_PACKAGES for p in (PACKAGE_ROOT / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = f"preflight/{path.relative_to(PACKAGE_ROOT).as_posix()}"
            source = path.read_bytes()
            zf.writestr(name, source)
            if name not in _PRECOMPILED:
                continue
            try:  # the same file name and flags as the host's compile(), so tracebacks read the same
                compiled = compile(source, name, "exec", dont_inherit=True)
            except SyntaxError:
                continue  # the host compiles it and reports the error as it would have
            zf.writestr(f"pyc/{magic}/{name}", marshal.dumps(compiled))
    return buf.getvalue()


# What the coordinator reads from one host for one request when the config does not say ([agent] in
# defaults.toml holds the documented value).
DEFAULT_MAX_OUTPUT = 64 * 2**20
# pkill of an agent that never started: one short command; a host that does not answer it in this long is gone.
KILL_BY_TOKEN_TIMEOUT_S = 10.0
# How long a host's interpreter may take from its start to the agent's hello when the config does not say
# ([agent] start_s in defaults.toml holds the documented value; the runner adds the connect timeout to it).
DEFAULT_START_S = 30.0
# What an AgentError says when --python does not exist on the host (the runner looks for it: one cause, not one
# per check).
INTERPRETER_MISSING = "the Python interpreter was not found"


def _parse_result(res: CommandResult, what: str) -> Dict[str, Any]:
    """The agent's RESULT payload; everything in it came from the host, so its shape is checked here."""
    if res.error:  # the transport stopped the command itself: output over the cap, or a dead peer
        raise AgentError(f"{what}: {res.error}", res.stderr[-2000:])
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(RESULT + " "):
            try:
                payload = json.loads(line[len(RESULT) + 1:])
            except ValueError as exc:
                raise AgentError(f"{what}: the host's answer is not valid JSON ({exc})", line[:2000]) from None
            if not isinstance(payload, dict) or not isinstance(payload.get("ok"), bool):
                raise AgentError(f"{what}: the host's answer is not an agent result (no boolean 'ok')",
                                 line[:2000])
            if not payload["ok"]:
                raise AgentError(f"{what} failed on the host: {str(payload.get('error'))[:2000]}",
                                 str(payload.get("traceback", ""))[:20000])
            if "value" not in payload:
                raise AgentError(f"{what}: the host's answer has no 'value'", line[:2000])
            if not isinstance(payload.get("host", {}), dict):
                raise AgentError(f"{what}: the host's answer has a 'host' that is not an object", line[:2000])
            return payload
    tail = (res.stderr.strip().splitlines() or [""])[-1][:300]
    if res.timed_out:
        raise AgentError(f"{what} timed out after {res.duration:.0f}s", res.stderr[-2000:])
    if res.rc == 127 or "not found" in tail:
        raise AgentError(f"{what}: {INTERPRETER_MISSING} on the host ({tail})", res.stderr)
    raise AgentError(f"{what} exited with rc={res.rc} without a result: {tail or 'no output'}", res.stderr[-2000:])


class _Request(RunningCommand):
    """One request to the host's persistent agent, seen as a command: its output is what its worker printed."""

    def __init__(self, session: "_Session", rid: int, max_output: Optional[int]):
        super().__init__(max_output)
        self._session = session
        self._rid = rid

    def close_stdin(self, wait: bool = True) -> None:
        self._session.send({"op": "stop", "id": self._rid})

    def wait(self, timeout: float) -> CommandResult:
        """As RunningCommand.wait; but while the agent has not said hello, only until its start-up deadline: an
        interpreter that never runs the agent (a hung NFS import, a blocking sitecustomize) fails the request then,
        with result.error saying so, instead of holding the caller for the request's whole budget."""
        deadline = time.monotonic() + timeout
        session = self._session
        by = session.hello_deadline
        if by is not None and by < deadline and session.starting and not self.done:
            session.wait_ready(max(0.0, by - time.monotonic()))
            if session.starting and not self.done:
                self._note_error(session.never_started())
                self.kill()
        return super().wait(max(0.0, deadline - time.monotonic()))

    def send(self, data: bytes) -> None:
        raise OSError("a request's stdin is its lifeline only")

    def kill(self) -> None:
        # The agent closes the worker's lifeline (it stops as a one-request agent would) and kills it if it
        # lingers; here the request ends now, as a timed-out command does.
        self._killed = True
        self._session.send({"op": "kill", "id": self._rid})
        self._session.forget(self._rid)
        self._finish(RC_TIMEOUT)


class _Session:
    """The host's persistent agent: one interpreter and one channel for the whole run.

    Requests go in as JSON lines; the answers come back framed (checks/agent.py serve()). Everything in
    the frames is from the host: a frame for an unknown request is dropped, a request's bytes count
    against that request's cap, and lines that are not frames (a noisy login shell) are skipped.
    """

    _HEADER_MAX = 200

    def __init__(self, transport: Transport, argv: Sequence[str], channel: Optional[RunningCommand] = None,
                 start_s: Optional[float] = None):
        self._lock = threading.Lock()
        # The hello is due start_s after the agent's command starts (None: no deadline of its own); the hello
        # comes before any request is served, so it takes the interpreter's start-up and the agent's imports only.
        self.started = time.monotonic()
        self.start_s = start_s
        self._python = argv[0] if argv else "python3"
        self._pending: Dict[int, _Request] = {}
        self._queued: list = []  # requests sent before the agent said it is ready
        self._next = 1
        self._ready = False
        self._buf = bytearray()
        self._frame: Optional[tuple] = None  # (request id, kind, bytes still to come) while inside a frame
        self._stderr = bytearray()
        self._discarded = 0
        self._ready_event = threading.Event()
        self.hello: Dict[str, Any] = {}
        self.dead = False
        if channel is not None:  # an agent already started elsewhere (one of a shared srun step's tasks)
            self._cmd = channel
        else:
            self._cmd = transport.start(argv, serve_input(), keep_stdin_open=True)
        self._cmd.stream_to(self._on_data)
        self._cmd.add_done_callback(self._channel_ended)

    # -- coordinator to agent
    def request(self, request: Dict[str, Any], max_output: Optional[int]) -> _Request:
        with self._lock:
            rid = self._next
            self._next += 1
            req = _Request(self, rid, max_output)
            if self.dead:
                self._end(req)
                return req
            self._pending[rid] = req
            line = json.dumps(dict(request, id=rid)).encode() + b"\n"
            if not self._ready:
                self._queued.append(line)
                return req
        self._send_line(line)
        return req

    def send(self, message: Dict[str, Any]) -> None:
        line = json.dumps(message).encode() + b"\n"
        with self._lock:
            if not self._ready:
                self._queued.append(line)
                return
        self._send_line(line)

    def _send_line(self, line: bytes) -> None:
        try:
            self._cmd.send(line)
        except (OSError, EOFError, NotImplementedError):
            pass  # the channel is gone: _channel_ended ends every pending request with the reason

    def forget(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    @property
    def said_hello(self) -> bool:
        with self._lock:
            return self._ready

    @property
    def starting(self) -> bool:
        """Started, alive, and no hello yet: requests to it are queued, unsent."""
        with self._lock:
            return not self._ready and not self.dead

    @property
    def hello_deadline(self) -> Optional[float]:
        """When (time.monotonic()) the hello is due; None without a start-up deadline."""
        return None if self.start_s is None else self.started + self.start_s

    def never_started(self) -> str:
        """The message of a request that the agent's missing hello ended."""
        return (f"the agent never started: {self._python} gave no hello within {self.start_s or 0:.0f}s of its start "
                "(a hung interpreter, import hook or login script)")

    def close(self) -> bool:
        """Close the agent's stdin: it stops whatever still runs, reaps, and exits. An agent that never said
        hello never read its stdin either (a hung interpreter or login): its command is killed. Returns whether
        the agent had said hello."""
        self._cmd.close_stdin()
        with self._lock:
            ready = self._ready
        if not ready:
            self._cmd.kill()
        return ready

    # -- agent to coordinator
    def _on_data(self, data: bytes, is_err: bool) -> None:
        if is_err:  # the agent's own stderr (interpreter missing, a crash): keep the tail for the message
            self._stderr.extend(data)
            del self._stderr[:-8192]
            return
        buf = self._buf
        buf.extend(data)
        while buf:
            if self._frame is None:
                nl = buf.find(b"\n", 0, self._HEADER_MAX + 1)
                if nl < 0:
                    if len(buf) > self._HEADER_MAX:
                        del buf[:]  # no line end where a header would have one: noise, skip it
                    return
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                parts = line.split()
                if len(parts) != 4 or parts[0] != FRAME or not parts[1].isdigit() or not parts[3].isdigit():
                    continue
                self._frame = (int(parts[1]), parts[2], int(parts[3]), bytearray())
                if self._frame[2] == 0:
                    self._deliver()
                continue
            rid, kind, left, acc = self._frame
            take = min(left, len(buf))
            chunk = bytes(buf[:take])
            del buf[:take]
            left -= take
            if kind in (b"o", b"e"):
                req = self._pending.get(rid)
                if req is not None:
                    req._feed(chunk, kind == b"e")
                else:
                    # Output for a request we stopped (over its cap, timed out): a real agent stops soon;
                    # a host that keeps sending gets its agent's channel closed.
                    self._discarded += len(chunk)
                    if self._discarded > DEFAULT_MAX_OUTPUT:
                        self._cmd._fail("the host kept sending output for a stopped request; "
                                        "its agent was closed")
                        del buf[:]
                        return
            elif len(acc) < 4096:  # exit codes and the hello: small; more from a host is dropped
                acc.extend(chunk)
            self._frame = (rid, kind, left, acc)
            if left == 0:
                self._deliver()

    def _deliver(self) -> None:
        assert self._frame is not None
        rid, kind, _, acc = self._frame
        self._frame = None
        if kind == b"h":
            try:
                hello = json.loads(bytes(acc).decode(errors="replace") or "{}")
            except ValueError:
                hello = {}
            with self._lock:
                self.hello = hello if isinstance(hello, dict) else {}
                self._ready = True
                queued, self._queued = self._queued, []
                self._ready_event.set()
            for line in queued:
                self._send_line(line)
        elif kind == b"x":
            with self._lock:
                req = self._pending.pop(rid, None)
            if req is not None:
                try:
                    rc = int(bytes(acc).decode())
                except ValueError:
                    rc = -1
                req._finish(rc)

    def _channel_ended(self) -> None:
        """When the agent's channel ends, so does every request still waiting on it."""
        with self._lock:
            self.dead = True
            pending, self._pending = list(self._pending.values()), {}
            self._ready_event.set()
        for req in pending:
            self._end(req)

    def wait_ready(self, timeout: float) -> Optional[Dict[str, Any]]:
        """The agent's hello ({"hostname": ..., "pid": ..., "python": ...}) once it is up; None if it died or
        did not come up in time."""
        self._ready_event.wait(timeout)
        with self._lock:
            return dict(self.hello) if self._ready and not self.dead else None

    def _end(self, req: _Request) -> None:
        if self._stderr:
            req._feed(bytes(self._stderr), True)
        if self._cmd.error:
            req._note_error(self._cmd.error)
        rc = self._cmd.rc
        req._finish(rc if rc is not None else -1)


class Agent:
    """The agent on one host: ``collect`` runs host checks; ``call``/``start`` run a host-side function.

    All of them are requests to one persistent agent per host (started on first use), over one channel.
    """

    def __init__(self, transport: Transport, python: str = "python3", token: str = "preflight",
                 max_output: int = DEFAULT_MAX_OUTPUT, start_s: Optional[float] = None):
        self.transport = transport
        self.python = python
        # The token appears in every agent's argv, so a last-resort cleanup can find them with pkill -f.
        self.token = token
        self.max_output = max_output
        # Seconds from an agent's start to its hello, after which its requests fail at once ("the agent never
        # started"); None: each request waits for its own deadline.
        self.start_s = start_s
        self.hostinfo: Dict[str, Any] = {}
        self._session: Optional[_Session] = None
        self._lock = threading.Lock()
        self.adopted = False  # the current session is an agent started elsewhere (adopt), not by this Agent

    def argv(self) -> Sequence[str]:
        return [self.python, "-c", BOOTSTRAP, self.token]

    def _live_session(self) -> _Session:
        """The current session, or a new agent of this host's own when there is none or it is gone. Call with
        _lock held."""
        if self._session is None or self._session.dead:
            self._session = _Session(self.transport, self.argv(), start_s=self.start_s)
            self.adopted = False
        return self._session

    def _start(self, request: Dict[str, Any]) -> RunningCommand:
        with self._lock:
            session = self._live_session()
        return session.request(request, self.max_output)

    @property
    def said_hello(self) -> bool:
        """The current (or last, if it died) agent of this host said hello: the interpreter did run it."""
        with self._lock:
            session = self._session
        return session is not None and session.said_hello

    @property
    def starting(self) -> bool:
        """The host's agent was started and has not said hello (yet): a request now would only queue."""
        with self._lock:
            return self._session is not None and self._session.starting

    def wait_started(self) -> bool:
        """Wait for the agent's hello, until its start-up deadline at most (at once without one); whether it came."""
        with self._lock:
            session = self._session
        if session is None:
            return False
        by = session.hello_deadline
        if session.starting and by is not None:
            session.wait_ready(max(0.0, by - time.monotonic()))
        return session.said_hello

    def never_started_text(self) -> str:
        """What a request to this host's agent that never said hello ends with."""
        with self._lock:
            session = self._session
        return session.never_started() if session is not None else "the agent never started"

    @property
    def never_started(self) -> bool:
        """The host's agent is past its start-up deadline without a hello: every request to it fails at once."""
        with self._lock:
            session = self._session
        if session is None or not session.starting:
            return False
        by = session.hello_deadline
        return by is not None and time.monotonic() >= by

    def close(self) -> None:
        """End the host's agent (it stops and reaps what is left); the next request starts a new one."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None and not session.close() and not self.transport.kill_reaches_host:
            self._kill_by_token()

    def _kill_by_token(self) -> None:
        """The agent never said hello, and killing its command does not reach the host's process (an SSH
        channel's close signals nothing): kill the process by this run's token in its argv. The pattern's
        first letter in brackets keeps it from matching the shell that runs pkill, whose argv holds it too."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", self.token):
            return
        pattern = f"[{self.token[0]}]{self.token[1:]}"
        try:
            self.transport.run(["pkill", "-KILL", "-f", "--", pattern], timeout=KILL_BY_TOKEN_TIMEOUT_S)
        except Exception:  # best effort: the host may be gone too
            pass

    def adopt(self, channel: RunningCommand) -> None:
        """Talk to an agent started elsewhere (its task in a SharedStep) instead of starting one; once that one
        is gone, the next request starts the host's own as usual."""
        with self._lock:
            self._session = _Session(self.transport, self.argv(), channel, self.start_s)
            self.adopted = True

    def open(self, timeout: float) -> Optional[Dict[str, Any]]:
        """Start the host's agent now and wait for its hello; None when it is not up within timeout (it may
        still come up: later requests wait for it under their own deadlines)."""
        with self._lock:
            session = self._live_session()
        return session.wait_ready(timeout)

    def preload(self, modules: Sequence[str], timeout: float = 120.0) -> RunningCommand:
        """Have the host's agent import these modules once, for every later request (no answer awaited: the
        request, which ends when the import has, is returned)."""
        return self._start({"op": "preload", "modules": list(modules), "timeout": timeout})

    def collect(self, checks: Sequence[str], params: Dict[str, Any], per_check: float) -> Dict[str, Any]:
        return self.collect_result(self.collect_start(checks, params, per_check), checks,
                                   collect_budget(checks, per_check))

    def collect_start(self, checks: Sequence[str], params: Dict[str, Any], per_check: float) -> RunningCommand:
        """Send the host checks request and return at once; collect_result waits for its answer. A thousand
        hosts' requests are in flight at once without a waiting thread per host."""
        return self._start({"op": "collect", "checks": list(checks), "params": params, "timeout": per_check})

    def collect_result(self, request: RunningCommand, checks: Sequence[str], timeout: float) -> Dict[str, Any]:
        """The answer to collect_start's request within timeout (then it is stopped); AgentError if none."""
        try:
            payload = _parse_result(request.wait(timeout), "host checks")
        except AgentError as exc:
            if self.starting:  # not a slow check: the interpreter never ran the agent
                with self._lock:
                    session = self._session
                if session is not None and session.start_s is not None:
                    raise AgentError(session.never_started(), exc.detail) from None
                raise AgentError(f"the agent never started: {self.python} gave no hello within {timeout:.0f}s "
                                 "(a hung interpreter, import hook or login script)", exc.detail) from None
            raise
        self.hostinfo = payload.get("host", {})
        return check_collect_shape(payload["value"], checks)

    def call_start(self, func: str, params: Dict[str, Any], timeout: float) -> RunningCommand:
        """call() without waiting: call_result(request, func, timeout) gets the value."""
        return self._start({"op": "call", "func": func, "params": params, "timeout": timeout})

    @staticmethod
    def call_result(request: RunningCommand, func: str, timeout: float) -> Any:
        return _parse_result(request.wait(timeout), func)["value"]

    def call(self, func: str, params: Dict[str, Any], timeout: float) -> Any:
        return self.call_result(self.call_start(func, params, timeout), func, timeout + 15)

    def start(self, func: str, params: Dict[str, Any], timeout: float) -> "Service":
        return Service(self._start({"op": "call", "func": func, "params": params, "timeout": timeout}),
                       func, timeout)


def collect_budget(checks: Sequence[str], per_check: float) -> float:
    """How long a host checks request may take: the agent runs the checks one after another, each under its
    own deadline, with start-up on top."""
    return per_check * max(1, len(checks)) + 30


def check_collect_shape(value: Any, checks: Sequence[str]) -> Dict[str, Any]:
    """A collect answer is {check: {"facts": ..., "duration_s": n} or {"error": "text", "duration_s": n}};
    anything else from the host raises AgentError (that host's ERROR), never a crash further on."""
    if not isinstance(value, dict):
        raise AgentError(f"host checks: the host's answer is a {type(value).__name__}, not an object of checks")
    for name in checks:
        entry = value.get(name)
        if entry is None:
            continue  # a missing check is reported as "no result" for that check alone
        where = f"host checks: the host's result for {name!r}"
        if not isinstance(entry, dict):
            raise AgentError(f"{where} is a {type(entry).__name__}, not an object")
        duration = entry.get("duration_s")
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not 0 <= duration < 1e9:
            raise AgentError(f"{where} has no valid 'duration_s' (got {str(duration)[:40]!r})")
        if "error" in entry:
            if not isinstance(entry["error"], str) or not isinstance(entry.get("traceback", ""), str):
                raise AgentError(f"{where} has an 'error' or 'traceback' that is not text")
        elif "facts" not in entry:
            raise AgentError(f"{where} has neither 'facts' nor 'error'")
        elif not isinstance(entry["facts"], dict):
            raise AgentError(f"{where} has 'facts' that are a {type(entry['facts']).__name__}, not an object")
    return value


class Service:
    """A long-lived host-side function (listener, iperf3 server, worker) started through the agent."""

    def __init__(self, cmd: RunningCommand, func: str, timeout: float):
        self.cmd = cmd
        self.func = func
        self.timeout = timeout

    def wait_ready(self, timeout: float) -> Dict[str, Any]:
        line = self.cmd.wait_for_output(READY.encode(), timeout)
        if line is None:
            if self.cmd.done:
                _parse_result(self.cmd.wait(1), self.func)  # raises with the agent's own error
            raise AgentError(f"{self.func} did not become ready within {timeout:.0f}s")
        return json.loads(line[len(READY) + 1:])

    def stop(self, timeout: float = 15.0) -> Any:
        """Tell the service to stop (close its stdin) and return its result."""
        self.cmd.close_stdin()
        return self.result(timeout)

    def result(self, timeout: Optional[float] = None) -> Any:
        res = self.cmd.wait(self.timeout + 15 if timeout is None else timeout)
        return _parse_result(res, self.func)["value"]

    def kill(self) -> None:
        self.cmd.kill()
