"""The rehearsal's host side: the tiny training script every rank runs, and the launch supervisor on the launch host.

``preflight rehearse`` (preflight/rehearse.py) writes this file's source to the launch directory of every host and
runs DeepSpeed's launcher with it exactly as the job's script, e.g. (the launcher appends ``--local_rank=N``)::

    deepspeed --hostfile hostfile --launcher pdsh preflight_rehearse.py --deepspeed_config /shared/ds.json \
        --preflight-run preflight-rehearse-0123456789ab --steps 2 --model-params 1000000 --init-timeout 60 ...

Each rank prints one line per phase on its stdout, which pdsh carries back to the launch host (as "node02: ...")
and the coordinator's SSH channel to the coordinator::

    @@PF-REHEARSE {"run": "preflight-rehearse-0123...", "event": "init", "rank": 1, "local_rank": 0, "host": "node02",
                   "t": 14.2, "s": 0.41, "backend": "gloo"}

Events: start (the environment and the address gloo will advertise), imported, init_begin, init (the time of
deepspeed.init_distributed, i.e. init_process_group), ops (DeepSpeed ops loaded or JIT-built, with their time),
initialize (deepspeed.initialize), step (each optimizer step), done (peak memory), error (phase, exception,
traceback). A rank ends itself ``--lifetime`` seconds after it started, whatever else fails.

As ``--supervise`` it runs the launcher on the launch host instead: its stdin is the rehearsal's lifeline, and when
that closes before the launcher ends (the coordinator stopped it, was interrupted or killed) it kills the launcher
and every process of the run on every host (pdsh, then pkill by the run's token).

Standard library only at import, Python 3.9: torch and deepspeed are imported by the rank, and timed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

TAG = "@@PF-REHEARSE"
# One event is one write(2) of at most PIPE_BUF bytes: the ranks of a host share the launcher's stdout pipe, and
# a write up to PIPE_BUF is never interleaved with another's. A longer event (a deep traceback) loses the middle
# of its traceback, keeping the start and the end (where the cause is).
MAX_EVENT_BYTES = 4000
LOOPBACK_FALLBACK = "127.0.0.1"  # what gloo advertises when the hostname resolves to no local address
SIOCGIFADDR = 0x8915


# --------------------------------------------------------------------------------------------- events

def _write_line(data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(1, view)
        except InterruptedError:
            continue
        except OSError:  # nobody reads our stdout any more (the launcher is gone): nothing to report to
            return
        view = view[n:]


def event_line(payload: Dict[str, Any], limit: int = MAX_EVENT_BYTES) -> bytes:
    """The event as one line of at most ``limit`` bytes: a long traceback keeps its first and last lines."""
    line = (TAG + " " + json.dumps(payload, default=str) + "\n").encode()
    trace = payload.get("traceback")
    while len(line) > limit and isinstance(trace, str) and len(trace) > 200:
        keep = max(100, len(trace) - (len(line) - limit) - 40)
        trace = trace[:keep // 3] + "\n[...]\n" + trace[-(keep - keep // 3):]
        payload = dict(payload, traceback=trace)
        line = (TAG + " " + json.dumps(payload, default=str) + "\n").encode()
    if len(line) > limit:  # a huge message: cut the fields, not the line
        payload = {k: (v[:300] if isinstance(v, str) else v) for k, v in payload.items() if k != "traceback"}
        line = (TAG + " " + json.dumps(payload, default=str)[:limit - len(TAG) - 3] + "\n").encode()
    return line


class Reporter:
    """Writes this process's events; every event carries the run, the rank's identity and its time since start."""

    def __init__(self, run: str, ident: Dict[str, Any]) -> None:
        self.run = run
        self.ident = ident
        self.started = time.monotonic()
        self.lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        payload: Dict[str, Any] = {"run": self.run, "event": event}
        payload.update(self.ident)
        payload["t"] = round(time.monotonic() - self.started, 3)
        payload.update(fields)
        with self.lock:
            _write_line(event_line(payload))


# ------------------------------------------------------------------------------------ what gloo advertises

def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR), None when it has none or does not exist."""
    import fcntl
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def bindable(address: str, family: int) -> bool:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


def gloo_address(env: Dict[str, str], hostname: str) -> Dict[str, Any]:
    """The address this rank's gloo device will advertise to the others, found as torch does it.

    GLOO_SOCKET_IFNAME: its first interface's address. Without it, torch's ProcessGroupGloo::createDefaultDevice
    uses the hostname when it resolves to an address this host can bind (getaddrinfo, first bindable: gloo's own
    lookup), else the loopback address. A loopback address (a Debian-style ``127.0.1.1 HOSTNAME`` line in
    /etc/hosts, or the fallback) cannot be reached from another host: connectFullMesh fails there."""
    ifname = env.get("GLOO_SOCKET_IFNAME", "")
    if ifname:
        first = ifname.split(",")[0]
        address = interface_address(first)
        return {"address": address, "source": f"GLOO_SOCKET_IFNAME={ifname}",
                "loopback": bool(address and address.startswith("127.")) or first == "lo"}
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError as exc:
        infos = []
        why = f"the hostname {hostname} does not resolve ({exc})"
    else:
        why = f"the hostname {hostname} resolves to no address of this host"
    resolved = [str(info[4][0]) for info in infos]
    for family, _, _, _, sockaddr in infos:
        if bindable(str(sockaddr[0]), family):
            address = str(sockaddr[0])
            return {"address": address, "source": f"hostname {hostname} resolves to {address}",
                    "resolved": resolved, "loopback": address.startswith("127.") or address == "::1"}
    return {"address": LOOPBACK_FALLBACK, "source": why + ": gloo falls back to the loopback address",
            "resolved": resolved, "loopback": True}


# ---------------------------------------------------------------------------------------------- the rank

def _rank_identity() -> Dict[str, Any]:
    def number(name: str) -> Optional[int]:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None
    return {"rank": number("RANK"), "local_rank": number("LOCAL_RANK"), "world_size": number("WORLD_SIZE"),
            "host": socket.gethostname(), "pid": os.getpid()}


def _descendants(pid: int, proc_root: str = "/proc") -> List[int]:
    """Every live process below ``pid`` (a JIT build's ninja and compilers), children before their parents' end."""
    parents: Dict[int, List[int]] = {}
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, name, "stat")) as fh:
                stat = fh.read()
        except OSError:
            continue
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _watchdog(rep: Reporter, lifetime: float, here: str, ops: "OpLog") -> None:
    """End this rank ``lifetime`` seconds after its start, or as soon as its launch directory is gone (the run was
    cleaned up while this rank was still starting, out of reach of the clean-up's pkill), whatever it is waiting
    on. Before it ends it stops its own JIT build and removes the locks it holds: a rank never leaves a lock that
    every later job on the host would wait on forever."""
    deadline = time.monotonic() + lifetime

    def expire() -> None:
        while time.monotonic() < deadline and os.path.isdir(here):
            time.sleep(1.0)
        if time.monotonic() >= deadline:
            rep.emit("deadline", lifetime=lifetime)
        ops.abandon()
        os._exit(124)
    threading.Thread(target=expire, daemon=True).start()


def layer_width(params: float, layers: int) -> int:
    """The width of ``layers`` square Linear layers holding about ``params`` parameters, a multiple of 8."""
    width = int(round((max(params, 64.0 * layers) / layers) ** 0.5 / 8.0)) * 8
    return max(8, width)


LOCKS_DIR = "locks"  # in a host's launch directory: one file per torch extension lock a rank of the run holds
STALE_MARGIN_S = 60.0  # a waited-on lock older than this rank's start by this much is not this run's
STALE_CHECKS = 3  # looks, 1 s apart, that find no process holding it, before it counts as stale
# The clean-up's shell lines for one launch directory $d (the coordinator's and the supervisor's): for each lock a
# rank of the run recorded (and still held when it died), kill what still builds in its directory (ninja and the
# compilers outlive a killed rank: their working directory is the build directory, matched by identity, stat's
# device:inode, as a container's process names another directory by the same path), then remove the lock. Nobody
# else's lock is touched: only the paths our ranks wrote, each the lock torch's FileBaton made for them, and only
# this host's records (named "<host>-<pid>-<n>": a --workdir shared by the hosts holds every host's). A record
# named *.try was written just before the rank tried to take the lock (it was killed before it knew whether it got
# it): its lock goes only when it is not older than the record, i.e. when that try made it.
RELEASE_LOCKS = ('h=$(uname -n); ls "$d/' + LOCKS_DIR + '" 2>/dev/null | while read -r n; do '
                 'case "$n" in "$h"-*) ;; *) continue;; esac; r="$d/' + LOCKS_DIR + '/$n"; '
                 '[ -f "$r" ] || continue; l=$(cat "$r"); b=${l%/lock}; [ "$b/lock" = "$l" ] || continue; '
                 'case "$n" in *.try) [ "$l" -ot "$r" ] && continue;; esac; '
                 'id=$(stat -c %d:%i "$b" 2>/dev/null) || continue; '
                 'for i in 1 2; do for p in /proc/[0-9]*; do '
                 'if [ "$(stat -L -c %d:%i "$p/cwd" 2>/dev/null)" = "$id" ]; then kill -9 "${p#/proc/}" 2>/dev/null; '
                 'fi; done; done; rm -f -- "$l"; done')


class StaleLock(RuntimeError):
    """The torch extension lock this rank waits on is held by no process on this host and predates the run."""

    def __init__(self, op: Optional[str], path: str, age_s: float) -> None:
        super().__init__(f"stale torch extensions lock {path} ({age_s:.0f} s old): no process holds it, and every "
                         f"load of {op or 'the op'} waits on it forever (torch/utils/file_baton.py FileBaton.wait)")
        self.op, self.path, self.age_s = op, path, age_s


def lock_holders(path: str, proc_root: str = "/proc") -> List[int]:
    """The processes on this host that hold a torch extension lock: one with it open (torch's FileBaton keeps its
    descriptor until release) or working in its directory (ninja and the compilers). By identity (stat through the
    /proc links): a process of another mount namespace (a container) means another file by the same path."""
    def ident(p: str) -> Optional[Tuple[int, int]]:
        try:
            st = os.stat(p)
        except OSError:
            return None
        return st.st_dev, st.st_ino
    wanted = {i for i in (ident(path), ident(os.path.dirname(path))) if i is not None}
    found: List[int] = []
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if int(pid) == os.getpid():
            continue
        base = os.path.join(proc_root, pid)
        if ident(os.path.join(base, "cwd")) in wanted:
            found.append(int(pid))
            continue
        try:
            fds = os.listdir(os.path.join(base, "fd"))
        except OSError:
            continue
        if any(ident(os.path.join(base, "fd", fd)) in wanted for fd in fds):
            found.append(int(pid))
    return found


class OpLog:
    """DeepSpeed's op loads seen by this rank (name, JIT or pre-built, seconds), each announced as it begins: a rank
    stuck in a JIT build (minutes of compiling, a compiler waiting on a lock) is named with the op it builds.

    It also watches torch's build lock (torch/utils/file_baton.py): each lock this rank takes is recorded in the
    launch directory (``locks/``) until it releases it, so that the clean-up removes a lock whose rank was killed
    mid-build, and nobody else's; and a lock it waits on that no process holds and that predates the run is a
    ``StaleLock`` error, not a wait forever."""

    def __init__(self, rep: Reporter, record_dir: Optional[str] = None) -> None:
        self.rep = rep
        self.ops: List[Dict[str, Any]] = []
        self.current: Optional[str] = None
        self.record_dir = record_dir
        self.records: Dict[str, Optional[str]] = {}  # each lock this rank holds: its record file, if one was written
        self.taken = 0  # locks tried so far: each one's record file has its own number
        self.started_wall = time.time()
        # Held from before a lock is tried until it is recorded, and by abandon() for good: the watchdog never
        # abandons the rank between torch's O_EXCL create of a lock and its entry in ``records``.
        self.guard = threading.Lock()

    def _entry(self) -> Dict[str, Any]:
        return self.ops[-1] if self.ops and self.ops[-1]["name"] == self.current else {}

    def install(self) -> None:
        try:
            from deepspeed.ops.op_builder.builder import OpBuilder
        except Exception:  # another DeepSpeed layout: the rehearsal runs without the op log
            return
        log = self
        load, jit_load = OpBuilder.load, OpBuilder.jit_load

        def timed_load(builder: Any, *a: Any, **kw: Any) -> Any:
            name = getattr(builder, "NAME", type(builder).__name__)
            entry: Dict[str, Any] = {"name": name, "jit": False, "s": None,
                                     "build_var": getattr(builder, "BUILD_VAR", None)}
            log.ops.append(entry)
            log.current, started = name, time.monotonic()
            log.rep.emit("op_begin", op=name, build_var=entry["build_var"])
            try:
                return load(builder, *a, **kw)
            finally:
                entry["s"] = round(time.monotonic() - started, 3)
                log.current = None
                log.rep.emit("op_end", **entry)

        def timed_jit(builder: Any, *a: Any, **kw: Any) -> Any:
            # DeepSpeed loads a pre-built op by import and anything else through jit_load, which compiles it or
            # finds it in the torch extensions cache: cold when its build directory holds no library yet.
            entry = log._entry()
            entry["jit"] = True
            try:
                from torch.utils.cpp_extension import _get_build_directory
                build_dir = _get_build_directory(str(getattr(builder, "name", None) or entry.get("name")), False)
                entry["build_dir"] = build_dir
                entry["cold"] = not any(n.endswith(".so") for n in os.listdir(build_dir))
            except Exception:
                pass
            log.rep.emit("op_jit", op=entry.get("name"), build_dir=entry.get("build_dir"), cold=entry.get("cold"))
            return jit_load(builder, *a, **kw)

        OpBuilder.load = timed_load
        OpBuilder.jit_load = timed_jit
        self._watch_locks()

    def _watch_locks(self) -> None:
        try:
            from torch.utils.file_baton import FileBaton
        except Exception:
            return
        log = self
        try_acquire, release = FileBaton.try_acquire, FileBaton.release

        def acquire(baton: Any) -> Any:
            return log._try(str(baton.lock_file_path), lambda: try_acquire(baton))

        def let_go(baton: Any) -> None:
            try:
                release(baton)
            finally:
                log._released(str(baton.lock_file_path))

        def wait(baton: Any) -> None:
            log._wait(str(baton.lock_file_path), float(getattr(baton, "wait_seconds", 0.1) or 0.1))

        baton_class: Any = FileBaton  # torch's stubs type these as FileBaton's own methods
        baton_class.try_acquire = acquire
        baton_class.release = let_go
        baton_class.wait = wait

    def _try(self, path: str, take: Callable[[], Any]) -> Any:
        """Take a lock through ``take`` (torch's try_acquire: an O_EXCL create) with its record written first, as
        ``<host>-<pid>-<n>.try``: a rank killed (the clean-up's pkill -KILL) right after the create still leaves
        the path to the clean-up. Taken, the record loses its ``.try``; not taken, it goes."""
        with self.guard:
            self.taken += 1
            record = self._write_record(f"{socket.gethostname()}-{os.getpid()}-{self.taken}", path)
            got = take()
            if not got:
                self._drop(record)
                return got
            if record:
                try:
                    os.rename(record + ".try", record)
                except OSError:
                    pass
            self.records[path] = record
        self._entry()["acquired"] = True
        self.rep.emit("lock", op=self.current, path=path)
        return got

    def _write_record(self, name: str, path: str) -> Optional[str]:
        """``records/<name>.try`` naming ``path``, written whole (a rename) before the try; None when the launch
        directory is gone (never made again here: the clean-up removed it)."""
        if not self.record_dir:
            return None
        record = os.path.join(self.record_dir, name)
        try:
            try:
                os.mkdir(self.record_dir)
            except FileExistsError:  # another rank of this host made it
                pass
            with open(record + ".new", "w") as fh:
                fh.write(path)
            os.rename(record + ".new", record + ".try")
        except OSError:
            return None
        return record

    @staticmethod
    def _drop(record: Optional[str]) -> None:
        for name in ((record, record + ".try") if record else ()):
            try:
                os.unlink(name)
            except OSError:
                pass

    def _released(self, path: str) -> None:
        if path in self.records:
            self._drop(self.records.pop(path))

    def abandon(self) -> None:
        """Stop this rank's build (ninja and the compilers, which would write on) and remove the locks it holds.
        It keeps the guard: no lock is taken after it, and none is half-taken while it runs."""
        self.guard.acquire()
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in list(self.records):
            try:
                os.unlink(path)
            except OSError:
                pass
            self._released(path)

    def _wait(self, path: str, step: float) -> None:
        """torch's FileBaton.wait (poll until the lock is gone), which also looks, once a second, for a process
        that holds the lock: none for STALE_CHECKS looks, on a lock from before this run, is a StaleLock."""
        entry = self._entry()
        entry["waited"] = True
        self.rep.emit("lock_wait", op=self.current, path=path)
        quiet, looked = 0, 0.0
        while os.path.exists(path):
            time.sleep(step)
            if time.monotonic() - looked < 1.0:
                continue
            looked = time.monotonic()
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                continue
            if mtime < self.started_wall - STALE_MARGIN_S and not lock_holders(path):
                quiet += 1
            else:
                quiet = 0
            if quiet >= STALE_CHECKS:
                raise StaleLock(self.current, path, time.time() - mtime)


def _dtype(torch: Any, config: Dict[str, Any]) -> Any:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return torch.float32


def _peak_memory(torch: Any, accelerator: Any) -> Dict[str, Any]:
    import resource
    out: Dict[str, Any] = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}
    try:
        if accelerator is not None and accelerator.device_name() != "cpu":
            out["peak_device_mib"] = round(accelerator.max_memory_allocated() / 2.0 ** 20, 1)
    except Exception:
        pass
    return out


def rank_main(argv: Sequence[str]) -> int:
    args = _rank_args(argv)
    rep = Reporter(args.preflight_run, _rank_identity())
    here = os.path.dirname(os.path.abspath(__file__))  # the launch directory on this host
    ops = OpLog(rep, os.path.join(here, LOCKS_DIR))
    _watchdog(rep, args.lifetime, here, ops)
    env = dict(os.environ)
    _emit_start(rep, env)
    # torch's inductor cache (/tmp/torchinductor_USER, made at import) goes into the launch directory, which the
    # rehearsal removes: nothing of it stays on the host. The job's own environment is left as it is otherwise.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchinductor"))
    # A JIT build's compiler writes its temporary files (cc*.s) to TMPDIR, and one killed with the rank leaves them:
    # into the launch directory too, which the clean-up removes.
    os.makedirs(os.path.join(here, "tmp"), exist_ok=True)
    os.environ["TMPDIR"] = os.path.join(here, "tmp")
    phase = "import"
    torch: Any = None
    accelerator: Any = None
    try:
        started = time.monotonic()
        torch = importlib.import_module("torch")
        deepspeed: Any = importlib.import_module("deepspeed")
        accelerator = importlib.import_module("deepspeed.accelerator").get_accelerator()
        backend = accelerator.communication_backend_name()
        imported = {"s": round(time.monotonic() - started, 3), "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "accelerator": accelerator.device_name(), "backend": backend}
        rep.emit("imported", **imported)
        ops.install()
        phase = "config"
        with open(args.deepspeed_config) as fh:
            config = json.load(fh)
        phase = "init"
        _init_distributed(rep, torch, deepspeed, backend, env, args.init_timeout, args.build_budget, ops)
        phase = "initialize"
        engine, width, micro, gas = _initialize(rep, torch, deepspeed, args, config)
        phase = "step"
        _train_steps(rep, torch, engine, _dtype(torch, config), width, micro, gas, args.steps)
        phase = "done"
        rep.emit("done", ops=ops.ops, **_peak_memory(torch, accelerator))
        code = 0
    except BaseException as exc:  # every failure is this rank's report; SystemExit and Ctrl-C included
        rep.emit("error", **_error_detail(exc, phase, ops, torch, accelerator))
        code = 1
    # No interpreter shutdown: gloo's and DeepSpeed's threads could hold it, and a rank must end when it is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_args(argv: Sequence[str]) -> argparse.Namespace:
    """The rank's options; the job's own ones (which the launcher may pass along) are ignored."""
    parser = argparse.ArgumentParser(prog="preflight_rehearse.py")
    parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher appends it
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--preflight-run", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model-params", type=float, default=1e6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--init-timeout", type=float, default=60.0)
    parser.add_argument("--lifetime", type=float, default=600.0)
    parser.add_argument("--build-budget", type=float, default=0.0)
    args, _unknown = parser.parse_known_args(list(argv))
    return args


def _emit_start(rep: Reporter, env: Dict[str, str]) -> None:
    """The start event: this rank's Python and the launch variables it was given, before torch is imported."""
    watched = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
               "NCCL_IB_HCA", "NCCL_DEBUG", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")
    rep.emit("start", python=sys.executable, version=sys.version.split()[0], cwd=os.getcwd(),
             env={k: env[k] for k in watched if k in env})


def _init_distributed(rep: Reporter, torch: Any, deepspeed: Any, backend: str, env: Dict[str, str],
                      init_timeout: float, build_budget: float = 0.0, ops: Optional["OpLog"] = None) -> None:
    """deepspeed.init_distributed (init_process_group), timed; init_begin first says which address gloo will
    advertise, so that a rank stuck in it still shows where it waits. torch's own timeout is the init timeout plus
    the JIT build budget: DeepSpeed builds its comm op (deepspeed_shm_comm on CPUs) before init_process_group, so a
    rank whose host builds slower waits for the others; the coordinator applies the init timeout itself, to the time
    no rank was building."""
    advertised = gloo_address(env, socket.gethostname()) if backend == "gloo" else None
    rep.emit("init_begin", backend=backend, advertise=advertised, init_timeout=init_timeout)
    import datetime
    loaded = len(ops.ops) if ops is not None else 0
    started = time.monotonic()
    deepspeed.init_distributed(dist_backend=backend,
                               timeout=datetime.timedelta(seconds=init_timeout + build_budget))
    took = time.monotonic() - started
    # The ops loaded inside it (the comm op, JIT-built on a cold cache) are reported apart: init_s is the rendezvous.
    built = sum(float(e.get("s") or 0) for e in (ops.ops if ops is not None else [])[loaded:])
    rep.emit("init", s=round(took - built, 3), build_s=round(built, 3) if built else None, backend=backend,
             world_size=torch.distributed.get_world_size())


def _initialize(rep: Reporter, torch: Any, deepspeed: Any, args: argparse.Namespace,
                config: Dict[str, Any]) -> Tuple[Any, int, int, int]:
    """(engine, layer width, micro batch, gradient accumulation steps): deepspeed.initialize, timed, with the job's
    config on a stack of Linear layers of about --model-params parameters (and a stand-in optimizer when the config
    names none)."""
    width = layer_width(args.model_params, args.layers)
    layers: List[Any] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them away
    extra: Dict[str, Any] = {}
    if "optimizer" not in config:  # the job brings its own optimizer: a plain AdamW stands in for it
        extra["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.monotonic()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), **extra)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rep.emit("initialize", s=round(time.monotonic() - started, 3), zero_stage=engine.zero_optimization_stage(),
             micro_batch=micro, gradient_accumulation=gas, train_batch=engine.train_batch_size(),
             width=width, layers=args.layers, params=params)
    return engine, width, micro, gas


def _train_steps(rep: Reporter, torch: Any, engine: Any, dtype: Any, width: int, micro: int, gas: int,
                 steps: int) -> None:
    """`steps` optimizer steps on random batches (forward, backward, step per micro batch), each timed."""
    device = engine.device
    for index in range(steps):
        started = time.monotonic()
        for _ in range(gas):
            x = torch.randn(micro, width, dtype=dtype, device=device)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        rep.emit("step", index=index, s=round(time.monotonic() - started, 4), loss=float(loss.item()))


def _error_detail(exc: BaseException, phase: str, ops: OpLog, torch: Any, accelerator: Any) -> Dict[str, Any]:
    """The error event of a failed rank: the phase, the exception and its traceback, the DeepSpeed op being loaded
    (and those loaded), and the peak memory once torch is imported. Called while `exc` is being handled."""
    detail: Dict[str, Any] = {"phase": phase, "type": type(exc).__name__, "message": str(exc)[:1500],
                              "traceback": traceback.format_exc()}
    if ops.current:
        detail["op"] = ops.current
    if isinstance(exc, StaleLock):
        detail["stale_lock"] = {"op": exc.op, "path": exc.path, "age_s": round(exc.age_s, 1)}
    if ops.ops:
        detail["ops"] = ops.ops
    if torch is not None:
        detail.update(_peak_memory(torch, accelerator))
    return detail


# ---------------------------------------------------------------------------------------- the supervisor

def env_files(cwd: str) -> List[Dict[str, Any]]:
    """The .deepspeed_env files DeepSpeed's runner reads (deepspeed/launcher/runner.py: DS_ENV_FILE, default
    ".deepspeed_env", in ~ then in the current directory), with their keys and the lines its
    ``key, val = line.split('=', 1)`` would raise on."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    found: List[Dict[str, Any]] = []
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as fh:
                lines = fh.readlines()
        except OSError as exc:
            found.append({"path": path, "error": str(exc)})
            continue
        keys = [line.split("=", 1)[0].strip() for line in lines if "=" in line]
        bad = [i for i, line in enumerate(lines, 1) if "=" not in line]
        found.append({"path": path, "keys": keys, "bad_lines": bad})
    return found


def _which(name: str) -> Optional[str]:
    import shutil
    return shutil.which(name)


TOKEN_PREFIX = "preflight-rehearse-"  # the run's token: TOKEN_PREFIX + 12 hex digits, in every rank's argv
SUPERVISOR_PREFIX = "preflight-supervise-"  # the supervisor's own mark: its reap by the run's token spares it
LAUNCH_FILE = "launch.json"  # in the launch directory: what the supervisor runs (its argv holds no token)


def pattern_of(token: str) -> str:
    """pkill -f's pattern for a token: its first letter bracketed, so that it never matches the shell running it."""
    return f"[{token[0]}]{token[1:]}"


def unmatched(path: str, token: str) -> str:
    """``path`` for a shell line, quoted so that the line never holds ``token`` literally (pkill -f of the token
    on the same host must not match the shell that runs the line); the shell joins the pieces back."""
    at = path.index(token)
    cut = at + len(token) // 2
    head, tail = (part.replace("'", "'\\''") for part in (path[:cut], path[cut:]))
    return f"'{head}''{tail}'"


def reap_everywhere(hosts: Sequence[str], token: str, directory: str, timeout: float) -> Dict[str, Any]:
    """Kill the run's processes and remove its launch directory on every host (pdsh, as the launcher reached them)
    and here: pkill -KILL -f of the run's token, the torch extension locks its ranks still held (RELEASE_LOCKS),
    then rm -rf of the directory."""
    out: Dict[str, Any] = {}
    pattern = pattern_of(token)
    line = f"pkill -KILL -f '{pattern}'; d={unmatched(directory, token)}; {RELEASE_LOCKS}; rm -rf -- \"$d\""
    if hosts and _which("pdsh"):
        try:
            proc = subprocess.run(["pdsh", "-S", "-w", ",".join(hosts), line], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                                  env=dict(os.environ, PDSH_RCMD_TYPE="ssh"))
            out["pdsh_rc"] = proc.returncode
        except (OSError, subprocess.SubprocessError) as exc:
            out["pdsh_error"] = str(exc)
    try:
        subprocess.run(["sh", "-c", line], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def script_interpreter(path: str) -> Optional[str]:
    """The Python a launcher script runs: its ``#!`` line (``#!/venv/bin/python3``, or ``#!/usr/bin/env python3``
    looked up on PATH); None when it is not a Python script (a shell wrapper such as a pyenv shim)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(512).decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
        if words and "python" in os.path.basename(words[0]):
            return _which(words[0])
        return None
    return words[0] if words and "python" in os.path.basename(words[0]) else None


def resolve_launcher(argv: Sequence[str], beside: bool) -> Dict[str, Any]:
    """Which launcher runs and with which Python: with ``beside``, the ``deepspeed`` next to this interpreter (the
    job's --python) when there is one, else the one on PATH. {"launcher_path", "launcher_from": "beside", "path" or
    "given", "launcher_python", "python": this interpreter, "same_python"}."""
    python = sys.executable
    out: Dict[str, Any] = {"python": python, "launcher_path": None, "launcher_from": "given", "launcher_python": None}
    if not argv:
        return out
    first = argv[0]
    candidate = os.path.join(os.path.dirname(python), "deepspeed")
    if beside and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        out.update(launcher_path=candidate, launcher_from="beside")
    else:
        out.update(launcher_path=_which(first), launcher_from="path" if beside else "given")
    path = out["launcher_path"]
    if path and "python" in os.path.basename(path):  # `PYTHON -m deepspeed.launcher.runner`
        out["launcher_python"] = path
    elif path:
        out["launcher_python"] = script_interpreter(path)
    if out["launcher_python"]:
        out["same_python"] = os.path.realpath(out["launcher_python"]) == os.path.realpath(python)
    return out


def supervise_main(argv: Sequence[str]) -> int:
    """Run the launcher of the launch directory's launch.json, as the job's own shell would; stdout carries its
    output and our events. When stdin closes (the coordinator is done, was interrupted or killed) or the lifetime
    passes: kill the launcher's session and reap the run everywhere, then exit."""
    with open(LAUNCH_FILE) as fh:
        spec = json.load(fh)
    launcher = [str(a) for a in spec["argv"]]
    token, hosts = str(spec["token"]), [str(h) for h in spec.get("hosts", [])]
    ident: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "role": "launcher"}
    rep = Reporter(token, ident)
    cwd = os.getcwd()
    found = resolve_launcher(launcher, bool(spec.get("beside")))
    if found.get("launcher_path") and found.get("launcher_from") == "beside":
        launcher[0] = str(found["launcher_path"])
    rep.emit("launcher", argv=launcher, cwd=cwd, env_files=env_files(cwd), pdsh=_which("pdsh"), **found)
    gone = threading.Event()

    def lifeline() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        gone.set()

    threading.Thread(target=lifeline, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: gone.set())
    deadline = time.monotonic() + float(spec.get("lifetime", 600))
    proc: Optional[subprocess.Popen] = None
    try:
        # Its own session: the launcher, pdsh and the ssh clients go with one killpg. stderr joins stdout, so the
        # coordinator reads the lines in the order they were written.
        proc = subprocess.Popen(launcher, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as exc:
        rep.emit("launcher_exit", rc=127, error=f"{launcher[0] if launcher else ''}: {exc.strerror}")
    while proc is not None and proc.poll() is None and not gone.is_set() and time.monotonic() < deadline:
        gone.wait(0.2)
    if proc is not None and proc.poll() is not None:
        rep.emit("launcher_exit", rc=proc.returncode)
    # Until the coordinator lets go (it has read everything), or the lifetime: then nothing of the run may stay.
    while not gone.is_set() and time.monotonic() < deadline:
        gone.wait(0.5)
    stopped = proc is not None and proc.poll() is None
    if stopped and proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    reaped = reap_everywhere(hosts, token, cwd, 30.0)
    if proc is not None:
        proc.wait()
    rep.emit("reaped", stopped=stopped, rc=proc.returncode if proc is not None else None, **reaped)
    return 0


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--supervise"]:
        return supervise_main(argv)
    return rank_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
