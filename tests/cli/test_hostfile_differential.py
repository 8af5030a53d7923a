"""preflight's hostfile parser and --include/--exclude against DeepSpeed's own launcher functions, as the oracle.

A seeded generator writes a few thousand hostfiles (comments, blank lines, tabs, CRLF and lone CR, form feed,
vertical tab, NEL, U+2028 inside lines, duplicates, bad and absurd slots, unknown hosts, empty filters ...) and
include/exclude strings. Each case runs through DeepSpeed's ``fetch_hostfile`` + ``parse_inclusion_exclusion``
(deepspeed/launcher/runner.py) and preflight's ``load_hostfile`` + ``apply_filters``. They must agree on accept
vs reject and on the exact host -> GPU-list mapping, in order, except for the deliberate differences in
``DELIBERATE`` (each with its reason). Anything else is an unexplained disagreement and fails the test.
"""
from __future__ import annotations

import logging
import random
import unicodedata
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from preflight.hostfile import MAX_SLOTS, SHELL_CHARS, HostfileError, apply_filters, load_hostfile

runner = pytest.importorskip("deepspeed.launcher.runner")

SEED = 20261123
CASES = 3200

Mapping = List[Tuple[str, List[int]]]
Outcome = Tuple[bool, Optional[Mapping]]  # (accepted, host -> GPU list in order)

NAMES = ["n1", "n2", "n3", "worker-0", "gpu-3", "a.b", "node01"]
ODD_NAMES = ["-oProxyCommand=x", "n1;touch${IFS}x", "n{1,2}",
             "n[1-2]", "node[01-03]", "rack[1-2]-n[1-2]", "n:1", "x#y", "n@1", "n\x1b1",
             "n]", "\ufeffn9"]
INNER_BREAKS = ["\f", "\v", "\x85", "\u2028", "\u2029", "\x1c", "\x1d"]
SLOTS = ["1", "2", "3", "4", "8", "08", "0", "16", "4096", "99999999999999999999", "1" + "0" * 30, "\u0663"]
ENDS = ["\n", "\r\n", "\r"]


def gen_line(rng: random.Random, fresh: List[str]) -> str:
    r = rng.random()
    if rng.random() < 0.06:
        name = rng.choice(ODD_NAMES)
    elif fresh and rng.random() < 0.9:
        name = fresh.pop()  # mostly distinct hosts, so that duplicates do not reject most files
    else:
        name = rng.choice(NAMES)
    slots = rng.choice(SLOTS[:6]) if rng.random() > 0.12 else rng.choice(SLOTS)
    if r < 0.55:
        sep = rng.choice([" ", " ", "\t", "  ", " \t "])
        line = f"{name}{sep}slots={slots}"
    elif r < 0.63:
        line = rng.choice(["# a comment", "#", "   # indented comment", "#n1 slots=2"])
    elif r < 0.70:
        line = rng.choice(["", " ", "\t", "  \t"])
    elif r < 0.76:
        line = f"{name} slots={slots} " + rng.choice(["max_slots=8", "# spare", "x", "slots=3", "#c"])
    elif r < 0.80:
        line = f"{name} slots={slots}{rng.choice(INNER_BREAKS)}{rng.choice(NAMES)} slots={rng.choice(SLOTS[:5])}"
    elif r < 0.83:
        line = f"{rng.choice(INNER_BREAKS)}{name} slots={slots}"
    elif r < 0.85:
        line = rng.choice([name, f"{name} slots=", f"{name} slots=-1", f"{name} slots=abc", f"{name} slot=2",
                           f"slots={slots}", f"{name}slots={slots}", f"{name} SLOTS={slots}"])
    elif r < 0.93:
        line = f"  {name} slots={slots}  "
    else:
        line = f"{name} slots={slots}" + rng.choice(["\t", " ", "\f"])
    if rng.random() < 0.05:
        line = "\t" + line
    return line


def gen_hostfile(rng: random.Random) -> str:
    fresh = rng.sample(NAMES, len(NAMES))
    lines = [gen_line(rng, fresh) for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8]))]
    end = rng.choice(ENDS) if rng.random() < 0.9 else None
    text = ""
    for line in lines:
        text += line + (end or rng.choice(ENDS))
    if lines and rng.random() < 0.3:
        text = text[:-1] if not text.endswith("\r\n") else text[:-2]  # no final line end
    if rng.random() < 0.02:
        text = "\ufeff" + text
    return text


def gen_node(rng: random.Random, names: List[str]) -> str:
    r = rng.random()
    name = rng.choice(names) if names and rng.random() < 0.85 else rng.choice(NAMES + ["zz", "", " n1", "n1 "])
    if r < 0.4:
        return name
    if r < 0.85:
        k = rng.choice([1, 1, 2, 3])
        ids = [str(rng.choice([0, 0, 1, 1, 2, 3, 4, 7, 9])) for _ in range(k)]
        return f"{name}:{','.join(ids)}"
    return rng.choice([f"{name}:", f"{name}:a", f"{name}: 1", f"{name}:+1", f"{name}:0:1", f"{name}:-1",
                       f"{name}:99999999999999999999", f"{name}:1,,2", f"{name}:1_0"])


def gen_filter(rng: random.Random, names: List[str]) -> Tuple[str, str]:
    r = rng.random()
    if r < 0.25:
        return "", ""
    spec = "@".join(gen_node(rng, names) for _ in range(rng.choice([1, 1, 2, 2, 3])))
    if rng.random() < 0.04:
        spec = rng.choice(["@", spec + "@", "@" + spec, " "])
    if r < 0.62:
        return spec, ""
    if r < 0.98:
        return "", spec
    return spec, "n1"


def deepspeed_outcome(path: str, include: str, exclude: str) -> Tuple[Outcome, Optional[Dict[str, int]]]:
    try:
        pool = runner.fetch_hostfile(path)
    except Exception:
        return (False, None), None
    try:
        active = runner.parse_inclusion_exclusion(pool, include, exclude)
    except Exception:
        return (False, None), dict(pool)
    return (True, [(h, list(g)) for h, g in active.items()]), dict(pool)


def preflight_outcome(path: str, include: str, exclude: str) -> Outcome:
    try:
        hosts = apply_filters(load_hostfile(path), include, exclude)
    except HostfileError:
        return False, None
    return True, [(h.name, list(h.gpus)) for h in hosts]


def _invisible(name: str) -> bool:
    return any(unicodedata.category(c)[0] == "C" for c in name)


# Deliberate differences: (name, reason, predicate(case) -> True when it explains the disagreement). Except for
# ranges, each applies only where DeepSpeed accepts and preflight rejects.
Case = Dict[str, Any]
DELIBERATE: List[Tuple[str, str, Callable[[Case], bool]]] = [
    ("range", "preflight expands node[01-04]-style ranges (a note says the launcher does not; "
              "'preflight hostfile --expand' writes the file it should get); DeepSpeed reads one literal host",
     lambda c: c["pool"] is not None and any("[" in h or "]" in h for h in c["pool"])),
    ("slots=0", "DeepSpeed keeps a host with no slots and then fails or runs on fewer GPUs than listed",
     lambda c: c["ds"][0] and any(v == 0 for v in c["pool"].values())),
    ("absurd slots", "more than MAX_SLOTS (1024) slots per host is a typo; DeepSpeed accepts up to what fits in "
                     "memory (slots=10**20 makes it raise OverflowError, which both reject)",
     lambda c: c["ds"][0] and any(v > MAX_SLOTS for v in c["pool"].values())),
    ("byte-order mark", "DeepSpeed makes U+FEFF part of the first host name, which then does not resolve",
     lambda c: c["ds"][0] and c["text"].startswith("\ufeff")),
    ("'-' host name", "ssh/pdsh would read a host name starting with '-' as an option (issue 16)",
     lambda c: c["ds"][0] and any(h.startswith("-") for h in c["pool"])),
    ("shell character", "a host name with ; $ ` { } # = / or another character a shell or ssh acts on is a typo or an "
                        "attack (issue 26): refused before any lookup",
     lambda c: c["ds"][0] and any(set(h) & SHELL_CHARS for h in c["pool"])),
    ("invisible character", "a control/format character in a host name cannot resolve and garbles terminals",
     lambda c: c["ds"][0] and any(_invisible(h) for h in c["pool"])),
    ("no hosts left", "DeepSpeed returns an empty resource dict and the launcher fails at its first host",
     lambda c: c["ds"] == (True, [])),
]


def run_cases(tmp_path) -> Tuple[Counter, List[Case]]:
    logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)
    rng = random.Random(SEED)
    counts: Counter = Counter()
    unexplained: List[Case] = []
    path = tmp_path / "hostfile"
    for i in range(CASES):
        text = gen_hostfile(rng)
        path.write_bytes(text.encode("utf-8"))
        names = []
        for line in text.replace("\r", "\n").split("\n"):
            tok = line.strip().split()
            if tok:
                names.append(tok[0])
        include, exclude = gen_filter(rng, names)
        ds, pool = deepspeed_outcome(str(path), include, exclude)
        ours = preflight_outcome(str(path), include, exclude)
        case = {"i": i, "text": text, "include": include, "exclude": exclude, "ds": ds, "ours": ours, "pool": pool}
        if ds == ours:
            counts["agree"] += 1
            counts["agree: both accept" if ds[0] else "agree: both reject"] += 1
            continue
        for name, _, applies in DELIBERATE:
            if applies(case):
                counts["deliberate: " + name] += 1
                counts["deliberate"] += 1
                break
        else:
            counts["unexplained"] += 1
            unexplained.append(case)
    return counts, unexplained


def test_preflight_agrees_with_deepspeed_on_generated_hostfiles_and_filters(tmp_path, record_property):
    counts, unexplained = run_cases(tmp_path)
    summary = {k: v for k, v in sorted(counts.items()) if v}
    summary["cases"] = CASES
    record_property("hostfile_differential", summary)
    print(f"\nhostfile differential (seed {SEED}): {summary}")
    assert counts["agree"] + counts["deliberate"] + counts["unexplained"] == CASES >= 3000
    # the generator must exercise both sides, or agreement means nothing
    assert counts["agree: both accept"] >= 800 and counts["agree: both reject"] >= 800
    for name, _, _ in DELIBERATE:
        assert counts["deliberate: " + name] > 0, f"the generator never produced the {name!r} difference"
    shown = "\n".join(f"case {c['i']}: {c['text']!r} include={c['include']!r} exclude={c['exclude']!r}: "
                      f"DeepSpeed {c['ds']}, preflight {c['ours']}" for c in unexplained[:10])
    assert not unexplained, f"{len(unexplained)} unexplained disagreements:\n{shown}"
