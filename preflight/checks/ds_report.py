"""DeepSpeed op compatibility (what ``ds_report`` shows), ninja for JIT builds, and the /dev/shm size. An op counts
as usable when it is pre-built, or compatible and its JIT build can run here: ninja, a C++ compiler, and for a CUDA
op under a CUDA torch the toolkit's nvcc of torch's major version (``preflight/hostside/jit.py``).

Asks DeepSpeed's own API (ALL_OPS[name].is_compatible(False)) in a child Python; falls back to running
``ds_report`` and parsing its coloured text (ANSI codes stripped):

    [WARNING]  async_io requires the dev libaio .so object and headers but these were not found.
    async_io ............... [NO] ....... [NO]
    fused_adam ............. [NO] ....... [OKAY]
    ...
    deepspeed info ................... 0.19.8, unknown, unknown
    shared memory (/dev/shm) size .... 128.00 GB

Thresholds: [ds_report] in ds_report.toml beside this module (required_ops, ignore_ops, shm_min_mib). Required ops are
``thresholds["ds_report"]["required_ops"]`` plus any ``required_ops`` the coordinator passed in ctx.params
(recorded in facts), so evaluate stays a pure function of facts and thresholds.
"""
from __future__ import annotations

import json
import os
import shlex
import re
import shutil
import sys
from typing import Any, Dict, List, Optional, Set

from ..hostside.fixes import pip_fix, pip_install, pip_phrase, python_word
from ..hostside.outcome import Finding, Outcome, Status, combine, error, limits
from ..hostside.seams import CheckSpec, HostContext
from ..hostside import jit
from ..hostside.proc import fork_python, sh

NAME = "ds_report"

_MARK = "@@PREFLIGHT_DS_REPORT@@"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_OP_ROW = re.compile(r"^(\w+)\s+\.+\s+\[(YES|NO)\]\s+\.+\s+\[(OKAY|NO)\]\s*$")
_NINJA_ROW = re.compile(r"^ninja\s+\.+\s+\[(OKAY|FAIL|NO)\]\s*$")
_ENV_ROW = re.compile(r"^(.+?)\s+\.{3,}\s+(.*)$")
_UNITS = {"B": 1, "KB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3, "TB": 1024 ** 4}

# What DeepSpeed's builders need when is_compatible() says no (op_builder/*.py and their warnings).
OP_FIXES = {
    "async_io": "sudo apt-get install -y libaio-dev gcc (RHEL: sudo dnf install -y libaio-devel gcc); the runtime "
                "libaio1/libaio.so.1 alone is not enough, DeepSpeed links a test program with -laio",
    "gds": "install libaio-dev as for async_io and NVIDIA GPUDirect Storage (libcufile: sudo apt-get install -y "
           "nvidia-gds)",
    "evoformer_attn": "{pip_cutlass}, or clone CUTLASS and export CUTLASS_PATH=/path/to/cutlass",
    "sparse_attn": "sparse_attn needs torch 1.x with triton 1.0; it is not available on torch 2.x",
    "fp_quantizer": "install the triton version that the ds_report warning names, with the job's interpreter's "
                    "pip ({pip_triton} followed by that version)",
}

_API_SCRIPT = r'''
import importlib.util, json, sys
out = {"deepspeed": None, "torch": None, "torch_cuda": None, "ops": {}, "installed": None,
       "import_error": None, "ninja_module": None}
try:
    import torch
    out["torch"] = str(torch.__version__)
    out["torch_cuda"] = getattr(torch.version, "cuda", None)
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import ninja  # noqa: F401 - what DeepSpeed's jit_load and ds_report test
    out["ninja_module"] = True
except Exception:
    out["ninja_module"] = False
try:
    out["installed"] = importlib.util.find_spec("deepspeed") is not None
except Exception as exc:
    out["installed"] = False
if out["installed"]:
    try:
        import deepspeed
        out["deepspeed"] = str(deepspeed.__version__)
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        try:
            from deepspeed.ops.op_builder.builder import CUDAOpBuilder
        except Exception:
            CUDAOpBuilder = None
        try:
            from deepspeed.git_version_info import installed_ops, accelerator_name
            from deepspeed.accelerator import get_accelerator
            same_acc = accelerator_name == get_accelerator()._name
        except Exception:
            installed_ops, same_acc = {}, False
        for name, builder in ALL_OPS.items():
            entry = {"installed": bool(installed_ops.get(name, False)) and same_acc}
            if CUDAOpBuilder is not None:
                entry["cuda"] = isinstance(builder, CUDAOpBuilder)  # its JIT build needs nvcc (on a CUDA torch)
            try:
                entry["compatible"] = bool(builder.is_compatible(False))
                note = getattr(builder, "error_log", None)
                entry["note"] = str(note)[:500] if note else None
            except Exception as exc:
                entry["compatible"] = False
                entry["note"] = f"is_compatible raised {type(exc).__name__}: {str(exc)[:300]}"
            out["ops"][name] = entry
    except Exception as exc:
        out["import_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
else:
    out["import_error"] = "ModuleNotFoundError: No module named 'deepspeed'"
sys.stdout.flush()
print("\n" + MARK + json.dumps(out))
'''


# --- pure parsers ----------------------------------------------------------------------------

def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def parse_size(text: Optional[str]) -> Optional[int]:
    """DeepSpeed's human_readable_size ('128.00 GB', 1024-based) -> bytes."""
    if not text:
        return None
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)\b", text.strip())
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_ds_report(text: str) -> Dict[str, Any]:
    """``ds_report`` stdout -> {"ninja", "ops": {name: {installed, compatible, note}}, "deepspeed", "torch",
    "torch_cuda", "nvcc", "shm_bytes", "env": {label: value}}. Warnings printed before an op's row become its note."""
    result: Dict[str, Any] = {"ninja": None, "ops": {}, "deepspeed": None, "torch": None, "torch_cuda": None,
                              "nvcc": None, "shm_bytes": None, "env": {}}
    pending: List[str] = []
    in_env = False
    for raw in strip_ansi(text).splitlines():
        line = raw.strip()
        if not line or set(line) == {"-"}:
            continue
        if line.startswith("DeepSpeed general environment info"):
            in_env = True
            continue
        m = _NINJA_ROW.match(line)
        if m and not in_env:
            result["ninja"] = m.group(1) == "OKAY"
            continue
        m = _OP_ROW.match(line)
        if m and not in_env:
            result["ops"][m.group(1)] = {"installed": m.group(2) == "YES", "compatible": m.group(3) == "OKAY",
                                         "note": " ".join(pending)[:500] or None}
            pending = []
            continue
        if in_env:
            m = _ENV_ROW.match(line)
            if m:
                result["env"][m.group(1).strip()] = m.group(2).strip()
            continue
        if result["ops"] or line.startswith("[WARNING]") or pending:
            if not line.startswith("op name"):
                pending.append(re.sub(r"^\[WARNING\]\s*", "", line))
    env = result["env"]
    if env.get("deepspeed info"):
        result["deepspeed"] = env["deepspeed info"].split(",")[0].strip() or None
    result["torch"] = env.get("torch version")
    result["torch_cuda"] = env.get("torch cuda version")
    nvcc = env.get("nvcc version")
    result["nvcc"] = nvcc if nvcc and re.match(r"^\d+\.\d+", nvcc) else None
    result["shm_bytes"] = parse_size(env.get("shared memory (/dev/shm) size"))
    return result


def parse_api_output(stdout: str) -> Optional[Dict[str, Any]]:
    """The child's last marker line -> its JSON (None when it crashed before printing it)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARK):
            try:
                return json.loads(line[len(_MARK):])
            except ValueError:
                return None
    return None


# --- host side -------------------------------------------------------------------------------

def _shm_bytes() -> Optional[int]:
    """As DeepSpeed's env_report.get_shm_size: f_frsize * f_blocks of /dev/shm."""
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, ValueError):
        return None
    return int(st.f_frsize * st.f_blocks)


def collect(ctx: HostContext) -> Dict[str, Any]:
    facts: Dict[str, Any] = {
        "deepspeed": None, "torch": None, "torch_cuda": None, "ops": {}, "ninja": False, "ninja_module": None,
        "ninja_binary": shutil.which("ninja"), "shm_bytes": _shm_bytes(), "source": None, "installed": None,
        "import_error": None, "python": sys.executable, "api_error": None, "ds_report_error": None,
        "tool_timeout": None, "required_ops": list(ctx.params.get("required_ops") or []),
    }
    script = _API_SCRIPT.replace("MARK", repr(_MARK))
    if "torch" in sys.modules and hasattr(os, "fork"):
        # The python check imported torch in this process: a forked child has it already, and imports only
        # DeepSpeed. Otherwise (no torch here, or it failed) a fresh interpreter, as ds_report itself runs.
        res = fork_python(script, timeout=ctx.remaining(240))
    else:
        res = sh([sys.executable, "-c", script], timeout=ctx.remaining(240))
    api = parse_api_output(res.out)
    if api is None:
        facts["api_error"] = f"rc={res.rc}: {(res.err or res.out).strip()[-500:]}"
        if res.rc == 124:
            facts["tool_timeout"] = f"DeepSpeed op report timed out after {res.duration:.0f}s"
    else:
        for key in ("deepspeed", "torch", "torch_cuda", "installed", "import_error", "ninja_module"):
            facts[key] = api.get(key)
        if api.get("deepspeed") and not api.get("import_error"):
            facts["ops"] = api.get("ops") or {}
            facts["source"] = "api"

    if facts["source"] is None:
        # DeepSpeed may live in another environment whose ds_report is on PATH (or the child crashed).
        rep = sh(["ds_report"], timeout=ctx.remaining(240))
        if rep.ok and "op name" in strip_ansi(rep.out):
            parsed = parse_ds_report(rep.out)
            facts.update(deepspeed=parsed["deepspeed"], torch=parsed["torch"], torch_cuda=parsed["torch_cuda"],
                         ops=parsed["ops"], source="ds_report", ds_report_path=shutil.which("ds_report"))
            facts["ninja_module"] = parsed["ninja"]
            if parsed["shm_bytes"] is not None and facts["shm_bytes"] is None:
                facts["shm_bytes"] = parsed["shm_bytes"]
        else:
            facts["ds_report_error"] = f"rc={rep.rc}: {(rep.err or rep.out).strip()[-300:]}"
            if rep.rc == 124:
                facts["tool_timeout"] = f"ds_report timed out after {rep.duration:.0f}s"
    facts["ninja"] = bool(facts["ninja_module"]) and facts["ninja_binary"] is not None
    # What a JIT build would use here (CUDA_HOME and its nvcc, the C++ compiler, DS_SKIP_CUDA_CHECK): an op that is
    # compatible but not pre-built is usable only if its build can run (hostside/jit.py).
    tools = jit.build_tools(timeout=ctx.remaining(20))
    for key in ("cuda_home", "cuda_home_from", "nvcc", "nvcc_path", "nvcc_error", "cxx", "cxx_name",
                "ds_skip_cuda_check"):
        facts[key] = tools.get(key)
    # An op whose build directory holds a lock nobody holds cannot be loaded: every load waits on it forever.
    scan = jit.extensions_facts(ctx.params)
    facts["locked_ops"] = [{"op": d["op"], "path": d["lock"]["path"], "age_s": d["lock"]["age_s"]}
                           for d in jit.stale_locks(scan)]
    return facts


# --- evaluation ------------------------------------------------------------------------------

def _op_fix(name: str, python: Any = None) -> str:
    """What op ``name`` needs; pip runs in the job's interpreter (python: its sys.executable on the host)."""
    fix = OP_FIXES.get(name, f"run `ds_report` on this host to see why {name} is not compatible and install what "
                             "its warning names")
    word = python_word(python) or "python3"
    return fix.format(pip_cutlass=pip_phrase(python, "nvidia-cutlass"),
                      pip_triton=f"{word} -m pip install triton==")


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    required: List[str] = []
    for op in list(limits(thresholds, NAME)["required_ops"]) + list(facts.get("required_ops") or []):
        if op not in required:
            required.append(op)
    ignore = set(limits(thresholds, NAME)["ignore_ops"])
    python = facts.get("python") or "python3"
    metrics: Dict[str, Any] = {"deepspeed": facts.get("deepspeed"), "torch": facts.get("torch"),
                               "source": facts.get("source"), "shm_bytes": facts.get("shm_bytes"),
                               "required_ops": required}
    if not facts.get("deepspeed"):
        return _without_deepspeed(facts, python, required, metrics)
    if not facts.get("source"):
        why = facts.get("import_error") or facts.get("api_error")
        return error(f"DeepSpeed {facts.get('deepspeed')} imports but its op table could not be read ({why}; "
                     f"ds_report: {facts.get('ds_report_error')})", "run `ds_report` on the host by hand", **metrics)

    ops: Dict[str, Dict[str, Any]] = facts.get("ops") or {}
    findings = _op_findings(ops, required, ignore, facts.get("deepspeed"), python)
    if not facts.get("ninja"):
        findings.append(_no_ninja(facts, ops, required, python))
    shm = facts.get("shm_bytes")
    findings.extend(_shm_findings(shm, int(limits(thresholds, NAME)["shm_min_mib"]) * 1024 * 1024))

    # Usable: pre-built, or compatible and its JIT build can run here (a CUDA op needs nvcc, every op ninja and a
    # C++ compiler): ds_report's "compatible" alone counts CUDA ops on a host without a CUDA toolkit.
    locked = {e["op"]: e for e in facts.get("locked_ops") or [] if float(e.get("age_s") or 0) >= jit.STALE_MIN_AGE_S}
    usable = [op for op in ops if jit.usable(op, facts) and op not in locked]
    unbuildable = sorted(op for op, e in ops.items() if e.get("compatible") and not e.get("installed")
                         and op not in usable and op not in locked)
    why_not = ""
    if unbuildable:
        reasons = sorted({b.short for op in unbuildable for b in jit.blockers(op, facts) if b.status == Status.FAIL})
        why_not = f" ({len(unbuildable)} compatible but not buildable here: {'; '.join(reasons)})"
    if locked:
        why_not += (f" ({len(locked)} locked by a stale torch extensions lock, every load waits on it: "
                    f"{', '.join(sorted(locked))}; see ext_locks)")
    required_usable = f", required {required} usable" if required else ""
    ok = (f"DeepSpeed {facts.get('deepspeed')} (torch {facts.get('torch')}, via {facts.get('source')}): "
          f"{len(usable)}/{len(ops)} ops usable{why_not}{required_usable}; ninja present; "
          f"/dev/shm {(shm or 0) // 1048576} MiB")
    metrics["ops_usable"] = len(usable)
    metrics["ops_unbuildable"] = unbuildable
    metrics["ops_locked"] = sorted(locked)
    metrics["ops_total"] = len(ops)
    return combine(findings, ok, metrics)


def _without_deepspeed(facts: Dict[str, Any], python: str, required: List[str], metrics: Dict[str, Any]) -> Outcome:
    """No DeepSpeed version: it does not import (FAIL), the report could not be had (ERROR), or it is not installed
    (FAIL when ops are required, else SKIP)."""
    if facts.get("installed") and facts.get("import_error"):
        return combine([Finding(Status.FAIL, f"DeepSpeed is installed for {python} but `import deepspeed` fails: "
                                f"{facts['import_error']}",
                                pip_fix("reinstall it into that interpreter, then check that it imports", python,
                                        "--force-reinstall", "deepspeed")
                                + (f"\n  {python_word(python)} -c 'import deepspeed'" if python_word(python) else
                                   ""))], "", metrics)
    if facts.get("tool_timeout"):
        return error(f"could not get DeepSpeed's op report: {facts['tool_timeout']}",
                     "run `ds_report` on the host by hand", **metrics)
    if facts.get("installed") is None and facts.get("api_error"):
        return error(f"could not run the DeepSpeed op report (child {python}: {facts['api_error']}; ds_report: "
                     f"{facts.get('ds_report_error')})",
                     f"run `{shlex.quote(str(python))} -c 'import deepspeed'` and `ds_report` on the host by hand",
                     **metrics)
    why = facts.get("import_error") or facts.get("api_error") or "not importable"
    reason = f"DeepSpeed is not installed for {python} ({why}) and no ds_report is on PATH"
    fix = pip_install(python, "deepspeed")
    if required:
        return combine([Finding(Status.FAIL, reason + f", but required_ops = {required}", fix)], "", metrics)
    return Outcome(Status.SKIP, reason + "; op checks do not apply", fix, metrics)


def _op_findings(ops: Dict[str, Dict[str, Any]], required: List[str], ignore: Set[str],
                 deepspeed: Any, python: Any = None) -> List[Finding]:
    """FAIL for a required op that is unknown or neither pre-built nor JIT-buildable; WARN for any other such op
    not in ignore_ops."""
    findings: List[Finding] = []
    for op in required:
        entry = ops.get(op)
        if entry is None:
            findings.append(Finding(Status.FAIL, f"required op {op!r} is not a DeepSpeed {deepspeed} op (known: "
                                    f"{', '.join(sorted(ops))})",
                                    "fix the name in [ds_report] required_ops"))
        elif not entry.get("installed") and not entry.get("compatible"):
            note = ": " + entry["note"] if entry.get("note") else ""
            findings.append(Finding(Status.FAIL, f"required op {op} is neither pre-built nor compatible for a JIT "
                                                 f"build (installed NO, compatible NO){note}",
                                    _op_fix(op, python)))
    for op, entry in sorted(ops.items()):
        if op in required or op in ignore:
            continue
        if not entry.get("installed") and not entry.get("compatible"):
            note = ": " + entry["note"] if entry.get("note") else ""
            findings.append(Finding(Status.WARN, f"op {op} is not compatible (cannot be JIT-built here){note}",
                                    _op_fix(op, python)
                                    + " (or add it to [ds_report] ignore_ops if the job does not use it)"))
    return findings


def _no_ninja(facts: Dict[str, Any], ops: Dict[str, Dict[str, Any]], required: List[str], python: str) -> Finding:
    """ninja is missing: FAIL when a required op needs a JIT build, else WARN."""
    needs_jit = [op for op in required if op in ops and not ops[op].get("installed")]
    missing = []
    if not facts.get("ninja_module"):
        missing.append("the ninja Python package (DeepSpeed checks `import ninja`)")
    if not facts.get("ninja_binary") and facts.get("source") == "api":
        missing.append("the ninja binary on PATH (torch's JIT build runs `ninja --version`)")
    what = "; ".join(missing) or "not found"
    required_jit = f"; required ops needing JIT: {needs_jit}" if needs_jit else ""
    return Finding(
        Status.FAIL if needs_jit else Status.WARN,
        f"ninja is missing ({what}): ops that are not pre-built cannot be JIT-compiled{required_jit}",
        pip_fix("install ninja into the job's interpreter (and make sure its bin directory is on PATH for "
                "non-interactive ssh)", python, "ninja"))


def _shm_findings(shm: Optional[int], shm_min: int) -> List[Finding]:
    """A WARN when /dev/shm is missing or below shm_min bytes."""
    if shm is None:
        return [Finding(Status.WARN, "/dev/shm is missing or unreadable; NCCL and DataLoader workers use it",
                        "mount a tmpfs: sudo mount -t tmpfs -o size=16g tmpfs /dev/shm (docker: "
                        "--shm-size=16g or --ipc=host)")]
    if shm < shm_min:
        return [Finding(Status.WARN, f"/dev/shm is {shm // 1048576} MiB, below {shm_min // 1048576} MiB (DeepSpeed's "
                                     "ds_report warns below 512 MiB; NCCL's shared-memory transport needs it)",
                        "docker run --shm-size=16g (or --ipc=host); on a host: sudo mount -o remount,size=16g "
                        "/dev/shm")]
    return []


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="DeepSpeed importable, op compatibility (ds_report) and ops usable (a JIT build needs ninja, a C++ "
                "compiler, nvcc for CUDA ops), /dev/shm size",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
    # The agent imports torch once before the host checks when a selected check uses it (agent.py, preload).
    uses_torch=True,
    params_from_options=jit.launch_params,  # TORCH_EXTENSIONS_DIR as the launch's .deepspeed_env sets it
)
