"""Each host's figures judged against its own past runs: the ``[history]`` settings, which figures a check declares
(``SPEC.baseline``), the robust statistics of a drop and the WARN it becomes, e.g.::

    node07 nvme paths[/local_nvme].write_Bps 1.9 GB/s is 61% of its median of the last 20 runs (3.1 GB/s);
    robust z -6.2, p < 1e-9
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.hostside.outcome import Status
from preflight.hostside.robust import MAX_P, MEDIAN_SE, p_text, p_value, robust_z, significant
from preflight.results import display_host

SECTION = "history"  # its thresholds' section in preflight/defaults.toml
# metrics.trend keeps at most this many past values per figure, however many runs a baseline takes (the report's
# sparkline; a bounded payload).
TREND_POINTS = 50


@dataclass(frozen=True)
class Settings:
    """The ``[history]`` section: how many runs a baseline takes and how clear a drop must be."""

    runs: int = 20
    min_runs: int = 5
    max_p: float = MAX_P
    min_deficit: float = 0.1
    noise_floor: float = 0.02
    busy_timeout_s: float = 5.0
    z_threshold: float = 3.0

    @classmethod
    def from_thresholds(cls, thresholds: Mapping[str, Any]) -> "Settings":
        section = thresholds.get(SECTION) or {}
        base = cls()
        return cls(int(section.get("runs", base.runs)), int(section.get("min_runs", base.min_runs)),
                   float(section.get("max_p", base.max_p)), float(section.get("min_deficit", base.min_deficit)),
                   float(section.get("noise_floor", base.noise_floor)),
                   float(section.get("busy_timeout_s", base.busy_timeout_s)),
                   float(section.get("z_threshold", base.z_threshold)))


def _pattern(key: str) -> "re.Pattern[str]":
    return re.compile("".join(".*" if part == "*" else re.escape(part) for part in re.split(r"(\*)", key)))


def declared(check: str) -> List[Tuple["re.Pattern[str]", str]]:
    """(pattern, "higher"/"lower") of the check's ``SPEC.baseline``; none for a name the registry does not have
    (the coordinator's own row, node-check's "preflight")."""
    from preflight import checks as registry
    if check not in registry.ORDER:
        return []
    return [(_pattern(k), v) for k, v in registry.spec(check).baseline.items()]


def direction(patterns: Sequence[Tuple["re.Pattern[str]", str]], key: str) -> Optional[str]:
    return next((d for p, d in patterns if p.fullmatch(key)), None)


# --------------------------------------------------------------------------------------------- what is judged

@dataclass
class Cell:
    """One (host, check) of a run as the history sees it. ``target`` is the report's object (a ``Result`` or an
    ``Outcome``: anything with status, message, fix and metrics), which a baseline WARN changes in place."""

    host: str
    check: str
    target: Any
    context: str = ""
    figures: List[Tuple[str, float]] = field(default_factory=list)
    drops: int = 0  # its figures named against its own past: this run is then no part of its next baselines
    cause: Optional[str] = None  # the id of its cause in the run (preflight.causes), for a cell that is no pass
    blocked: bool = False  # a victim: it follows from another cell's fault, counted in that one's cause


@dataclass(frozen=True)
class Drop:
    """A figure significantly worse than the host's own median: the WARN's numbers."""

    host: str
    check: str
    key: str
    better: str
    value: float
    median: float
    runs: int
    z: float
    p: float

    @property
    def ratio(self) -> float:
        return self.value / self.median

    def message(self, max_p: float = MAX_P) -> str:
        unit, scale = unit_of(self.key)
        value, median = in_unit(self.value / scale, unit), in_unit(self.median / scale, unit)
        if self.better == "higher":
            how = f"is {100 * self.ratio:.0f}% of"
        else:
            how = f"is {self.ratio:.2g}x"
        runs = f"the last {self.runs} runs" if self.runs != 1 else "its last run"
        return (f"{display_host(self.host)} {self.check} {self.key} {value} {how} its median of {runs} ({median}); "
                f"robust z {self.z:+.1f}, {p_text(self.z, max_p)}")

    def fix(self) -> str:
        host = display_host(self.host)
        return (f"compare with its own past: preflight history {host} --check {self.check} (a disk, link or GPU that "
                "wears or was reconfigured drops against its own runs before it leaves the fleet's spread)")

    def to_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "value": self.value, "median": self.median, "runs": self.runs,
                "ratio": round(self.ratio, 4), "z": round(self.z, 2), "p": self.p, "better": self.better}


def unit_of(key: str) -> Tuple[str, float]:
    """(unit, scale) a figure is printed in, from its key's suffix; ("", 1) where the suffix is ambiguous."""
    leaf = key.rsplit(".", 1)[-1]
    for suffix, unit, scale in (("_Bps", "GB/s", 1e9), ("_GBps", "GB/s", 1.0), ("_ms", "ms", 1.0),
                                ("_s", "s", 1.0), ("_tflops", "TFLOPS", 1.0), ("_gflops", "GFLOPS", 1.0)):
        if leaf.endswith(suffix):
            return unit, scale
    return "", 1.0


def in_unit(x: float, unit: str) -> str:
    return f"{x:.3g} {unit}" if unit else f"{x:.3g}"


def judge(value: float, past: Sequence[float], better: str, settings: Settings) -> Optional[Tuple[float, float, float]]:
    """(median, z, p) of value against the host's own past runs when it is significantly worse than their median
    (robust z beyond z_threshold, one-sided p < max_p) by at least min_deficit; else None. sigma is the past runs'
    robust spread (1.4826 x MAD), at least noise_floor x the median, widened by the median's own uncertainty over
    n runs (as the peer comparison's median of n links is)."""
    if len(past) < settings.min_runs:
        return None
    med, sigma, _ = robust_z(past, value, settings.noise_floor)
    if med <= 0:
        return None
    sigma *= math.sqrt(1.0 + MEDIAN_SE ** 2 / len(past))
    z = (value - med) / sigma
    worse = -z if better == "lower" else z  # negative: worse, whichever way is better
    deficit = (1.0 - value / med) if better == "higher" else (value / med - 1.0)
    if deficit < settings.min_deficit or worse > -settings.z_threshold or not significant(worse, settings.max_p):
        return None
    return med, z, p_value(z)


def trend(key: str, value: float, past: Sequence[float], better: str, flagged: bool,
          settings: Settings) -> Optional[Dict[str, Any]]:
    """The report's sparkline for one figure with a baseline: the past values (oldest first, at most TREND_POINTS),
    this run's value, the median and the band median +/- z_threshold robust sigmas (sigma as ``judge`` takes it);
    None below min_runs."""
    if len(past) < settings.min_runs:
        return None
    med, sigma, _ = robust_z(past, value, settings.noise_floor)
    sigma *= math.sqrt(1.0 + MEDIAN_SE ** 2 / len(past))
    def num(x: float) -> float:
        return float(f"{x:.6g}")
    return {"key": key, "value": num(value), "series": [num(x) for x in past[-TREND_POINTS:]], "median": num(med),
            "low": num(med - settings.z_threshold * sigma), "high": num(med + settings.z_threshold * sigma),
            "better": better, "flagged": flagged}


def apply_drops(cell: Cell, drops: Sequence[Drop], settings: Settings) -> None:
    """The cell gets each drop as a WARN finding: its status the worst of its own and WARN, the drops' lines
    before a passing cell's message (after a failing one's), the fix added, and the numbers in metrics.baseline."""
    if not drops:
        return
    target = cell.target
    lines = [d.message(settings.max_p) for d in drops]
    status = Status(target.status)
    if status.rank < Status.WARN.rank:
        target.message = "; ".join(lines + ([target.message] if target.message else []))
        target.status = Status.WARN
    else:
        target.message = "; ".join(([target.message] if target.message else []) + lines)
    fix = drops[0].fix()
    target.fix = "; ".join(x for x in (target.fix, fix) if x)
    target.metrics["baseline"] = [d.to_dict() for d in drops]
