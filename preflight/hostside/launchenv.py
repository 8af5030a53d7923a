"""The environment DeepSpeed's pdsh launcher gives every rank, and what is wrong in it: shared by launcher_ssh
(the inherited environment) and ds_config (DS_SKIP_CUDA_CHECK for JIT builds). Pure, standard library only.

DeepSpeed 0.19.8's runner (deepspeed/launcher/runner.py) exports to the ranks the launch host's variables whose
names start with MLFLOW, PYTHON, MV2, UCX (EXPORT_ENVS, :36) or the accelerator's prefixes (NCCL for CUDA,
accelerator/cuda_accelerator.py:411-412), then every ``KEY=VALUE`` line of ``~/.deepspeed_env`` and
``./.deepspeed_env`` (:37-38, :596-611), e.g.::

    NCCL_SOCKET_IFNAME==ib0         -> exported, also from the shell
    TORCH_NCCL_BLOCKING_WAIT=1      -> exported only from .deepspeed_env: not from the shell (no NCCL prefix)
    NCCL_DEBUG                      -> a line without '=': the runner raises ValueError before any rank starts
"""
from __future__ import annotations

import os
import re
import shlex
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .outcome import Status

# runner.py:36 EXPORT_ENVS, plus the CUDA accelerator's export_envs() (cuda_accelerator.py:411-412).
EXPORTED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
# runner.py:43 EXCLUDE_ENVS, applied at :591-601: with AISC_JOB_NAME in the launch shell these are not exported.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
# The variables a check looks at in the coordinator's shell (and, over SSH, in each host's own environment).
WATCHED_PREFIXES = ("NCCL_", "TORCH", "PYTORCH_", "DS_", "DEEPSPEED_", "CUDA_", "GLOO_", "OMP_NUM_THREADS",
                    "TRITON_")
# Set in the shell, not exported by pdsh, and meant for the ranks (CUDA_HOME and the like are each host's own):
# these prefixes, and every name of RANK_READS.
MEANT_FOR_RANKS = ("TORCH_NCCL_", "GLOO_")

# The DS_/DEEPSPEED_ names DeepSpeed 0.19.8 reads: every such string literal in its installed package
# (tests/checks/launcher_ssh/test_launchenv.py re-derives the set from the installed source and compares).
DEEPSPEED_READS = frozenset("""
DEEPSPEED_COMPILE_SCHEDULER_BUDGET_DEBUG DEEPSPEED_TIMEOUT DS_ACCELERATOR DS_ALLOW_DEPRECATED_FP16 DS_BUILD_AIO
DS_BUILD_CCL_COMM DS_BUILD_CPU_ADAGRAD DS_BUILD_CPU_ADAM DS_BUILD_CPU_LION DS_BUILD_CUTLASS_OPS DS_BUILD_DEEP_COMPILE
DS_BUILD_EVOFORMER_ATTN DS_BUILD_FP_QUANTIZER DS_BUILD_FUSED_ADAM DS_BUILD_FUSED_LAMB DS_BUILD_FUSED_LION DS_BUILD_GDS
DS_BUILD_INFERENCE_CORE_OPS DS_BUILD_NOT_IMPLEMENTED DS_BUILD_PIN_MEMORY DS_BUILD_QUANTIZER DS_BUILD_RAGGED_DEVICE_OPS
DS_BUILD_RAGGED_OPS DS_BUILD_RANDOM_LTD DS_BUILD_SHM_COMM DS_BUILD_SPATIAL_INFERENCE DS_BUILD_STOCHASTIC_TRANSFORMER
DS_BUILD_TRANSFORMER DS_BUILD_TRANSFORMER_INFERENCE DS_BUILD_UTILS DS_DC_OFFLOAD_ACT_BUDGET_GB DS_DC_OFFLOAD_ACT_MARGIN
DS_DC_OFFLOAD_ACT_MIN_SIZE_MB DS_DC_OFFLOAD_OPT_BUDGET_GB DS_DEBUG_CUDA_BUILD DS_ENV_FILE DS_EVOFORMER_GPU_ARCH
DS_IGNORE_CUDA_DETECTION DS_IGNORE_CUTLASS_DETECTION DS_NVCC_THREADS DS_PIN_MEMORY_BACKEND
DS_PIN_MEMORY_REGISTER_DEVICE DS_SDMA_ALLGATHER DS_SDMA_ALLGATHER_MAX_NUMEL DS_SKIP_CUDA_CHECK
DS_USE_CUTLASS_PYTHON_BINDINGS
""".split())
# Read where `deepspeed` runs or at install time, never by a rank: DS_ENV_FILE (runner.py:37), DS_BUILD_*
# (op_builder's BUILD_VAR, read by setup.py's pre-build).
LAUNCHER_ONLY = ("DS_ENV_FILE", "DS_BUILD_")
# What torch 2.13 reads in a rank (each name appears in its installed tree: distributed_c10d.py,
# ProcessGroupNCCL.hpp, cpp_extension.py, cuda/memory.py ...; tests/checks/launcher_ssh/test_launchenv.py looks),
# and the CUDA runtime's (CUDA C Programming Guide, "CUDA Environment Variables").
TORCH_READS = frozenset("""
TORCH_DISTRIBUTED_DEBUG TORCH_SHOW_CPP_STACKTRACES TORCH_LOGS PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
PYTORCH_NO_CUDA_MEMORY_CACHING TORCH_EXTENSIONS_DIR TORCH_CUDA_ARCH_LIST GLOO_SOCKET_IFNAME GLOO_DEVICE_TRANSPORT
TORCHINDUCTOR_CACHE_DIR TORCH_DIST_INIT_BARRIER TORCH_NCCL_BLOCKING_WAIT TORCH_NCCL_ASYNC_ERROR_HANDLING
TORCH_NCCL_DUMP_ON_TIMEOUT TORCH_NCCL_TRACE_BUFFER_SIZE TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC TORCH_NCCL_ENABLE_MONITORING
TORCH_NCCL_DESYNC_DEBUG TORCH_NCCL_AVOID_RECORD_STREAMS TORCH_NCCL_HIGH_PRIORITY TORCH_NCCL_NAN_CHECK
TORCH_NCCL_ENABLE_TIMING OMP_NUM_THREADS
""".split())
CUDA_READS = frozenset(("CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING",
                        "CUDA_VISIBLE_DEVICES", "CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE",
                        "CUDA_CACHE_DISABLE", "CUDA_DEVICE_ORDER"))
# NCCL's documented variables (NCCL env.rst, 2.2x): exported by prefix anyway, listed for the did-you-mean.
NCCL_READS = frozenset("""
NCCL_SOCKET_IFNAME NCCL_SOCKET_FAMILY NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD NCCL_CROSS_NIC NCCL_IB_HCA
NCCL_IB_DISABLE NCCL_IB_GID_INDEX NCCL_IB_ADDR_FAMILY NCCL_IB_ROCE_VERSION_NUM NCCL_IB_TIMEOUT NCCL_IB_RETRY_CNT
NCCL_IB_SL NCCL_IB_TC NCCL_IB_QPS_PER_CONNECTION NCCL_IB_ADAPTIVE_ROUTING NCCL_IB_PCI_RELAXED_ORDERING
NCCL_IB_MERGE_NICS NCCL_IB_SPLIT_DATA_ON_QPS NCCL_IB_CUDA_SUPPORT NCCL_IB_GDR_LEVEL NCCL_NET_GDR_LEVEL
NCCL_NET_GDR_READ NCCL_DMABUF_ENABLE NCCL_NET NCCL_NET_PLUGIN NCCL_NET_SHARED_BUFFERS NCCL_DEBUG NCCL_DEBUG_SUBSYS
NCCL_DEBUG_FILE NCCL_P2P_DISABLE NCCL_P2P_LEVEL NCCL_P2P_NET_CHUNKSIZE NCCL_P2P_PCI_CHUNKSIZE NCCL_SHM_DISABLE
NCCL_SHM_USE_CUDA_MEMCPY NCCL_BUFFSIZE NCCL_NTHREADS NCCL_MAX_NCHANNELS NCCL_MIN_NCHANNELS NCCL_MAX_CTAS
NCCL_MIN_CTAS NCCL_CHECKS_DISABLE NCCL_CHECK_POINTERS NCCL_LAUNCH_MODE NCCL_IGNORE_CPU_AFFINITY NCCL_TOPO_FILE
NCCL_TOPO_DUMP_FILE NCCL_GRAPH_FILE NCCL_GRAPH_DUMP_FILE NCCL_COLLNET_ENABLE NCCL_NVLS_ENABLE NCCL_ALGO NCCL_PROTO
NCCL_CUMEM_ENABLE NCCL_NVB_DISABLE NCCL_PXN_DISABLE NCCL_NET_FORCE_FLUSH NCCL_IGNORE_DISABLED_P2P NCCL_COMM_ID
NCCL_HOSTID NCCL_SET_THREAD_NAME NCCL_CONF_FILE NCCL_RAS_ENABLE NCCL_WORK_FIFO_DEPTH NCCL_RUNTIME_CONNECT
""".split())
# Every name the did-you-mean compares with (the legacy and no-such names are judged on their own).
KNOWN_NAMES = DEEPSPEED_READS | TORCH_READS | CUDA_READS | NCCL_READS
# Prefixes of a name the user meant for DeepSpeed: one that DeepSpeed does not read is a note.
DEEPSPEED_LOOKING = ("DS_", "DEEPSPEED_")

# Names that do nothing (issue 24's audit; /work/shared/reference/facts.md "Folklore wrong").
NO_SUCH = {
    "NCCL_TIMEOUT": "NCCL has no such variable: the collectives' timeout is init_process_group(timeout=...), "
                    "in DeepSpeed deepspeed.init_distributed(timeout=...) or DEEPSPEED_TIMEOUT=<minutes> "
                    "(deepspeed/constants.py:19; torch's default is 10 minutes for NCCL)",
}
# Old names and what replaced them: torch reads the NCCL_ spellings as deprecated aliases of its TORCH_NCCL_
# variables (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp), NCCL renamed its rings to channels in 2.5.
LEGACY = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
    "NCCL_MIN_NRINGS": "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NRINGS": "NCCL_MAX_NCHANNELS",
}
# Legacy names whose variable is best left unset: torch's default is what preflight recommends.
DEFAULT_IS_RIGHT = frozenset({"NCCL_ASYNC_ERROR_HANDLING"})
# deepspeed/accelerator/real_accelerator.py:23 SUPPORTED_ACCELERATOR_LIST; another DS_ACCELERATOR raises
# ValueError in get_accelerator() (:111-113), in the launcher and in every rank.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ACCELERATORS = ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")


def read_deepspeed_env(cwd: Optional[str] = None, home: Optional[str] = None,
                       environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The variables DeepSpeed's launcher exports to every rank from its .deepspeed_env files, read as it reads them
    (deepspeed/launcher/runner.py:37-38 and :604-611): the name is $DS_ENV_FILE or ".deepspeed_env", in the home
    directory and then the working directory (a later file's value wins), each line ``KEY=VALUE`` split at the
    first '=' and stripped (multinode_runner.py:37-41). Read where preflight runs, taken as where deepspeed will
    run. {"files": [paths read], "vars": {KEY: VALUE}, "sources": {KEY: the path its value came from}, "bad_lines":
    ["path:N: line"]} (a line without '=', an empty one too, makes the launcher raise ValueError)."""
    env = os.environ if environ is None else environ
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    # "unterminated": the files whose last line has no newline, where `echo K=V >> file` would glue onto it.
    out: Dict[str, Any] = {"files": [], "vars": {}, "sources": {}, "bad_lines": [], "name": name,
                           "unterminated": [], "bad_names": [],
                           "cwd_file": os.path.abspath(os.path.join(cwd if cwd is not None else ".", name))}
    for folder in (home if home is not None else os.path.expanduser("~"), cwd if cwd is not None else "."):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.abspath(path) in out["files"]:
            continue
        try:
            with open(path, errors="replace") as f:
                text = f.read(1 << 20)
        except OSError:
            continue
        lines = text.splitlines()
        if text and not text.endswith("\n"):
            out["unterminated"].append(os.path.abspath(path))
        out["files"].append(os.path.abspath(path))
        for n, line in enumerate(lines, 1):
            key, sep, value = line.partition("=")
            if not sep:
                out["bad_lines"].append(f"{path}:{n}: {line[:200]}")
                continue
            if not _NAME.fullmatch(key.strip()):
                out["bad_names"].append(f"{path}:{n}: {line[:200]}")
            out["vars"][key.strip()] = value.strip()
            out["sources"][key.strip()] = os.path.abspath(path)
    return out


def snapshot(environ: Mapping[str, str], deepspeed_env: Dict[str, Any]) -> Dict[str, Any]:
    """What the ranks of a multi-host pdsh launch will have: {"shell": the watched variables of the launch shell,
    "exported": {name: (value, "shell" | "<.deepspeed_env path>")}, "deepspeed_env": deepspeed_env}.

    In DeepSpeed's order (runner.py:591-611): the shell's variables whose names start with an EXPORT_ENVS prefix
    (less EXCLUDE_ENVS' names when its key is set), then ~/.deepspeed_env, then ./.deepspeed_env, each line through
    runner.add_export (multinode_runner.py:37-41), so a later value of the same name wins."""
    shell = {k: v for k, v in environ.items() if k.startswith(WATCHED_PREFIXES + EXPORTED_PREFIXES)}
    excluded = {n for key, names in EXCLUDE_ENVS.items() if key in environ for n in names}
    exported: Dict[str, List[str]] = {k: [v, "the launch shell"] for k, v in shell.items()
                                      if k.startswith(EXPORTED_PREFIXES) and k not in excluded}
    where = deepspeed_env.get("files") or []
    sources = deepspeed_env.get("sources") or {}  # absent in facts recorded before it was kept
    for k, v in (deepspeed_env.get("vars") or {}).items():
        exported[k] = [v, sources.get(k) or (where[-1] if where else ".deepspeed_env")]
    return {"shell": shell, "exported": exported, "deepspeed_env": deepspeed_env}


# --- each host's own environment, as an SSH command from the launch host gets it ------------------------------

ENV_MARK = "@@preflight-env@@"  # between `hostname`'s line and `env`'s output in launcher_ssh's probe
VALUE_KEEP = 256  # characters of a host's value kept: enough to compare, small in the report


def parse_host_env(text: str) -> Dict[str, str]:
    """The variables a rank reads from ``env`` output (a host's, so data: names must be NAME-shaped, values are kept
    short and never executed), e.g. ``TORCH_DISTRIBUTED_DEBUG=INFO`` -> {"TORCH_DISTRIBUTED_DEBUG": "INFO"}."""
    out: Dict[str, str] = {}
    for line in (text or "").splitlines():
        name, sep, value = line.partition("=")
        # Only names a rank reads: nothing else of a host's environment (tokens, passwords) is kept.
        if sep and _NAME.fullmatch(name) and (name in KNOWN_NAMES or _rank_reads(name)):
            out[name] = value[:VALUE_KEEP]
    return out


def rank_env(snap: Dict[str, Any], host_env: Optional[Mapping[str, str]]) -> Dict[str, List[str]]:
    """{name: [value, source]} of the watched variables a rank on one host starts with: the host's own environment
    for a non-interactive SSH command (what pdsh's ssh gets there: sshd, PAM, the login shell's rc files), then
    the launcher's exports, which win (pdsh runs ``export K=V; ...`` before deepspeed.launcher.launch,
    multinode_runner.py:103-110). host_env None: not known, the exports alone."""
    out: Dict[str, List[str]] = {k: [v, "the host's own environment"] for k, v in (host_env or {}).items()}
    for k, v in (snap.get("exported") or {}).items():
        out[k] = [str(v[0]), str(v[1])]
    return out


# --- names: did you mean ----------------------------------------------------------------------------------------

def _distance(a: str, b: str, cap: int = 3) -> int:
    """Damerau-Levenshtein (optimal string alignment) distance, stopped at ``cap``."""
    if abs(len(a) - len(b)) >= cap:
        return cap
    prev2: List[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) >= cap:
            return cap
        prev2, prev = prev, cur
    return min(prev[-1], cap)


def _undoubled(name: str) -> List[str]:
    """``name`` with one doubled run typed once: DS_ACCELERATORATOR -> DS_ACCELERATOR (the "ATOR" typed twice)."""
    out = []
    for size in range(2, len(name) // 2 + 1):
        for i in range(len(name) - 2 * size + 1):
            if name[i:i + size] == name[i + size:i + 2 * size]:
                out.append(name[:i + size] + name[i + 2 * size:])
    return out


def did_you_mean(name: str, known: Any = None) -> Optional[str]:
    """The known name ``name`` was probably meant to be, or None: within edit distance 2 (1 for names under 10
    characters, where 2 edits reach real neighbours such as NCCL_IB_SL/NCCL_IB_TC), or the same with one part
    typed twice. A known name is never a typo."""
    names = KNOWN_NAMES if known is None else known
    if name in names or name.startswith("DS_BUILD_"):  # DS_BUILD_*: pip install's (setup.py: DS_BUILD_OPS, ...)
        return None
    for shorter in _undoubled(name):
        if shorter in names:
            return shorter
    limit = 2 if len(name) >= 10 else 1
    best = sorted((_distance(name, k), k) for k in names if abs(len(k) - len(name)) <= limit)
    if best and best[0][0] <= limit and (len(best) == 1 or best[1][0] > best[0][0]):
        return best[0][1]
    return None


def _rank_reads(name: str) -> bool:
    """A variable a rank reads (so one set only in the launch shell is lost), not one read where `deepspeed` runs."""
    if name.startswith(LAUNCHER_ONLY) or name == "CUDA_VISIBLE_DEVICES":
        return False  # CUDA_VISIBLE_DEVICES: launch.py:172 sets it per node from the slots (--include)
    return name in DEEPSPEED_READS or name in TORCH_READS or name in CUDA_READS or name.startswith(MEANT_FOR_RANKS)


# --- what is wrong ------------------------------------------------------------------------------------------

class EnvFinding(NamedTuple):
    """One problem of the inherited environment; ``hosts``: the hosts it applies to (empty: all of them)."""

    status: Status
    message: str
    fix: str
    hosts: Sequence[str] = ()


def parse_ifname_filter(value: str) -> Tuple[bool, bool, List[str]]:
    """NCCL's interface filter (NCCL env.rst, NCCL_SOCKET_IFNAME and NCCL_IB_HCA): a comma list of prefixes, '^'
    first excludes them, '=' first makes them exact names; an HCA entry may end in ':port'. -> (exclude, exact,
    names without their ports)."""
    text = value.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    return exclude, exact, [i.split(":")[0] for i in text.split(",") if i]


def ifname_filter(value: str) -> Any:
    """NCCL's interface filter (``parse_ifname_filter``) -> match(name)."""
    exclude, exact, items = parse_ifname_filter(value)

    def match(name: str) -> bool:
        hit = any(name == i if exact else name.startswith(i) for i in items)
        return hit != exclude
    return match


def check(snap: Dict[str, Any], host_net: Dict[str, Dict[str, Any]],
          host_envs: Optional[Mapping[str, Optional[Mapping[str, str]]]] = None) -> List[EnvFinding]:
    """Findings on what every rank inherits. host_net: {host: {"ifnames": [...], "ib": [{"device", "port",
    "active"}]}} from the interfaces check's facts (hosts without them are not judged on names). host_envs:
    {host: its own environment for an SSH command (``parse_host_env``), None where not read}. A finding of
    Status.PASS is a note (said, never a warning)."""
    found: List[EnvFinding] = []
    exported: Dict[str, List[str]] = snap.get("exported") or {}
    shell: Dict[str, str] = snap.get("shell") or {}
    ds_env = snap.get("deepspeed_env") or {}
    for line in ds_env.get("bad_lines") or []:
        found.append(EnvFinding(Status.FAIL, f"{line} has no '=': DeepSpeed's launcher raises ValueError "
                                "(\"not enough values to unpack\", runner.py:610) before any rank starts",
                                "make every line KEY=VALUE, with no empty lines"))
    for line in ds_env.get("bad_names") or []:
        # Checked with DeepSpeed's own export builder in tests/checks/launcher_ssh/test_launchenv.py:
        # `export # x=1; export B=2; cd ...`
        found.append(EnvFinding(Status.FAIL, f"{line}: its name is not a variable name, and DeepSpeed's pdsh "
                                "launcher puts it into `export NAME=VALUE;` in the command every host runs "
                                "(multinode_runner.py:103-105): a '#' there comments out the rest of the command, "
                                "so no rank starts", "remove the line (.deepspeed_env has no comments)"))
    seen = dict(exported)
    for k, v in shell.items():
        seen.setdefault(k, [v, "the launch shell"])
    for name in sorted(seen):
        value, source = seen[name]
        if name in NO_SUCH:
            found.append(EnvFinding(Status.WARN, f"{name}={value} ({source}) has no effect: {NO_SUCH[name]}",
                                    f"unset {name}; set the timeout where it is read"))
        elif name in DEFAULT_IS_RIGHT:
            # Renaming it would keep a setting preflight does not recommend (recommend.NOT_NEEDED): the value
            # 0 or 2 is _error_handling_findings' WARN, any other value only restates torch's default.
            if value.strip() not in ("0", "2"):
                found.append(EnvFinding(Status.WARN, f"{name}={value} ({source}) is the legacy name of "
                                        f"{LEGACY[name]}, and torch's default (3) already ends a job whose "
                                        "collective fails", f"unset {name} (remove its line from {source})"))
        elif name in LEGACY:
            found.append(EnvFinding(Status.WARN, f"{name} ({source}) is the legacy name of {LEGACY[name]}",
                                    f"rename it {LEGACY[name]}={value}"))
    found.extend(_name_findings(seen, str(ds_env.get("name") or ".deepspeed_env")))
    accel = seen.get("DS_ACCELERATOR")
    if accel and accel[0] not in ACCELERATORS:
        found.append(EnvFinding(Status.FAIL, f"DS_ACCELERATOR={accel[0]} ({accel[1]}) is not an accelerator "
                                "DeepSpeed knows: get_accelerator() raises ValueError (\"DS_ACCELERATOR must be one "
                                "of ...\", real_accelerator.py:111-113)",
                                "unset it (DeepSpeed detects the accelerator) or use one of "
                                f"{', '.join(ACCELERATORS)}"))
    found.extend(_error_handling_findings(seen))
    found.extend(_unpassed_findings(shell, exported, host_envs, str(ds_env.get("name") or ".deepspeed_env"),
                                    ds_env.get("cwd_file") in (ds_env.get("unterminated") or [])))
    found.extend(_interface_findings(exported, host_net))
    return found


def _rename_fix(name: str, meant: str, value: str, source: str, env_file: str) -> str:
    """The command that renames a misspelt variable where it was set, so that the ranks get the right one."""
    from .validate import env_value
    if source != "the launch shell":  # a .deepspeed_env line: rename it in place (names are [A-Za-z0-9_])
        return f"sed -i 's/^{name}=/{meant}=/' {shlex.quote(source)}"
    if meant.startswith(EXPORTED_PREFIXES):  # the launcher passes the shell's value of the right name
        return f"unset {name}; export {meant}={shlex.quote(value)}"
    if env_value(value):  # the shell's value would not reach the ranks: the .deepspeed_env line instead
        return (f"unset {name}; echo {shlex.quote(f'{meant}={value}')} >> {shlex.quote(env_file)} (in the directory "
                f"you run deepspeed from: the launcher does not pass the shell's {meant} to the ranks)")
    return f"unset {name}, and put {meant} with its value in {env_file}"


def _name_findings(seen: Dict[str, List[str]], env_file: str = ".deepspeed_env") -> List[EnvFinding]:
    """A name close to one DeepSpeed, torch, CUDA or NCCL reads: WARN with the did-you-mean (nothing reads the
    misspelt one, so the setting is silently lost). A DeepSpeed-looking name DeepSpeed does not read: a note.
    DS_BUILD_* is pip install's (setup.py reads DS_BUILD_OPS and the like), not judged here."""
    found: List[EnvFinding] = []
    for name in sorted(seen):
        if name in KNOWN_NAMES or name in LEGACY or name in NO_SUCH or name.startswith("DS_BUILD_"):
            continue
        value, source = seen[name]
        meant = did_you_mean(name)
        if meant is not None:
            found.append(EnvFinding(Status.WARN, f"{name}={value} ({source}) is not a variable DeepSpeed, torch or "
                                    f"NCCL reads: did you mean {meant}? Nothing reads {name}, so the setting is lost",
                                    _rename_fix(name, meant, value, source, env_file)))
        elif name.startswith(DEEPSPEED_LOOKING):
            found.append(EnvFinding(Status.PASS, f"{name} ({source}) is not a variable DeepSpeed 0.19.8 reads (none "
                                    "of its DS_/DEEPSPEED_ names is close): it has no effect", ""))
    return found


def _unpassed_findings(shell: Dict[str, str], exported: Dict[str, List[str]],
                       host_envs: Optional[Mapping[str, Optional[Mapping[str, str]]]],
                       env_file: str, unterminated: bool = False) -> List[EnvFinding]:
    """A variable a rank reads, set in the launch shell, that the pdsh launcher does not pass: WARN, unless each
    host's own SSH environment already has that value. Fix: the .deepspeed_env line, as a command."""
    from .validate import env_value
    found: List[EnvFinding] = []
    judged = {h: e for h, e in (host_envs or {}).items()}
    for name in sorted(k for k in shell if _rank_reads(k) and k not in exported):
        value = shell[name]
        missing = sorted(h for h, e in judged.items() if e is None or e.get(name) != value)
        if judged and not missing:
            continue  # every host sets it the same way itself
        hosts: Sequence[str] = missing if judged and len(missing) < len(judged) else ()
        where = f" on {', '.join(hosts)}" if hosts else ""
        line = f"{name}={value}"
        # A file whose last line has no newline gets one first: `echo` alone would glue the line onto it, and an
        # empty line would make the launcher raise ValueError (runner.py:610).
        add = (f"printf '\\n%s\\n' {shlex.quote(line)}" if unterminated else f"echo {shlex.quote(line)}")
        fix = (f"in the directory you run deepspeed from: {add} >> {shlex.quote(env_file)} "
               f"(or the same line in ~/{env_file}, for every job)" if env_value(value) else
               f"put the line {line!r} in {env_file} (its value holds shell characters, which DeepSpeed's "
               "\"...\" quoting expands on every host: check what it becomes)")
        found.append(EnvFinding(Status.WARN, f"{line} is set in the launch shell, but DeepSpeed's pdsh launcher does "
                                f"not pass it to the ranks{where} (it exports only NCCL*, PYTHON*, UCX*, MV2*, "
                                "MLFLOW* and the .deepspeed_env lines, runner.py:36 and :591-611): the ranks run "
                                "without it", fix, hosts))
    return found


def _error_handling_findings(seen: Dict[str, List[str]]) -> List[EnvFinding]:
    """TORCH_NCCL_ASYNC_ERROR_HANDLING (or its legacy name) at a value that keeps a failed rank alive. torch's
    ProcessGroupNCCL reads it with the default 3, SkipCleanUp: on a failed or timed-out collective the watchdog
    tears the process down (ProcessGroupNCCL.hpp:161-176 in torch 2.13's include/ tree, SHOULD_TEAR_DOWN; torch's
    torch_nccl_environment_variables.md: "By default, it is set to 3"). 0 (no handling) and 2 (abort the
    communicators, keep the process) leave the job hanging instead of ending it."""
    found: List[EnvFinding] = []
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if name not in seen:
            continue
        value, source = seen[name]
        if value.strip() in ("0", "2"):
            what = "no handling" if value.strip() == "0" else "abort the communicators without tearing down"
            found.append(EnvFinding(Status.WARN, f"{name}={value} ({source}) means {what}: a failed or timed-out "
                                    f"collective leaves the job hanging instead of ending it; torch's default (3, "
                                    f"SkipCleanUp) tears the process down (ProcessGroupNCCL.hpp ErrorHandlingMode)",
                                    f"unset {name} (remove its line from {source} or `unset {name}` in the shell "
                                    f"that runs deepspeed): torch's default ends the job on such an error"))
    return found


def _loopback_only(name: str) -> bool:
    """Interfaces NCCL and gloo must not use between hosts: loopback, and docker's bridges (the same 172.17.0.1
    on every host). ncclenv.allowed never recommends them."""
    return name == "lo" or name.startswith("docker")


def _socket_ifname_findings(exported: Dict[str, List[str]], known: Dict[str, Dict[str, Any]]) -> List[EnvFinding]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME that match no interface on a host, or only loopback or docker."""
    found: List[EnvFinding] = []
    nccl = exported.get("NCCL_SOCKET_IFNAME")
    if nccl:
        match = ifname_filter(nccl[0])
        bad = sorted(h for h, n in known.items() if not [i for i in n["ifnames"] if match(i)])
        if bad:
            names = ", ".join(bad)
            found.append(EnvFinding(Status.FAIL, f"NCCL_SOCKET_IFNAME={nccl[0]} ({nccl[1]}) matches no interface on "
                                    f"{names}: NCCL finds no socket interface there and the job fails at init",
                                    "set NCCL_SOCKET_IFNAME to an interface every host has (see `ip -br link` on "
                                    f"{bad[0]}), or unset it", bad))
        # Every interface it matches on a host is loopback or docker: preflight's recommendation never names
        # those (ncclenv.allowed); across hosts the ranks cannot reach each other over them.
        local = sorted(h for h, n in known.items() if h not in bad and all(
            _loopback_only(i) for i in n["ifnames"] if match(i)))
        if local and len(known) > 1:
            found.append(EnvFinding(Status.FAIL, f"NCCL_SOCKET_IFNAME={nccl[0]} ({nccl[1]}) matches only loopback or "
                                    f"docker interfaces on {', '.join(local)}: the ranks on other hosts cannot reach "
                                    f"an address there, and the first collective hangs until its timeout",
                                    f"set NCCL_SOCKET_IFNAME to the hosts' real NIC (preflight's recommendation "
                                    f"names it; see `ip -br addr` on {local[0]}), or unset it", local))
    gloo = exported.get("GLOO_SOCKET_IFNAME")
    if gloo:
        wanted = [i for i in gloo[0].split(",") if i]
        bad = sorted(h for h, n in known.items() if set(wanted) - set(n["ifnames"]))
        if bad:
            names = ", ".join(bad)
            found.append(EnvFinding(Status.FAIL, f"GLOO_SOCKET_IFNAME={gloo[0]} ({gloo[1]}) names an interface that "
                                    f"{names} lacks: torch's gloo needs each named interface on every process",
                                    "name interfaces every host has, or unset it", bad))
        local = sorted(h for h in known if h not in bad and wanted and all(_loopback_only(i) for i in wanted))
        if local and len(known) > 1:
            found.append(EnvFinding(Status.FAIL, f"GLOO_SOCKET_IFNAME={gloo[0]} ({gloo[1]}) is loopback or docker: "
                                    f"every gloo rank advertises an address the other hosts cannot reach "
                                    f"(\"Gloo connectFullMesh failed\")",
                                    "set GLOO_SOCKET_IFNAME to the hosts' real NIC (preflight's recommendation names "
                                    "it), or unset it", local))
    return found


def _ib_findings(exported: Dict[str, List[str]], known: Dict[str, Dict[str, Any]]) -> List[EnvFinding]:
    """NCCL_IB_HCA that matches no IB/RoCE device on a host; NCCL_IB_DISABLE against the hosts' active ports."""
    found: List[EnvFinding] = []
    hca = exported.get("NCCL_IB_HCA")
    with_ib = {h: n for h, n in known.items() if isinstance(n.get("ib"), list)}
    if hca:
        match = ifname_filter(hca[0])
        bad = sorted(h for h, n in with_ib.items() if not [p for p in n["ib"] if match(str(p.get("device")))])
        if bad:
            names = ", ".join(bad)
            found.append(EnvFinding(Status.WARN, f"NCCL_IB_HCA={hca[0]} ({hca[1]}) matches no IB/RoCE device on "
                                    f"{names}: NCCL falls back to TCP sockets there",
                                    "name devices of /sys/class/infiniband on every host (ibv_devices), or "
                                    "unset it", bad))
    disable = exported.get("NCCL_IB_DISABLE")
    if disable and disable[0].strip() == "1" and with_ib and all(
            any(p.get("active") for p in n["ib"]) for n in with_ib.values()):
        # NCCL env.rst: NCCL_IB_DISABLE=1 prevents the IB/RoCE transport, NCCL uses IP sockets instead.
        # preflight's recommendation (ncclenv.ib_env) sets NCCL_IB_HCA on these ports instead.
        hosts = sorted(with_ib)
        found.append(EnvFinding(Status.WARN, f"NCCL_IB_DISABLE=1 ({disable[1]}) makes NCCL use TCP sockets, but "
                                f"every host ({', '.join(hosts)}) has an active IB/RoCE port: the collectives run at "
                                f"socket speed",
                                f"unset NCCL_IB_DISABLE (remove it from {disable[1]}) and use the NCCL_IB_HCA that "
                                f"preflight recommends"))
    if disable and disable[0].strip() == "0":
        bad = sorted(h for h, n in with_ib.items() if not any(p.get("active") for p in n["ib"]))
        if bad:
            names = ", ".join(bad)
            found.append(EnvFinding(Status.WARN, f"NCCL_IB_DISABLE=0 ({disable[1]}) asks for InfiniBand/RoCE, but "
                                    f"{names} has no active IB port: NCCL uses TCP sockets there",
                                    "bring the IB ports up (ibstat) or unset NCCL_IB_DISABLE", bad))
    return found


def _interface_findings(exported: Dict[str, List[str]], host_net: Dict[str, Dict[str, Any]]) -> List[EnvFinding]:
    known = {h: n for h, n in host_net.items() if isinstance(n, dict) and n.get("ifnames") is not None}
    return _socket_ifname_findings(exported, known) + _ib_findings(exported, known)
