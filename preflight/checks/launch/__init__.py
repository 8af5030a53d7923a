"""The ``launch`` check: the job's launch rehearsed inside ``preflight run`` (opt-in: ``--checks launch`` or
``--rehearse``, with ``--deepspeed-config``), exactly as ``preflight rehearse`` runs it (docs/rehearse.md).

    preflight run --hostfile hostfile --deepspeed-config /shared/ds.json --rehearse
    -> on node01, in /tmp/preflight-rehearse-<id> on every host: python3 -m deepspeed.launcher.runner --hostfile
       hostfile --launcher pdsh preflight_rehearse.py --deepspeed_config /shared/ds.json ...
    -> node02::launch FAILED - rank 1 (local 0) advertised the loopback address 127.0.1.1 ...; fix: ...

DeepSpeed 0.19.8: the launcher is its runner (deepspeed/launcher/runner.py:643, what the ``deepspeed`` script runs)
in the run's --python, which starts every host with that same interpreter (``sys.executable``,
launcher/multinode_runner.py:109) after ``cd`` into its own directory there; it exports the ``.deepspeed_env`` files
(runner.py:37-38, 604-611). The table of contents: ``judge.py`` reads the launch host's output into outcomes (pure),
``drive.py`` runs the launch over the coordinator's connections (``ClusterView.shell``) and cleans up on every host.
Its steps, stand-in model size and timeouts are the ``[launch]`` section of thresholds.toml beside it.
"""
from __future__ import annotations

import os
import shlex
from typing import Any, Dict, List, Optional

from ...hostside.outcome import BlockedBy, Outcome, Status, limits
from ...hostside.seams import CheckSpec, ClusterView, Option, Thresholds
from .drive import LaunchRun
from .judge import CLUSTER, ENV_FILE_NAME, LaunchPlan

NAME = "launch"
DEEPSPEED_MASTER_PORT = 29500  # --master_port default: deepspeed/constants.py:12
MAX_ENV_BYTES = 1 << 20


def hostfile_text(hosts: List[Any]) -> str:
    """The hostfile the launcher reads: one ``NAME slots=N`` line per host of the run, N covering its selected slots
    (the run's -i/-e already applied; ``include_of`` names the selected slots when they are not 0..N-1)."""
    lines = []
    for h in hosts:
        gpus = list(h.gpus or [])
        lines.append(f"{h.name} slots={max(gpus) + 1 if gpus else h.slots}\n")
    return "".join(lines)


def include_of(hosts: List[Any]) -> str:
    """DeepSpeed's --include for the run's selected slots (``node01:0,2@node02``), "" when every host uses 0..N-1."""
    if all(not h.gpus or list(h.gpus) == list(range(len(h.gpus))) for h in hosts):
        return ""
    return "@".join(f"{h.name}:{','.join(str(g) for g in h.gpus)}" if h.gpus else h.name for h in hosts)


def _env_file() -> Dict[str, Any]:
    """./.deepspeed_env (or $DS_ENV_FILE) of the directory preflight runs in, which the launch directory gets:
    {"path", "text"}, {"error"} when it cannot be read, {} when there is none."""
    name = os.environ.get("DS_ENV_FILE", ENV_FILE_NAME)
    if not os.path.isfile(name):
        return {}
    try:
        with open(name, "rb") as fh:
            data = fh.read(MAX_ENV_BYTES + 1)
        if len(data) > MAX_ENV_BYTES:
            return {"error": f"./{name} is over {MAX_ENV_BYTES} bytes"}
        return {"path": os.path.abspath(name), "text": data.decode()}
    except (OSError, UnicodeDecodeError) as exc:
        return {"error": f"./{name}: cannot read: {getattr(exc, 'strerror', None) or exc}"}


def _row(outcome: Outcome) -> Dict[str, Any]:
    row: Dict[str, Any] = {"status": outcome.status.value, "message": outcome.message, "fix": outcome.fix,
           "metrics": outcome.metrics}
    if outcome.blocked_by is not None:  # a rank that only waited for another host's: that host's victim
        row["blocked_by"] = [outcome.blocked_by.host, outcome.blocked_by.check]
    return row


def _stale_lock_seen(facts: Any) -> bool:
    """The ext_locks facts of a host hold a lock nobody holds (its own check names it, with the rm -f)."""
    return isinstance(facts, dict) and any(d.get("lock") and not d.get("holders") for d in facts.get("dirs") or [])


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    """Run the rehearsal over the run's own connections: {"rows": {host or "*": outcome as a dict}, "survivors":
    {host: processes left}} or {"skipped": why, "status": ...} when it cannot run here."""
    o = cluster.options
    lim = limits(cluster.thresholds, NAME)
    if not o.deepspeed_config:
        return {"skipped": "the launch rehearsal needs the job's config: pass --deepspeed-config FILE"}
    if cluster.local:
        return {"skipped": "the launch rehearsal needs a hostfile (DeepSpeed's pdsh launch across hosts): pass "
                           "--hostfile, or use `preflight rehearse`"}
    if o.transport == "srun":
        return {"skipped": "inside a Slurm allocation the job is started by srun, not DeepSpeed's pdsh launcher: "
                           "not rehearsed"}
    reachable = {h.name for h in cluster.hosts}
    down = [h.name for h in cluster.all_hosts if h.name not in reachable]
    if down:
        return {"skipped": f"not launched: {', '.join(down[:5])} unreachable (see the ssh check); the launch needs "
                           "every host", "status": "error"}
    env = _env_file()
    if env.get("error"):
        return {"skipped": env["error"], "status": "error",
                "fix": "make it a readable KEY=VALUE text file, as DeepSpeed's runner reads it"}
    python = o.python or "python3"
    hosts = list(cluster.all_hosts)
    plan = LaunchPlan(
        hostfile=o.hostfile or "hostfile", hosts=hosts, deepspeed_config=os.path.abspath(o.deepspeed_config),
        include=include_of(hosts), master_addr=o.master_addr,
        master_port=o.master_port if o.master_port != DEEPSPEED_MASTER_PORT else None,
        launcher_ssh_port=o.launcher_ssh_port, deepspeed=f"{shlex.quote(python)} -m deepspeed.launcher.runner",
        python=python, steps=int(lim["steps"]), model_params=float(lim["model_params"]),
        init_timeout=float(lim["init_timeout_s"]), timeout=float(lim["timeout_s"]), env_file=env.get("path"),
        build_budget=float(lim["jit_build_budget_s"]),
        parallel=max(1, cluster.parallel))
    run = LaunchRun(plan, {h.name: cluster.shell(h.name) for h in hosts}, cluster.progress)
    rows = run.rehearse(env.get("text"), hostfile_text(hosts))
    if run.interrupted:
        raise KeyboardInterrupt  # the launch is stopped and cleaned up: the run's own Ctrl-C handling goes on
    for host, outcome in rows.items():
        # A rank stuck on the stale lock that ext_locks already named on its host follows from that result.
        seen = cluster.facts.get(host, {}).get("ext_locks")
        if outcome.metrics.get("cause") == "stale lock" and _stale_lock_seen(seen):
            outcome.blocked_by = BlockedBy(host, "ext_locks")
    return {"rows": {h: _row(outcome) for h, outcome in rows.items()}, "survivors": run.survivors(),
            "token": run.token}


def evaluate(facts: Dict[str, Any], thresholds: Thresholds) -> Dict[str, Outcome]:
    """{host or "*": outcome} from the rehearsal's judged rows; a host where a process of the launch survived the
    clean-up is an ERROR there (the check must leave nothing behind)."""
    if "skipped" in facts:
        status = Status.ERROR if facts.get("status") == "error" else Status.SKIP
        return {CLUSTER: Outcome(status, str(facts["skipped"]), str(facts.get("fix", "")))}
    out: Dict[str, Outcome] = {}
    for host, row in (facts.get("rows") or {}).items():
        blocked = row.get("blocked_by")
        out[host] = Outcome(Status(row["status"]), row["message"], row.get("fix", ""), dict(row.get("metrics") or {}),
                            blocked_by=BlockedBy(str(blocked[0]), str(blocked[1])) if blocked else None)
    token: Optional[str] = facts.get("token")
    for host, left in (facts.get("survivors") or {}).items():
        before = out.get(host)
        out[host] = Outcome(Status.ERROR, f"processes of the launch survived pkill -KILL on {host}: {left}"
                            + (f"; {before.message}" if before is not None else ""),
                            f"kill them by hand: pkill -KILL -f {token}", before.metrics if before else {})
    return out


REHEARSE = Option("--rehearse", "also rehearse the job's launch (the launch check, with --deepspeed-config): "
                  "DeepSpeed's launcher over pdsh starts a tiny model with the config on every slot (docs/rehearse.md)",
                  action="store_true")


SPEC = CheckSpec(
    name=NAME,
    description="the job's launch rehearsed (opt-in, --rehearse): DeepSpeed's launcher over pdsh starts a tiny model "
                "with the job's config on every slot for 2 steps; each failure named on its host and rank "
                "(docs/rehearse.md)",
    scope="cluster",
    default=False,
    coordinate=coordinate,
    evaluate=evaluate,
    options=(REHEARSE,),
    selected_by=("rehearse",),  # --rehearse runs it without --checks
    reads=("ext_locks",),  # a rank stuck on a stale lock is blocked by that host's ext_locks result
)
