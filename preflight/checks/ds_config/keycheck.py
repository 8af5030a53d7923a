"""Verdicts on the config's keys: unknown and misspelled keys, deprecated spellings, keys the hosts' DeepSpeed
lacks or has removed, and the optimizer/scheduler names.

Reads the tables in ``keys.py`` and the errors of DeepSpeed's own models (``deepspeed_models.py``), e.g.
``"zero_optimisation": {...}`` -> FAIL "unknown top level key ...; did you mean 'zero_optimization'?".
"""
from __future__ import annotations

import difflib
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ...hostside.outcome import Status
from .keys import (DEPRECATED, DS_OPTIMIZERS, DS_SCHEDULERS, REMOVED_ISSUE, SECTIONS, TOP_LEVEL, TORCH_OPTIMIZERS,
                   TORCH_SCHEDULERS, ZERO_SUPPORTED)
from .parse import optimizer_params, optimizer_type, parse_version, zero_stage
from .findings import Report, hosts_text, vstr

# Keys starting with these are comments by convention (DeepSpeedExamples' "_comment", hjson-era "//").
COMMENT_PREFIXES = ("_", "#", "//")


def did_you_mean(key: str, choices: Sequence[str]) -> str:
    m = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    if not m:
        m = difflib.get_close_matches(key.lower(), [c.lower() for c in choices], n=1, cutoff=0.6)
        if m:
            m = [c for c in choices if c.lower() == m[0]]
    return m[0] if m else ""


def _known_elsewhere(key: str, here: str) -> List[str]:
    out = []
    if here != "" and key in TOP_LEVEL:
        out.append("the top level")
    for sec, keys in SECTIONS.items():
        if sec != here and key in keys and sec != "bfloat16":
            out.append(sec)
    return out


def _distance(a: str, b: str) -> int:
    """Edit distance with transpositions (optimal string alignment): 'zero_optimisation' -> 1."""
    prev2: List[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def near_miss(key: str, choices: Sequence[str]) -> str:
    """The real key this one is a typo of (case, one or two edits; three in long names), else ''.

    Stricter than did_you_mean: a near miss turns an ignored key into a FAIL, so unrelated keys that only share
    a word (comms_config vs comms_logger, log vs log_level) must not match.
    """
    low = key.lower()
    limit = 1 if len(low) <= 5 else 2 if len(low) <= 12 else 3
    best, best_d = "", limit + 1
    for c in choices:
        if abs(len(c) - len(low)) > limit:
            continue
        d = _distance(low, c.lower())
        if d < best_d:
            best, best_d = c, d
    return best


def _unknown_key_finding(report: Report, path: str, key: str, section: str, choices: Sequence[str],
                         how: str, rejected: bool) -> None:
    """rejected: DeepSpeed refuses the key (a model forbidding extras): FAIL. Otherwise DeepSpeed ignores it:
    FAIL when it is a near miss of a real key (the setting meant silently keeps its default), else WARN."""
    guess = near_miss(key, choices) if not rejected else did_you_mean(key, choices)
    elsewhere = _known_elsewhere(key, section)
    hint = ""
    if guess:
        hint = f"; did you mean {guess!r}?"
    elif elsewhere:
        hint = f"; {key!r} is a key of {' / '.join(elsewhere)}"
    where = section or "top level"
    guess_path = (section + "." if section else "") + guess
    fix = (f"rename {path} to {guess_path}" if guess else
           f"move {key!r} into {elsewhere[0]}" if elsewhere and elsewhere[0] != "the top level" else
           f"move {key!r} to the top level" if elsewhere else f"remove {path} (not a DeepSpeed setting)")
    if not rejected and guess:
        how += f", so {guess_path} keeps its default"
    status = Status.FAIL if rejected or guess else Status.WARN
    report.add(status, f"{path}: unknown {where} key ({how}){hint}", fix)


# Sections DeepSpeed validates with pydantic models that forbid extra keys, for when DeepSpeed is not importable
# on the coordinator (with DeepSpeed, it is asked instead: deepspeed_models.validate_with_deepspeed).
FORBID_EXTRA = ("zero_optimization", "fp16", "bf16", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger")


def _check_sections(config: Dict[str, Any], checked_by_ds: Set[str], report: Report) -> None:
    """The unknown keys in each known section DeepSpeed's own models did not validate."""
    for sec_path, known in SECTIONS.items():
        top, _, sub = sec_path.partition(".")
        if top in checked_by_ds:
            continue  # DeepSpeed's own model validated it (errors below)
        value = config.get(top)
        if sub:
            value = value.get(sub) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            continue
        rejected = top in FORBID_EXTRA
        how = (f"DeepSpeed's {sec_path} model forbids extra keys, so the job fails at deepspeed.initialize"
               if rejected else "DeepSpeed ignores keys it does not read: this setting has no effect")
        for key in value:
            if key in known or key.startswith(COMMENT_PREFIXES):
                continue
            if sec_path == "optimizer" and key in ("adam_w_mode", "torch_adam", "lr", "betas", "eps",
                                                    "weight_decay"):
                report.add(Status.FAIL, f"optimizer.{key}: not read there (DeepSpeed reads optimizer.type, "
                                        "optimizer.params and optimizer.legacy_fusion only)",
                           f"move {key!r} into optimizer.params")
                continue
            _unknown_key_finding(report, f"{sec_path}.{key}", key, sec_path, list(known), how, rejected)


def _report_model_errors(ds_models: Dict[str, Any], report: Report) -> None:
    """What DeepSpeed's own pydantic models and optimizer classes rejected, one finding each."""
    for err in ds_models.get("errors") or []:
        loc = [err.get("section", "")] + list(err.get("loc") or [])
        path = ".".join(str(x) for x in loc if x != "")
        etype = str(err.get("type") or "")
        version = ds_models.get("version") or "?"
        if etype in ("extra_forbidden", "value_error.extra"):
            key = str(loc[-1])
            parent = ".".join(str(x) for x in loc[:-1])
            if key in SECTIONS.get(parent, {}):
                # A key some DeepSpeed release has, unknown only to the coordinator's: the version gates judge it
                # against the hosts' DeepSpeed instead.
                continue
            choices = list(SECTIONS.get(parent, {})) or list(SECTIONS.get(loc[0], {}))
            _unknown_key_finding(report, path, key, parent, choices,
                                 f"DeepSpeed {version}'s pydantic model rejects it: {err.get('msg')}", True)
        else:
            report.add(Status.FAIL, f"{path}: invalid value (DeepSpeed {version} says: {err.get('msg')})",
                       f"fix {path} as DeepSpeed's message says")
    for err in ds_models.get("param_errors") or []:
        key, accepted = str(err.get("key")), [str(a) for a in err.get("accepted") or []]
        guess = did_you_mean(key, accepted)
        hint = f"; did you mean {guess!r}?" if guess else ""
        param_path = f"{err.get('path')}.{key}"
        report.add(Status.FAIL, f"{param_path}: {err.get('class')} takes no such parameter, so deepspeed.initialize "
                                f"raises TypeError: {err.get('why')} (it takes: {', '.join(accepted)}){hint}",
                   f"rename it to {guess!r}" if guess else f"remove {param_path}")


def check_keys(config: Dict[str, Any], ds_models: Optional[Dict[str, Any]], report: Report) -> None:
    for key in config:
        if key in TOP_LEVEL or key.startswith(COMMENT_PREFIXES):
            continue
        _unknown_key_finding(report, key, key, "", list(TOP_LEVEL),
                             "DeepSpeed ignores unknown top-level keys: this setting has no effect", False)
    _check_sections(config, set((ds_models or {}).get("sections") or []), report)
    _report_model_errors(ds_models or {}, report)
    zero = config.get("zero_optimization")
    if isinstance(zero, bool):
        stage = 1 if zero else 0
        report.add(Status.WARN, f"zero_optimization: {str(zero).lower()} is the deprecated boolean form (DeepSpeed "
                                f"maps it to stage {stage} with a warning)",
                   f'use "zero_optimization": {{"stage": {stage}}}')


def check_deprecated(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: Report) -> None:
    for section, old, new, note, renamed_in in DEPRECATED:
        container = config if section == "" else config.get(section)
        if not isinstance(container, dict) or old not in container:
            continue
        if section == "" and old == "bfloat16" and "bf16" in config:
            note = "ignored: bf16 is present and takes precedence"
        if renamed_in and versions:
            cut = parse_version(renamed_in)
            if cut is not None and all(v < cut for v in versions.values()):
                continue  # every host still reads the old name
        path = f"{section}.{old}" if section else old
        report.add(Status.WARN, f"{path} is deprecated ({note}); the modern key is {new}",
                   f"replace {path} with {new}")


def gate_findings(label: str, info: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: Report,
                   added_status: Status = Status.WARN) -> None:
    added, removed = info.get("added"), info.get("removed")
    if added:
        last_without = parse_version(added[0]) or (0, 0, 0)
        old = {h: v for h, v in versions.items() if v <= last_without}
        if old:
            old_versions = ", ".join(sorted({vstr(v) for v in old.values()}))
            runs = "runs" if len(old) == 1 else "run"
            report.add(added_status,
                       f"{label} needs DeepSpeed >= {added[1]} (absent in {added[0]}); {hosts_text(sorted(old))} "
                       f"{runs} DeepSpeed {old_versions}",
                       f"upgrade DeepSpeed on those hosts (pip install -U 'deepspeed>={added[1]}') or drop {label}",
                       {h: f"{label} needs DeepSpeed >= {added[1]}; this host runs {vstr(v)}"
                        for h, v in old.items()})
    if removed:
        first_without = parse_version(removed[1]) or (0, 0, 0)
        why = info.get("why") or "removed"
        new = {h: v for h, v in versions.items() if v >= first_without}
        if new:
            new_versions = ", ".join(sorted({vstr(v) for v in new.values()}))
            runs = "runs" if len(new) == 1 else "run"
            report.add(Status.FAIL,
                       f"{label} was removed in DeepSpeed {removed[1]} ({why}); {hosts_text(sorted(new))} {runs} "
                       f"{new_versions}, which rejects the config",
                       f"remove {label} from the config (see {REMOVED_ISSUE})",
                       {h: f"{label} was removed in DeepSpeed {removed[1]}; this host runs {vstr(v)}"
                        for h, v in new.items()})
        elif not versions:
            report.add(Status.WARN, f"{label} was removed in DeepSpeed {removed[1]} ({why}); DeepSpeed >= "
                                    f"{removed[1]} rejects the config (host DeepSpeed version unknown)",
                       f"remove {label} from the config")


def check_versions(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: Report) -> None:
    for key in config:
        info = TOP_LEVEL.get(key)
        if info:
            gate_findings(key, info, versions, report)
    for sec_path, known in SECTIONS.items():
        if sec_path == "bfloat16":
            continue
        top, _, sub = sec_path.partition(".")
        value = config.get(top)
        if sub:
            value = value.get(sub) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            continue
        for key in value:
            info = known.get(key)
            if info:
                gate_findings(f"{sec_path}.{key}", info, versions, report)


def check_optimizer(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: Report) -> None:
    name = optimizer_type(config)
    stage = zero_stage(config) or 0
    if name is not None and not (isinstance(config["optimizer"].get("type"), str)
                                 and name.lower() == "auto"):
        low = name.lower()
        if low in DS_OPTIMIZERS:
            gate_findings(f"optimizer type {name}", DS_OPTIMIZERS[low], versions, report,
                           added_status=Status.FAIL)
            if low in ("onebitadam", "zerooneadam", "onebitlamb") and stage > 0:
                report.add(Status.FAIL, f"optimizer {name} with ZeRO stage {stage} (DeepSpeed asserts: not "
                                        "compatible with ZeRO)", f"use stage 0 with {name}, or Adam/AdamW with ZeRO")
        elif name in TORCH_OPTIMIZERS:
            if stage > 0 and config.get("zero_allow_untested_optimizer") is not True and low not in ZERO_SUPPORTED:
                report.add(Status.FAIL, f"optimizer torch.optim.{name} with ZeRO stage {stage} needs "
                                        "\"zero_allow_untested_optimizer\": true (DeepSpeed asserts 'You are using an "
                                        "untested ZeRO Optimizer')",
                           'add "zero_allow_untested_optimizer": true, or use Adam/AdamW/Adagrad/Lion')
        else:
            known = sorted(set(k for k in DS_OPTIMIZERS) | set(TORCH_OPTIMIZERS))
            guess = did_you_mean(name, [k for k in DS_OPTIMIZERS] + TORCH_OPTIMIZERS)
            ds_names = ", ".join(sorted(DS_OPTIMIZERS))
            hint = f"; did you mean {guess!r}?" if guess else ""
            wanted = repr(guess) if guess else f"one of {', '.join(known)}"
            report.add(Status.FAIL, f"optimizer type {name!r} is unknown to DeepSpeed (DeepSpeed names, any case: "
                                    f"{ds_names}; else a torch.optim class, exact case: {', '.join(TORCH_OPTIMIZERS)})"
                                    f"{hint}",
                       f"set optimizer.type to {wanted}")
        if stage > 0 and low in ("lamb", "muadam", "muadamw", "musgd") and \
                config.get("zero_allow_untested_optimizer") is not True:
            report.add(Status.FAIL, f"optimizer {name} with ZeRO stage {stage} needs "
                                    "\"zero_allow_untested_optimizer\": true (its class is not in DeepSpeed's "
                                    "ZERO_SUPPORTED_OPTIMIZERS)",
                       'add "zero_allow_untested_optimizer": true')
    params = optimizer_params(config)
    if "max_grad_norm" in params:
        max_grad_norm = params["max_grad_norm"]
        report.add(Status.FAIL, f"optimizer.params.max_grad_norm = {max_grad_norm!r}: DeepSpeed raises "
                                "\"'max_grad_norm' is not supported as an optimizer parameter\"",
                   f'remove it and set "gradient_clipping": {max_grad_norm} at the top level')

    sched = config.get("scheduler")
    sname = sched.get("type") if isinstance(sched, dict) else None
    if sname is not None and not (isinstance(sname, str) and sname.lower() == "auto"):
        if sname in DS_SCHEDULERS:
            gate_findings(f"scheduler type {sname}", DS_SCHEDULERS[sname], versions, report,
                           added_status=Status.FAIL)
        elif sname not in TORCH_SCHEDULERS:
            choices = list(DS_SCHEDULERS) + TORCH_SCHEDULERS
            guess = did_you_mean(str(sname), choices)
            hint = f"; did you mean {guess!r}?" if guess else ""
            ds_names = ", ".join(DS_SCHEDULERS)
            report.add(Status.FAIL, f"scheduler type {sname!r} is unknown (DeepSpeed's: {ds_names}; else a "
                                    f"torch.optim.lr_scheduler class: {', '.join(TORCH_SCHEDULERS)}; exact case){hint}",
                       f"set scheduler.type to {guess or 'one of ' + ds_names}")




def check_installed(facts: Dict[str, Any], report: Report) -> None:
    """FAIL on hosts where ds_config's probe found no DeepSpeed in the job's interpreter (nothing to run the config);
    ERROR where the probe itself could not run (the config file, DeepSpeed and the paths are unknown there)."""
    failed = {h: str(p.get("error"))[:300] for h, p in sorted((facts.get("host_probe") or {}).items())
              if isinstance(p, dict) and p.get("error") and "deepspeed_found" not in p}
    if failed:
        first = next(iter(failed.values()))
        report.add(Status.ERROR, f"ds_config's probe could not run in the job's interpreter (--python) on "
                                 f"{hosts_text(sorted(failed))}: {first}; the config file, DeepSpeed and the offload "
                                 "paths there are unchecked",
                   "check that --python names the job's interpreter on those hosts", failed)
    missing = sorted(h for h, p in (facts.get("host_probe") or {}).items()
                     if isinstance(p, dict) and "deepspeed_found" in p and not p.get("deepspeed")
                     and not p.get("deepspeed_found"))
    if missing:
        report.add(Status.FAIL, f"DeepSpeed is not installed in the job's interpreter (--python) on "
                                f"{hosts_text(missing)}: the config cannot be used there",
                   "pip install deepspeed into that interpreter, or pass the job's interpreter with --python",
                   {h: "DeepSpeed is not installed in the job's interpreter (--python)" for h in missing})


def check_validated(facts: Dict[str, Any], config: Dict[str, Any], report: Report) -> None:
    """WARN where DeepSpeed's own validation ran nowhere (coordinate tried this machine, then the first host with
    DeepSpeed): the keys were checked against preflight's tables only, and what only DeepSpeed's code can judge
    was not checked. Silent on facts without the attempt recorded (``deepspeed_validation``)."""
    tried = facts.get("deepspeed_validation")
    if not isinstance(tried, dict) or facts.get("deepspeed_models") is not None:
        return
    missed = ["the sections DeepSpeed validates with its own models (values and keys)"]
    opt, sched = config.get("optimizer"), config.get("scheduler")
    if isinstance(opt, dict) and isinstance(opt.get("params"), dict):
        missed.insert(0, "optimizer.params against the optimizer's constructor (a wrong key is a TypeError at "
                         "deepspeed.initialize)")
    if isinstance(sched, dict) and isinstance(sched.get("params"), dict):
        missed.insert(1, "scheduler.params against the scheduler's constructor")
    why = "; ".join(str(t) for t in tried.get("tried") or []) or "DeepSpeed is not importable"
    report.add(Status.WARN, f"DeepSpeed's own validation of the config ran nowhere ({why}), so these were not "
                            f"checked: {'; '.join(missed)} (keys were checked against preflight's tables only)",
               "install DeepSpeed in the job's interpreter on the hosts (--python PATH), or on this machine: "
               "python3 -m pip install deepspeed")
