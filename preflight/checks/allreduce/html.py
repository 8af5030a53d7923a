"""The all-reduce's section of the HTML report (``SPEC.html``): busbw against message size, drawn as inline SVG.

Reads the cluster row's metrics, e.g.::

    {"host": "*", "check": "allreduce", "status": "pass", "message": "busbw 3.3 GB/s at 16 MiB", ...,
     "metrics": {"sizes": [{"bytes": 65536, "busbw_GBps": 0.0065, "algbw_GBps": 0.0043, "time_s": 0.015}, ...],
                 "world_size": 4, "hosts": ["node01", ...], "backend": "gloo", "min_busbw": null}}

and returns ``<p class="caption">...<svg id="busbw">...</svg><details>(the numbers)</details>``, or why there is no
plot. Runs on the coordinator only (the renderer calls it); standard library and preflight.hostside only.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ...hostside.display import CELL, STATUS_COLOURS, absent, badge, esc
from ...hostside.fmt import human_bytes
from ...hostside.outcome import Status

CLUSTER = "*"  # the host of the cluster-wide result, which carries the sweep
TITLE = "All-reduce bus bandwidth"
# Plot geometry (px): plot area and margins for the tick labels and axis titles.
PLOT_W, PLOT_H = 640, 300
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 72, 24, 16, 56
Y_TICKS = 5   # intervals on the busbw axis
X_TICKS_MAX = 9  # more log2 ticks than this overlap at PLOT_W: label every 2nd (4th...) power of two


def nice_ceiling(x: float) -> float:
    """The smallest 1, 2, 2.5, 5 x 10^k at or above x: round axis ends."""
    if x <= 0:
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1, 2, 2.5, 5, 10):
        if x <= m * 10 ** exp * (1 + 1e-9):
            return m * 10 ** exp
    return 10 ** (exp + 1)


def _tick(value: float) -> str:
    return f"{value:.6g}"


def render(results: Sequence[Mapping[str, Any]], hosts: Sequence[str]) -> str:
    """The caption, the plot and a table of the numbers; or one line saying why there is no plot."""
    r = next((r for r in results if r["host"] == CLUSTER), None)
    if r is None:
        return absent("the all-reduce did not run (add allreduce to --checks)")
    m = r.get("metrics") or {}
    rows = [row for row in m.get("sizes") or [] if row.get("bytes") and row.get("busbw_GBps") is not None]
    if not rows:
        return absent("no busbw measured: " + CELL[Status(r["status"])] + " - " + r["message"])
    caption = (f'{esc(m.get("world_size") or "?")} ranks on {len(m.get("hosts") or [])} hosts, '
               f'{esc(m.get("backend") or "?")}; busbw = algbw &times; 2(n-1)/n, as nccl-tests reports it. '
               f'{badge(r["status"])} {esc(r["message"])}')
    table = "".join(f'<tr><td>{esc(human_bytes(row["bytes"]))}</td><td>{row.get("time_s", 0):.4g}</td>'
                    f'<td>{row.get("algbw_GBps", 0):.4g}</td><td>{row["busbw_GBps"]:.4g}</td></tr>' for row in rows)
    numbers = (f'<details><summary>numbers</summary><table class="sizes"><thead><tr><th>size</th><th>s / iter</th>'
               f'<th>algbw GB/s</th><th>busbw GB/s</th></tr></thead><tbody>{table}</tbody></table></details>')
    return f'<p class="caption">{caption}</p>{busbw_svg(rows, m.get("min_busbw"))}{numbers}'


def busbw_svg(rows: List[Dict[str, Any]], min_busbw: Optional[float]) -> str:
    """busbw (linear) against message size (log2), the --min-busbw floor dashed; one point per size."""
    xs = [math.log2(row["bytes"]) for row in rows]
    lo, hi = math.floor(min(xs)), math.ceil(max(xs))
    if hi == lo:  # one size: centre it
        lo, hi = lo - 1, hi + 1
    top_value = max([row["busbw_GBps"] for row in rows] + [float(min_busbw or 0)])
    ymax = nice_ceiling(top_value * 1.05)
    width, height = PLOT_LEFT + PLOT_W + PLOT_RIGHT, PLOT_TOP + PLOT_H + PLOT_BOTTOM

    def px(x: float) -> float:
        return PLOT_LEFT + (x - lo) / (hi - lo) * PLOT_W

    def py(y: float) -> float:
        return PLOT_TOP + PLOT_H - y / ymax * PLOT_H

    out = [f'<svg id="busbw" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="12" role="img" aria-label="all-reduce busbw by message size">',
           f'<rect x="{PLOT_LEFT}" y="{PLOT_TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="#fbfbfc" '
           f'stroke="#9ca3af"/>']
    for k in range(Y_TICKS + 1):
        v = ymax * k / Y_TICKS
        y = py(v)
        out.append(f'<line class="ytick" x1="{PLOT_LEFT - 5}" x2="{PLOT_LEFT + PLOT_W}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="{"#9ca3af" if k == 0 else "#e5e7eb"}"/>'
                   f'<text x="{PLOT_LEFT - 8}" y="{y:.1f}" dy="0.35em" text-anchor="end">{_tick(v)}</text>')
    step = max(1, math.ceil((hi - lo + 1) / X_TICKS_MAX))
    for e in range(lo, hi + 1, step):
        x = px(e)
        out.append(f'<line class="xtick" x1="{x:.1f}" x2="{x:.1f}" y1="{PLOT_TOP}" y2="{PLOT_TOP + PLOT_H + 5}" '
                   f'stroke="#e5e7eb"/><text x="{x:.1f}" y="{PLOT_TOP + PLOT_H + 20}" text-anchor="middle">'
                   f'{esc(human_bytes(2 ** e))}</text>')
    out.append(f'<text x="{PLOT_LEFT + PLOT_W / 2}" y="{height - 8}" text-anchor="middle" font-weight="600">'
               f'message size (bytes, log2 scale)</text>'
               f'<text transform="translate(16,{PLOT_TOP + PLOT_H / 2}) rotate(-90)" text-anchor="middle" '
               f'font-weight="600">busbw (GB/s)</text>')
    if min_busbw:
        y = py(float(min_busbw))
        colour = STATUS_COLOURS[Status.FAIL][0]
        out.append(f'<line x1="{PLOT_LEFT}" x2="{PLOT_LEFT + PLOT_W}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" '
                   f'stroke-dasharray="6 4"/><text x="{PLOT_LEFT + PLOT_W - 4}" y="{y - 5:.1f}" text-anchor="end" '
                   f'fill="{colour}">--min-busbw {_tick(float(min_busbw))}</text>')
    points = [(px(x), py(row["busbw_GBps"])) for x, row in zip(xs, rows)]
    out.append(f'<polyline class="series" fill="none" stroke="#2563eb" stroke-width="2.5" '
               f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>')
    for (x, y), row in zip(points, rows):
        tip = (f"{human_bytes(row['bytes'])}: busbw {row['busbw_GBps']:.4g} GB/s, "
               f"algbw {row.get('algbw_GBps', 0):.4g} GB/s")
        out.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="#2563eb" stroke="#ffffff" '
                   f'stroke-width="1.5"><title>{esc(tip)}</title></circle>')
    out.append("</svg>")
    return "".join(out)
