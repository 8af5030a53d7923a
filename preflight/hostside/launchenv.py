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
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .outcome import Status

# runner.py:36 EXPORT_ENVS, plus the CUDA accelerator's export_envs() (cuda_accelerator.py:411-412).
EXPORTED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
# The variables a check looks at in the coordinator's shell.
WATCHED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "DS_", "DEEPSPEED_", "CUDA_", "GLOO_")
# Set in the shell, not exported by pdsh, and meant for the ranks (CUDA_HOME and the like are each host's own).
MEANT_FOR_RANKS = ("TORCH_NCCL_", "DS_", "DEEPSPEED_", "GLOO_")

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
# deepspeed/accelerator/real_accelerator.py:23 SUPPORTED_ACCELERATOR_LIST; another DS_ACCELERATOR raises
# ValueError in get_accelerator() (:111-113), in the launcher and in every rank.
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
    out: Dict[str, Any] = {"files": [], "vars": {}, "sources": {}, "bad_lines": []}
    for folder in (home if home is not None else os.path.expanduser("~"), cwd if cwd is not None else "."):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.abspath(path) in out["files"]:
            continue
        try:
            with open(path, errors="replace") as f:
                lines = f.read(1 << 20).splitlines()
        except OSError:
            continue
        out["files"].append(os.path.abspath(path))
        for n, line in enumerate(lines, 1):
            key, sep, value = line.partition("=")
            if not sep:
                out["bad_lines"].append(f"{path}:{n}: {line[:200]}")
                continue
            out["vars"][key.strip()] = value.strip()
            out["sources"][key.strip()] = os.path.abspath(path)
    return out


def snapshot(environ: Mapping[str, str], deepspeed_env: Dict[str, Any]) -> Dict[str, Any]:
    """What the ranks of a multi-host pdsh launch will have: {"shell": the watched variables of the launch shell,
    "exported": {name: (value, "shell" | "<.deepspeed_env path>")}, "deepspeed_env": deepspeed_env}."""
    shell = {k: v for k, v in environ.items() if k.startswith(WATCHED_PREFIXES + EXPORTED_PREFIXES)}
    exported: Dict[str, List[str]] = {k: [v, "the launch shell"] for k, v in shell.items()
                                      if k.startswith(EXPORTED_PREFIXES)}
    where = deepspeed_env.get("files") or []
    sources = deepspeed_env.get("sources") or {}  # absent in facts recorded before it was kept
    for k, v in (deepspeed_env.get("vars") or {}).items():
        exported[k] = [v, sources.get(k) or (where[-1] if where else ".deepspeed_env")]
    return {"shell": shell, "exported": exported, "deepspeed_env": deepspeed_env}


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


def check(snap: Dict[str, Any], host_net: Dict[str, Dict[str, Any]]) -> List[EnvFinding]:
    """Findings on what every rank inherits. host_net: {host: {"ifnames": [...], "ib": [{"device", "port",
    "active"}]}} from the interfaces check's facts (hosts without them are not judged on names)."""
    found: List[EnvFinding] = []
    exported: Dict[str, List[str]] = snap.get("exported") or {}
    shell: Dict[str, str] = snap.get("shell") or {}
    ds_env = snap.get("deepspeed_env") or {}
    for line in ds_env.get("bad_lines") or []:
        found.append(EnvFinding(Status.FAIL, f"{line} has no '=': DeepSpeed's launcher raises ValueError "
                                "(\"not enough values to unpack\", runner.py:610) before any rank starts",
                                "make every line KEY=VALUE, with no empty lines"))
    seen = dict(exported)
    for k, v in shell.items():
        seen.setdefault(k, [v, "the launch shell"])
    for name in sorted(seen):
        value, source = seen[name]
        if name in NO_SUCH:
            found.append(EnvFinding(Status.WARN, f"{name}={value} ({source}) has no effect: {NO_SUCH[name]}",
                                    f"unset {name}; set the timeout where it is read"))
        elif name in LEGACY:
            found.append(EnvFinding(Status.WARN, f"{name} ({source}) is the legacy name of {LEGACY[name]}",
                                    f"rename it {LEGACY[name]}={value}"))
    accel = seen.get("DS_ACCELERATOR")
    if accel and accel[0] not in ACCELERATORS:
        found.append(EnvFinding(Status.FAIL, f"DS_ACCELERATOR={accel[0]} ({accel[1]}) is not an accelerator "
                                "DeepSpeed knows: get_accelerator() raises ValueError (\"DS_ACCELERATOR must be one "
                                "of ...\", real_accelerator.py:111-113)",
                                "unset it (DeepSpeed detects the accelerator) or use one of "
                                f"{', '.join(ACCELERATORS)}"))
    found.extend(_error_handling_findings(seen))
    for name in sorted(k for k in shell if k.startswith(MEANT_FOR_RANKS) and k not in exported):
        found.append(EnvFinding(Status.WARN, f"{name}={shell[name]} is set in the launch shell, but DeepSpeed's pdsh "
                                "launcher does not pass it to the ranks (it exports only NCCL*, PYTHON*, UCX*, MV2*, "
                                "MLFLOW* and the .deepspeed_env lines, runner.py:36 and :596-611)",
                                f"put {name}={shell[name]} in .deepspeed_env (in the directory you run deepspeed "
                                "from, or ~)"))
    found.extend(_interface_findings(exported, host_net))
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


def _interface_findings(exported: Dict[str, List[str]], host_net: Dict[str, Dict[str, Any]]) -> List[EnvFinding]:
    found: List[EnvFinding] = []
    known = {h: n for h, n in host_net.items() if isinstance(n, dict) and n.get("ifnames") is not None}
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
