"""Robust statistics: the robust z of a host's figure against its own past runs (history.py), and the relative
spread of repeated measurements (``rel_noise``) that the straggler detectors use as measured noise. Pure, no I/O.
The straggler verdicts themselves (compute, iperf3, all-reduce rounds) are a small-sample test: ``stats.py``.

A value is compared with its peers by a robust z: (x - median) / sigma, sigma = 1.4826 x MAD (the median absolute
deviation, scaled to estimate a normal standard deviation) but never below a floor that carries the measurement's
own noise, so that identical peers (MAD 0) cannot turn a 0.1% difference into an infinite z. For example
``robust_z([100, 101, 99, 100], 90, 0.01)`` -> (100.0, 1.4826, -6.7), ``p_text(-6.7)`` -> ``"p < 1e-9"`` and
``p_text(-2.0)`` -> ``"p = 0.02"``.

Severity follows the evidence (issue 26): a peer comparison names a device or host only when its deficit is
``significant`` (one-sided p below the check's ``max_p``, 0.05 by default), however large the deficit; a large
deficit that is not significant is ambiguous, and the check measures again instead of failing. ``p_text`` never
prints a p on the other side of ``max_p`` than the p it describes (0.0496 is "p = 0.0496", not "p = 0.05").
"""
from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence, Tuple

from . import stats

# The one-sided p below which a deficit counts as evidence (the checks' `max_p` default; the usual 5% level).
MAX_P = 0.05

# 1.4826 * MAD estimates the standard deviation of normally distributed data (the usual robust-z constant).
MAD_TO_SIGMA = 1.4826
# The standard error of a median of n normal samples is about sqrt(pi/2) = 1.2533 times that of their mean.
MEDIAN_SE = 1.2533


def robust_z(values: Sequence[float], x: float, rel_floor: float) -> Tuple[float, float, float]:
    """(median, robust sigma, z of x) of x against its peers: sigma = 1.4826 * MAD of the peers, but never below
    rel_floor * median. rel_floor carries the measurement's own noise and a fixed minimum."""
    med = statistics.median(values)
    mad = statistics.median([abs(v - med) for v in values])
    sigma = max(MAD_TO_SIGMA * mad, rel_floor * abs(med), 1e-12)
    return med, sigma, (x - med) / sigma


def rel_noise(samples: Sequence[float]) -> Optional[float]:
    """Relative robust spread (1.4826 * MAD / median) of repeated measurements of one thing; None below 3."""
    if len(samples) < 3:
        return None
    med = statistics.median(samples)
    return MAD_TO_SIGMA * statistics.median([abs(x - med) for x in samples]) / med if med > 0 else None


def p_value(z: float) -> float:
    """One-sided tail probability of a normal deviate as extreme as z."""
    return 0.5 * math.erfc(abs(z) / math.sqrt(2))


def z_limit(max_p: float) -> float:
    """The z a deficit must be below to be significant at one-sided ``max_p``: -1.645 at 0.05, -2.33 at 0.01."""
    if max_p >= 0.5:
        return 0.0
    return statistics.NormalDist().inv_cdf(max(max_p, 1e-300))


def significant(z: float, max_p: float = MAX_P) -> bool:
    """A deficit (z < 0) whose one-sided p is below max_p; max_p >= 1 accepts every deficit (statistics off)."""
    return max_p >= 1.0 or (z < 0 and p_value(z) < max_p)


def p_text(z: float, max_p: float = MAX_P) -> str:
    """p_value as text: how unlikely noise alone makes a deviation of z, written as stats.p_text writes any p."""
    return stats.p_text(p_value(z), max_p)
