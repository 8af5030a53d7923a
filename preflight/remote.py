"""Ship the host-side checks to a host and talk to the agent there, over any Transport.

The checks package travels as an in-memory zip on the agent's stdin (see checks/agent.py), so a run writes
no file on the hosts. Sample of what the agent prints and this module parses:

    @@PREFLIGHT-READY {"port": 40213}
    @@PREFLIGHT-RESULT {"ok": true, "value": {...}, "host": {"hostname": "node01", "python": "3.11.7"}}
"""
from __future__ import annotations

import io
import json
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from preflight.checks.agent import BOOTSTRAP, READY, RESULT
from preflight import checks as _checks_pkg
from preflight.transport import CommandResult, RunningCommand, Transport

# Where the host-side package lives: preflight/checks when installed, the repository's checks/ in a checkout
# (setuptools' package-dir maps one onto the other).
CHECKS_DIR = Path(_checks_pkg.__file__).resolve().parent
# The name the host-side code is imported under on the host: its imports are relative, so only the agent's
# BOOTSTRAP (``import preflight.checks.agent``) cares, and a stub ``preflight`` package makes it resolve.
PACKAGE_PATH = "preflight/checks"


class AgentError(Exception):
    """The agent could not run or answer; ``detail`` holds stderr for the report."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


@lru_cache(maxsize=1)
def agent_code() -> bytes:
    """The checks package as a zip: every .py file of it and its subpackages, no bytecode (the hosts' Python
    may differ), under ``preflight/checks/`` beside an empty ``preflight/__init__.py``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("preflight/__init__.py", b"")
        for path in sorted(CHECKS_DIR.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            zf.writestr(f"{PACKAGE_PATH}/{path.relative_to(CHECKS_DIR).as_posix()}", path.read_bytes())
    return buf.getvalue()


def _stdin_for(request: Dict[str, Any]) -> bytes:
    code = agent_code()
    return b"%d\n" % len(code) + code + json.dumps(request).encode() + b"\n"


# What the coordinator reads from one host for one request when the config does not say ([agent] in
# defaults.toml holds the documented value).
DEFAULT_MAX_OUTPUT = 64 * 2**20


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
        raise AgentError(f"{what}: the Python interpreter was not found on the host ({tail})", res.stderr)
    raise AgentError(f"{what} exited with rc={res.rc} without a result: {tail or 'no output'}", res.stderr[-2000:])


class Agent:
    """The agent on one host: ``collect`` runs host checks; ``call``/``start`` run a host-side function."""

    def __init__(self, transport: Transport, python: str = "python3", token: str = "preflight",
                 max_output: int = DEFAULT_MAX_OUTPUT):
        self.transport = transport
        self.python = python
        # The token appears in every agent's argv, so a last-resort cleanup can find them with pkill -f.
        self.token = token
        self.max_output = max_output
        self.hostinfo: Dict[str, Any] = {}

    def _argv(self) -> Sequence[str]:
        return [self.python, "-c", BOOTSTRAP, self.token]

    def _start(self, request: Dict[str, Any]) -> RunningCommand:
        return self.transport.start(self._argv(), _stdin_for(request), keep_stdin_open=True,
                                    max_output=self.max_output)

    def collect(self, checks: Sequence[str], params: Dict[str, Any], per_check: float) -> Dict[str, Any]:
        # The agent runs checks one after another, each under its own deadline; allow start-up on top.
        budget = per_check * max(1, len(checks)) + 30
        res = self._start({"op": "collect", "checks": list(checks), "params": params,
                           "timeout": per_check}).wait(budget)
        payload = _parse_result(res, "host checks")
        self.hostinfo = payload.get("host", {})
        return check_collect_shape(payload["value"], checks)

    def call(self, func: str, params: Dict[str, Any], timeout: float) -> Any:
        res = self._start({"op": "call", "func": func, "params": params, "timeout": timeout}).wait(timeout + 15)
        return _parse_result(res, func)["value"]

    def start(self, func: str, params: Dict[str, Any], timeout: float) -> "Service":
        return Service(self._start({"op": "call", "func": func, "params": params, "timeout": timeout}),
                       func, timeout)


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
