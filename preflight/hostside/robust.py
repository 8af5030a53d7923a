"""Robust statistics shared by the straggler detectors (compute, iperf3, allreduce): pure, no I/O.

A value is compared with its peers by a robust z: (x - median) / sigma, sigma = 1.4826 x MAD (the median absolute
deviation, scaled to estimate a normal standard deviation) but never below a floor that carries the measurement's
own noise, so that identical peers (MAD 0) cannot turn a 0.1% difference into an infinite z. For example
``robust_z([100, 101, 99, 100], 90, 0.01)`` -> (100.0, 1.4826, -6.7), and ``p_text(-6.7)`` -> ``"p = 1e-11"``.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence, Tuple

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


def p_text(z: float) -> str:
    """p_value as text: how unlikely noise alone makes a deviation of z."""
    p = p_value(z)
    return "p < 1e-9" if p < 1e-9 else "p = %.1g" % p
