"""Stale torch extension locks: the ``lock`` file a killed JIT build leaves in the torch extensions cache, on which
every later job that loads the op waits forever. Reads the cache the ranks will use (hostside/jit.py), e.g.::

    /root/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/lock   (age 2 h, no process holds it)
    -> FAIL: rm -f /root/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/lock

A lock is held while a process has it open (torch's FileBaton keeps its descriptor until release) or works in
that directory (ninja and the compilers it starts); one that nobody holds is stale (torch/utils/file_baton.py,
cpp_extension.py:2345-2400; pytorch issue 189245). A build directory with objects and no library is a build that
was stopped: the next job rebuilds it (WARN).

Thresholds: [ext_locks] in ext_locks.toml beside this module.
"""
from __future__ import annotations

import shlex
from typing import Any, Dict

from ..hostside import jit
from ..hostside.fixes import prebuild_phrase
from ..hostside.outcome import Finding, Outcome, Status, combine, limits
from ..hostside.seams import CheckSpec, HostContext

NAME = "ext_locks"


def collect(ctx: HostContext) -> Dict[str, Any]:
    return jit.extensions_facts(ctx.params)


def evaluate(facts: Dict[str, Any], thresholds: Dict[str, Any]) -> Outcome:
    lim = limits(thresholds, NAME)
    root = facts.get("root") or "?"
    metrics: Dict[str, Any] = {"root": root, "root_from": facts.get("root_from"),
                               "build_dirs": len(facts.get("dirs") or []),
                               "locks": [d["lock"] for d in facts.get("dirs") or [] if d.get("lock")]}
    if not facts.get("exists"):
        return Outcome(Status.PASS, f"no torch extensions cache at {root} ({facts.get('root_from')}): no lock; the "
                       "first job start JIT-builds the ops it loads", metrics=metrics)
    findings = []
    min_age, quiet = float(lim["min_age_s"]), float(lim["quiet_s"])
    for d in jit.stale_locks(facts):
        lock = d["lock"]
        age = float(lock.get("age_s") or 0.0)
        if age < min_age:  # a build that is just starting (the lock is made before ninja runs): not yet stale
            continue
        idle = d.get("idle_s")
        if isinstance(idle, (int, float)) and idle < quiet:
            # Written to moments ago by no process we can see: a build in another container or PID namespace
            # sharing this cache holds it; calling that stale would tell the user to break a running build.
            findings.append(Finding(
                Status.WARN,
                f"torch extensions lock {lock['path']} (op {d['op']}, {jit.age_text(age)} old): no process this "
                f"host's /proc shows holds it, but {d['dir']} was written {jit.age_text(idle)} ago: a build in "
                "another container or PID namespace that shares this cache may still be running",
                f"if no build of {d['op']} runs on this host in any container, the lock is stale: "
                f"rm -f {shlex.quote(lock['path'])}"))
            continue
        unsure = (f"; {facts['unreadable_procs']} process(es) could not be looked at (permission denied: another "
                  "user's, or another namespace's)" if facts.get("unreadable_procs") else "")
        findings.append(Finding(
            Status(lim["stale_lock"]),
            f"stale torch extensions lock {lock['path']} (op {d['op']}, {jit.age_text(age)} old): no process on this "
            f"host holds it and no build runs in {d['dir']}{unsure}; every job that loads {d['op']} here waits on it "
            "forever, at 0% CPU and without a word (torch/utils/file_baton.py FileBaton.wait; pytorch issue 189245)",
            f"rm -f {shlex.quote(lock['path'])}"))
    for d in jit.partial_builds(facts):
        findings.append(Finding(
            Status.WARN,
            f"partial build of {d['op']} in {d['dir']} ({d['objects']} object file(s), no library): a build that "
            "was stopped; the next job that loads it rebuilds it at its start",
            f"nothing is stuck: the next job start builds it; pre-build DeepSpeed's ops ("
            f"{prebuild_phrase(facts.get('python'), ['DS_BUILD_OPS'], facts.get('deepspeed'))}) or start clean "
            f"with rm -rf {shlex.quote(d['dir'])}"))
    building = [d for d in facts.get("dirs") or [] if d.get("holders")]
    held = ""
    if building:
        held = "; building now: " + ", ".join(
            f"{d['op']} (pid {', '.join(str(h['pid']) for h in d['holders'][:3])})" for d in building[:5])
    ok = (f"no stale lock in {root} ({facts.get('root_from')}; {len(facts.get('dirs') or [])} op build "
          f"director{'y' if len(facts.get('dirs') or []) == 1 else 'ies'}){held}")
    return combine(findings, ok, metrics)


SPEC = CheckSpec(
    name=NAME,
    description="stale torch extension locks (a killed JIT build's lock file that hangs every later job start) and "
                "partial builds in the torch extensions cache the ranks will use",
    scope="host",
    default=True,
    collect=collect,
    evaluate=evaluate,
    params_from_options=jit.launch_params,
)
