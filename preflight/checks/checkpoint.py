"""The checkpoint directory (--checkpoint-dir) on every host: exists, writable, room for a checkpoint, shared or not.

On each host ``probe`` writes a small test file into the directory (fsync'd) and reports ``os.statvfs`` (free
bytes, f_fsid), ``st_dev`` and the filesystem from /proc/self/mounts; ``look`` then lists which hosts' test files
it sees, and ``cleanup`` removes its own. Facts, e.g.::

    {"path": "/ckpt", "hosts": ["node01", "node02"], "model_params": 7e9, "world_size": 16,
     "probes": {"node01": {"exists": true, "writable": true, "free_bytes": 812345678848, "fsid": 4242,
                           "st_dev": 2049, "fstype": "nfs4", "source": "nas:/ckpt", "test_file": "..."}},
     "seen": {"node01": ["node01", "node02"], "node02": ["node01", "node02"]}}

A DeepSpeed ZeRO checkpoint holds 16 bytes/param of optimizer state (fp32 master weights, Adam's two moments)
plus 2 bytes/param of bf16/fp16 weights, spread over the ranks. One shared filesystem short of room for it is one
cause, the cluster row's FAIL; the hosts' cells repeat it as its victims (``blocked_by`` the cluster row).
Thresholds: [checkpoint] in checkpoint.toml beside this module.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from ..hostside.outcome import BlockedBy, Finding, Outcome, Status, combine, error, limits, skip
from ..hostside.jobinputs import CHECKPOINT_DIR, MODEL_PARAMS
from ..hostside.seams import CheckSpec, ClusterView, HostContext
from ..hostside.proc import read_text
from ..hostside import tempfiles

NAME = "checkpoint"

CLUSTER = "*"
PREFIX = ".preflight-ckpt-"


# --- host side ---------------------------------------------------------------------------------------------------

def _mount_of(path: str) -> Dict[str, Optional[str]]:
    """The /proc/self/mounts entry with the longest mount point containing path: {"fstype", "source", "target"}."""
    best: Dict[str, Optional[str]] = {"fstype": None, "source": None, "target": None}
    real = os.path.realpath(path)
    for line in (read_text("/proc/self/mounts", "") or "").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        target = parts[1].replace("\\040", " ")
        if (real == target or real.startswith(target.rstrip("/") + "/")) and \
                len(target) >= len(best["target"] or ""):
            best = {"fstype": parts[2], "source": parts[0], "target": target}
    return best


def probe(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    path = str(params["path"])
    out: Dict[str, Any] = {"exists": os.path.isdir(path), "writable": False, "error": None, "test_file": None}
    if not out["exists"]:
        out["error"] = "no such directory" if not os.path.exists(path) else "not a directory"
        return out
    st, vfs = os.stat(path), os.statvfs(path)
    out.update(st_dev=st.st_dev, fsid=getattr(vfs, "f_fsid", None), free_bytes=vfs.f_bavail * vfs.f_frsize,
               size_bytes=vfs.f_blocks * vfs.f_frsize, **_mount_of(path))
    name = os.path.join(path, f"{PREFIX}{params['token']}-{params['host']}")
    # It outlives this request (look reads it, cleanup removes it): the agent removes it when its own lifeline
    # closes, if the coordinator never gets to cleanup (killed with kill -9).
    tempfiles.register(name, keep=True)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"preflight checkpoint-dir test %s\n" % str(time.time()).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        out.update(writable=True, test_file=name)
    except OSError as exc:
        out["error"] = f"cannot write a file there: {exc.strerror or exc}"
        if exc.errno == errno.EEXIST:
            tempfiles.forget(name)  # another's file of that name: never removed as ours
        else:
            tempfiles.remove(name)
    return out


def look(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    """Which of the hosts' test files this host sees (a shared filesystem shows all of them)."""
    path = str(params["path"])
    prefix = f"{PREFIX}{params['token']}-"
    try:
        names = os.listdir(path)
    except OSError as exc:
        return {"seen": [], "error": str(exc)}
    return {"seen": sorted(n[len(prefix):] for n in names if n.startswith(prefix))}


def cleanup(params: Dict[str, Any], ctx: HostContext) -> Dict[str, Any]:
    removed = []
    for name in params.get("files") or []:
        if os.path.basename(name).startswith(PREFIX):  # never anything but our own test file
            if tempfiles.remove(name):  # and the agent forgets it
                removed.append(name)
    return {"removed": removed}


# --- coordinator side --------------------------------------------------------------------------------------------

def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    import secrets
    path = CHECKPOINT_DIR.value(cluster.options)
    hosts = [h.name for h in cluster.hosts]
    facts: Dict[str, Any] = {"path": path, "hosts": hosts, "model_params": MODEL_PARAMS.value(cluster.options),
                             "world_size": sum(h.slots for h in cluster.hosts),
                             "slots": {h.name: h.slots for h in cluster.hosts},
                             "unreachable": [h.name for h in cluster.all_hosts if h.name not in hosts],
                             "probes": {}, "seen": {}, "errors": {}}
    if not path:
        facts["skipped"] = "no --checkpoint-dir given"
        return facts
    token = secrets.token_hex(4)
    probes = cluster.call_all(NAME + ".probe", {h: {"path": path, "token": token, "host": h} for h in hosts}, 60.0)
    written: Dict[str, List[str]] = {}
    try:
        for h, value in probes.items():
            if isinstance(value, BaseException):
                facts["errors"][h] = str(value) or type(value).__name__
            else:
                facts["probes"][h] = value
                if value.get("test_file"):
                    written[h] = [value["test_file"]]
        if written:
            seen = cluster.call_all(NAME + ".look", {h: {"path": path, "token": token} for h in written}, 60.0)
            facts["seen"] = {h: (v.get("seen") if isinstance(v, dict) else None) for h, v in seen.items()}
    finally:
        # Every host removes its own test file (a shared directory would also let one host remove all of them).
        if written:
            cluster.call_all(NAME + ".cleanup", {h: {"files": f} for h, f in written.items()}, 60.0)
    return facts


# --- evaluate (pure) ---------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _host_findings(h: str, p: Dict[str, Any], facts: Dict[str, Any], total: Optional[float], shared: bool,
                   lim: Dict[str, Any]) -> Tuple[List[Finding], Dict[str, Any], bool]:
    """(host h's findings on its checkpoint dir, its metrics, whether it lacks room for its share)."""
    path, params = facts.get("path"), facts.get("model_params")
    world = int(facts.get("world_size") or 0) or 1
    lacks_room = False
    findings: List[Finding] = []
    metrics = {k: p.get(k) for k in ("free_bytes", "size_bytes", "fstype", "source", "st_dev", "fsid")}
    if not p.get("exists"):
        findings.append(Finding(Status.FAIL, f"{h}: checkpoint dir {path}: {p.get('error')}",
                                f"create it on {h} (mkdir -p {path}), or mount the shared checkpoint filesystem "
                                "there"))
    elif not p.get("writable"):
        findings.append(Finding(Status.FAIL, f"{h}: checkpoint dir {path}: {p.get('error')}",
                                f"fix the permissions for the job's user on {h} (ls -ld {path}; is it mounted "
                                "read-only?)"))
    if total is not None and p.get("exists"):
        # On one shared filesystem the whole checkpoint lands there; on local disks each host keeps its ranks'.
        need = total if shared else total * int((facts.get("slots") or {}).get(h, 1)) / world
        need *= float(lim["free_margin"])
        metrics["needed_bytes"] = int(need)
        if p.get("free_bytes") is not None and p["free_bytes"] < need:
            lacks_room = True
            if shared:
                whose = "the whole checkpoint: shared filesystem"
            else:
                whose = f"this host's {int((facts.get('slots') or {}).get(h, 1))} of {world} ranks' shards"
            findings.append(Finding(Status.FAIL, f"{h}: {path} has {_gib(p['free_bytes'])} free, a checkpoint of "
                                    f"{float(params or 0):.3g} params needs {_gib(need)} there ({whose})",
                                    f"free space on {h} or point --checkpoint-dir (the job's save_checkpoint "
                                    "path) at a larger filesystem"))
    return findings, metrics, lacks_room


def _not_shared(path: Any, probes: Dict[str, Dict[str, Any]], writers: List[str], seen: Dict[str, Optional[List[str]]],
                lim: Dict[str, Any], summary_metrics: Dict[str, Any]) -> Outcome:
    """The cluster row when the hosts write to the checkpoint dir but not all of them see each other's files."""
    lonely = sorted(h for h in writers if set(seen.get(h) or []) < set(writers))
    status = Status.WARN if lim["require_shared"] else Status.PASS
    verb_s = "s" if len(lonely) == 1 else ""
    files = ("its own test file" if all(seen.get(h) == [h] for h in lonely)
             else "some of the others' test files")
    ids = ", ".join(f"{h} {probes[h].get('st_dev')}/{probes[h].get('fsid')}" for h in writers[:4])
    return Outcome(status, f"{path} is not one shared filesystem: {', '.join(lonely[:6])} see{verb_s} only "
                           f"{files} (st_dev/fsid: {ids}); a file written by rank 0 (a config, the 'latest' tag) "
                           "is not visible to the other ranks, so they wait or load stale state",
                           f"mount one shared filesystem (NFS/Lustre/GPFS) at {path} on every host, or set "
                           "DeepSpeed's checkpoint.use_node_local_storage and save on every node", summary_metrics)


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Dict[str, Outcome]:
    lim = limits(thresholds, NAME)
    out: Dict[str, Outcome] = {}
    for h in facts.get("unreachable") or []:
        out[h] = error("not run: the host is unreachable (see its ssh result)")
    if facts.get("skipped"):
        out[CLUSTER] = skip(facts["skipped"])
        return out
    path = facts.get("path")
    for h, why in (facts.get("errors") or {}).items():
        out[h] = error(f"could not look at {path} on {h}: {why}", "rerun with -v")
    probes: Dict[str, Dict[str, Any]] = facts.get("probes") or {}
    seen: Dict[str, Optional[List[str]]] = facts.get("seen") or {}
    writers = sorted(h for h, p in probes.items() if p.get("writable"))
    shared = bool(writers) and all(set(seen.get(h) or []) >= set(writers) for h in writers)
    # The size of one checkpoint: 16 B/param optimizer state + 2 B/param weights over all ranks (ZeRO shards).
    params = facts.get("model_params")
    per_param = float(lim["optimizer_bytes_per_param"]) + float(lim["weight_bytes_per_param"])
    total = float(params) * per_param if params else None
    # One filesystem that several hosts write to: its lack of room is one cause, the cluster row's, and each host's
    # cell only repeats it (a victim, blocked by that row), as "3 hosts need fixing" would send the user to 3 hosts.
    one_fs = shared and len(writers) >= 2
    short: List[str] = []
    for h, p in probes.items():
        findings, metrics, lacks_room = _host_findings(h, p, facts, total, shared, lim)
        if lacks_room and one_fs and h in writers:
            short.append(h)
        ok = f"{path} writable on {h} ({p.get('fstype') or '?'}, {_gib(p.get('free_bytes') or 0)} free)"
        out[h] = combine(findings, ok, metrics)
        if h in short and len(findings) == 1:  # only the shared filesystem's lack of room: the cluster row's cause
            out[h].blocked_by = BlockedBy(CLUSTER, NAME)
    summary_metrics = {"shared": shared, "writers": writers, "seen": seen,
                       "checkpoint_bytes": int(total) if total is not None else None}
    if short:
        out[CLUSTER] = _shared_too_small(facts, probes, writers, short, total or 0.0, lim, summary_metrics)
    elif len(probes) >= 2 and writers and not shared:
        out[CLUSTER] = _not_shared(path, probes, writers, seen, lim, summary_metrics)
    else:
        state = (f"one shared filesystem on all {len(writers)} hosts" if shared and len(writers) > 1
                 else "writable" if writers else "not writable anywhere")
        size = f"; a checkpoint of {float(params or 0):.3g} params takes {_gib(total)}" if total else ""
        out[CLUSTER] = Outcome(Status.PASS, f"{path} is {state}{size}", metrics=summary_metrics)
    return out


def _shared_too_small(facts: Dict[str, Any], probes: Dict[str, Dict[str, Any]], writers: List[str], short: List[str],
                      total: float, lim: Dict[str, Any], metrics: Dict[str, Any]) -> Outcome:
    """The cluster row when one shared filesystem lacks room for the whole checkpoint: its real free space (the least
    any host reported: the same filesystem, read at slightly different moments) against what is needed, and where."""
    path = facts.get("path")
    free = min(int(probes[h].get("free_bytes") or 0) for h in short)
    need = total * float(lim["free_margin"])
    first = probes[short[0]]
    fs = " ".join(str(x) for x in (first.get("fstype"), first.get("source")) if x) or "?"
    target = first.get("target") or path
    params = float(facts.get("model_params") or 0)
    metrics = dict(metrics, free_bytes=free, needed_bytes=int(need), fstype=first.get("fstype"),
                   source=first.get("source"), target=target)
    return Outcome(Status.FAIL, f"{path} is one shared filesystem ({fs}) on all {len(writers)} hosts with "
                                f"{_gib(free)} free; a checkpoint of {params:.3g} params needs {_gib(need)} there "
                                f"(the whole checkpoint, all {int(facts.get('world_size') or 0) or 1} ranks' shards)",
                   f"free space on the shared filesystem (df -h {target}), or point --checkpoint-dir (the job's "
                   "save_checkpoint path) at a larger filesystem", metrics)


# What the registry knows of this check (preflight/hostside/seams.py: CheckSpec); last, as it names the
# functions above.
SPEC = CheckSpec(
    name=NAME,
    description="--checkpoint-dir on every host: exists, writable, free space for a checkpoint, one shared filesystem",
    scope="cluster",
    default=True,
    coordinate=coordinate,
    evaluate=evaluate,
    options=(CHECKPOINT_DIR, MODEL_PARAMS),
    # Small test files and free space, nothing timed: quiet; it writes to the checkpoint filesystem (runner.Schedule).
    quiet=True,
    loads=("disk",),
)
