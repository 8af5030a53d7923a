"""Vocabulary shared by every check: the status enum, findings, outcomes, the seams, and bounded host commands.

This module runs on the hosts (shipped by the agent) and on the coordinator, so it uses only the
standard library and stays compatible with Python 3.9. It is the lowest layer: ``checks/`` never imports
the coordinator (``preflight.*``); a cluster check receives what it needs through the ``ClusterView``
Protocol below, and every check module satisfies ``CheckModule`` (the registry verifies it on load).

Thresholds are the merged config (``preflight/defaults.toml`` + ``--config``), read only through
``limits(thresholds, NAME)``, e.g. ``limits(thresholds, "nvme")["min_write_gbps"]``.
"""
from __future__ import annotations

import contextlib
import enum
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple, Union,
                    runtime_checkable)


class Status(str, enum.Enum):
    """PASS/WARN/FAIL are verdicts about the host; SKIP always carries a reason; ERROR means 'could not run'."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    @property
    def rank(self) -> int:
        # A definite FAIL outranks ERROR when one check has both: it is the more useful thing to show.
        return {"skip": 0, "pass": 1, "warn": 2, "error": 3, "fail": 4}[self.value]


@dataclass
class Finding:
    """One sub-result of a check (one GPU's ECC errors, one config key); the check's status is the worst."""

    status: Status
    message: str
    fix: str = ""

    def to_dict(self) -> Dict[str, str]:
        return {"status": self.status.value, "message": self.message, "fix": self.fix}


@dataclass
class Outcome:
    """What ``evaluate`` returns for one (host, check): the message states actual vs expected."""

    status: Status
    message: str
    fix: str = ""
    metrics: Dict[str, Any] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)


def combine(findings: Sequence[Finding], ok_message: str, metrics: Optional[Dict[str, Any]] = None) -> Outcome:
    """Fold findings into one outcome: worst status wins; the message lists every non-PASS finding.

    With no findings at all the outcome is PASS with ``ok_message``.
    """
    metrics = dict(metrics or {})
    findings = list(findings)
    if not findings:
        return Outcome(Status.PASS, ok_message, metrics=metrics)
    worst = max((f.status for f in findings), key=lambda s: s.rank)
    shown = [f for f in findings if f.status not in (Status.PASS,)] or findings
    if worst == Status.SKIP or all(f.status == Status.SKIP for f in shown):
        shown = [f for f in findings if f.status == Status.SKIP]
    else:
        shown = [f for f in shown if f.status != Status.SKIP] or shown
    message = "; ".join(f.message for f in shown)
    fixes: List[str] = []
    for f in shown:
        if f.fix and f.fix not in fixes:
            fixes.append(f.fix)
    if worst == Status.PASS:
        message = ok_message if ok_message else message
    metrics.setdefault("findings", [f.to_dict() for f in findings])
    return Outcome(worst, message, "; ".join(fixes), metrics, findings)


def skip(reason: str, **metrics: Any) -> Outcome:
    return Outcome(Status.SKIP, reason, metrics=dict(metrics))


def error(reason: str, fix: str = "", **metrics: Any) -> Outcome:
    return Outcome(Status.ERROR, reason, fix, metrics=dict(metrics))


class ThresholdsError(KeyError):
    """A check asked for a [section] that the thresholds do not have: a bug or a stale defaults.toml."""


def limits(thresholds: Mapping[str, Any], name: str) -> Dict[str, Any]:
    """The one accessor for a check's thresholds: the ``[name]`` section of the merged config.

    ``preflight/defaults.toml`` is the only source of the numbers; there are no fallback copies in the
    checks, so a missing section is an error that names it rather than a silently different default.
    """
    section = thresholds.get(name)
    if not isinstance(section, dict):
        raise ThresholdsError("thresholds have no [%s] section (preflight/defaults.toml is the source of every "
                              "threshold)" % name)
    return section


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], limit: int, timeout: float) -> List[Any]:
    """Run fn over items with at most ``limit`` at once; an item not done by the deadline yields TimeoutError.

    ``limit`` worker threads take the items in order (an item not started by the deadline is not started):
    a thread per item, most of them waiting for a slot, was 1,000 threads to connect 1,000 hosts 32 at a
    time. Daemon threads, not an executor: a thread stuck in a C call (DNS, a dead socket) must not block exit.
    """
    results: List[Any] = [TimeoutError(f"no answer within {timeout:.0f}s")] * len(items)
    deadline = time.monotonic() + timeout
    todo = iter(enumerate(items))
    take = threading.Lock()

    def work() -> None:
        while time.monotonic() < deadline:
            with take:
                i, item = next(todo, (-1, None))
            if i < 0:
                return
            try:
                results[i] = fn(item)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes that item's result
                results[i] = exc

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(limit, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return list(results)


# --- host side -------------------------------------------------------------------------------

@dataclass
class Cmd:
    """Result of a bounded host-side command. rc 127: not installed; rc 124: timed out."""

    rc: int
    out: str
    err: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.rc == 0


# The agent's own code (a zip of this package) when running under the agent; None on the coordinator.
AGENT_CODE: Optional[bytes] = None

# Every child process a check starts, so the agent can kill them all on timeout, Ctrl-C or a dropped channel.
LIVE: "set[subprocess.Popen[bytes]]" = set()


def spawn(argv: Sequence[str], env: Optional[Dict[str, str]] = None, stdin: Any = subprocess.DEVNULL,
          stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE,
          cwd: Optional[str] = None) -> "subprocess.Popen[bytes]":
    """Start a long-lived child (iperf3 server, worker) in its own process group, tracked for cleanup."""
    full_env = dict(os.environ)
    full_env.update({"LC_ALL": "C", "LANG": "C"})
    if env:
        full_env.update(env)
    proc = subprocess.Popen(list(argv), stdin=stdin, stdout=stdout, stderr=stderr, env=full_env, cwd=cwd,
                            start_new_session=True)
    LIVE.add(proc)
    return proc


def stop(proc: "subprocess.Popen[bytes]", grace: float = 2.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after grace seconds, and forget it."""
    import signal
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    LIVE.discard(proc)


def kill_all() -> None:
    for proc in list(LIVE):
        stop(proc, grace=0.5)


def sh(argv: Sequence[str], timeout: float = 10.0, env: Optional[Dict[str, str]] = None,
       input_text: Optional[str] = None, cwd: Optional[str] = None) -> Cmd:
    """Run argv (never a shell string) with a deadline, C locale, stdout/stderr captured concurrently."""
    start = time.monotonic()
    try:
        proc = spawn(argv, env=env, cwd=cwd,
                     stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL)
    except FileNotFoundError:
        return Cmd(127, "", "%s: command not found" % argv[0], 0.0)
    except PermissionError as exc:
        return Cmd(126, "", "%s: %s" % (argv[0], exc), 0.0)
    try:
        out, err = proc.communicate(input_text.encode() if input_text is not None else None, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        stop(proc, grace=0)
        out, err = proc.communicate()
        rc = 124
        err = err + ("\n%s: timed out after %.0fs" % (argv[0], timeout)).encode()
    finally:
        if proc.poll() is None:  # an exception (agent deadline, SIGTERM) interrupted communicate()
            stop(proc, grace=0)
        LIVE.discard(proc)
    return Cmd(rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - start)


class _Forked:
    """A forked child seen as much of a Popen as stop() and LIVE need (pid, poll, wait)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def forked_child_stdio(stdin_fd: int, stdout_fd: int, stderr_fd: int, session: bool = False) -> tuple:
    """In a child just forked: its own process group (session=True: its own session), these descriptors as its
    0/1/2 and no other of the parent's, default handlers for the signals the agent catches, and new sys.std*
    objects. Returns the old stream objects: the caller keeps them until os._exit, because freeing one takes its
    lock, which a thread that did not survive the fork may hold (a worker's lifeline thread, blocked in read)."""
    import signal
    import sys
    if session:
        os.setsid()
    else:
        os.setpgid(0, 0)
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.closerange(3, 65536)  # the parent's channel, and its other children's pipes and lifelines
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    held = (sys.stdin, sys.stdout, sys.stderr)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    return held


def fork_python(script: str, timeout: float = 10.0) -> Cmd:
    """Run a Python script in a forked child of this process, like ``sh([sys.executable, "-c", script])``
    but inheriting what this process already imported: after the python check imported torch in the same
    worker, ds_report's DeepSpeed probe skips a second torch import (1.5-3 s a host). Own process group,
    a deadline, stdout/stderr read concurrently, tracked in LIVE like a spawned child."""
    import selectors
    import sys
    start = time.monotonic()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        rc = 1
        try:
            held = forked_child_stdio(os.open(os.devnull, os.O_RDONLY), out_w, err_w)  # noqa: F841
            exec(compile(script, "<forked>", "exec"), {"__name__": "__main__"})
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc)
    os.close(out_w)
    os.close(err_w)
    child = _Forked(pid)
    LIVE.add(child)  # type: ignore[arg-type]  # stop() and kill_all() need only pid, poll and wait
    chunks: Dict[int, List[bytes]] = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    code: Optional[int] = None
    try:
        deadline = start + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(min(left, 1.0)):
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
        if not sel.get_map():
            try:
                code = child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
    finally:
        if code is None or child.poll() is None:
            stop(child, grace=0)  # type: ignore[arg-type]
        LIVE.discard(child)  # type: ignore[arg-type]
        sel.close()
        os.close(out_r)
        os.close(err_r)
    err = b"".join(chunks[err_r])
    if code is None:
        code = 124
        err += b"\nforked python: timed out after %.0fs" % timeout
    return Cmd(code, b"".join(chunks[out_r]).decode(errors="replace"), err.decode(errors="replace"),
               time.monotonic() - start)


class NVMLUnavailable(Exception):
    """NVML could not be opened; the message is the fact to record, ``module`` the nvidia-ml-py version if any."""

    def __init__(self, message: str, module: Optional[str] = None):
        super().__init__(message)
        self.module = module


@contextlib.contextmanager
def nvml_session() -> Iterator[Any]:
    """Import nvidia-ml-py and initialise NVML for the block, shutting it down afterwards.

    Raises NVMLUnavailable (import or nvmlInit failed: no driver, version mismatch) before the block runs.
    """
    try:
        import pynvml  # nvidia-ml-py
    except Exception as exc:  # noqa: BLE001 - a missing/broken module is a fact
        raise NVMLUnavailable("cannot import pynvml (nvidia-ml-py): %s" % exc) from None
    module = getattr(pynvml, "__version__", "unknown")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        raise NVMLUnavailable("nvmlInit: %s" % (str(exc) or type(exc).__name__), module) from None
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def as_str(value: Any) -> str:
    """NVML returns bytes from some nvidia-ml-py versions and str from others."""
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_evidence(torch_cuda: Optional[str] = None) -> List[str]:
    """Why this host should have working NVIDIA GPUs, whatever the driver says: the reasons found, or [].

    A missing or broken driver on such a host is a FAIL, not a "CPU host" SKIP. Evidence: device nodes
    (/dev/nvidia0), an NVIDIA display/3D controller on the PCI bus (lspci -mm -n: vendor 10de, class 03xx), or
    the job's torch being a CUDA build (torch.version.cuda, or a "+cu124"-style wheel version).
    """
    import glob
    import sys
    reasons: List[str] = []
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes:
        reasons.append("%s exists" % nodes[0])
    lspci = sh(["lspci", "-mm", "-n"], timeout=5.0)
    if lspci.ok:
        for line in lspci.out.splitlines():
            parts = [x.strip('"') for x in line.split('"') if x.strip()]
            # slot "class" "vendor" "device" ...: class 0300 VGA, 0302 3D controller; vendor 10de NVIDIA
            if len(parts) >= 3 and parts[1].startswith("03") and parts[2].lower() == "10de":
                reasons.append("lspci shows an NVIDIA display/3D controller at %s" % parts[0])
                break
    if torch_cuda is None:
        torch = sys.modules.get("torch")  # imported by the python/driver_cuda checks in this agent, if at all
        torch_cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    if torch_cuda:
        reasons.append("the job's torch is a CUDA %s build" % torch_cuda)
    return reasons


def gpus_expected(facts: Dict[str, Any], configured: bool) -> Tuple[bool, str]:
    """(expected, why) for the driver_cuda and gpu verdicts: the coordinator's per-host param, the [gpu]
    gpus_expected threshold, or the host's own evidence (``gpu_evidence``)."""
    if facts.get("gpus_expected") is not None:
        return bool(facts["gpus_expected"]), "the coordinator expects GPUs on this host"
    if configured:
        return True, "gpus_expected = true in [gpu]"
    evidence = facts.get("gpu_evidence") or []
    if evidence:
        return True, "GPUs are expected: " + "; ".join(str(e) for e in evidence)
    return False, "no sign of NVIDIA GPUs (no /dev/nvidia*, no NVIDIA PCI device, torch is not a CUDA build)"


def read_text(path: str, default: Optional[str] = None) -> Optional[str]:
    """Read a small /proc or /sys file; None (or default) when absent or unreadable."""
    try:
        with open(path, "r", errors="replace") as fh:
            return fh.read()
    except OSError:
        return default


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


@runtime_checkable
class ClusterView(Protocol):
    """What a cluster check's ``coordinate(cluster)`` receives; the coordinator's ``runner.Cluster`` is one.

    hosts: reachable hosts; all_hosts: every host of the hostfile, in order; master: the first host.
    facts: {host name: {check name: facts}} from the host checks (and "ssh"); options: run options the checks
    read (nvme_paths, master_port, deepspeed_config, ...); thresholds: the merged config (read it with
    ``limits``); parallel: the fan-out limit. ``call``/``call_all``/``start`` run a host-side function
    ``"module.func"`` of this package through the agent on a host.
    """

    hosts: List[Any]
    all_hosts: List[Any]
    master: Any
    world_size: int
    facts: Dict[str, Dict[str, Any]]
    options: Dict[str, Any]
    thresholds: Dict[str, Dict[str, Any]]
    parallel: int
    local: bool
    progress: Any

    def address(self, host: str) -> str: ...

    def call(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any: ...

    def call_all(self, func: str, params_by_host: Dict[str, Dict[str, Any]], timeout: float) -> Dict[str, Any]: ...

    def start(self, host: str, func: str, params: Dict[str, Any], timeout: float) -> Any: ...


Evaluation = Union[Outcome, Dict[str, Outcome]]


class CheckModule(Protocol):
    """A check: one module (or subpackage) of this package, listed in ``ORDER`` in ``__init__``.

    NAME: stable lowercase id used in JSON, JUnit and ``preflight list``; DESCRIPTION: one line;
    SCOPE: one of ``SCOPES``; DEFAULT: runs without ``--checks``. A "host" check also has ``collect(ctx)``,
    a "cluster" check ``coordinate(cluster)``. ``evaluate`` is pure: recorded facts in, outcome(s) out.
    """

    NAME: str
    DESCRIPTION: str
    SCOPE: str
    DEFAULT: bool

    def evaluate(self, facts: Dict[str, Any], thresholds: Dict[str, Dict[str, Any]]) -> Evaluation: ...


def validate_check_module(module: Any) -> None:
    """Raise TypeError naming the module and what it lacks, if it does not satisfy ``CheckModule``."""
    where = getattr(module, "__name__", repr(module))
    problems = []
    for attr, kind in (("NAME", str), ("DESCRIPTION", str), ("SCOPE", str), ("DEFAULT", bool)):
        if not isinstance(getattr(module, attr, None), kind):
            problems.append("%s must be a %s" % (attr, kind.__name__))
    scope = getattr(module, "SCOPE", None)
    if isinstance(scope, str) and scope not in SCOPES:
        problems.append("SCOPE %r is not one of %s" % (scope, ", ".join(SCOPES)))
    needs = ["evaluate"] + {"host": ["collect"], "cluster": ["coordinate"]}.get(scope or "", [])
    for fn in needs:
        if not callable(getattr(module, fn, None)):
            problems.append("SCOPE %r needs a function %s()" % (scope, fn))
    if problems:
        raise TypeError("check module %s: %s" % (where, "; ".join(problems)))
