"""The recommended NCCL/Gloo environment for the job: every check's contribution gathered, checked and merged.

A check that knows something about the environment declares ``SPEC.recommend`` (hostside/seams.py: a pure
``RecommendInput -> Recommendation``); this module names no check. After the run it gives each contribution, in
ORDER, the facts of its check and of the checks it reads, then sets the variables the parts ask for, each with its
reason, e.g. ``NCCL_SOCKET_IFNAME = "=eth1"`` because "network 10.1.0.0/24 reaches all hosts with the best
measured bandwidth ...", and adds what holds for every job (NCCL_DEBUG), and a note on each variable of the folklore
never to set (NEVER) that the ranks would inherit today. Every value passes one gate before it is printed or written to
DeepSpeed's .deepspeed_env (``env_file_text``).

It then compares the result with what DeepSpeed's launcher would pass the ranks today (the launch shell's NCCL*
variables and the .deepspeed_env lines, hostside/launchenv.py), one state per variable (``env_diff``)::

    NCCL_SOCKET_IFNAME  set        (nothing inherited)
    NCCL_DEBUG          unchanged  (WARN in /job/.deepspeed_env)
    NCCL_IB_DISABLE     changed    (0 in the launch shell -> 1)
    TORCH_NCCL_ASYNC_ERROR_HANDLING  not set  (1 in ~/.deepspeed_env: preflight recommends nothing, it stays)

and an inherited value that contradicts a measured one (a check's contribution, not a general default) is a WARN
of the check that judged the inherited environment (``contradictions``, ``add_to_inherited_row``).
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from preflight import checks as registry
from preflight.hostside import launchenv, validate
from preflight.hostside.outcome import Finding, Status, combine
from preflight.hostside.seams import CheckSpec, EnvVar, Recommendation, RecommendInput

Env = Dict[str, str]

# Folklore that must never be recommended, with what to say instead.
NEVER = {
    # torch 2.13: distributed_c10d.py _get_default_timeout -> constants.py default_pg_nccl_timeout, the C++
    # kProcessGroupNCCLDefaultTimeout (ProcessGroupNCCL.hpp:157-158, 10 min) for NCCL, default_pg_timeout
    # (kBackendDefaultTimeout, Backend.hpp:19-20, 30 min) for gloo and the others.
    "NCCL_TIMEOUT": "NCCL_TIMEOUT does not exist: set the collective timeout with "
                    "torch.distributed.init_process_group(timeout=datetime.timedelta(minutes=N)) "
                    "(DeepSpeed: deepspeed.init_distributed(timeout=...)); torch's default is 10 minutes for NCCL "
                    "and 30 minutes for gloo",
    # NCCL's env docs: NCCL_MIN_NRINGS (until 2.4) became NCCL_MIN_NCHANNELS; NCCL_MIN_CTAS is a separate knob.
    "NCCL_MIN_NRINGS": "NCCL_MIN_NRINGS is the pre-2.5 name of NCCL_MIN_NCHANNELS (still read as an alias, ignored "
                       "when NCCL_MIN_NCHANNELS is set); NCCL tunes channels itself",
    # Not "use TORCH_NCCL_ASYNC_ERROR_HANDLING": preflight does not recommend that either (NOT_NEEDED below).
    "NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING is PyTorch's legacy name of "
                                 "TORCH_NCCL_ASYNC_ERROR_HANDLING, which preflight does not recommend either: "
                                 "torch's default (3, SkipCleanUp) already ends the job when a collective fails or "
                                 "times out",
}
# The only variables preflight ever writes to the --env-file (DeepSpeed's .deepspeed_env): a key outside this set is
# a bug, never something a host could add.
OWNED_KEYS = frozenset({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA",
                        "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
# What every job gets, whatever the checks found. TORCH_NCCL_ASYNC_ERROR_HANDLING is not among them: torch's
# default, 3 (SkipCleanUp), already tears the process down on a failed or timed-out collective (ProcessGroupNCCL's
# getCvarInt(TORCH_NCCL_ASYNC_ERROR_HANDLING, 3); ErrorHandlingMode and SHOULD_TEAR_DOWN, ProcessGroupNCCL.hpp:
# 161-176 of torch 2.13; torch_nccl_environment_variables.md "By default, it is set to 3"), and 1 only adds an
# ncclCommAbort first, which the same header calls the step that can itself hang. An inherited 0 or 2 (the job
# hangs) is the inherited environment's WARN (hostside/launchenv.py).
GENERAL = (
    EnvVar("NCCL_DEBUG", "WARN", "NCCL prints the reason of a failure instead of failing silently; INFO for more"),
)
NOT_NEEDED = ("TORCH_NCCL_ASYNC_ERROR_HANDLING is not recommended: torch's default (3, SkipCleanUp) already ends "
              "the job when a collective fails or times out; only 0 or 2 keep it hanging (named above if inherited)")
# The variables whose note (NEVER, NOT_NEEDED) is printed only when the ranks would get them today: a note about a
# variable nobody set is noise (issue 30: -v printed all of them on every run).
NOTED = dict(NEVER, TORCH_NCCL_ASYNC_ERROR_HANDLING=NOT_NEEDED)
# The metric by which the check that judged the inherited environment marks its results (the launch shell's and
# .deepspeed_env's exported names, on its cluster row or the first host's): the contradictions join that check.
INHERITED_METRIC = "launch_env"
# Variables whose value is a list of NCCL names: the same names with or without '=' (exact) or ':port' match
# the same interfaces on hosts without look-alike names, so that is no contradiction.
NAME_LISTS = frozenset({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"})


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
        return [f"its answer {type(part).__name__} (expected a Recommendation)"]
    return [str(s.name) for s in part.steps if isinstance(s, EnvVar) and (s.name in NEVER or s.name not in OWNED_KEYS)]


class Advice(NamedTuple):
    """The whole recommendation: env, reasons and notes as ``recommend`` returns them; ``diff``: ``env_diff``
    against the inherited environment; ``findings``: the inherited values that contradict measured ones."""

    env: Env
    reasons: Dict[str, str]
    notes: List[str]
    diff: Dict[str, Dict[str, Any]]
    findings: List[Finding]


def recommend(cluster: Any, results: List[Any],
              specs: Optional[Sequence[CheckSpec]] = None) -> Tuple[Env, Dict[str, str], List[str]]:
    """(env, {var: reason}, notes) for the job; the runner prints them and writes the --env-file.

    specs: the checks whose contributions to gather, in order (default: every registered check)."""
    env, reasons, notes, _ = _gather(cluster, results, specs)
    return env, reasons, notes


def advise(cluster: Any, results: List[Any], specs: Optional[Sequence[CheckSpec]] = None,
           inherited: Optional[Mapping[str, Sequence[str]]] = None) -> Advice:
    """``recommend`` plus the comparison with what the launcher passes the ranks today. inherited: {name: [value,
    where]} (default: ``inherited_env()``, read on this machine, where preflight runs and deepspeed will)."""
    env, reasons, notes, measured = _gather(cluster, results, specs)
    given = inherited_env() if inherited is None else inherited
    diff = env_diff(env, given, measured)
    return Advice(env, reasons, set_notes(given) + notes, diff, contradictions(diff, reasons))


def set_notes(inherited: Mapping[str, Any]) -> List[str]:
    """The notes on folklore (NEVER) and on TORCH_NCCL_ASYNC_ERROR_HANDLING (NOT_NEEDED), for the variables that
    are set (``inherited``: what the ranks get today), in NOTED's order; none for a variable nobody set."""
    return [note for name, note in NOTED.items() if name in inherited]


def _gather(cluster: Any, results: List[Any], specs: Optional[Sequence[CheckSpec]]
            ) -> Tuple[Env, Dict[str, str], List[str], List[str]]:
    """(env, reasons, notes, the variables a check's contribution set: measured, not general)."""
    env: Env = {}
    reasons: Dict[str, str] = {}
    notes: List[str] = []
    caveats: List[str] = []
    measured: List[str] = []

    def put(var: EnvVar) -> None:
        if not validate.env_key(var.name) or not validate.env_value(var.value):
            # The last gate before the printed exports and the --env-file: whatever a host reported, nothing a
            # shell or DeepSpeed's `export K="V"` would interpret gets through.
            notes.append(f"not recommending {validate.quote(var.name)}: its value {validate.quote(var.value)} "
                         "holds characters a shell would interpret")
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
                raise ValueError(f"refusing to recommend {', '.join(refused)}")
        except Exception as exc:  # one check's bug costs its part of the environment, never the run
            notes.append(f"no recommendation from the {spec.name} check "
                         f"({type(exc).__name__}: {validate.quote(str(exc))})")
            continue
        for step in part.steps:
            if isinstance(step, EnvVar):
                put(step)
                if step.name in env:
                    measured.append(step.name)
            else:
                notes.append(str(step))
        caveats.extend(str(c) for c in part.caveats)
    for var in GENERAL:
        put(var)
    notes.extend(caveats)
    return env, reasons, notes, measured


# --- what the ranks inherit today -----------------------------------------------------------------------------

def inherited_env(environ: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                  home: Optional[str] = None) -> Dict[str, List[str]]:
    """What DeepSpeed's pdsh launcher passes every rank from this machine: {name: [value, where]}, where is "the
    launch shell" or the .deepspeed_env path (launchenv.snapshot: runner.py:36 and :596-611)."""
    import os
    env = os.environ if environ is None else environ
    snap = launchenv.snapshot(env, launchenv.read_deepspeed_env(cwd, home, env))
    return {k: [str(v[0]), str(v[1])] for k, v in (snap.get("exported") or {}).items()}


def _names(value: str) -> Tuple[bool, frozenset]:
    """(excluded, names) of an NCCL name list without its '=' and ':port' parts."""
    exclude, _, items = launchenv.parse_ifname_filter(value)
    return exclude, frozenset(items)


def env_diff(env: Mapping[str, str], inherited: Mapping[str, Sequence[str]],
             measured: Sequence[str] = ()) -> Dict[str, Dict[str, Any]]:
    """Each recommended variable, and each inherited one preflight owns but does not recommend, against what the
    ranks inherit: {name: {"state": "set" | "unchanged" | "changed" | "not set", "recommended": value or None,
    "inherited": value or None, "source": where or None, "measured": bool}}. "set": not inherited, the
    recommendation adds it; "changed": inherited with another value, the recommendation replaces it; "not set":
    inherited, preflight recommends nothing, the inherited value stays."""
    diff: Dict[str, Dict[str, Any]] = {}
    for name, value in safe_env(dict(env)).items():
        old = inherited.get(name)
        if old is None:
            state = "set"
        else:
            state = "unchanged" if str(old[0]).strip() == value else "changed"
        diff[name] = {"state": state, "recommended": value, "inherited": None if old is None else str(old[0]),
                      "source": None if old is None else str(old[1]), "measured": name in measured}
    for name in sorted(k for k in inherited if k in OWNED_KEYS and k not in diff):
        value, source = inherited[name][0], inherited[name][1]
        diff[name] = {"state": "not set", "recommended": None, "inherited": str(value), "source": str(source),
                      "measured": False}
    return diff


def _fix(name: str, value: str, source: str) -> str:
    """A line to paste that gives the ranks ``value``: the .deepspeed_env line replaced where it came from, else
    the launch shell's export (the launcher passes NCCL* from it, runner.py:36)."""
    if source != "the launch shell":
        # Values passed validate.env_value (no quote, $, `, \ or space); '|' is not among NCCL's characters.
        return (f"sed -i 's|^{name}=.*|{name}={value}|' {shlex.quote(source)} (the line the launcher exports "
                f"from {source})")
    return f"export {name}={shlex.quote(value)} in the shell that runs deepspeed, or put {name}={value} in " \
           f"./.deepspeed_env (preflight run --env-file .deepspeed_env writes it)"


def contradictions(diff: Mapping[str, Mapping[str, Any]], reasons: Mapping[str, str]) -> List[Finding]:
    """A WARN for each inherited value that contradicts a measured recommendation (a check's contribution:
    NCCL_SOCKET_IFNAME from iperf3's fastest network, NCCL_IB_* from the IB ports): the ranks would use the
    inherited one. A general default (NCCL_DEBUG) is the user's to choose, and the same names written with or
    without NCCL's '=' are the same choice."""
    found: List[Finding] = []
    for name, d in diff.items():
        if d.get("state") != "changed" or not d.get("measured"):
            continue
        old, new, source = str(d["inherited"]), str(d["recommended"]), str(d["source"])
        if name in NAME_LISTS and _names(old) == _names(new):
            continue
        why = reasons.get(name, "")
        found.append(Finding(Status.WARN, f"{name}={old} ({source}) contradicts preflight's measured "
                             f"recommendation {name}={new}" + (f" ({why})" if why else "") +
                             ": every rank of the job would use the inherited value",
                             _fix(name, new, source)))
    return found


def add_to_inherited_row(results: List[Any], findings: Sequence[Finding]) -> None:
    """Put the contradictions on the cluster row of the check that judged the inherited environment (the one whose
    results carry the ``launch_env`` metric), next to its own findings there (or as that row, if it has none);
    nothing when no check looked at it (not run, a single host, srun)."""
    from preflight.results import CLUSTER, Result
    check = next((r.check for r in results if isinstance(r.metrics, dict) and INHERITED_METRIC in r.metrics), None)
    if not findings or check is None:
        return
    row = next((i for i, r in enumerate(results) if r.host == CLUSTER and r.check == check), None)
    mine = list(findings)
    metrics: Dict[str, Any] = {}
    if row is not None:
        old = results[row]
        metrics = dict(old.metrics)
        metrics.pop("findings", None)
        earlier = [Finding(Status(f["status"]), f["message"], f.get("fix", ""))
                   for f in old.metrics.get("findings") or [] if isinstance(f, dict) and "status" in f]
        mine = (earlier or [Finding(old.status, old.message, old.fix)]) + mine
    outcome = combine(mine, "", metrics)
    outcome.where = "launch shell"  # an inherited value: fixed where deepspeed is launched, on no host
    result = Result.from_outcome(CLUSTER, check, outcome)
    if row is None:
        results.append(result)
    else:
        result.duration_s = results[row].duration_s
        results[row] = result


def diff_line(entry: Mapping[str, Any]) -> str:
    """One variable's state as the terminal shows it, e.g. "changed from 0 (the launch shell)"."""
    state = entry.get("state")
    if state == "set":
        return "set: not inherited today"
    if state == "unchanged":
        return f"unchanged: already {entry.get('inherited')} ({entry.get('source')})"
    if state == "changed":
        return f"changed from {entry.get('inherited')} ({entry.get('source')})"
    return f"not set by preflight: {entry.get('inherited')} ({entry.get('source')}) stays"


def safe_env(env: Env) -> Env:
    """The variables that may be written or printed: owned keys whose values a shell would not interpret."""
    return {k: v for k, v in env.items() if k in OWNED_KEYS and validate.env_value(v)}


def env_file_text(env: Env) -> str:
    """DeepSpeed's .deepspeed_env: one KEY=VALUE line per variable and nothing else (a blank line crashes its
    launcher). Its pdsh runner turns each line into `export K=V` (quoted as "V" when V has other characters than
    [\\w@%+=:,./-]) in a shell on every node, so each value is checked again here: no $, `, ", \\ or newline."""
    return "".join(f"{k}={v}\n" for k, v in safe_env(env).items())


def export_lines(env: Env) -> List[str]:
    """The same variables as env_file_text, as shell lines to paste (shlex-quoted, so the same text)."""
    return [f"export {k}={shlex.quote(v)}" for k, v in safe_env(env).items()]
