"""On the coordinator, in the HTML report (``SPEC.html``): a heat map of the measured links, from the hosts' results::

    {"host": "node01", "check": "iperf3", "status": "pass", "metrics": {"network": "198.18.0.0/24",
     "links": [{"src": "node01", "dst": "node02", "gbps": 0.190246, "retransmits": 0, "error": None}, ...]}}
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .common import CLUSTER
from ...hostside.display import STATUS_COLOURS, absent, badge, esc
from ...hostside.fmt import rate
from ...hostside.outcome import Status

# Colour scale, as link rate / the median of the unflagged hosts (reference_median). At or below SLOW_RATIO a link is
# fully red: the default straggler_fail_fraction ("a node at 50% must never pass"). At or above FAST_RATIO fully
# green: at least the median is what a healthy link of this cluster does. Hues in between run through amber.
SLOW_RATIO, FAST_RATIO = 0.5, 1.0
SLOW_HUE, FAST_HUE = 0, 130
UNMEASURED_FILL, SELF_FILL, GRID_LINE = "#f1f3f5", "#cfd4da", "#ffffff"
# Geometry (px). The grid is at most HEATMAP_MAX_PX wide (fits a laptop screen beside the labels); cells shrink
# with hosts down to CELL_MIN_PX (64 hosts: 10 px), and values are written inside cells only when a cell is wide
# enough for "1234" at the value font (VALUE_TEXT_MIN_PX); the <title> tooltip has them always.
HEATMAP_MAX_PX, CELL_MAX_PX, CELL_MIN_PX, VALUE_TEXT_MIN_PX = 640, 64, 8, 34
SLANT_MIN_PX = 20  # column labels at -45 degrees from this cell width up (label spacing cell*sin45 > font)
CHAR_PX = 0.62  # average glyph width / font size of the sans-serif font: sizes the label margins
FLAGGED = ("fail", "warn")  # the statuses whose host is outlined in the map and listed beside it


def measured_links(results: Sequence[Mapping[str, Any]]) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Every measured (src, dst) link from the hosts' results (each link is listed at both of its ends)."""
    links: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for r in results:
        if r["host"] != CLUSTER:
            for ln in (r.get("metrics") or {}).get("links") or []:
                if ln.get("src") and ln.get("dst"):
                    links[(ln["src"], ln["dst"])] = ln
    return links


def reference_median(ok: List[Dict[str, Any]], flagged: Iterable[str]) -> Optional[float]:
    """The median that colours the heat map: of the links between hosts the check did not flag (the cluster
    median when it flagged none; the report's text calls each number by its own name, issue 26).

    With 4 hosts a straggler takes part in half the links, so the plain median would be its rate and its links
    would look normal; evaluate compares a host with the links that do not involve it, as here.
    """
    flagged = set(flagged)
    healthy = [ln["gbps"] for ln in ok if ln["src"] not in flagged and ln["dst"] not in flagged]
    rates = healthy or [ln["gbps"] for ln in ok]
    return statistics.median(rates) if rates else None


def _ratio_colour(ratio: float) -> str:
    t = min(1.0, max(0.0, (ratio - SLOW_RATIO) / (FAST_RATIO - SLOW_RATIO)))
    return f"hsl({SLOW_HUE + t * (FAST_HUE - SLOW_HUE):.0f}, 70%, 62%)"


def _short_rate(gbps: float, mbit: bool) -> str:
    value = gbps * 1000 if mbit else gbps
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def html_section(results: Sequence[Mapping[str, Any]], host_names: Sequence[str]) -> str:
    """The heat map (``<svg id="heatmap">``) of this check's results, the flagged hosts beside it; or why none."""
    per_host = {r["host"]: r for r in results if r["host"] != CLUSTER}
    cluster = next((r for r in results if r["host"] == CLUSTER), None)
    if cluster is None and not per_host:
        return absent("iperf3 did not run (add iperf3 to --checks)")
    links = measured_links(results)
    ok = [ln for ln in links.values() if not ln.get("error") and ln.get("gbps") is not None]
    if not links:
        why = cluster["message"] if cluster is not None else "no link was measured"
        return absent("no heat map: " + why)
    named = {n for pair in links for n in pair}
    hosts = [h for h in host_names if h in per_host or h in named]
    hosts += sorted(named - set(hosts))  # a link to a host the report does not list still gets its row
    marked = {h: r for h, r in per_host.items() if r["status"] in FLAGGED}
    median = reference_median(ok, marked)
    network = next((r["metrics"]["network"] for r in per_host.values() if (r.get("metrics") or {}).get("network")),
                   None)
    svg, values = _heatmap_svg(hosts, links, median, marked, {h: r["status"] for h, r in per_host.items()})
    n = len(hosts)
    caption = (f'iperf3 TCP rate{" on " + esc(network) if network else ""}: rows send (src), columns receive '
               f'(dst). Colour: rate relative to the median of the unflagged hosts ({esc(rate(median))}, their '
               f'links with each other; the cluster median when no host is flagged). '
               f'{len(links)} of {n * (n - 1)} ordered pairs measured: pairs are sampled in rounds of disjoint '
               f'pairs, not all-to-all. {esc(values)}')
    legend = (f'<div class="legend"><span><span class="ramp" style="background: linear-gradient(to right, '
              f'{_ratio_colour(SLOW_RATIO)}, {_ratio_colour((SLOW_RATIO + FAST_RATIO) / 2)}, '
              f'{_ratio_colour(FAST_RATIO)})"></span> &le;{SLOW_RATIO:.0%} &hellip; &ge;{FAST_RATIO:.0%} of '
              f'median</span><span><span class="swatch" style="background:{UNMEASURED_FILL}"></span>not measured'
              f'</span><span><span class="swatch" style="background:{SELF_FILL}"></span>same host</span>'
              f'<span><span class="swatch st-fail"></span>failed test (&times;)</span>'
              f'<span><span class="swatch" style="border:2px solid {STATUS_COLOURS[Status.FAIL][0]}"></span>'
              f'flagged host (row and column)</span></div>')
    flagged = "".join(f'<li data-host="{esc(h)}">{badge(r["status"])} '
                      f'{"" if r["message"].startswith(h) else "<b>" + esc(h) + "</b>: "}{esc(r["message"])}</li>'
                      for h, r in marked.items())
    flagged_html = (f'<h3>flagged hosts (iperf3 FAIL/WARN)</h3><ul id="stragglers">{flagged}</ul>' if flagged else
                    '<p class="caption" id="stragglers">no straggler: every host\'s links are within the '
                    'iperf3 thresholds.</p>')
    return (f'<p class="caption">{caption}</p>{legend}'
            f'<div class="maprow"><div class="scroll">{svg}</div><div class="flagged">{flagged_html}</div></div>')


def _heatmap_svg(hosts: List[str], links: Dict[Tuple[str, str], Dict[str, Any]], median: Optional[float],
                 marked: Mapping[str, Mapping[str, Any]], statuses: Dict[str, str]) -> Tuple[str, str]:
    """The SVG, and one line saying where the values are (in the cells, or only in the tooltips)."""
    n = len(hosts)
    cell = max(CELL_MIN_PX, min(CELL_MAX_PX, HEATMAP_MAX_PX // n))
    font = max(8, min(13, cell - 2))
    label_w = int(max(len(h) for h in hosts) * font * CHAR_PX) + 18  # + the flagged marker dot
    # Slanted column labels read better but need cells wider than the font, else they overlap: then upright.
    angle = 45 if cell >= SLANT_MIN_PX else 90
    rise, run = math.sin(math.radians(angle)), math.cos(math.radians(angle))
    left, top = label_w + 20, int(label_w * rise) + 20
    width, height = left + n * cell + int(label_w * run) + font + 8, top + n * cell + 8
    index = {h: i for i, h in enumerate(hosts)}
    mbit = median is not None and median < 1.0
    show_values = cell >= VALUE_TEXT_MIN_PX
    grid = "".join(f"M{left},{top + k * cell}h{n * cell}M{left + k * cell},{top}v{n * cell}"
                   for k in range(1, n))
    out = [f'<svg id="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="{font}" data-hosts="{n}" role="img" '
           f'aria-label="iperf3 bandwidth heat map">',
           f'<rect x="{left}" y="{top}" width="{n * cell}" height="{n * cell}" fill="{UNMEASURED_FILL}"/>',
           # Grid lines instead of one element per unmeasured cell: the page stays small at 64+ hosts.
           f'<path d="{grid}" stroke="{GRID_LINE}" stroke-width="1" pointer-events="none"/>',
           f'<text x="{left - 6}" y="{top - 6}" text-anchor="end" fill="#6b7280">src \\ dst</text>']
    out += _heatmap_labels(hosts, marked, statuses, left, top, cell, angle)
    out += _heatmap_cells(links, index, median, left, top, cell, mbit, show_values)
    out += _heatmap_bands(marked, index, left, top, cell, n)
    out.append("</svg>")
    unit = "Mbit/s" if mbit else "Gbit/s"
    values = (f"Values in {unit}." if show_values else
              f"{n} hosts: the values are in each cell's tooltip (hover), not written in the cells.")
    return "".join(out), values


def _heatmap_labels(hosts: List[str], marked: Mapping[str, Mapping[str, Any]], statuses: Dict[str, str],
                    left: int, top: int, cell: int, angle: int) -> List[str]:
    """Each host's row and column label (a flagged host's in bold, with a dot, in its status colour) and its
    diagonal self cell."""
    def label_colour(h: str) -> str:
        st = statuses.get(h)
        return STATUS_COLOURS[Status(st)][0] if st in ("fail", "warn", "error") else "#1f2937"

    out = []
    for i, h in enumerate(hosts):
        y = top + i * cell + cell / 2
        x = left + i * cell + cell / 2
        weight = ' font-weight="700"' if h in marked else ""
        dot = (f'<circle cx="{left - 10}" cy="{y:.1f}" r="4" fill="{label_colour(h)}"/>' if h in marked else "")
        out.append(f'{dot}<text class="row-label" x="{left - 18}" y="{y:.1f}" dy="0.35em" text-anchor="end" '
                   f'fill="{label_colour(h)}"{weight}>{esc(h)}</text>')
        out.append(f'<text class="col-label" transform="translate({x:.1f},{top - 8}) rotate(-{angle})" '
                   f'dy="0.35em" fill="{label_colour(h)}"{weight}>{esc(h)}</text>')
        out.append(f'<rect class="self" x="{left + i * cell}" y="{top + i * cell}" width="{cell}" '
                   f'height="{cell}" fill="{SELF_FILL}"><title>{esc(h)}</title></rect>')
    return out


def _heatmap_cells(links: Dict[Tuple[str, str], Dict[str, Any]], index: Dict[str, int], median: Optional[float],
                   left: int, top: int, cell: int, mbit: bool, show_values: bool) -> List[str]:
    """One cell per measured link between two of the hosts: a crossed-out cell for a failed test, else coloured by
    its rate's ratio to the median, with the rate as its tooltip (and written in it when the cells are big enough)."""
    value_font = min(12, cell // 3)
    failed_fill, failed_mark = STATUS_COLOURS[Status.FAIL]
    out = []
    for (src, dst), ln in links.items():
        if src not in index or dst not in index or src == dst:
            continue
        x, y = left + index[dst] * cell, top + index[src] * cell
        geometry = f'x="{x}" y="{y}" width="{cell}" height="{cell}"'
        data = f'data-src="{esc(src)}" data-dst="{esc(dst)}"'
        if ln.get("error") or ln.get("gbps") is None:
            tip = f"{src} \u2192 {dst}: failed: {ln.get('error') or 'no result'}"
            pad = cell * 0.28
            out.append(f'<rect class="cell failed" {data} {geometry} fill="{failed_fill}" '
                       f'stroke="{GRID_LINE}"><title>{esc(tip)}</title></rect>'
                       f'<path d="M{x + pad:.1f},{y + pad:.1f}L{x + cell - pad:.1f},{y + cell - pad:.1f}'
                       f'M{x + cell - pad:.1f},{y + pad:.1f}L{x + pad:.1f},{y + cell - pad:.1f}" '
                       f'stroke="{failed_mark}" stroke-width="2" pointer-events="none"/>')
            continue
        gbps = float(ln["gbps"])
        ratio = gbps / median if median else 1.0
        retrans = ln.get("retransmits")
        tip = (f"{src} \u2192 {dst}: {rate(gbps)} ({ratio:.0%} of median)"
               + (f", {retrans} retransmits" if retrans is not None else ""))
        out.append(f'<rect class="cell" {data} data-gbps="{gbps:.6g}" {geometry} fill="{_ratio_colour(ratio)}" '
                   f'stroke="{GRID_LINE}"><title>{esc(tip)}</title></rect>')
        if show_values:
            out.append(f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2:.1f}" dy="0.35em" text-anchor="middle" '
                       f'font-size="{value_font}" fill="#111827" pointer-events="none">'
                       f'{_short_rate(gbps, mbit)}</text>')
    return out


def _heatmap_bands(marked: Mapping[str, Mapping[str, Any]], index: Dict[str, int], left: int, top: int, cell: int,
                   n: int) -> List[str]:
    """Flagged hosts: outline their whole row and column so that a straggler's band stands out."""
    band_w = max(1.5, min(3.0, cell / 8))  # the flagged band's outline: thin enough not to hide small cells
    out = []
    for h, r in marked.items():
        i = index[h]
        colour = STATUS_COLOURS[Status(r["status"])][0]
        band = f'fill="none" stroke="{colour}" stroke-width="{band_w}" pointer-events="none"'
        d = band_w / 2  # the outline sits just outside the row's and column's cells
        out.append(f'<rect class="flagged-row" data-host="{esc(h)}" x="{left - d}" y="{top + i * cell - d:.1f}" '
                   f'width="{n * cell + 2 * d}" height="{cell + 2 * d}" {band}/>'
                   f'<rect class="flagged-col" data-host="{esc(h)}" x="{left + i * cell - d}" y="{top - d:.1f}" '
                   f'width="{cell + 2 * d}" height="{n * cell + 2 * d}" {band}/>')
    return out
