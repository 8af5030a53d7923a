"""The host-side agent: runs checks' collect functions (or one host-side function) and prints JSON.

It is started by the coordinator as ``PYTHON -c BOOTSTRAP`` with the checks package streamed over stdin, so
nothing is written to the host's disk. After the code comes one JSON request line; stdin then stays open
as a lifeline: when it closes (coordinator done, timed out, Ctrl-C'd, or the SSH connection dropped) the
agent stops its work, kills every child it started and exits. Output lines (anything else on stdout, such
as a noisy shell profile, is ignored by the coordinator):

    @@PREFLIGHT-READY {"port": 40213}
    @@PREFLIGHT-RESULT {"ok": true, "value": {...}, "host": {"hostname": "node01", ...}}

Requests: {"op": "collect", "checks": ["libaio", ...], "params": {...}, "timeout": per-check seconds}
          {"op": "call", "func": "ports.listen", "params": {...}, "timeout": seconds}
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict

from . import base

RUN_ENV = "PREFLIGHT_RUN"
READY = "@@PREFLIGHT-READY"
RESULT = "@@PREFLIGHT-RESULT"


class Abort(BaseException):
    """Raised into the main thread by SIGALRM (deadline), SIGTERM/SIGINT/SIGHUP, or the stdin lifeline.

    A BaseException so that checks' ``except Exception`` blocks do not swallow it; their ``finally`` runs.
    """


# Runs the agent from code streamed on stdin: "<length>\n<zip of the checks package><request line>".
# Kept small and Python 3.9-compatible: it is passed as `python -c` on every host.
BOOTSTRAP = r"""
import sys, io, zipfile, importlib.abc, importlib.util
n = int(sys.stdin.buffer.readline())
code = sys.stdin.buffer.read(n)
z = zipfile.ZipFile(io.BytesIO(code))
names = set(z.namelist())
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        p = name.replace(".", "/")
        for fn, pkg in ((p + "/__init__.py", True), (p + ".py", False)):
            if fn in names:
                spec = importlib.util.spec_from_loader(name, self, origin="preflight:" + fn, is_package=pkg)
                return spec
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        fn = module.__spec__.origin.split(":", 1)[1]
        exec(compile(z.read(fn), fn, "exec"), module.__dict__)
sys.meta_path.insert(0, Finder())
import preflight.checks.agent, os
rc = preflight.checks.agent.main(sys.argv[1:], code)
sys.stdout.flush()
# Skip interpreter shutdown: it would wait on the lifeline thread's lock on stdin.
os._exit(rc)
"""

_stop = threading.Event()
_finished = threading.Event()
_abort_reason = ["deadline"]
_write_lock = threading.Lock()


def _emit(tag: str, payload: Dict[str, Any]) -> None:
    line = "%s %s\n" % (tag, json.dumps(payload, default=str))
    with _write_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


_aborting = [False]


def _on_signal(signum, frame) -> None:
    if signum == signal.SIGALRM:
        # Deadlines are per check: each one may fire once.
        raise Abort("deadline")
    if _aborting[0]:
        return  # already unwinding: a second signal must not interrupt the cleanup in finally blocks
    _aborting[0] = True
    if _abort_reason[0] == "deadline":
        _abort_reason[0] = "signal %d" % signum
    raise Abort(_abort_reason[0])


def _lifeline(stdin) -> None:
    """Block on stdin; EOF means the coordinator is gone or wants us to stop."""
    try:
        while stdin.read(4096):
            pass
    except Exception:
        pass
    _stop.set()
    _abort_reason[0] = "coordinator closed the session"
    # Give a server in wait_stop() the chance to return and clean up before interrupting the main thread.
    if not _finished.wait(2.0):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except OSError:
            pass
    time.sleep(10)
    base.kill_all()  # the main thread is stuck in C code: clean up and leave anyway
    os._exit(3)


def _host_facts() -> Dict[str, Any]:
    return {"hostname": socket.gethostname(), "python": platform.python_version(),
            "executable": sys.executable, "pid": os.getpid()}


def _collect(names, params: Dict[str, Any], per_check: float) -> Dict[str, Any]:
    """Run each named check's collect under its own deadline; one check's failure never stops the next."""
    out: Dict[str, Any] = {}
    for name in names:
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, per_check)
        try:
            module = importlib.import_module("." + name, __package__)
            ctx = base.HostContext(params=params, deadline=start + per_check)
            out[name] = {"facts": module.collect(ctx)}
        except Abort as exc:
            if str(exc) != "deadline":
                raise
            out[name] = {"error": "timed out after %.0fs on the host" % per_check}
        except Exception as exc:  # a check's bug or a missing tool: that check's ERROR, not the agent's
            out[name] = {"error": "%s: %s" % (type(exc).__name__, exc),
                         "traceback": traceback.format_exc(limit=6)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            base.kill_all()
        out[name]["duration_s"] = round(time.monotonic() - start, 3)
    return out


def _call(func: str, params: Dict[str, Any], timeout: float) -> Any:
    module_name, _, attr = func.rpartition(".")
    module = importlib.import_module("." + module_name, __package__)
    ctx = base.HostContext(params=params, deadline=time.monotonic() + timeout,
                           ready=lambda info: _emit(READY, info), wait_stop=_wait_stop)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return getattr(module, attr)(params, ctx)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _wait_stop(max_s: float) -> bool:
    """Block until the coordinator closes stdin (True) or max_s passes (False)."""
    return _stop.wait(max_s)


def spawn_call(func: str, params: Dict[str, Any], timeout: float, env: Dict[str, str] = None):
    """Start another agent on this host running ``func`` (e.g. one all-reduce rank), tracked for cleanup.

    The child gets the same in-memory code as this agent; its stdin stays open as its lifeline (closing the
    Popen's stdin, or this agent dying, stops it). Read its result with ``read_result(proc.stdout.read())``.
    """
    import subprocess
    code = base.AGENT_CODE
    if code is None:
        raise RuntimeError("spawn_call works only inside the agent")
    token = os.environ.get(RUN_ENV, "preflight")
    proc = base.spawn([sys.executable, "-c", BOOTSTRAP, token], env=env, stdin=subprocess.PIPE)
    request = {"op": "call", "func": func, "params": params, "timeout": timeout}
    proc.stdin.write(b"%d\n" % len(code) + code + json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    return proc


def read_result(stdout: bytes) -> Dict[str, Any]:
    """The RESULT payload of an agent's stdout ({"ok": ..., "value": ...} or {"ok": False, "error": ...})."""
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        if line.startswith(RESULT + " "):
            return json.loads(line[len(RESULT) + 1:])
    return {"ok": False, "error": "no result (the process died?)"}


def _ancestors(pid: int) -> set:
    chain = set()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        stat = base.read_text("/proc/%d/stat" % pid, "") or ""
        try:
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            break
    return chain


def reap(params: Dict[str, Any], ctx: base.HostContext) -> Dict[str, Any]:
    """Last-resort cleanup: kill every process of this run still alive on the host (found by environment)."""
    token = params["token"].encode()
    marker = RUN_ENV.encode() + b"=" + token + b"\0"
    spared = _ancestors(os.getpid())  # our own shell also carries the token in its argv
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spared:
            continue
        try:
            # Agents carry the token in argv; their children inherit it in the environment.
            with open("/proc/%s/cmdline" % entry, "rb") as fh:
                found = token in fh.read().split(b"\0")
            if not found:
                with open("/proc/%s/environ" % entry, "rb") as fh:
                    found = marker in fh.read()
            if not found:
                continue
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
        except (OSError, ValueError):
            continue
    return {"killed": killed}


def main(argv, code=None) -> int:
    # Marks this agent and every child it starts, so that reap() can find them after a hard failure.
    if argv:
        os.environ[RUN_ENV] = argv[0]
    for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    stdin = sys.stdin.buffer
    request = json.loads(stdin.readline().decode())
    threading.Thread(target=_lifeline, args=(stdin,), daemon=True).start()
    base.AGENT_CODE = code  # lets host-side functions start helper interpreters with the same code (workers)
    payload: Dict[str, Any] = {"host": _host_facts()}
    try:
        if request["op"] == "collect":
            payload["value"] = _collect(request["checks"], request.get("params", {}), float(request["timeout"]))
        elif request["op"] == "call":
            payload["value"] = _call(request["func"], request.get("params", {}), float(request["timeout"]))
        else:
            raise ValueError("unknown op %r" % request["op"])
        payload["ok"] = True
    except Abort as exc:
        payload.update(ok=False, error="aborted: %s" % exc)
    except Exception as exc:
        payload.update(ok=False, error="%s: %s" % (type(exc).__name__, exc),
                       traceback=traceback.format_exc(limit=8))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        base.kill_all()
    _emit(RESULT, payload)
    _finished.set()
    return 0
