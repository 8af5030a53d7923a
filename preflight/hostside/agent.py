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
          {"op": "serve"}: the persistent agent (one per host for the whole run, see serve()).

The persistent agent reads one JSON request per line, each with an "id"; {"op": "stop", "id": N} closes that
request's lifeline (a service's stop), {"op": "kill", "id": N} does too and kills it if it lingers. Every
request runs in its own forked worker (its own deadlines, signals and children, exactly as a one-request
agent), and everything the workers print comes back framed, so any byte stream (SSH, srun) carries it:

    @@PF 0 h 40\n{"hostname": "node01", ...}  the agent is ready for requests
    @@PF 7 o 123\n<123 bytes>          stdout of request 7 (e for stderr)
    @@PF 7 x 1\n0                      request 7 ended with exit code 0

{"op": "preload", "modules": ["torch"], "timeout": s, "id": N} imports torch into the agent itself, so that
every worker forked later has it: the coordinator sends it before the host checks when a selected check uses
torch, and the python check, ds_report's DeepSpeed probe (forked from the worker), compute's rounds and the
all-reduce ranks (forked from the supervisor's worker) import nothing again. A failed import leaves torch out
(the python check then reports it); an import that crashes the interpreter would crash the python check's worker
too, and the next request starts a new agent.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

from . import hello as hellos
from . import proc as procs
from . import seams
from . import tempfiles
from .hello import MACHINE_ADDRESSES_MAX, machine_identity  # noqa: F401  (part of this module's interface)

RUN_ENV = "PREFLIGHT_RUN"
# This agent's own mark, in the environment of every command it (or a worker) starts: when its lifeline closes it
# reaps its own processes, never those of another agent of the same run on the same machine (one machine under two
# names, or namespace hosts that share a PID namespace), whose requests may still be running.
AGENT_ENV = "PREFLIGHT_AGENT"
READY = "@@PREFLIGHT-READY"
# Where the checks live on the host: their collect functions and "module.func" host-side functions.
CHECKS_PACKAGE = "preflight.checks"
RESULT = "@@PREFLIGHT-RESULT"


class Abort(BaseException):
    """Raised into the main thread by SIGALRM (deadline), SIGTERM/SIGINT/SIGHUP, or the stdin lifeline.

    A BaseException so that checks' ``except Exception`` blocks do not swallow it; their ``finally`` runs.
    """


# Runs the agent from code streamed on stdin: "<length>\n<zip of the checks package><request line>".
# Kept small and Python 3.9-compatible: it is passed as `python -c` on every host. It reads fd 0 itself, exactly
# what it needs and not a byte more: a buffered reader would swallow the requests that follow in the pipe, and
# serve() reads fd 0 directly (a shared srun step's requests arrive while the agent is still starting).
# What a host pays before the hello is the interpreter's start and this: it reads the zip's directory with
# int.from_bytes and inflates a file with zlib only when it is imported (zipfile, importlib.abc and importlib.util
# cost a bare interpreter's start again), runs the coordinator's bytecode of the hello-path modules when its magic
# number is this Python's (else compiles the source), and says hello (hostside/hello.py) before importing the agent.
# The garbage collector is off until the agent's imports are done, then those objects are frozen: no collection
# walks them again, in the agent or in a forked worker (whose walk would also copy the pages it touches).
BOOTSTRAP = r"""
import sys, os, marshal, zlib, gc
gc.disable()
def line():
    b = b""
    while not b.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        b += c
    return b
n = int(line())
parts, got = [], 0
while got < n:
    c = os.read(0, min(n - got, 1 << 20))
    if not c:
        break
    parts.append(c)
    got += len(c)
code = b"".join(parts)
def u(o, k):
    return int.from_bytes(code[o:o + k], "little")
e = code.rfind(b"PK\5\6")
names, o = {}, u(e + 16, 4)
for _ in range(u(e + 10, 2)):
    k = u(o + 28, 2)
    names[code[o + 46:o + 46 + k].decode()] = (u(o + 42, 4), u(o + 10, 2), u(o + 20, 4))
    o += 46 + k + u(o + 30, 2) + u(o + 32, 2)
def read(fn):
    o, how, size = names[fn]
    o += 30 + u(o + 26, 2) + u(o + 28, 2)
    return zlib.decompress(code[o:o + size], -15) if how == 8 else code[o:o + size]
try:
    import _frozen_importlib_external
    pyc = "pyc/" + _frozen_importlib_external.MAGIC_NUMBER.hex() + "/"
except (ImportError, AttributeError):
    pyc = "?"
Spec = type(sys.__spec__)
class Finder:
    def find_spec(self, name, path, target=None):
        p = name.replace(".", "/")
        for fn, pkg in ((p + "/__init__.py", True), (p + ".py", False)):
            if fn in names:
                return Spec(name, self, origin="preflight:" + fn, is_package=pkg)
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        fn = module.__spec__.origin.split(":", 1)[1]
        c = marshal.loads(read(pyc + fn)) if pyc + fn in names else compile(read(fn), fn, "exec")
        exec(c, module.__dict__)
sys.meta_path.insert(0, Finder())
first = line()
import preflight.hostside.hello
preflight.hostside.hello.early(first)
import preflight.hostside.agent
gc.freeze()
gc.enable()
rc = preflight.hostside.agent.main(sys.argv[1:], code, first)
sys.stdout.flush()
# Skip interpreter shutdown: it would wait on the lifeline thread's lock on stdin.
os._exit(rc)
"""

_stop = threading.Event()
_finished = threading.Event()
_abort_reason = ["deadline"]
_write_lock = threading.Lock()


def _emit(tag: str, payload: Dict[str, Any]) -> None:
    line = f"{tag} {json.dumps(payload, default=str)}\n"
    with _write_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


_aborting = [False]


def _on_signal(signum: int, frame: Any) -> None:
    if signum == signal.SIGALRM:
        # Deadlines are per check: each one may fire once.
        raise Abort("deadline")
    if _aborting[0]:
        return  # already unwinding: a second signal must not interrupt the cleanup in finally blocks
    _aborting[0] = True
    if _abort_reason[0] == "deadline":
        _abort_reason[0] = f"signal {signum}"
    raise Abort(_abort_reason[0])


def _lifeline(stdin: IO[bytes]) -> None:
    """Block on stdin; EOF means the coordinator is gone or wants us to stop."""
    try:
        while stdin.read(4096):
            pass
    except Exception:
        pass
    _stop.set()
    # The request's temporary files go now, while its main thread unwinds (its finally removes them again, and the
    # agent does if this process is killed before that).
    tempfiles.unlink_registered(kept=not tempfiles.attached())
    _abort_reason[0] = "coordinator closed the session"
    # Give a server in wait_stop() the chance to return and clean up before interrupting the main thread.
    if not _finished.wait(2.0):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except OSError:
            pass
    time.sleep(10)
    procs.kill_all()  # the main thread is stuck in C code: clean up and leave anyway
    os._exit(3)


def _host_facts() -> Dict[str, Any]:
    return {"hostname": hellos.hostname(), "python": hellos.python_version(),
            "executable": sys.executable, "pid": os.getpid()}


def _collect(names: Sequence[str], params: Dict[str, Any], per_check: float) -> Dict[str, Any]:
    """Run each named check's collect under its own deadline; one check's failure never stops the next."""
    out: Dict[str, Any] = {}
    for name in names:
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, per_check)
        try:
            module = importlib.import_module(CHECKS_PACKAGE + "." + name)
            ctx = seams.HostContext(params=params, deadline=start + per_check)
            out[name] = {"facts": module.collect(ctx)}
        except Abort as exc:
            if str(exc) != "deadline":
                raise
            out[name] = {"error": f"timed out after {per_check:.0f}s on the host"}
        except Exception as exc:  # a check's bug or a missing tool: that check's ERROR, not the agent's
            import traceback  # on errors alone: every host would pay its import
            out[name] = {"error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc(limit=6)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            procs.kill_all()
        out[name]["duration_s"] = round(time.monotonic() - start, 3)
    return out


def _call(func: str, params: Dict[str, Any], timeout: float) -> Any:
    module_name, _, attr = func.rpartition(".")
    # "iperf3.serve" is a check's function; "hostside.agent.reap" one of the host-side support's.
    package = "preflight" if module_name.startswith("hostside.") else CHECKS_PACKAGE
    module = importlib.import_module(package + "." + module_name)
    ctx = seams.HostContext(params=params, deadline=time.monotonic() + timeout,
                           ready=lambda info: _emit(READY, info), wait_stop=_wait_stop)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return getattr(module, attr)(params, ctx)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _wait_stop(max_s: float) -> bool:
    """Block until the coordinator closes stdin (True) or max_s passes (False)."""
    return _stop.wait(max_s)


class _ForkedCall(procs.Forked):
    """A call running in a forked child, with the pipes of a Popen(stdin=PIPE, stdout=PIPE, stderr=PIPE)."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        super().__init__(pid)
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr


def fork_call(func: str, params: Dict[str, Any], timeout: float,
              env: Optional[Dict[str, str]] = None) -> Any:
    """Run ``func`` (e.g. one all-reduce rank) in a forked child of this process, tracked for cleanup; returns a
    Popen-like object (pid, poll, wait, stdin/stdout/stderr pipes); read its result with
    ``read_result(proc.stdout.read())``. The child has every module this process imported (torch, once the agent
    preloaded it: a rank then starts in milliseconds, not the 1.5-3 s of a new interpreter importing torch). It
    runs in its own session with env added, its stdin is its lifeline (closing proc.stdin, or this process
    dying, stops it), and it holds none of this process's other descriptors (another rank's lifeline among
    them)."""
    env = dict({"LC_ALL": "C", "LANG": "C"}, **(env or {}))  # as procs.spawn gives its children
    pid, life_w, out_r, err_r = _fork_one({"op": "call", "func": func, "params": params, "timeout": timeout},
                                          env=env, session=True)
    proc = _ForkedCall(pid, os.fdopen(life_w, "wb"), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
    procs.LIVE.add(proc)  # type: ignore[arg-type]  # stop() and kill_all() need only pid, poll and wait
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
        stat = procs.read_text(f"/proc/{pid}/stat", "") or ""
        try:
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            break
    return chain


def loaded(params: Dict[str, Any], ctx: seams.HostContext) -> Dict[str, Any]:
    """Which of params["names"] this worker found already imported, and its agent's pid (its parent)."""
    return {"modules": {name: name in sys.modules for name in params.get("names", [])}, "agent": os.getppid()}


def _read_proc(path: str) -> bytes:
    """A whole /proc file through a bare descriptor: reap() reads two per process on the host, and a file
    object costs more than the read (14 instead of 23 us per process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks: List[bytes] = []
        while True:
            chunk = os.read(fd, 1 << 17)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _is_agent_argv(cmdline: bytes, token: bytes) -> bool:
    """cmdline (NUL-separated) is an agent's own, ``PYTHON -c BOOTSTRAP TOKEN`` (remote.Agent.argv; the token
    right after the code), or a fork of one. Only that shape: the launcher of an agent carries the same words
    after its own (``srun ... -- PYTHON -c BOOTSTRAP TOKEN``), and killing it was a leak. A node's run-wide
    reap ran where the coordinator's srun runs (a batch script's first node; every node of the test bed, one
    PID namespace) and SIGKILLed the shared step's srun client, so its helper never cancelled the step, and
    the one agent that reap spared (its own ancestor) never saw the EOF that srun alone could forward: that
    agent and its slurmstepd stayed for as long as the allocation did (InactiveLimit=0, the default)."""
    args = cmdline.split(b"\0")
    if args and not args[-1]:
        args.pop()
    return len(args) >= 4 and args[1] == b"-c" and args[3] == token


def _uts_namespace(pid: str) -> str:
    """The process's UTS namespace (its hostname's), e.g. ``uts:[4026531838]``; "" when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return ""


def reap(params: Dict[str, Any], ctx: seams.HostContext) -> Dict[str, Any]:
    """Last-resort cleanup: kill every process of this run still alive on the host (found by argv or environment).

    With params["agent"] (an agent's AGENT_ENV, when its own lifeline closes): only that agent's processes, those
    with its mark in their environment (commands it started) and those with the run's token in argv whose
    environment is the agent's own (forks of it: a worker, a rank); another agent of the same run has its own
    connection's environment (SSH_CONNECTION, SLURM_PROCID) and is spared."""
    token = params["token"].encode()
    marker = RUN_ENV.encode() + b"=" + token + b"\0"
    agent = str(params.get("agent") or "").encode()
    own_env = _read_proc("/proc/self/environ") if agent else b""
    if agent:
        marker = AGENT_ENV.encode() + b"=" + agent + b"\0"
    spared = _ancestors(os.getpid())  # our own shell also carries the token in its argv
    # Only this host's processes: where hosts share one PID namespace but not their UTS one (a test bed of
    # namespace hosts, one slurmd each), a node's reap killed the other nodes' agents before they answered their
    # own reap, and a shared srun step sees no end of a killed task: the coordinator waited out its 25 s clean-up.
    # The namespace is looked at first: one readlink, where reading a process's argv and environment costs two
    # reads. On such a test bed every host's /proc lists every host's processes, and a scan that read them all
    # cost each of 1,000 hosts ~100 ms of CPU, twice at the end of every run.
    here = _uts_namespace("self")
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spared:
            continue
        try:
            if _uts_namespace(entry) != here:
                continue
            # Agents carry the token in argv; their children inherit it in the environment.
            found = _is_agent_argv(_read_proc(f"/proc/{entry}/cmdline"), token)
            environ = _read_proc(f"/proc/{entry}/environ") if agent or not found else b""
            if agent:
                found = marker in environ or (found and environ == own_env)
            elif not found:
                found = marker in environ
            if not found:
                continue
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
        except (OSError, ValueError):
            continue
    return {"killed": killed}


def main(argv: Sequence[str], code: Optional[bytes] = None, first: Optional[bytes] = None) -> int:
    """first: the request line, when the BOOTSTRAP read it (unbuffered); else it is read here."""
    # Marks this agent and every child it starts, so that reap() can find them after a hard failure.
    if argv:
        os.environ[RUN_ENV] = argv[0]
    os.environ[AGENT_ENV] = f"{os.getpid()}-{os.urandom(6).hex()}"
    stdin = sys.stdin.buffer
    request = json.loads((first if first is not None else stdin.readline()).decode())
    procs.AGENT_CODE = code  # lets host-side functions start helper interpreters with the same code (workers)
    if request.get("op") == "serve":
        return serve(os.environ.get(RUN_ENV, ""), bool(request.get("step")))
    return _run_one(request, stdin)


def _run_one(request: Dict[str, Any], stdin: IO[bytes]) -> int:
    """One request in this process: stdin is its lifeline, RESULT (and READY) lines go to stdout."""
    for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    threading.Thread(target=_lifeline, args=(stdin,), daemon=True).start()
    payload: Dict[str, Any] = {"host": _host_facts()}
    try:
        if request["op"] == "collect":
            payload["value"] = _collect(request["checks"], request.get("params", {}), float(request["timeout"]))
        elif request["op"] == "call":
            payload["value"] = _call(request["func"], request.get("params", {}), float(request["timeout"]))
        else:
            raise ValueError(f"unknown op {request['op']!r}")
        payload["ok"] = True
    except Abort as exc:
        payload.update(ok=False, error=f"aborted: {exc}")
    except Exception as exc:
        import traceback
        payload.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc(limit=8))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        procs.kill_all()
        tempfiles.end_request()  # a temporary file never outlives its request (the kept ones are the agent's)
    _emit(RESULT, payload)
    _finished.set()
    return 0


# --- the persistent agent ---------------------------------------------------------------------------------

FRAME = b"@@PF"
# After a request's lifeline closes, its worker gets this long to finish (its own lifeline handling SIGTERMs
# itself after 2 s and leaves after 12 s), then its process group is killed.
_KILL_AFTER_S = 14.0


class _Shutdown(Exception):
    pass


class _Worker:
    def __init__(self, pid: int, out_fd: int, err_fd: int, life_fd: int):
        self.pid = pid
        self.fds = {out_fd: b"o", err_fd: b"e"}
        self.life_fd = life_fd
        self.rc = None  # type: Any
        self.kill_at = None  # type: Any
        self.exited_at = None  # type: Any
        self.temp_fd = -1  # the read end of its pipe to _LEDGER


def _write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(1, view)
        view = view[n:]


# In a shared step (serve(step=True)) the agent's stdout reaches the coordinator through `srun --label`, which
# labels whatever chunk it forwards and ends it with a newline: a length-prefixed frame would not survive. There
# every frame is one line of base64 (no newline, no '.') ended by a '.', so the coordinator can join the pieces
# of a split line per label and knows where a frame ends.
LINE_FRAME = b"@@PL"
_LINE_CHUNK = 768  # bytes of payload per line: 1,024 base64 characters, well inside any line buffer
_line_frames = [False]


def _frame(rid: int, kind: bytes, data: bytes = b"") -> None:
    if not _line_frames[0]:
        _write_all(b"%s %d %s %d\n" % (FRAME, rid, kind, len(data)) + data)
        return
    import base64  # a shared srun step's line frames alone
    size = _LINE_CHUNK if kind in (b"o", b"e") else max(1, len(data))  # streams may be cut; hello, exit code not
    _write_all(b"".join(b"%s %d %s %s.\n" % (LINE_FRAME, rid, kind, base64.b64encode(data[start:start + size]))
                        for start in range(0, max(1, len(data)), size)))


# The temporary files the workers registered (hostside/tempfiles.py): what a killed worker left, the agent removes.
_LEDGER = tempfiles.Ledger()


def _fork_worker(rid: int, request: Dict[str, Any]) -> _Worker:
    temp_r, temp_w = _LEDGER.channel()
    try:
        pid, life_w, out_r, err_r = _fork_one(request, temp_fd=temp_w)
    except BaseException:
        _LEDGER.close(temp_r)
        raise
    finally:
        os.close(temp_w)
    worker = _Worker(pid, out_r, err_r, life_w)
    worker.temp_fd = temp_r
    return worker


def _fork_one(request: Dict[str, Any], env: Optional[Dict[str, str]] = None,
              session: bool = False, temp_fd: int = -1) -> Tuple[int, int, int, int]:
    """Fork a one-request agent serving request: its stdin is a lifeline pipe, its stdout and stderr pipes; it
    holds none of this process's other descriptors (the agent's channel, the other workers' or ranks' pipes) but
    temp_fd, its pipe to the agent's temp-file ledger, when given.
    Its own process group (session=True: its own session), env added. Returns (pid, lifeline write end,
    stdout read end, stderr read end)."""
    global _stop, _finished, _write_lock
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    life_r, life_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        rc = 70
        try:
            held = procs.forked_child_stdio(life_r, out_w, err_w, session, keep=temp_fd)  # noqa: F841
            if temp_fd >= 0:
                tempfiles.attach(temp_fd)
            os.environ.update(env or {})
            # The parent's state belongs to the request it serves (a supervisor forking ranks is one): the child
            # starts afresh.
            _stop, _finished, _write_lock = threading.Event(), threading.Event(), threading.Lock()
            _aborting[0], _abort_reason[0] = False, "deadline"
            procs.LIVE.clear()  # the parent's children are not this child's to stop
            rc = _run_one(request, sys.stdin.buffer)
            sys.stdout.flush()
        except BaseException:
            try:
                import traceback
                traceback.print_exc()
                sys.stderr.flush()
            except Exception:
                pass
        os._exit(rc)
    for fd in (out_w, err_w, life_r):
        os.close(fd)
    return pid, life_w, out_r, err_r


def _close_lifeline(worker: _Worker) -> None:
    if worker.life_fd >= 0:
        try:
            os.close(worker.life_fd)
        except OSError:
            pass
        worker.life_fd = -1
    if worker.kill_at is None:
        worker.kill_at = time.monotonic() + _KILL_AFTER_S


def _kill_worker(worker: _Worker) -> None:
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except OSError:
        pass


# Modules the persistent agent may import into itself, so that later workers inherit them instead of
# importing them again. Only after a host check proved they import cleanly here (a crash would cost the
# agent, which the coordinator then restarts), never anything that initializes a GPU at import.
_PRELOADABLE = ("torch",)
_PRELOAD_TIMEOUT_S = 120.0  # when the request names none


def _preload(names: Sequence[str], timeout: float = _PRELOAD_TIMEOUT_S) -> int:
    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("preload took too long")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(timeout)))
    try:
        for name in names:
            if name in _PRELOADABLE:
                importlib.import_module(name)
        return 0
    except _Shutdown:
        raise
    except BaseException:
        return 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def serve(token: str, step: bool = False) -> int:
    """The persistent agent: one process per host for the whole run, a forked worker per request.

    Single-threaded (a select loop), so forking is safe. Its stdin is the run's lifeline: when it closes
    (coordinator done, killed, or the connection dropped) every worker's lifeline closes, stragglers are
    killed, and everything of the run still alive on the host is reaped before it exits.

    With step=True it is one task of a Slurm step over every node, whose stdin srun broadcasts to all tasks:
    it takes only the lines addressed to its node ("@NODE {request}"), writes line frames, and ends with a "q"
    frame when asked to exit ({"op": "exit"}), since its task's end is not reported per node.
    """
    route = b""
    if step:
        node = os.environ.get("SLURMD_NODENAME", "")
        if not node:
            sys.stderr.write("preflight agent: a shared step needs SLURMD_NODENAME (set by slurmd)\n")
            return 2
        route = b"@" + node.encode() + b" "
        _line_frames[0] = True

    def on_signal(signum: int, frame: Any) -> None:
        raise _Shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = _Server(route)
    try:
        server.run()
    except (_Shutdown, OSError):
        pass
    # The coordinator is gone or asked us to go: stop every request the way its own lifeline would.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    server.stop_workers()
    if token and not server.reaped:
        try:  # grandchildren in their own sessions; this agent's alone (see AGENT_ENV)
            reap({"token": token, "agent": os.environ.get(AGENT_ENV, "")}, None)  # type: ignore[arg-type]
        except Exception:
            pass
    _LEDGER.close_all()  # the workers' temporary files, the kept ones (checkpoint probes) too
    if route:
        try:
            _frame(0, b"q")
        except OSError:
            pass
    return 0


class _Server:
    """serve()'s select loop: the coordinator's requests on stdin (only those after ``route``, in a shared step),
    a forked worker per request, and each worker's output framed back to the coordinator."""

    def __init__(self, route: bytes) -> None:
        import selectors  # the persistent agent's alone

        self.route = route
        self.readable = selectors.EVENT_READ
        self.sel = selectors.DefaultSelector()
        self.sel.register(0, self.readable, None)
        self.workers: Dict[int, _Worker] = {}
        self.by_fd: Dict[int, Tuple[int, _Worker]] = {}
        self.inbuf = bytearray()
        self.stdin_open = True
        # The coordinator's run-wide reap (hostside.agent.reap of the run's token, the last request of a run)
        # kills a superset of what this agent's own reap at its exit would: once it has ended and no worker was
        # started after it, the exit skips its own scan of /proc (at a thousand namespace hosts that share one
        # /proc, each scan cost every host ~10 ms of CPU).
        self.forks = 0
        self.run_reap: Optional[Tuple[int, int]] = None  # (its request id, self.forks when it was started)
        self.reaped = False

    def run(self) -> None:
        """Say hello, then serve until stdin ends or says exit (_Shutdown), or a write to the coordinator fails
        (OSError)."""
        if not hellos.SENT[0]:  # the BOOTSTRAP said it before importing this module (hello.early), or not
            _frame(0, b"h", hellos.hello_payload(self.route[1:-1].decode() if self.route else None))
            hellos.SENT[0] = True
        while self.stdin_open or self.workers:
            timeout = 1.0 if self.workers else None  # idle: sleep until the coordinator says something
            for key, _ in self.sel.select(timeout):
                if key.fd == 0:
                    self._read_requests()
                else:
                    self._read_worker(key.fd)
            self._watch_workers(time.monotonic())

    def _read_requests(self) -> None:
        data = os.read(0, 65536)
        if not data:
            raise _Shutdown()
        self.inbuf.extend(data)
        while True:
            nl = self.inbuf.find(b"\n")
            if nl < 0:
                break
            line = bytes(self.inbuf[:nl])
            del self.inbuf[:nl + 1]
            self._handle(line)

    def _handle(self, line: bytes) -> None:
        if self.route:
            if not line.startswith(self.route):
                return  # another node's request
            line = line[len(self.route):]
        try:
            msg = json.loads(line.decode())
            rid = int(msg["id"])
            op = msg["op"]
        except (ValueError, KeyError, TypeError):
            return  # not ours: the coordinator only sends well-formed requests
        if op == "exit":
            raise _Shutdown()
        if op in ("stop", "kill"):
            if rid in self.workers:
                _close_lifeline(self.workers[rid])
            return
        if op == "preload":
            rc = _preload(msg.get("modules") or [], float(msg.get("timeout") or _PRELOAD_TIMEOUT_S))
            _frame(rid, b"x", b"%d" % rc)
            return
        if rid in self.workers:
            return
        worker = _fork_worker(rid, msg)
        self.forks += 1
        self.reaped = False
        if op == "call" and msg.get("func") == "hostside.agent.reap" and not (msg.get("params") or {}).get("agent"):
            self.run_reap = (rid, self.forks)
        self.workers[rid] = worker
        for fd in worker.fds:
            self.sel.register(fd, self.readable, None)
            self.by_fd[fd] = (rid, worker)

    def _read_worker(self, fd: int) -> None:
        rid, worker = self.by_fd[fd]
        data = os.read(fd, 65536)
        if data:
            _frame(rid, worker.fds[fd], data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        del worker.fds[fd]
        self.by_fd.pop(fd, None)
        if not worker.fds:
            self._finish(rid, worker)

    def _watch_workers(self, now: float) -> None:
        for rid, worker in list(self.workers.items()):
            _LEDGER.read(worker.temp_fd)  # its pipe holds 64 KiB: taken as it goes
            if worker.rc is None:
                pid, status = os.waitpid(worker.pid, os.WNOHANG)
                if pid:
                    worker.rc = os.waitstatus_to_exitcode(status)
                    worker.exited_at = now
            if worker.rc is not None and worker.exited_at is not None and now - worker.exited_at > 2.0:
                self._finish(rid, worker)  # exited, but a child it left holds its output open
            elif worker.kill_at is not None and now > worker.kill_at:
                _kill_worker(worker)

    def _finish(self, rid: int, worker: _Worker) -> None:
        for fd in list(worker.fds):
            self.sel.unregister(fd)
            os.close(fd)
            self.by_fd.pop(fd, None)
        worker.fds.clear()
        if worker.rc is None:
            _, status = os.waitpid(worker.pid, 0)
            worker.rc = os.waitstatus_to_exitcode(status)
        _LEDGER.close(worker.temp_fd)  # it has ended: what it registered and did not remove is removed now
        worker.temp_fd = -1
        _close_lifeline(worker)
        self.workers.pop(rid, None)
        if self.stdin_open and self.run_reap == (rid, self.forks) and worker.rc == 0:
            self.reaped = True
        if self.stdin_open:
            _frame(rid, b"x", str(worker.rc).encode())

    def stop_workers(self) -> None:
        """Close every worker's lifeline, give them _KILL_AFTER_S to end, then kill what is left (no more frames:
        the coordinator is gone or asked us to go)."""
        self.stdin_open = False
        deadline = time.monotonic() + _KILL_AFTER_S
        for worker in self.workers.values():
            _close_lifeline(worker)
        while self.workers and time.monotonic() < deadline:
            for rid, worker in list(self.workers.items()):
                pid, _ = os.waitpid(worker.pid, os.WNOHANG)
                if pid:
                    worker.rc = 0
                    self._finish(rid, worker)
            time.sleep(0.1)
        for worker in self.workers.values():
            _kill_worker(worker)
            try:
                os.waitpid(worker.pid, 0)
            except OSError:
                pass
