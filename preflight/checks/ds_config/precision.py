"""Verdicts on precision: fp16 with bf16, bf16 on GPUs older than Ampere, static fp16 loss scaling without clipping,
and a note (not a WARN) for fp16 or fp32 on GPUs that all do bf16.

Reads ``"bf16": {"enabled": true}`` against the gpu facts' compute capability, e.g. ``"cc": [7, 0]`` (V100).
"""
from __future__ import annotations

from typing import Any, Dict, List

from ...hostside.outcome import Status
from .parse import enabled
from .findings import Report, hosts_text, num


def check_precision(config: Dict[str, Any], gpus: Dict[str, List[Dict[str, Any]]], report: Report) -> str:
    fp16 = enabled(config.get("fp16"))
    bf16_sec = config.get("bf16") if "bf16" in config else config.get("bfloat16")
    bf16 = enabled(bf16_sec)
    if fp16 and bf16:
        report.add(Status.FAIL, "fp16.enabled and bf16.enabled are both true (DeepSpeed asserts 'bfloat16 and fp16 "
                                "modes cannot be simultaneously enabled')",
                   "keep one: bf16 on Ampere (compute capability 8.0) or newer, fp16 otherwise")
    if bf16:
        old: Dict[str, str] = {}
        for host, lst in sorted(gpus.items()):
            bad = [g for g in lst if isinstance(g.get("cc"), (list, tuple)) and len(g["cc"]) >= 1
                   and (g["cc"][0], (g["cc"][1] if len(g["cc"]) > 1 else 0)) < (8, 0)]
            if bad:
                g = bad[0]
                cc = ".".join(str(x) for x in g["cc"])
                old[host] = f"{len(bad)} GPU(s) of compute capability {cc} ({g.get('name') or '?'}): bf16 needs >= 8.0"
        if old:
            has = "has" if len(old) == 1 else "have"
            listed = "; ".join(f"{h}: {m}" for h, m in sorted(old.items()))
            report.add(Status.FAIL, f"bf16 is enabled but {hosts_text(sorted(old))} {has} GPUs without bf16 support "
                                    f"(compute capability < 8.0; {listed})",
                       'use "fp16": {"enabled": true} with dynamic loss scaling on these GPUs, or exclude the hosts',
                       old)
    if fp16:
        sec = config.get("fp16") or {}
        ls = sec.get("loss_scale", 0)
        clip = config.get("gradient_clipping")
        clip_set = isinstance(clip, str) or (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0)
        if isinstance(ls, (int, float)) and not isinstance(ls, bool) and ls != 0 and not clip_set:
            report.add(Status.WARN, f"fp16 uses a static loss_scale of {num(ls)} without gradient_clipping (expected "
                                    "dynamic scaling, loss_scale 0, or clipping): overflows are not caught",
                       'set "fp16": {"loss_scale": 0} (dynamic), add "gradient_clipping": 1.0, or use bf16 on '
                       "Ampere or newer")
    label = "bf16" if bf16 else "fp16" if fp16 else "precision auto" if (bf16 is None or fp16 is None) else "fp32"
    note = bf16_note(config, label, gpus)
    return f"{label} ({note})" if note else label


def bf16_note(config: Dict[str, Any], label: str, gpus: Dict[str, List[Dict[str, Any]]]) -> str:
    """A note, never a WARN: fp16 or fp32 where every GPU of every host does bf16 (compute capability >= 8.0, as
    DeepSpeed's bf16 needs). bf16 has fp32's exponent range, so it needs no loss scaling, and halves fp32's memory
    (the choice is the user's: some models are validated in fp16 or fp32)."""
    if label not in ("fp16", "fp32") or not gpus:
        return ""
    if label == "fp32" and enabled(config.get("torch_autocast")):
        return ""  # torch autocast lowers precision itself
    ccs = set()
    for lst in gpus.values():
        for g in lst:
            cc = g.get("cc")
            if not isinstance(cc, (list, tuple)) or not cc:
                return ""  # a GPU whose capability is unknown: no claim about all of them
            ccs.add((int(cc[0]), int(cc[1]) if len(cc) > 1 else 0))
    if not ccs or min(ccs) < (8, 0):
        return ""
    shown = ", ".join(f"{a}.{b}" for a, b in sorted(ccs))
    why = "needs no loss scaling" if label == "fp16" else "halves the memory of fp32 and runs on the tensor cores"
    return (f"note: every GPU does bf16 (compute capability {shown}): \"bf16\": {{\"enabled\": true}} "
            f"{why}")
