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
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

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


def blockers(op: str, facts: Mapping[str, Any], launch_env: Optional[Mapping[str, str]] = None) -> List[Blocker]:
    """What stops the JIT build of ``op`` on a host whose ds_report facts are ``facts`` (ops, ninja_binary or ninja,
    torch_cuda, nvcc, cuda_home, nvcc_error, cxx, cxx_name, ds_skip_cuda_check); [] when it is
    pre-built, not compatible (ds_report's own verdict says so), or nothing stops it. A fact that was not recorded
    is no blocker."""
    entry = (facts.get("ops") or {}).get(op)
    if not isinstance(entry, Mapping) or entry.get("installed") or not entry.get("compatible"):
        return []
    found: List[Blocker] = []
    ninja = facts.get("ninja_binary") if "ninja_binary" in facts else facts.get("ninja")
    if not ninja:
        # DeepSpeed 0.19.8 jit_load: torch's verify_ninja_availability runs `ninja --version` (builder.py:573-577).
        found.append(Blocker(Status.FAIL, "no ninja on PATH: the JIT build stops with \"Unable to JIT load the "
                             f"{op} op due to ninja not being installed.\"",
                             "python -m pip install ninja in the job's environment, with its bin directory on the "
                             "PATH of a non-interactive ssh login", "no ninja"))
    if "cxx" in facts and not facts.get("cxx"):
        name = facts.get("cxx_name") or "c++"
        origin = "$CXX" if name != "c++" else "$CXX unset, so c++"
        found.append(Blocker(Status.FAIL, f"no C++ compiler: torch builds the op with {name} ({origin}), not found on "
                             "PATH",
                             "install one (apt-get install -y g++; dnf install -y gcc-c++), or point CXX at it in "
                             "the job's environment (.deepspeed_env)", f"no C++ compiler ({name})"))
    if not (is_cuda_op(op, entry) and needs_cuda(facts)):
        return found
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
                             f"DS_BUILD_{op.upper()}=1 pip install deepspeed", "no nvcc"))
        return found
    if torch_cuda and major(nvcc) is not None and major(nvcc) != major(torch_cuda):
        source = skip_cuda_check(facts, launch_env)
        consequence = (f"nvcc {nvcc} and torch's CUDA {torch_cuda} differ in major version: the JIT build compiles "
                       f"{op} against CUDA {nvcc} inside a process that runs torch's CUDA {torch_cuda}; DeepSpeed "
                       "refuses this pair with CUDAMismatchException (op_builder/builder.py:107-129: at every JIT "
                       "build before DeepSpeed 0.12.3, and when pre-building, DS_BUILD_OPS=1 pip install deepspeed, "
                       "which therefore fails the same way here)")
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


def usable(op: str, facts: Mapping[str, Any], launch_env: Optional[Mapping[str, str]] = None) -> bool:
    """Pre-built, or compatible and nothing FAILs its JIT build here."""
    entry = (facts.get("ops") or {}).get(op) or {}
    if entry.get("installed"):
        return True
    return bool(entry.get("compatible")) and not any(b.status == Status.FAIL
                                                     for b in blockers(op, facts, launch_env))
