"""What DeepSpeed's JIT build of an op needs on a host, and what stops it: shared by ds_report (how many ops are
usable) and ds_config (the ops the job's config needs).

Host side, ``build_tools()`` reads what the build will use, as torch and DeepSpeed 0.19.8 look for it, e.g.::

    {"cuda_home": "/usr/local/cuda", "cuda_home_from": "nvcc on PATH", "nvcc": "13.0",
     "nvcc_path": "/usr/local/cuda/bin/nvcc", "cxx": "/usr/bin/c++", "cxx_name": "c++", "ds_skip_cuda_check": None}

from ``nvcc -V``'s ``Cuda compilation tools, release 13.0, V13.0.88``. ``blockers()`` is pure. Standard library only.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from .fixes import pip_fix, prebuild_phrase
from .outcome import Status
from .proc import sh

# The ops whose DeepSpeed 0.19.8 builder is a CUDAOpBuilder on the CUDA accelerator (deepspeed/ops/op_builder/*.py;
# cpu_adam, cpu_adagrad and cpu_lion come from op_builder/cpu/, CPUOpBuilders, even on CUDA:
# accelerator/cuda_accelerator.py, _lazy_init_class_dict). Used when the op table came from ds_report's text,
# which does not say; the API path asks each builder (isinstance CUDAOpBuilder).
CUDA_OPS = frozenset({
    "async_io", "cutlass_ops", "dc", "evoformer_attn", "fp_quantizer", "fused_adam", "fused_lamb", "fused_lion",
    "gds", "inference_core_ops", "quantizer", "ragged_device_ops", "ragged_ops", "random_ltd", "spatial_inference",
    "stochastic_transformer", "transformer", "transformer_inference",
})

_RELEASE = re.compile(r"release (\d+)\.(\d+)")


# --- host side -------------------------------------------------------------------------------

def find_cuda_home(environ: Mapping[str, str]) -> Dict[str, Optional[str]]:
    """torch.utils.cpp_extension._find_cuda_home (torch 2.x, cpp_extension.py:155-180) on Linux: $CUDA_HOME, else
    $CUDA_PATH, else the parent of the bin directory of nvcc on PATH, else /usr/local/cuda if it exists."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(var):
            return {"cuda_home": environ[var], "cuda_home_from": var}
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        return {"cuda_home": os.path.dirname(os.path.dirname(nvcc)), "cuda_home_from": "nvcc on PATH"}
    if os.path.exists("/usr/local/cuda"):
        return {"cuda_home": "/usr/local/cuda", "cuda_home_from": "/usr/local/cuda"}
    return {"cuda_home": None, "cuda_home_from": None}


def parse_nvcc_release(text: Optional[str]) -> Optional[str]:
    """'Cuda compilation tools, release 13.0, V13.0.88' -> '13.0' (major.minor, as DeepSpeed's
    installed_cuda_version reads it: op_builder/builder.py:58-60)."""
    m = _RELEASE.search(text or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def build_tools(timeout: float = 20.0) -> Dict[str, Any]:
    """What a JIT build on this host would use, in this process's environment (the agent's, as pdsh's ssh gives
    the ranks theirs): the CUDA toolkit and its nvcc, the C++ compiler, and DS_SKIP_CUDA_CHECK."""
    env = os.environ
    out: Dict[str, Any] = dict(find_cuda_home(env))
    out.update(nvcc=None, nvcc_path=None, nvcc_error=None)
    if out["cuda_home"]:
        # DeepSpeed runs CUDA_HOME/bin/nvcc -V (installed_cuda_version, builder.py:43-61), whatever is on PATH.
        out["nvcc_path"] = os.path.join(out["cuda_home"], "bin", "nvcc")
        if not os.path.exists(out["nvcc_path"]):
            out["nvcc_error"] = f"{out['nvcc_path']} does not exist"
        else:
            res = sh([out["nvcc_path"], "-V"], timeout=timeout)
            out["nvcc"] = parse_nvcc_release(res.out) if res.ok else None
            if out["nvcc"] is None:
                out["nvcc_error"] = f"rc={res.rc}: {(res.err or res.out).strip()}"[:300]
    # torch.utils.cpp_extension.get_cxx_compiler (cpp_extension.py:477-482): $CXX, else c++.
    out["cxx_name"] = env.get("CXX") or "c++"
    out["cxx"] = shutil.which(out["cxx_name"])
    out["ds_skip_cuda_check"] = env.get("DS_SKIP_CUDA_CHECK")
    return out


# --- pure ------------------------------------------------------------------------------------

class Blocker(NamedTuple):
    """Why a JIT build of an op will not succeed on a host (FAIL), or may not behave (WARN); the fix for it, and
    the cause in a few words (the same for every op it stops: "no nvcc")."""

    status: Status
    message: str
    fix: str
    short: str


def major(version: Optional[str]) -> Optional[int]:
    m = re.match(r"^\s*(\d+)", str(version or ""))
    return int(m.group(1)) if m else None


def is_cuda_op(name: str, entry: Mapping[str, Any]) -> bool:
    """The builder is a CUDAOpBuilder: the API's own answer when recorded, else the DeepSpeed 0.19.8 table."""
    if isinstance(entry.get("cuda"), bool):
        return bool(entry["cuda"])
    return name in CUDA_OPS


def needs_cuda(facts: Mapping[str, Any]) -> bool:
    """A CUDA op is built with nvcc where torch is a CUDA build. (DeepSpeed 0.19.8's jit_load builds it for the CPU
    when torch.cuda.is_available() is false, builder.py:579-580: a CUDA torch on a host without a usable GPU, which
    the gpu and driver_cuda checks fail on their own; ds_report does not initialise CUDA to ask.)"""
    return bool(facts.get("torch_cuda"))


def skip_cuda_check(facts: Mapping[str, Any], launch_env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Where DS_SKIP_CUDA_CHECK=1 comes from for a rank on this host, or None: a .deepspeed_env the launcher exports
    (it wins: pdsh's command exports it before the rank starts) else the host's own environment. DeepSpeed tests
    ``os.getenv("DS_SKIP_CUDA_CHECK", "0") == "1"`` (builder.py:119)."""
    launch = (launch_env or {}).get("DS_SKIP_CUDA_CHECK")
    if launch is not None:
        return ".deepspeed_env" if launch == "1" else None
    return "the host's environment" if facts.get("ds_skip_cuda_check") == "1" else None


def _cuda_blockers(op: str, facts: Mapping[str, Any], launch_env: Optional[Mapping[str, str]],
                   python: Any) -> List[Blocker]:
    """What stops the JIT build of the CUDA op ``op`` that blockers() does not: no nvcc, or one whose major version
    is not torch's CUDA's."""
    found: List[Blocker] = []
    torch_cuda = facts.get("torch_cuda")
    nvcc = facts.get("nvcc")
    if not nvcc and "nvcc" in facts:
        where = facts.get("cuda_home")
        if where and facts.get("nvcc_error"):
            why = f"CUDA_HOME {where} has no working nvcc ({facts['nvcc_error']})"
        elif where:
            why = f"no nvcc found under CUDA_HOME {where}"
        else:
            why = ("no CUDA toolkit: CUDA_HOME and CUDA_PATH are unset, no nvcc is on PATH and there is no "
                   "/usr/local/cuda, so torch's build stops with \"CUDA_HOME environment variable is not set\"")
        found.append(Blocker(Status.FAIL, f"{op} is a CUDA op and {why}",
                             f"install the CUDA toolkit {torch_cuda or ''} (torch's CUDA) and export "
                             f"CUDA_HOME=/usr/local/cuda-{torch_cuda or 'X.Y'} in the job's environment "
                             "(.deepspeed_env), or pre-build the op on a host that has it: "
                             + prebuild_phrase(python, [f"DS_BUILD_{op.upper()}"], facts.get("deepspeed")), "no nvcc"))
        return found
    if torch_cuda and major(nvcc) is not None and major(nvcc) != major(torch_cuda):
        source = skip_cuda_check(facts, launch_env)
        consequence = (f"nvcc {nvcc} and torch's CUDA {torch_cuda} differ in major version: the JIT build compiles "
                       f"{op} against CUDA {nvcc} inside a process that runs torch's CUDA {torch_cuda}; DeepSpeed "
                       "refuses this pair with CUDAMismatchException (op_builder/builder.py:107-129: at every JIT "
                       "build before DeepSpeed 0.12.3, and when pre-building, "
                       f"{prebuild_phrase(python, ['DS_BUILD_OPS'], facts.get('deepspeed'))}, which therefore fails "
                       "the same way here)")
        match = (f"install the CUDA {torch_cuda} toolkit and export CUDA_HOME=/usr/local/cuda-{torch_cuda} for the job "
                 f"(.deepspeed_env), or install the torch build for CUDA {nvcc}")
        short = f"nvcc {nvcc} vs torch's CUDA {torch_cuda}"
        if source:
            found.append(Blocker(Status.WARN, f"{consequence}; DS_SKIP_CUDA_CHECK=1 ({source}) is DeepSpeed's override "
                                 "and allows it \"but it may result in unexpected behavior\"", match,
                                 short + ", allowed by DS_SKIP_CUDA_CHECK=1"))
        else:
            found.append(Blocker(Status.FAIL, consequence,
                                 match + "; DS_SKIP_CUDA_CHECK=1 in .deepspeed_env is DeepSpeed's override, at your "
                                 "own risk", short))
    return found


def blockers(op: str, facts: Mapping[str, Any], launch_env: Optional[Mapping[str, str]] = None) -> List[Blocker]:
    """What stops the JIT build of ``op`` on a host whose ds_report facts are ``facts`` (ops, ninja_binary or ninja,
    torch_cuda, nvcc, cuda_home, nvcc_error, cxx, cxx_name, ds_skip_cuda_check); [] when it is
    pre-built, not compatible (ds_report's own verdict says so), or nothing stops it. A fact that was not recorded
    is no blocker."""
    entry = (facts.get("ops") or {}).get(op)
    if not isinstance(entry, Mapping) or entry.get("installed") or not entry.get("compatible"):
        return []
    found: List[Blocker] = []
    python = facts.get("python")  # the job's interpreter (ds_report's sys.executable): its pip is the one to run
    ninja = facts.get("ninja_binary") if "ninja_binary" in facts else facts.get("ninja")
    if not ninja:
        # DeepSpeed 0.19.8 jit_load: torch's verify_ninja_availability runs `ninja --version` (builder.py:573-577).
        found.append(Blocker(Status.FAIL, "no ninja on PATH: the JIT build stops with \"Unable to JIT load the "
                             f"{op} op due to ninja not being installed.\"",
                             pip_fix("install ninja with the job's interpreter, and put its bin directory on the "
                                     "PATH of a non-interactive ssh login", python, "ninja"), "no ninja"))
    if "cxx" in facts and not facts.get("cxx"):
        name = facts.get("cxx_name") or "c++"
        origin = "$CXX" if name != "c++" else "$CXX unset, so c++"
        found.append(Blocker(Status.FAIL, f"no C++ compiler: torch builds the op with {name} ({origin}), not found on "
                             "PATH",
                             "install one (apt-get install -y g++; dnf install -y gcc-c++), or point CXX at it in "
                             "the job's environment (.deepspeed_env)", f"no C++ compiler ({name})"))
    if not (is_cuda_op(op, entry) and needs_cuda(facts)):
        return found
    return found + _cuda_blockers(op, facts, launch_env, python)


def usable(op: str, facts: Mapping[str, Any], launch_env: Optional[Mapping[str, str]] = None) -> bool:
    """Pre-built, or compatible and nothing FAILs its JIT build here."""
    entry = (facts.get("ops") or {}).get(op) or {}
    if entry.get("installed"):
        return True
    return bool(entry.get("compatible")) and not any(b.status == Status.FAIL
                                                     for b in blockers(op, facts, launch_env))


# --- the torch extensions cache: where the JIT builds go, and the locks they leave ---------------------------
#
# torch.utils.cpp_extension (torch 2.13, _get_build_directory, cpp_extension.py:2789-2830): the build directory of
# op NAME is $TORCH_EXTENSIONS_DIR/NAME when the variable is set, else <cache>/torch_extensions/<py>_<accelerator>/NAME
# (<cache>: $XDG_CACHE_HOME or ~/.cache, torch._appdirs.user_cache_dir; <py>_<accelerator>: py311_cpu, py311_cu128,
# py311_rocm63). Its load (cpp_extension.py:2345-2400) takes FileBaton(BUILD_DIR/lock) (torch/utils/file_baton.py): a
# plain file made with os.open(O_CREAT | O_EXCL), its descriptor open until release() removes it. A builder killed
# while it holds it never removes it, and every later load of that op waits in FileBaton.wait, polling
# os.path.exists every 0.1 s, forever, with no message (pytorch issue 189245).

LOCK_NAME = "lock"
STALE_MIN_AGE_S = 30.0  # a lock younger than this may be a build that is only starting ([ext_locks] min_age_s)
MAX_EXT_DIRS = 400  # op build directories looked at per host (a cache holds a few dozen)
# Programs that run in a build directory while torch builds there (ninja as the driver, then the compilers and
# the linker it starts): one of them with its working directory there means a build is in progress.
BUILDERS = ("ninja", "c++", "g++", "gcc", "cc", "cc1plus", "cc1", "clang", "clang++", "nvcc", "cicc", "ptxas",
            "ld", "collect2", "as", "hipcc", "icpx")


def extensions_root(launch_value: Optional[str], environ: Mapping[str, str]) -> Tuple[str, str, bool]:
    """(root, where the value comes from, whether the root is the default) of the torch extensions cache that a
    rank on this host will use: TORCH_EXTENSIONS_DIR from the launch's .deepspeed_env (DeepSpeed's launcher exports
    it to every rank), else from this host's own environment (a non-interactive ssh login's, what pdsh gives the
    ranks), else torch's default <cache>/torch_extensions."""
    if launch_value:
        return os.path.expanduser(launch_value), "TORCH_EXTENSIONS_DIR in .deepspeed_env", False
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"], "TORCH_EXTENSIONS_DIR in the host's environment", False
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions"), "torch's default (no TORCH_EXTENSIONS_DIR)", True


def _is_build_dir(path: str, names: List[str]) -> bool:
    return LOCK_NAME in names or "build.ninja" in names or any(n.endswith((".so", ".o")) for n in names)


def build_dirs(root: str, limit: int = MAX_EXT_DIRS) -> List[str]:
    """The op build directories under ``root``: ROOT/<op>/ (TORCH_EXTENSIONS_DIR set) and ROOT/<py>_<acc>/<op>/ (the
    default layout), those holding a lock, a build.ninja, objects or a library."""
    found: List[str] = []

    def listing(path: str) -> List[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    for first in listing(root):
        one = os.path.join(root, first)
        if not os.path.isdir(one) or os.path.islink(one):
            continue
        names = listing(one)
        if _is_build_dir(one, names):
            found.append(one)
        for second in names:
            two = os.path.join(one, second)
            if os.path.isdir(two) and not os.path.islink(two) and _is_build_dir(two, listing(two)):
                found.append(two)
        if len(found) >= limit:
            break
    return found[:limit]


FileId = Tuple[int, int]  # (st_dev, st_ino): a file itself, whatever path or mount namespace names it


def _file_id(path: str) -> Optional[FileId]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _proc_links(proc_root: str = "/proc") -> Tuple[List[Tuple[int, str, str, FileId]], int]:
    """([(pid, comm, "cwd" or "fd", the file it is)], processes whose links could not be read): every process's
    working directory and open files, read once per scan. By identity (stat through the /proc link), not by path: a
    process in another mount namespace (a container) names other files by the same path."""
    links: List[Tuple[int, str, str, FileId]] = []
    unreadable = 0
    try:
        pids = [int(p) for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return links, 0
    me = os.getpid()
    for pid in pids:
        if pid == me:
            continue
        base = os.path.join(proc_root, str(pid))
        try:
            with open(os.path.join(base, "comm")) as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        try:
            os.readlink(os.path.join(base, "cwd"))
            fds = os.listdir(os.path.join(base, "fd"))
        except PermissionError:  # another user's process (or another namespace's): it may hold the lock unseen
            unreadable += 1
            continue
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        cwd = _file_id(os.path.join(base, "cwd"))
        if cwd is not None:
            links.append((pid, comm, "cwd", cwd))
        for fd in fds:
            target = _file_id(os.path.join(base, "fd", fd))
            if target is not None:
                links.append((pid, comm, "fd", target))
    return links, unreadable


def holders(directory: str, links: List[Tuple[int, str, str, FileId]]) -> List[Dict[str, Any]]:
    """The processes that hold a build directory: one with its lock (or the directory) open, the torch process that
    took the lock keeps its descriptor open until release; or one working in it, ninja and the compilers it starts
    run with the build directory as their working directory."""
    ids = {i for i in (_file_id(directory), _file_id(os.path.join(directory, LOCK_NAME))) if i is not None}
    out: Dict[int, Dict[str, Any]] = {}
    for pid, comm, kind, target in links:
        if target in ids:
            entry = out.setdefault(pid, {"pid": pid, "comm": comm[:32], "how": []})
            if kind not in entry["how"]:
                entry["how"].append(kind)
    return sorted(out.values(), key=lambda e: e["pid"])[:10]


def scan_extensions(root: str, now: Optional[float] = None, proc_root: str = "/proc") -> Dict[str, Any]:
    """The torch extensions cache under ``root``: {"root", "exists", "dirs": [{"dir", "op", "lock": {"path",
    "age_s", "holders"} or None, "libraries", "objects", "holders"}], "unreadable_procs"}."""
    import time
    now = time.time() if now is None else now
    out: Dict[str, Any] = {"root": root, "exists": os.path.isdir(root), "dirs": [], "unreadable_procs": 0}
    if not out["exists"]:
        return out
    dirs = build_dirs(root)
    links: List[Tuple[int, str, str, FileId]] = []
    if dirs:
        links, out["unreadable_procs"] = _proc_links(proc_root)
    for directory in dirs:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        held = holders(directory, links)
        entry: Dict[str, Any] = {"dir": directory, "op": os.path.basename(directory), "lock": None,
                                 "libraries": sorted(n for n in names if n.endswith(".so"))[:5],
                                 "objects": sum(1 for n in names if n.endswith(".o")), "holders": held,
                                 "idle_s": _idle_s(directory, names, now)}
        lock = os.path.join(directory, LOCK_NAME)
        try:
            st = os.lstat(lock)
        except OSError:
            st = None
        if st is not None:
            entry["lock"] = {"path": lock, "age_s": round(max(0.0, now - st.st_mtime), 1), "holders": held}
        out["dirs"].append(entry)
    return out


def _idle_s(directory: str, names: List[str], now: float) -> Optional[float]:
    """Seconds since the newest write to any file in the build directory (ninja's log and objects, the lock): a
    build that this host's /proc cannot see (another container or PID namespace) still writes here."""
    newest = None
    for name in names:
        try:
            mtime = os.lstat(os.path.join(directory, name)).st_mtime
        except OSError:
            continue
        newest = mtime if newest is None else max(newest, mtime)
    return None if newest is None else round(max(0.0, now - newest), 1)


def stale_locks(scan: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The build directories whose lock no live process holds (no descriptor open on it, nobody working there)."""
    return [d for d in scan.get("dirs") or [] if d.get("lock") and not d.get("holders")]


def partial_builds(scan: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Build directories with objects but no library, and no build running: a build that was stopped."""
    return [d for d in scan.get("dirs") or [] if d.get("objects") and not d.get("libraries")
            and not d.get("holders") and not d.get("lock")]


def age_text(seconds: Any) -> str:
    """3725 -> '1 h 2 min'; 42 -> '42 s'."""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "?"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s // 3600:.0f} h {(s % 3600) / 60:.0f} min"
    return f"{s / 86400:.0f} days"


def launch_params(_options: Any = None) -> Dict[str, Any]:
    """Per-host params (``CheckSpec.params_from_options``, run where preflight runs, taken as where ``deepspeed``
    runs): TORCH_EXTENSIONS_DIR as the launch's .deepspeed_env gives it to every rank, if it sets it."""
    from .launchenv import read_deepspeed_env
    value = (read_deepspeed_env().get("vars") or {}).get("TORCH_EXTENSIONS_DIR")
    return {"torch_extensions_dir": value} if value else {}


def extensions_facts(params: Mapping[str, Any]) -> Dict[str, Any]:
    """Host side: the cache the ranks will use, scanned (``scan_extensions``), with where its root comes from."""
    root, source, default = extensions_root(params.get("torch_extensions_dir"), os.environ)
    scan = scan_extensions(root)
    scan.update(root_from=source, default_root=default, python=sys.executable, deepspeed=_deepspeed_version())
    return scan


def _deepspeed_version() -> Optional[str]:
    """The installed DeepSpeed's version (metadata only: importing it imports torch), which a pre-build fix pins."""
    import importlib.metadata
    try:
        return importlib.metadata.version("deepspeed")
    except Exception:  # not installed, or broken metadata: the fix names deepspeed unpinned
        return None
