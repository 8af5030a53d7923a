"""Each host's figures judged against its own past runs: the ``[history]`` settings, which figures a check declares
(``SPEC.baseline``), the robust statistics of a drop and the WARN it becomes, e.g.::

    node07 nvme paths[/local_nvme].write_Bps 1.9 GB/s is 61% of its median of the last 20 runs (3.1 GB/s);
    robust z -6.2, p = 0.0001 (t, 7.8 df)
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.hostside import stats
from preflight.hostside.outcome import Status
from preflight.hostside.robust import MAX_P, MEDIAN_SE, robust_z
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
    """A figure significantly worse than the host's own median: the WARN's numbers. ``fleet``: the factor every
    host of the check moved by in this run (``Drift``) that was taken out before judging, 1.0 when none; ``p_adj``
    and ``family``: Holm's adjustment over every figure compared in the run."""

    host: str
    check: str
    key: str
    better: str
    value: float
    median: float
    runs: int
    z: float
    p: float
    p_adj: float = 1.0
    family: int = 1
    fleet: float = 1.0

    @property
    def ratio(self) -> float:
        return self.value / self.median

    def figure(self) -> str:
        """The figure against its past: ``median_gbps 4.1 is 48% of its median of the last 7 runs (8.6``, the
        parenthesis left open for what the caller adds."""
        unit, scale = unit_of(self.key)
        value, median = in_unit(self.value / scale, unit), in_unit(self.median / scale, unit)
        if self.better == "higher":
            how = f"is {100 * self.ratio:.0f}% of"
        else:
            how = f"is {self.ratio:.2g}x"
        runs = f"the last {self.runs} runs" if self.runs != 1 else "its last run"
        return f"{self.key} {value} {how} its median of {runs} ({median}"

    def message(self, max_p: float = MAX_P) -> str:
        fleet = ""
        if self.fleet < 1.0:  # what is left of the drop once the fleet's common factor is taken out
            left = self.ratio / self.fleet if self.better == "higher" else self.ratio * self.fleet
            shown = f"{100 * left:.0f}%" if self.better == "higher" else f"{left:.2g}x"
            fleet = f", {shown} after the fleet's common {100 * self.fleet:.0f}% is taken out"
        adjusted = (f"; adjusted {stats.p_text(self.p_adj, max_p)} over {self.family} figures (Holm)"
                    if self.family > 1 else "")
        return (f"{display_host(self.host)} {self.check} {self.figure()}{fleet}); robust z {self.z:+.1f}, "
                f"{stats.p_text(self.p, max_p)} (t, {past_df(self.runs):.1f} df){adjusted}")

    def fix(self) -> str:
        host = display_host(self.host)
        return (f"compare with its own past: preflight history {host} --check {self.check} (a disk, link or GPU that "
                "wears or was reconfigured drops against its own runs before it leaves the fleet's spread)")

    def to_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "value": self.value, "median": self.median, "runs": self.runs,
                "ratio": round(self.ratio, 4), "z": round(self.z, 2), "p": self.p, "p_adj": self.p_adj,
                "family": self.family, "fleet": round(self.fleet, 4), "better": self.better}


# A drop shared by the fleet: with at least this many hosts of a check compared on a figure, their median ratio to
# their own pasts is the fleet's common factor (a slower machine room, a driver, a power cap): one cause, not one
# per host.
FLEET_MIN_HOSTS = 3


@dataclass
class Drift:
    """One figure of one check that the fleet's hosts moved on together in this run: ``factor`` is the median over
    ``hosts`` of each one's value over its own median (worse below 1, whichever way is better); ``dropped`` the
    hosts whose own drop was significant before the common factor was taken out, with (value, median); ``also`` the
    cluster row's own drops of that check in the run, said on the same line (Recorder.judge): one cause."""

    check: str
    key: str
    better: str
    factor: float
    hosts: int
    dropped: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    also: List[Drop] = field(default_factory=list)

    def common(self, settings: "Settings") -> float:
        """The common drop taken out of each host's figure: the factor, where the fleet dropped by at least the
        noise floor (less is what one run measures differently from the next); else 1 (a common rise is not taken
        out either: the host's own past decides)."""
        return self.factor if 1.0 - self.factor >= settings.noise_floor else 1.0

    def adjust(self, value: float, settings: "Settings") -> float:
        """The value with the fleet's common drop taken out."""
        f = self.common(settings)
        return value / f if self.better == "higher" else value * f

    def notable(self, settings: "Settings") -> bool:
        """The fleet itself dropped: by at least min_deficit, with at least half of its hosts significantly."""
        return 1.0 - self.factor >= settings.min_deficit and 2 * len(self.dropped) >= self.hosts

    def message(self) -> str:
        unit, scale = unit_of(self.key)
        shown = sorted(self.dropped.items(), key=lambda kv: worse_ratio(kv[1][0], kv[1][1], self.better))[:4]
        listed = ", ".join(f"{display_host(h)} {in_unit(v / scale, unit)} of {in_unit(m / scale, unit)}"
                           for h, (v, m) in shown)
        more = f" and {len(self.dropped) - 4} more" if len(self.dropped) > 4 else ""
        cluster = "".join(f"; the cluster's own {d.figure()})" for d in self.also)
        return (f"{self.check} {self.key}: the fleet dropped against its own past, the median host at "
                f"{100 * self.factor:.0f}% of its median ({self.hosts} hosts compared; {len(self.dropped)} "
                f"significantly: {listed}{more}{cluster}): one cause common to the hosts, not one per host")

    def fix(self) -> str:
        return ("look for what changed for every host at once (clocks or power caps, a driver or firmware update, "
                "a shared load, the settings); each host's figures against the last run: preflight diff --against last")


def worse_ratio(value: float, median: float, better: str) -> float:
    """value against its median with worse below 1, whichever way is better."""
    if median <= 0 or value <= 0:
        return 1.0
    return value / median if better == "higher" else median / value


def drifts(figures: Sequence[Tuple[str, str, str, float, Sequence[float], str]], settings: "Settings"
           ) -> Dict[Tuple[str, str], Drift]:
    """Each (check, key) that at least FLEET_MIN_HOSTS hosts were compared on (host, check, key, value, past,
    better), with the fleet's common factor and the hosts whose own drop was significant."""
    groups: Dict[Tuple[str, str], List[Tuple[str, float, Sequence[float], str]]] = {}
    for host, check, key, value, past, better in figures:
        if len(past) >= settings.min_runs:
            groups.setdefault((check, key), []).append((host, value, past, better))
    out: Dict[Tuple[str, str], Drift] = {}
    for (check, key), members in groups.items():
        if len(members) < FLEET_MIN_HOSTS:
            continue
        ratios = [worse_ratio(v, statistics.median(past), b) for _, v, past, b in members]
        drift = Drift(check, key, members[0][3], statistics.median(ratios), len(members))
        for host, value, past, better in members:
            verdict = judge(value, past, better, settings)
            if verdict:
                drift.dropped[host] = (value, verdict[0])
        out[(check, key)] = drift
    return out


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


def spread(value: float, past: Sequence[float], settings: Settings) -> Tuple[float, float]:
    """(median, sigma) of a host's past runs as every comparison against them takes it: sigma is their robust spread
    (1.4826 x MAD), at least noise_floor x the median, widened by the median's own uncertainty over n runs (as the
    peer comparison's median of n links is)."""
    med, sigma, _ = robust_z(past, value, settings.noise_floor)
    return med, sigma * math.sqrt(1.0 + MEDIAN_SE ** 2 / len(past))


def past_df(n: int) -> float:
    """The degrees of freedom of Student's t that a value's robust z against n past runs follows (the past's median
    and MAD both estimated from those n): 0.4 n - 0.2, at least 1. Fitted by simulation (normal runs, 2 million draws
    per n: 1.8 df at 5 runs, 3.4 at 8, 4.2 at 10, 7.9 at 20, for one-sided p from 0.01 to 0.0001), never above the
    fit, so that the stated p holds (tests/history/test_history.py::test_a_drop_s_p_holds_on_simulated_pasts). The
    normal tail that z was read against before stated p = 0.0001 where 1-3% of healthy runs got there."""
    return max(1.0, 0.4 * n - 0.2)


def tail_p(z: float, n: int) -> float:
    """The one-sided p of a robust z this far below the median of n past runs (1 where it is not below)."""
    return stats.t_cdf(z, past_df(n)) if z < 0 else 1.0


def judge(value: float, past: Sequence[float], better: str, settings: Settings) -> Optional[Tuple[float, float, float]]:
    """(median, z, p) of value against the host's own past runs when it is significantly worse than their median
    (robust z beyond z_threshold, one-sided p < max_p) by at least min_deficit; else None (sigma: ``spread``)."""
    if len(past) < settings.min_runs:
        return None
    med, sigma = spread(value, past, settings)
    if med <= 0:
        return None
    z = (value - med) / sigma
    worse = -z if better == "lower" else z  # negative: worse, whichever way is better
    deficit = (1.0 - value / med) if better == "higher" else (value / med - 1.0)
    p = tail_p(worse, len(past))
    if deficit < settings.min_deficit or worse > -settings.z_threshold or not p < settings.max_p:
        return None
    return med, z, p


def one_sided_p(value: float, past: Sequence[float], better: str, settings: Settings) -> float:
    """The one-sided p of value being worse than the past's median, as ``judge`` takes it (1 where it is not worse):
    each compared figure's member of the run's Holm family."""
    med, sigma = spread(value, past, settings)
    worse = (med - value if better == "lower" else value - med) / sigma
    return tail_p(worse, len(past))


def trend(key: str, value: float, past: Sequence[float], better: str, flagged: bool,
          settings: Settings) -> Optional[Dict[str, Any]]:
    """The report's sparkline for one figure with a baseline: the past values (oldest first, at most TREND_POINTS),
    this run's value, the median and the band median +/- z_threshold robust sigmas (``spread``);
    None below min_runs."""
    if len(past) < settings.min_runs:
        return None
    med, sigma = spread(value, past, settings)
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
