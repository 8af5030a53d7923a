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
            return f"{int(value)} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def rate(gbps: Optional[float]) -> str:
    """A network rate in Gbit/s as text: 0.0241 -> '24.1 Mbit/s'; 9.412 -> '9.41 Gbit/s'; None -> 'n/a'."""
    if gbps is None:
        return "n/a"
    if gbps < 1.0:
        return f"{gbps * 1000:.1f} Mbit/s"
    return f"{gbps:.2f} Gbit/s"


def gbps(x: float) -> str:
    """A GB/s figure with 3 significant digits below 100 (0.0253, 45.1), whole numbers above (460)."""
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"
