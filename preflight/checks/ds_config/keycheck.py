"""Verdicts on the config's keys: unknown and misspelled keys, deprecated spellings, keys the hosts' DeepSpeed
lacks or has removed, and the optimizer/scheduler names.

Reads the tables in ``keys.py`` and the errors of DeepSpeed's own models (``deepspeed_models.py``), e.g.
``"zero_optimisation": {...}`` -> FAIL "unknown top level key ...; did you mean 'zero_optimization'?".
"""
from __future__ import annotations

import difflib
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
        hint = "; did you mean %r?" % guess
    elif elsewhere:
        hint = "; %r is a key of %s" % (key, " / ".join(elsewhere))
    where = section or "top level"
    fix = ("rename %s to %s" % (path, (section + "." if section else "") + guess) if guess else
           "move %r into %s" % (key, elsewhere[0]) if elsewhere and elsewhere[0] != "the top level" else
           "move %r to the top level" % key if elsewhere else "remove %s (not a DeepSpeed setting)" % path)
    if not rejected and guess:
        how += ", so %s keeps its default" % ((section + "." if section else "") + guess)
    status = Status.FAIL if rejected or guess else Status.WARN
    report.add(status, "%s: unknown %s key (%s)%s" % (path, where, how, hint), fix)


# Sections DeepSpeed validates with pydantic models that forbid extra keys, for when DeepSpeed is not importable
# on the coordinator (with DeepSpeed, it is asked instead: deepspeed_models.validate_with_deepspeed).
FORBID_EXTRA = ("zero_optimization", "fp16", "bf16", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger")


def check_keys(config: Dict[str, Any], ds_models: Optional[Dict[str, Any]], report: Report) -> None:
    for key in config:
        if key in TOP_LEVEL or key.startswith(COMMENT_PREFIXES):
            continue
        _unknown_key_finding(report, key, key, "", list(TOP_LEVEL),
                             "DeepSpeed ignores unknown top-level keys: this setting has no effect", False)
    checked_by_ds = set((ds_models or {}).get("sections") or [])
    zero = config.get("zero_optimization")
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
        how = ("DeepSpeed's %s model forbids extra keys, so the job fails at deepspeed.initialize" % sec_path
               if rejected else "DeepSpeed ignores keys it does not read: this setting has no effect")
        for key in value:
            if key in known or key.startswith(COMMENT_PREFIXES):
                continue
            if sec_path == "optimizer" and key in ("adam_w_mode", "torch_adam", "lr", "betas", "eps",
                                                    "weight_decay"):
                report.add(Status.FAIL, "optimizer.%s: not read there (DeepSpeed reads optimizer.type, "
                                        "optimizer.params and optimizer.legacy_fusion only)" % key,
                           "move %r into optimizer.params" % key)
                continue
            _unknown_key_finding(report, "%s.%s" % (sec_path, key), key, sec_path, list(known), how, rejected)
    for err in (ds_models or {}).get("errors") or []:
        loc = [err.get("section", "")] + list(err.get("loc") or [])
        path = ".".join(str(x) for x in loc if x != "")
        etype = str(err.get("type") or "")
        version = (ds_models or {}).get("version") or "?"
        if etype in ("extra_forbidden", "value_error.extra"):
            key = str(loc[-1])
            parent = ".".join(str(x) for x in loc[:-1])
            if key in SECTIONS.get(parent, {}):
                # A key some DeepSpeed release has, unknown only to the coordinator's: the version gates judge it
                # against the hosts' DeepSpeed instead.
                continue
            choices = list(SECTIONS.get(parent, {})) or list(SECTIONS.get(loc[0], {}))
            _unknown_key_finding(report, path, key, parent, choices,
                                 "DeepSpeed %s's pydantic model rejects it: %s" % (version, err.get("msg")), True)
        else:
            report.add(Status.FAIL, "%s: invalid value (DeepSpeed %s says: %s)" % (path, version, err.get("msg")),
                       "fix %s as DeepSpeed's message says" % path)
    for err in (ds_models or {}).get("param_errors") or []:
        key, accepted = str(err.get("key")), [str(a) for a in err.get("accepted") or []]
        guess = did_you_mean(key, accepted)
        hint = "; did you mean %r?" % guess if guess else ""
        report.add(Status.FAIL, "%s.%s: %s takes no such parameter, so deepspeed.initialize raises TypeError: %s "
                                "(it takes: %s)%s" % (err.get("path"), key, err.get("class"), err.get("why"),
                                                      ", ".join(accepted), hint),
                   "rename it to %r" % guess if guess else "remove %s.%s" % (err.get("path"), key))
    if isinstance(zero, bool):
        report.add(Status.WARN, "zero_optimization: %s is the deprecated boolean form (DeepSpeed maps it to "
                                "stage %d with a warning)" % (str(zero).lower(), 1 if zero else 0),
                   'use "zero_optimization": {"stage": %d}' % (1 if zero else 0))


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
        path = "%s.%s" % (section, old) if section else old
        report.add(Status.WARN, "%s is deprecated (%s); the modern key is %s" % (path, note, new),
                   "replace %s with %s" % (path, new))


def gate_findings(label: str, info: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: Report,
                   added_status: Status = Status.WARN) -> None:
    added, removed = info.get("added"), info.get("removed")
    if added:
        last_without = parse_version(added[0]) or (0, 0, 0)
        old = {h: v for h, v in versions.items() if v <= last_without}
        if old:
            report.add(added_status,
                       "%s needs DeepSpeed >= %s (absent in %s); %s run%s DeepSpeed %s"
                       % (label, added[1], added[0], hosts_text(sorted(old)), "s" if len(old) == 1 else "",
                          ", ".join(sorted({vstr(v) for v in old.values()}))),
                       "upgrade DeepSpeed on those hosts (pip install -U 'deepspeed>=%s') or drop %s"
                       % (added[1], label),
                       {h: "%s needs DeepSpeed >= %s; this host runs %s" % (label, added[1], vstr(v))
                        for h, v in old.items()})
    if removed:
        first_without = parse_version(removed[1]) or (0, 0, 0)
        why = info.get("why") or "removed"
        new = {h: v for h, v in versions.items() if v >= first_without}
        if new:
            report.add(Status.FAIL,
                       "%s was removed in DeepSpeed %s (%s); %s run%s %s, which rejects the config"
                       % (label, removed[1], why, hosts_text(sorted(new)), "s" if len(new) == 1 else "",
                          ", ".join(sorted({vstr(v) for v in new.values()}))),
                       "remove %s from the config (see %s)" % (label, REMOVED_ISSUE),
                       {h: "%s was removed in DeepSpeed %s; this host runs %s" % (label, removed[1], vstr(v))
                        for h, v in new.items()})
        elif not versions:
            report.add(Status.WARN, "%s was removed in DeepSpeed %s (%s); DeepSpeed >= %s rejects the config "
                                    "(host DeepSpeed version unknown)" % (label, removed[1], why, removed[1]),
                       "remove %s from the config" % label)


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
                gate_findings("%s.%s" % (sec_path, key), info, versions, report)


def check_optimizer(config: Dict[str, Any], versions: Dict[str, Tuple[int, int, int]], report: Report) -> None:
    name = optimizer_type(config)
    stage = zero_stage(config) or 0
    if name is not None and not (isinstance(config["optimizer"].get("type"), str)
                                 and name.lower() == "auto"):
        low = name.lower()
        if low in DS_OPTIMIZERS:
            gate_findings("optimizer type %s" % name, DS_OPTIMIZERS[low], versions, report,
                           added_status=Status.FAIL)
            if low in ("onebitadam", "zerooneadam", "onebitlamb") and stage > 0:
                report.add(Status.FAIL, "optimizer %s with ZeRO stage %d (DeepSpeed asserts: not compatible with "
                                        "ZeRO)" % (name, stage), "use stage 0 with %s, or Adam/AdamW with ZeRO" % name)
        elif name in TORCH_OPTIMIZERS:
            if stage > 0 and config.get("zero_allow_untested_optimizer") is not True and low not in ZERO_SUPPORTED:
                report.add(Status.FAIL, "optimizer torch.optim.%s with ZeRO stage %d needs "
                                        "\"zero_allow_untested_optimizer\": true (DeepSpeed asserts 'You are using an "
                                        "untested ZeRO Optimizer')" % (name, stage),
                           'add "zero_allow_untested_optimizer": true, or use Adam/AdamW/Adagrad/Lion')
        else:
            known = sorted(set(k for k in DS_OPTIMIZERS) | set(TORCH_OPTIMIZERS))
            guess = did_you_mean(name, [k for k in DS_OPTIMIZERS] + TORCH_OPTIMIZERS)
            report.add(Status.FAIL, "optimizer type %r is unknown to DeepSpeed (DeepSpeed names, any case: %s; "
                                    "else a torch.optim class, exact case: %s)%s"
                       % (name, ", ".join(sorted(DS_OPTIMIZERS)), ", ".join(TORCH_OPTIMIZERS),
                          "; did you mean %r?" % guess if guess else ""),
                       "set optimizer.type to %s" % (repr(guess) if guess else "one of %s" % ", ".join(known)))
        if stage > 0 and low in ("lamb", "muadam", "muadamw", "musgd") and \
                config.get("zero_allow_untested_optimizer") is not True:
            report.add(Status.FAIL, "optimizer %s with ZeRO stage %d needs \"zero_allow_untested_optimizer\": true "
                                    "(its class is not in DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS)" % (name, stage),
                       'add "zero_allow_untested_optimizer": true')
    params = optimizer_params(config)
    if "max_grad_norm" in params:
        report.add(Status.FAIL, "optimizer.params.max_grad_norm = %r: DeepSpeed raises \"'max_grad_norm' is not "
                                "supported as an optimizer parameter\"" % params["max_grad_norm"],
                   'remove it and set "gradient_clipping": %s at the top level' % params["max_grad_norm"])

    sched = config.get("scheduler")
    sname = sched.get("type") if isinstance(sched, dict) else None
    if sname is not None and not (isinstance(sname, str) and sname.lower() == "auto"):
        if sname in DS_SCHEDULERS:
            gate_findings("scheduler type %s" % sname, DS_SCHEDULERS[sname], versions, report,
                           added_status=Status.FAIL)
        elif sname not in TORCH_SCHEDULERS:
            choices = list(DS_SCHEDULERS) + TORCH_SCHEDULERS
            guess = did_you_mean(str(sname), choices)
            report.add(Status.FAIL, "scheduler type %r is unknown (DeepSpeed's: %s; else a torch.optim.lr_scheduler "
                                    "class: %s; exact case)%s" % (sname, ", ".join(DS_SCHEDULERS),
                                                                   ", ".join(TORCH_SCHEDULERS),
                                                                   "; did you mean %r?" % guess if guess else ""),
                       "set scheduler.type to %s" % (guess or "one of %s" % ", ".join(DS_SCHEDULERS)))




def check_installed(facts: Dict[str, Any], report: Report) -> None:
    """FAIL on hosts where ds_config's probe found no DeepSpeed in the job's interpreter (nothing to run the config)."""
    missing = sorted(h for h, p in (facts.get("host_probe") or {}).items()
                     if isinstance(p, dict) and "deepspeed_found" in p and not p.get("deepspeed")
                     and not p.get("deepspeed_found"))
    if missing:
        report.add(Status.FAIL, "DeepSpeed is not installed in the job's interpreter (--python) on %s: the config "
                                "cannot be used there" % hosts_text(missing),
                   "pip install deepspeed into that interpreter, or pass the job's interpreter with --python",
                   {h: "DeepSpeed is not installed in the job's interpreter (--python)" for h in missing})
