"""What every rank opens at start-up, besides the code: the config file at the launcher's path, and the checkpoint
it resumes from. Pure: the host probe's facts in, findings out.

E.g. ``"host_probe": {"node02": {"config_file": {"path": "/job/ds.json", "exists": false, ...}, "checkpoint":
{"latest": "global_step1000", "layout": {"zero_stage": "1 or 2", "dp_size": 8, "mp_size": 1, ...}}}}`` against
``"config_file": {"sha256": "9f2c..."}`` (the coordinator's copy), the config's ZeRO stage and the world size.
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional, Tuple

from ...hostside.outcome import Status
from .ckpt_version import mismatch
from .findings import Report, hosts_text
from .parse import zero_stage

def universal_fix(checkpoint: str) -> str:
    """DeepSpeed's own converter (deepspeed/checkpoint/ds_to_universal.py; it writes CKPT/latest_universal,
    :1370-1374), and what makes load_checkpoint read that (runtime/config.py:549-550, engine.py:4428)."""
    return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {checkpoint} --output_folder "
            f"{checkpoint}_universal, then set \"checkpoint\": {{\"load_universal\": true}} in the config")


def check_config_file(facts: Dict[str, Any], report: Report) -> str:
    """FAIL naming the hosts where the config is missing at the launcher's path, unreadable, or not the same file
    as the coordinator's (sha256): each rank opens the path `deepspeed ... --deepspeed_config PATH` passes."""
    mine = facts.get("config_file") or {}
    if not mine.get("sha256"):
        return ""
    path = mine.get("path") or facts.get("config_path")
    missing: Dict[str, str] = {}
    differ: Dict[str, str] = {}
    unread: Dict[str, str] = {}
    for name, probe in sorted((facts.get("host_probe") or {}).items()):
        entry = (probe or {}).get("config_file")
        if not isinstance(entry, dict):
            continue  # the probe failed on that host (its other findings say why) or predates this check
        if not entry.get("exists"):
            missing[name] = (f"the DeepSpeed config {path} does not exist here: every rank on this host fails to "
                             "open it")
        elif entry.get("error"):
            unread[name] = f"the DeepSpeed config {path} cannot be read here: {entry['error']}"
        elif entry.get("sha256") != mine["sha256"]:
            sha = str(entry.get("sha256"))[:12]
            differ[name] = (f"the DeepSpeed config {path} here differs from the coordinator's (sha256 {sha}..., "
                            f"{entry.get('size')} bytes; the coordinator's {mine['sha256'][:12]}..., "
                            f"{mine.get('size')} bytes)")
    q = shlex.quote(str(path))

    def copy_fix(hosts: Dict[str, str]) -> str:
        return (f"copy it to the same path there from where you run deepspeed (for h in {' '.join(sorted(hosts))}; "
                f"do scp {q} $h:{q}; done), or keep it on a filesystem every host mounts at that path")

    if missing:
        report.add(Status.FAIL, f"the DeepSpeed config {path} is missing on {hosts_text(sorted(missing))}: the "
                                "launcher passes this path to every rank, and the ranks there fail at start-up",
                   copy_fix(missing), missing)
    if unread:
        report.add(Status.FAIL, f"the DeepSpeed config {path} is unreadable on {hosts_text(sorted(unread))}: "
                                f"{next(iter(unread.values()))}",
                   "make it readable by the job's user on those hosts (chmod a+r, or its directory a+x)", unread)
    if differ:
        report.add(Status.FAIL, f"the DeepSpeed config {path} on {hosts_text(sorted(differ))} is not the file checked "
                                "here (different content): those ranks would train with another config",
                   copy_fix(differ), differ)
    return "" if missing or unread or differ else "the same config on every host"


def _stage_mismatch(found: str, stage: Optional[int]) -> bool:
    """The config's stage cannot load a checkpoint of this layout: ZeRO-3 reads per-rank model states that stages
    0-2 never write and the other way round, and a ZeRO stage reads optimizer partitions a stage-0 fp16/fp32 run
    never wrote. (Stage 0 under bf16 writes partitions too, its BF16_Optimizer has a dp_process_group,
    engine.py:1916-1921: a "1 or 2" layout is no mismatch for stage 0.)"""
    if stage is None:
        return False
    if stage >= 3 or found == "3":
        return (stage >= 3) != (found == "3")
    return stage >= 1 and found == "0"


def _nothing_to_resume(first: Dict[str, Any], host: str, report: Report) -> Optional[str]:
    """The summary when the first host's checkpoint cannot be or need not be resumed (unreadable, no latest file),
    else None."""
    directory, latest_name = first.get("dir"), first.get("latest_name") or "latest"
    if first.get("error"):
        report.add(Status.FAIL, f"cannot read the checkpoint to resume on {host}: {first['error']}",
                   f"fix {directory}/{latest_name} (it names the tag directory to load) or remove it to start from "
                   "scratch")
        return "resume: unreadable"
    if not first.get("latest"):
        if latest_name == "latest_universal":
            # load_universal without latest_universal: DeepSpeed raises ValueError (engine.py:4434-4435).
            report.add(Status.FAIL, f"the config sets checkpoint.load_universal, but {directory} has no "
                                    "latest_universal: load_checkpoint raises \"Invalid for universal checkpoint\"",
                       "convert the checkpoint first: " + universal_fix(f"{directory}/TAG"))
            return "resume: no universal checkpoint"
        return ""  # nothing to resume: a fresh start
    return None


def _check_stage(config: Dict[str, Any], stage_found: str, where: str, report: Report) -> Optional[int]:
    """FAIL when the checkpoint's ZeRO stage's files are not the ones the config's stage loads; the config's stage."""
    stage = zero_stage(config)
    if _stage_mismatch(stage_found, stage):
        wanted = "3" if stage is not None and stage >= 3 else "1 or 2" if stage else "0"
        report.add(Status.FAIL, f"the checkpoint {where} was saved with ZeRO stage {stage_found} "
                                f"({_stage_files(stage_found)}) but the config sets ZeRO stage {stage}, which loads "
                                f"{_stage_files(wanted)}: resuming fails",
                   f"resume with the stage it was saved with (zero_optimization.stage {stage_found}), or convert it "
                   f"to a universal checkpoint, which any stage loads: {universal_fix(where)}")
    return stage


def _check_parallel_sizes(layout: Dict[str, Any], facts: Dict[str, Any], stage_found: str, stage: Optional[int],
                          where: str, report: Report) -> List[str]:
    """FAIL when the checkpoint's model- or data-parallel size is not the job's; its summary parts."""
    parts: List[str] = []
    dp, mp = layout.get("dp_size"), layout.get("mp_size")
    world = int(facts.get("world_size") or 0)
    mp_given = facts.get("model_parallel_size")
    mp_now = int(mp_given) if mp_given else int(mp or 1)
    if mp_given and mp and int(mp) != int(mp_given):
        report.add(Status.FAIL, f"the checkpoint {where} was saved with model-parallel size {mp} "
                                f"(mp_rank_00..{mp - 1:02d}) but the job runs with --model-parallel-size {mp_given}",
                   f"resume with model-parallel size {mp}, or convert it: {universal_fix(where)}")
    # DeepSpeed compares the sizes only when ZeRO loads its partitions (engine.py:4748: _load_zero_checkpoint runs
    # for a ZeRO stage), against the sequence-data-parallel size: world / (tensor x pipeline).
    if dp and world and stage_found != "0" and stage:
        dp_now = world // mp_now if world % mp_now == 0 else None
        if dp_now is not None and dp_now != int(dp):
            report.add(Status.FAIL, f"the checkpoint {where} was saved at data-parallel size {dp} ({dp} ZeRO "
                                    f"partitions, *optim_states.pt per MP rank) but this hostfile gives {dp_now} "
                                    f"(world size {world} / model-parallel {mp_now}): DeepSpeed raises "
                                    f"ZeRORuntimeException \"The checkpoint being loaded used a DP world size of {dp} "
                                    f"but the current world size is {dp_now}\"",
                       f"resume on {dp} data-parallel ranks, or convert it to a universal checkpoint, which loads at "
                       f"any size: {universal_fix(where)}")
        parts.append(f"DP {dp}")
    return parts


def check_resume(config: Dict[str, Any], facts: Dict[str, Any], report: Report) -> str:
    """With --checkpoint-dir holding a checkpoint (a ``latest`` file and its tag directory), FAIL when its layout
    cannot be loaded by this config on this cluster: another ZeRO stage, another data-parallel size (DeepSpeed
    raises ZeRORuntimeException, engine.py:4748-4753), another model-parallel size. Read on the first host, as
    rank 0 reads it; a host that does not see the same tag cannot load its files."""
    probes = facts.get("host_probe") or {}
    seen: Dict[str, Dict[str, Any]] = {n: p["checkpoint"] for n, p in probes.items()
                                       if isinstance(p, dict) and isinstance(p.get("checkpoint"), dict)}
    names = [h["name"] for h in facts.get("hosts") or [] if h["name"] in seen]
    if not names:
        return ""
    first = seen[names[0]]
    directory, latest_name = first.get("dir"), first.get("latest_name") or "latest"
    nothing = _nothing_to_resume(first, names[0], report)
    if nothing is not None:
        return nothing
    tag = first["latest"]
    where = f"{directory}/{tag}"
    layout = first.get("layout") or {}
    others = _hosts_without(names, seen, tag)
    if others:
        report.add(Status.FAIL, f"the checkpoint to resume ({where}) is not visible on {hosts_text(sorted(others))}: "
                                f"{next(iter(others.values()))}",
                   "put --checkpoint-dir on a filesystem every host mounts at the same path", others)
    if latest_name == "latest_universal":
        return f"resume from universal checkpoint {tag} (any ZeRO stage and parallel sizes)"
    stage_found = layout.get("zero_stage")
    if stage_found is None:
        report.add(Status.FAIL, f"{directory}/latest names tag {tag}, but {where} holds no DeepSpeed model states "
                                "(*model_states.pt): load_checkpoint finds nothing to load",
                   "point latest at a complete checkpoint tag, or remove it to start from scratch")
        return "resume: no checkpoint files"
    version = mismatch(first.get("ds_version"), {n: (probes[n] or {}).get("deepspeed") for n in names}, where)
    if version is not None:  # saved with another DeepSpeed minor version (ckpt_version.py)
        report.add(Status.WARN, *version)
    stage = _check_stage(config, stage_found, where, report)
    parts = _check_parallel_sizes(layout, facts, stage_found, stage, where, report)
    sizes = ", " + ", ".join(parts) if parts else ""
    return f"resume {tag} (ZeRO stage {stage_found}{sizes})"


def _stage_files(stage: str) -> str:
    return {"3": "zero_pp_rank_N_mp_rank_00_model_states.pt per data-parallel rank",
            "1 or 2": "one mp_rank_00_model_states.pt and a *optim_states.pt per data-parallel rank",
            "0": "mp_rank_00_model_states.pt, no ZeRO partitions"}.get(stage, stage)


def _hosts_without(names: List[str], seen: Dict[str, Dict[str, Any]], tag: str) -> Dict[str, str]:
    """{host: why} for the hosts that do not see the first host's tag with the same layout."""
    first = seen[names[0]]
    out: Dict[str, str] = {}
    for n in names[1:]:
        c = seen[n]
        if c.get("latest") != tag:
            out[n] = (f"no {c.get('latest_name', 'latest')} there" if not c.get("latest")
                      else f"its latest names {c.get('latest')!r}, not {tag!r}")
        elif _shape(c) != _shape(first):
            out[n] = (f"its {c.get('dir')}/{tag} holds other files ({_shape(c)[1]} vs {_shape(first)[1]} on "
                      f"{names[0]})")
    return out


def _shape(c: Dict[str, Any]) -> Tuple[Any, str]:
    layout = c.get("layout") or {}
    return (layout.get("zero_stage"), f"{layout.get('model_files')} model, {layout.get('optim_files')} optim files")
