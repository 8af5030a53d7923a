"""Formatting of sizes and rates shared by the checks' messages and the HTML report (pure, no imports).

    human_bytes(1 << 20) -> '1 MiB';  rate(0.0241) -> '24.1 Mbit/s';  gbps(0.02531) -> '0.0253'
"""
from __future__ import annotations

from typing import Optional


def human_bytes(n: float) -> str:
    """1048576 -> '1 MiB'; 1610612736 -> '1.5 GiB'; 512 -> '512 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return ("%d %s" % (value, unit)) if value == int(value) else ("%.1f %s" % (value, unit))
    return "%d B" % n


def rate(gbps: Optional[float]) -> str:
    """A network rate in Gbit/s as text: 0.0241 -> '24.1 Mbit/s'; 9.412 -> '9.41 Gbit/s'; None -> 'n/a'."""
    if gbps is None:
        return "n/a"
    if gbps < 1.0:
        return "%.1f Mbit/s" % (gbps * 1000)
    return "%.2f Gbit/s" % gbps


def gbps(x: float) -> str:
    """A GB/s figure with 3 significant digits below 100 (0.0253, 45.1), whole numbers above (460)."""
    return ("%.3g" % x) if x < 100 else ("%.0f" % x)
