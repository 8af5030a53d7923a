"""The recommended NCCL/Gloo environment for the job: every check's contribution gathered, checked and merged.

A check that knows something about the environment declares ``SPEC.recommend`` (hostside/seams.py: a pure
``RecommendInput -> Recommendation``); this module names no check. After the run it gives each contribution, in
ORDER, the facts of its check and of the checks it reads, then sets the variables the parts ask for, each with its
reason, e.g. ``NCCL_SOCKET_IFNAME = "=eth1"`` because "network 10.1.0.0/24 reaches all hosts with the best
measured bandwidth ...", and adds what holds for every job: NCCL_DEBUG, TORCH_NCCL_ASYNC_ERROR_HANDLING (PyTorch's
distributed docs) and the folklore never to set. Every value passes one gate before it is printed or written to
DeepSpeed's .deepspeed_env (``env_file_text``).
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple

from preflight import checks as registry
from preflight.hostside import validate
from preflight.hostside.outcome import Status
from preflight.hostside.seams import CheckSpec, EnvVar, Recommendation, RecommendInput

Env = Dict[str, str]

# Folklore that must never be recommended, with what to say instead.
NEVER = {
    "NCCL_TIMEOUT": "NCCL_TIMEOUT does not exist: set the collective timeout with "
                    "torch.distributed.init_process_group(timeout=datetime.timedelta(minutes=N)) "
                    "(DeepSpeed: deepspeed.init_distributed(timeout=...)); the default is 10 minutes",
    # NCCL's env docs: NCCL_MIN_NRINGS (until 2.4) became NCCL_MIN_NCHANNELS; NCCL_MIN_CTAS is a separate knob.
    "NCCL_MIN_NRINGS": "NCCL_MIN_NRINGS is the pre-2.5 name of NCCL_MIN_NCHANNELS (still read as an alias, ignored "
                       "when NCCL_MIN_NCHANNELS is set); NCCL tunes channels itself",
    "NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING is PyTorch's legacy name: use "
                                 "TORCH_NCCL_ASYNC_ERROR_HANDLING (recommended above)",
}
# The only variables preflight ever writes to the --env-file (DeepSpeed's .deepspeed_env): a key outside this set is
# a bug, never something a host could add.
OWNED_KEYS = frozenset({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA",
                        "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
# What every job gets, whatever the checks found.
GENERAL = (
    EnvVar("NCCL_DEBUG", "WARN", "NCCL prints the reason of a failure instead of failing silently; INFO for more"),
    EnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
           "a failed or timed-out collective aborts the job instead of hanging it (the legacy "
           "NCCL_ASYNC_ERROR_HANDLING is deprecated)"),
)


def _master_address(cluster: Any, hosts: List[str]) -> Optional[str]:
    if not hosts or not hasattr(cluster, "address"):
        return None
    try:
        return cluster.address(hosts[0])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def contribution_input(spec: CheckSpec, cluster: Any, results: Sequence[Any]) -> RecommendInput:
    """What ``spec.recommend`` may see: the reachable hosts, and the facts and FAILed hosts of its own check and
    of the checks it declares in ``reads`` (nothing else of the run)."""
    hosts = [h.name for h in cluster.hosts]
    names = (spec.name,) + tuple(spec.reads)
    every = getattr(cluster, "facts", {}) or {}
    facts: Dict[str, Dict[str, Any]] = {}
    for key in hosts + ["*"]:
        per = every.get(key)
        if isinstance(per, dict):
            mine = {name: per[name] for name in names if per.get(name) is not None}
            if mine:
                facts[key] = mine
    failed = {name: sorted({r.host for r in results if r.check == name and r.status == Status.FAIL})
              for name in names}
    return RecommendInput(hosts, facts, {k: v for k, v in failed.items() if v}, _master_address(cluster, hosts))


def _refused(part: Recommendation) -> List[str]:
    """The variables of a part that preflight does not own (or must never set): a bug in that check."""
    if not isinstance(part, Recommendation):
        return ["its answer %s (expected a Recommendation)" % type(part).__name__]
    return [str(s.name) for s in part.steps if isinstance(s, EnvVar) and (s.name in NEVER or s.name not in OWNED_KEYS)]


def recommend(cluster: Any, results: List[Any],
              specs: Optional[Sequence[CheckSpec]] = None) -> Tuple[Env, Dict[str, str], List[str]]:
    """(env, {var: reason}, notes) for the job; the runner prints them and writes the --env-file.

    specs: the checks whose contributions to gather, in order (default: every registered check)."""
    env: Env = {}
    reasons: Dict[str, str] = {}
    notes: List[str] = []
    caveats: List[str] = []

    def put(var: EnvVar) -> None:
        if not validate.env_key(var.name) or not validate.env_value(var.value):
            # The last gate before the printed exports and the --env-file: whatever a host reported, nothing a
            # shell or DeepSpeed's `export K="V"` would interpret gets through.
            notes.append("not recommending %s: its value %s holds characters a shell would interpret"
                         % (validate.quote(var.name), validate.quote(var.value)))
            return
        env[var.name] = var.value
        reasons[var.name] = var.why

    for spec in registry.all_specs() if specs is None else specs:
        if spec.recommend is None:
            continue
        try:
            part = spec.recommend(contribution_input(spec, cluster, results))
            refused = _refused(part)
            if refused:
                raise ValueError("refusing to recommend %s" % ", ".join(refused))
        except Exception as exc:  # one check's bug costs its part of the environment, never the run
            notes.append("no recommendation from the %s check (%s: %s)"
                         % (spec.name, type(exc).__name__, validate.quote(str(exc))))
            continue
        for step in part.steps:
            if isinstance(step, EnvVar):
                put(step)
            else:
                notes.append(str(step))
        caveats.extend(str(c) for c in part.caveats)
    for var in GENERAL:
        put(var)
    notes.extend(NEVER.values())
    notes.extend(caveats)
    return env, reasons, notes


def safe_env(env: Env) -> Env:
    """The variables that may be written or printed: owned keys whose values a shell would not interpret."""
    return {k: v for k, v in env.items() if k in OWNED_KEYS and validate.env_value(v)}


def env_file_text(env: Env) -> str:
    """DeepSpeed's .deepspeed_env: one KEY=VALUE line per variable and nothing else (a blank line crashes its
    launcher). Its pdsh runner turns each line into `export K=V` (quoted as "V" when V has other characters than
    [\\w@%+=:,./-]) in a shell on every node, so each value is checked again here: no $, `, ", \\ or newline."""
    return "".join("%s=%s\n" % (k, v) for k, v in safe_env(env).items())


def export_lines(env: Env) -> List[str]:
    """The same variables as env_file_text, as shell lines to paste (shlex-quoted, so the same text)."""
    return ["export %s=%s" % (k, shlex.quote(v)) for k, v in safe_env(env).items()]
