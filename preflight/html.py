"""Self-contained HTML report (``--html FILE``): matrix, details, environment, iperf3 heat map, busbw plot.

Reads only the Report's structured results, like every reporter. One file with inline CSS and inline SVG, no
JavaScript and no external assets: clusters are often offline. Consumes e.g.::

    Result("node03", "iperf3", Status.FAIL, "node03: median 48.1 Mbit/s ... (25%)", "on node03: ethtool eth0 ...",
           {"links": [{"src": "node03", "dst": "node04", "gbps": 0.048, "retransmits": 0, "error": None}], ...})
    Result("*", "allreduce", Status.PASS, "busbw ...", metrics={"sizes": [{"bytes": 65536, "busbw_GBps": 0.0065,
                                                                           "algbw_GBps": 0.0043, "time_s": 0.015}]})

and produces ``<!doctype html>...<table id="matrix">...<svg id="heatmap">...<svg id="busbw">...</html>``.
"""
from __future__ import annotations

import math
import re
import statistics
from html import escape
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from preflight.hostside.fmt import human_bytes
from preflight.hostside.outcome import Status
from preflight.hostside.fmt import rate
from preflight import __version__
from preflight.results import CLUSTER, CLUSTER_NAME, Report, Result, display_host
from preflight.report import CELL, summary_line

# The one definition of the status colours (background, text): the matrix cells, the badges, the heat map's
# marked hosts and failed links all use these. Passing cells are pale so that the rest stands out.
STATUS_COLOURS: Dict[Status, Tuple[str, str]] = {
    Status.PASS: ("#c6f0d2", "#14532d"),
    Status.WARN: ("#fcd34d", "#451a03"),
    Status.FAIL: ("#dc2626", "#ffffff"),
    Status.SKIP: ("#e5e7eb", "#4b5563"),
    Status.ERROR: ("#a21caf", "#ffffff"),
}
# Details list order: what needs action first; SKIP before PASS because a skip carries a reason worth reading.
DETAIL_ORDER = (Status.FAIL, Status.ERROR, Status.WARN, Status.SKIP, Status.PASS)
NO_RESULT = "\u00b7"  # the matrix cell of a check not run on that row, as in the terminal matrix
SUMMARY_HOSTS = 8  # the header names this many hosts at most; the matrix lists them all
NAV = " &middot; ".join(f'<a href="#{target}">{name}</a>' for target, name in (
    ("matrix-section", "matrix"), ("details", "results"), ("environment", "environment"),
    ("network", "iperf3 heat map"), ("allreduce", "all-reduce busbw")))

# Heat map colour scale, as link rate / the cluster median (reference_median). At or below SLOW_RATIO a link is fully
# red: iperf3's default straggler_fail_fraction ("a node at 50% must never pass"). At or above FAST_RATIO fully
# green: at least the median is what a healthy link of this cluster does. Hues in between run through amber.
SLOW_RATIO, FAST_RATIO = 0.5, 1.0
SLOW_HUE, FAST_HUE = 0, 130
UNMEASURED_FILL, SELF_FILL, GRID_LINE = "#f1f3f5", "#cfd4da", "#ffffff"
# Heat map geometry (px). The grid is at most HEATMAP_MAX_PX wide (fits a laptop screen beside the labels);
# cells shrink with hosts down to CELL_MIN_PX (64 hosts: 10 px), and values are written inside cells only when
# a cell is wide enough for "1234" at the value font (VALUE_TEXT_MIN_PX); the <title> tooltip has them always.
HEATMAP_MAX_PX, CELL_MAX_PX, CELL_MIN_PX, VALUE_TEXT_MIN_PX = 640, 64, 8, 34
SLANT_MIN_PX = 20  # column labels at -45 degrees from this cell width up (label spacing cell*sin45 > font)
CHAR_PX = 0.62  # average glyph width / font size of the sans-serif font: sizes the label margins
# busbw plot geometry (px): plot area and margins for the tick labels and axis titles.
PLOT_W, PLOT_H = 640, 300
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 72, 24, 16, 56
Y_TICKS = 5   # intervals on the busbw axis
X_TICKS_MAX = 9  # more log2 ticks than this overlap at PLOT_W: label every 2nd (4th...) power of two

CSS = """
:root { --fg: #1f2937; --muted: #6b7280; --line: #e5e7eb; --card: #ffffff; --bg: #f6f7f9; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; }
main { max-width: 1200px; margin: 0 auto; padding: 20px 24px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 0 0 10px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 16px 18px;
          margin: 16px 0; }
.meta, .caption, .absent, .dur { color: var(--muted); }
.absent { font-style: italic; margin: 0; }
.verdict { display: inline-block; padding: 4px 12px; border-radius: 6px; font-weight: 700; margin: 8px 0; }
.counts > span { margin-right: 16px; }
.badge { display: inline-block; min-width: 52px; text-align: center; padding: 1px 6px; border-radius: 4px;
         font-weight: 600; font-size: 12px; }
.scroll { overflow: auto; max-height: 80vh; }
table { border-collapse: collapse; }
#matrix th, #matrix td { border: 1px solid var(--line); padding: 4px 10px; white-space: nowrap; }
#matrix thead th { position: sticky; top: 0; background: #f9fafb; z-index: 2; }
#matrix tbody th { position: sticky; left: 0; background: #f9fafb; text-align: left; font-weight: 600; z-index: 1; }
#matrix tr.cluster th { font-style: italic; }
#matrix tr.cluster td, #matrix tr.cluster th { border-top: 2px solid #9ca3af; }
#matrix td { text-align: center; font-weight: 600; }
#matrix td a { color: inherit; text-decoration: none; display: block; }
#matrix td.none { color: #9ca3af; font-weight: 400; }
.result { border-left: 4px solid; padding: 6px 10px; margin: 6px 0; background: #fafafa; border-radius: 0 4px 4px 0; }
.result:target, .result:has(.anchor:target) { outline: 2px solid #2563eb; }
.result .msg { margin: 4px 0 0; white-space: pre-wrap; word-break: break-word; }
.result .fix { margin: 4px 0 0; }
.result .fix code { white-space: pre-wrap; word-break: break-word; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f3f4f6; padding: 10px; border-radius: 6px; overflow: auto; }
#env th, #env td { border-bottom: 1px solid var(--line); padding: 4px 10px 4px 0; text-align: left;
                   vertical-align: top; }
#heatmap rect.cell:hover, #busbw circle:hover { stroke: #111827; stroke-width: 2; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; margin: 8px 0; color: var(--muted); }
.swatch { display: inline-block; width: 14px; height: 14px; vertical-align: -2px; border: 1px solid #d1d5db;
          margin-right: 4px; }
.ramp { display: inline-block; width: 160px; height: 14px; vertical-align: -2px; border-radius: 2px; }
details > summary { cursor: pointer; }
.maprow { display: flex; flex-wrap: wrap; gap: 8px 28px; align-items: flex-start; }
.flagged { flex: 1 1 300px; }
.flagged ul { padding-left: 18px; margin: 0; }
.flagged li { margin-bottom: 6px; }
"""


def _esc(value: Any) -> str:
    return escape(str(value), quote=True)


def _status_css() -> str:
    return "".join(f".st-{s.value} {{ background: {bg}; color: {fg}; }}\n"
                   f".result.st-border-{s.value} {{ border-left-color: {bg}; }}\n"
                   for s, (bg, fg) in STATUS_COLOURS.items())


def _badge(status: Status, text: Optional[str] = None) -> str:
    return f'<span class="badge st-{status.value}">{_esc(text or CELL[status])}</span>'


def _anchor_ids(results: Sequence[Result]) -> Dict[int, str]:
    """A stable, unique, URL-safe anchor per result: r-<host>-<check> (the cluster row is 'cluster')."""
    ids: Dict[int, str] = {}
    used: Dict[str, int] = {}
    for i, r in enumerate(results):
        host = display_host(r.host)
        base = "r-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{host}-{r.check}")
        used[base] = used.get(base, 0) + 1
        ids[i] = base if used[base] == 1 else f"{base}-{used[base]}"
    return ids


# --------------------------------------------------------------------------------------- page parts

def _summary(report: Report) -> str:
    ok = report.exit_code == 0
    counts = report.counts()
    verdict = ("no FAIL or ERROR: ready to submit" if ok else "FAIL or ERROR found: fix before submitting")
    if report.strict and counts["warn"] and not ok and not (counts["fail"] or counts["error"]):
        verdict = "warnings with --strict: fix before submitting"
    badges = "".join(f"<span>{_badge(s)} {counts[s.value]}</span>" for s in DETAIL_ORDER)
    names = [h.name for h in report.hosts]
    shown = names if len(names) <= SUMMARY_HOSTS else names[:2] + ["\u2026"] + names[-1:]
    down = [h.name for h in report.hosts if not h.reachable]
    hosts = ", ".join(shown) + (f" (unreachable: {', '.join(down)})" if down else "")
    return (f'<section id="summary"><h1>preflight report</h1>'
            f'<div class="meta">started {_esc(report.started_at)} &middot; {report.duration_s:.1f} s &middot; '
            f'{len(report.hosts)} host{"s" if len(report.hosts) != 1 else ""}: {_esc(hosts)} &middot; '
            f'preflight {_esc(__version__)}</div>'
            f'<div class="verdict st-{"pass" if ok else "fail"}">exit code {report.exit_code}: {verdict}</div>'
            f'<div class="counts">{badges}</div><p>{_esc(summary_line(report))}</p>'
            f'<nav>{NAV}</nav></section>')


def _matrix(report: Report, ids: Dict[int, str]) -> str:
    """Hosts as rows, checks as columns, the cluster-wide row last: report.matrix() as a table."""
    cells: Dict[str, Dict[str, Tuple[int, Result]]] = {}
    for i, r in enumerate(report.results):
        cells.setdefault(r.host, {})[r.check] = (i, r)
    columns = [c for c in report.checks if any(c in row for row in cells.values())]
    rows = [h.name for h in report.hosts] + ([CLUSTER] if CLUSTER in cells else [])
    head = "".join(f'<th scope="col">{_esc(c)}</th>' for c in columns)
    body = []
    records = {h.name: h for h in report.hosts}
    for host in rows:
        if host == CLUSTER:
            label, tip, cls = CLUSTER_NAME, "cluster-wide checks", "cluster"
        else:
            h = records[host]
            label, cls = host, "host"
            tip = f"{h.address}, {h.slots} slots" + ("" if h.reachable else ", unreachable")
        tds = []
        for check in columns:
            got = cells.get(host, {}).get(check)
            if got is None:
                tds.append(f'<td class="none" title="not run on this row">{NO_RESULT}</td>')
                continue
            i, r = got
            tds.append(f'<td class="st st-{r.status.value}" data-check="{_esc(check)}" title="{_esc(r.message)}">'
                       f'<a href="#{ids[i]}">{_esc(CELL[r.status])}</a></td>')
        body.append(f'<tr class="{cls}" data-host="{_esc(host)}"><th scope="row" title="{_esc(tip)}">'
                    f'{_esc(label)}</th>{"".join(tds)}</tr>')
    return (f'<section id="matrix-section"><h2>Matrix</h2><div class="scroll"><table id="matrix"><thead><tr>'
            f'<th scope="col">host</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
            f'<p class="caption">Click a cell for its message and fix. The last row holds the cluster-wide '
            f'checks; {NO_RESULT} = not run on that row.</p></section>')


def _result_item(same: List[Tuple[int, Result]], ids: Dict[int, str]) -> str:
    """One entry for results that say the same thing on several hosts (64 hosts missing one path: one entry);
    every result keeps its own anchor for the matrix's links."""
    r = same[0][1]
    hosts = ", ".join(display_host(x.host) for _, x in same)
    anchors = "".join(f'<a class="anchor" id="{ids[i]}"></a>' for i, _ in same[1:])
    took = max(x.duration_s for _, x in same)
    fix = (f'<p class="fix"><b>fix:</b> <code>{_esc(r.fix)}</code></p>'
           if r.fix and r.status != Status.PASS else "")
    return (f'<div class="result st-border-{r.status.value}" id="{ids[same[0][0]]}">{anchors}{_badge(r.status)} '
            f'<b>{_esc(hosts)}{" :: " if len(same) > 1 else "::"}{_esc(r.check)}</b> '
            f'<span class="dur">{took:.1f} s</span>'
            f'<p class="msg">{_esc(r.message)}</p>{fix}</div>')


def _details(report: Report, ids: Dict[int, str]) -> str:
    groups = []
    for status in DETAIL_ORDER:
        same: Dict[Tuple[str, str, str], List[Tuple[int, Result]]] = {}
        for i, r in enumerate(report.results):
            if r.status == status:
                same.setdefault((r.check, r.message, r.fix), []).append((i, r))
        items = [_result_item(rs, ids) for rs in same.values()]
        if not items:
            continue
        count = sum(len(rs) for rs in same.values())
        title = f"{_badge(status)} {count} result{'s' if count != 1 else ''}"
        if status == Status.PASS:
            # Collapsed: passes are the bulk and need no action; a matrix link still opens it (the browser
            # reveals a closed <details> that holds the fragment's target).
            groups.append(f'<details class="group" data-status="pass"><summary><h3 style="display:inline">'
                          f'{title}</h3></summary>{"".join(items)}</details>')
        else:
            groups.append(f'<div class="group" data-status="{status.value}"><h3>{title}</h3>{"".join(items)}</div>')
    return f'<section id="details"><h2>Results</h2>{"".join(groups) or _absent("no results")}</section>'


def _absent(why: str) -> str:
    return f'<p class="absent">{_esc(why)}</p>'


def _environment(report: Report) -> str:
    if report.env:
        rows = "".join(f'<tr><th><code>{_esc(k)}</code></th><td><code>{_esc(v)}</code></td>'
                       f'<td>{_esc(report.reasons.get(k, ""))}</td></tr>' for k, v in report.env.items())
        exports = "\n".join(f"export {k}={v}" for k, v in report.env.items())
        env = (f'<table id="env"><thead><tr><th>variable</th><th>value</th><th>why</th></tr></thead>'
               f'<tbody>{rows}</tbody></table><h3>as shell lines (<code>--env-file</code> writes them as '
               f'<code>.deepspeed_env</code>)</h3><pre>{_esc(exports)}</pre>')
    else:
        env = _absent("no environment recommended (the checks that inform it did not run)")
    notes = ("<h3>notes</h3><ul id=\"notes\">" + "".join(f"<li>{_esc(n)}</li>" for n in report.notes) + "</ul>"
             if report.notes else "")
    return f'<section id="environment"><h2>Recommended environment</h2>{env}{notes}</section>'


# --------------------------------------------------------------------------------------- iperf3 heat map

def iperf3_links(report: Report) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Every measured (src, dst) link from the hosts' iperf3 metrics (each link is listed at both of its ends)."""
    links: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for r in report.results:
        if r.check == "iperf3" and r.host != CLUSTER:
            for ln in r.metrics.get("links") or []:
                if ln.get("src") and ln.get("dst"):
                    links[(ln["src"], ln["dst"])] = ln
    return links


def reference_median(ok: List[Dict[str, Any]], flagged: Iterable[str]) -> Optional[float]:
    """The cluster median that colours the heat map: of the links between hosts iperf3 did not flag.

    With 4 hosts a straggler takes part in half the links, so the plain median would be its rate and its links
    would look normal; the check itself compares a host with the links that do not involve it, as here.
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


def _heatmap(report: Report) -> str:
    title = "<h2>Host-to-host bandwidth (iperf3)</h2>"
    per_host = {r.host: r for r in report.results if r.check == "iperf3" and r.host != CLUSTER}
    cluster = next((r for r in report.results if r.check == "iperf3" and r.host == CLUSTER), None)
    if cluster is None and not per_host:
        return f'<section id="network">{title}{_absent("iperf3 did not run (add iperf3 to --checks)")}</section>'
    links = iperf3_links(report)
    ok = [ln for ln in links.values() if not ln.get("error") and ln.get("gbps") is not None]
    if not links:
        why = cluster.message if cluster is not None else "no link was measured"
        return f'<section id="network">{title}{_absent("no heat map: " + why)}</section>'
    named = {n for pair in links for n in pair}
    hosts = [h.name for h in report.hosts if h.name in per_host or h.name in named]
    hosts += sorted(named - set(hosts))  # a link to a host the report does not list still gets its row
    marked = {h: r for h, r in per_host.items() if r.status in (Status.FAIL, Status.WARN)}
    median = reference_median(ok, marked)
    network = next((r.metrics.get("network") for r in per_host.values() if r.metrics.get("network")), None)
    svg, values = _heatmap_svg(hosts, links, median, marked, {h: r.status for h, r in per_host.items()})
    n = len(hosts)
    caption = (f'iperf3 TCP rate{" on " + _esc(network) if network else ""}: rows send (src), columns receive '
               f'(dst). Colour: rate relative to the cluster median ({_esc(rate(median))}, links between '
               f'unflagged hosts). '
               f'{len(links)} of {n * (n - 1)} ordered pairs measured: pairs are sampled in rounds of disjoint '
               f'pairs, not all-to-all. {_esc(values)}')
    legend = (f'<div class="legend"><span><span class="ramp" style="background: linear-gradient(to right, '
              f'{_ratio_colour(SLOW_RATIO)}, {_ratio_colour((SLOW_RATIO + FAST_RATIO) / 2)}, '
              f'{_ratio_colour(FAST_RATIO)})"></span> &le;{SLOW_RATIO:.0%} &hellip; &ge;{FAST_RATIO:.0%} of '
              f'median</span><span><span class="swatch" style="background:{UNMEASURED_FILL}"></span>not measured'
              f'</span><span><span class="swatch" style="background:{SELF_FILL}"></span>same host</span>'
              f'<span><span class="swatch st-fail"></span>failed test (&times;)</span>'
              f'<span><span class="swatch" style="border:2px solid {STATUS_COLOURS[Status.FAIL][0]}"></span>'
              f'flagged host (row and column)</span></div>')
    flagged = "".join(f'<li data-host="{_esc(h)}">{_badge(r.status)} '
                      f'{"" if r.message.startswith(h) else "<b>" + _esc(h) + "</b>: "}{_esc(r.message)}</li>'
                      for h, r in marked.items())
    flagged_html = (f'<h3>flagged hosts (iperf3 FAIL/WARN)</h3><ul id="stragglers">{flagged}</ul>' if flagged else
                    '<p class="caption" id="stragglers">no straggler: every host\'s links are within the '
                    'iperf3 thresholds.</p>')
    return (f'<section id="network">{title}<p class="caption">{caption}</p>{legend}'
            f'<div class="maprow"><div class="scroll">{svg}</div><div class="flagged">{flagged_html}</div></div>'
            f'</section>')


def _heatmap_svg(hosts: List[str], links: Dict[Tuple[str, str], Dict[str, Any]], median: Optional[float],
                 marked: Dict[str, Result], statuses: Dict[str, Status]) -> Tuple[str, str]:
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
    band_w = max(1.5, min(3.0, cell / 8))  # the flagged band's outline: thin enough not to hide small cells
    index = {h: i for i, h in enumerate(hosts)}
    mbit = median is not None and median < 1.0
    show_values = cell >= VALUE_TEXT_MIN_PX
    value_font = min(12, cell // 3)
    grid = "".join(f"M{left},{top + k * cell}h{n * cell}M{left + k * cell},{top}v{n * cell}"
                   for k in range(1, n))
    out = [f'<svg id="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="{font}" data-hosts="{n}" role="img" '
           f'aria-label="iperf3 bandwidth heat map">',
           f'<rect x="{left}" y="{top}" width="{n * cell}" height="{n * cell}" fill="{UNMEASURED_FILL}"/>',
           # Grid lines instead of one element per unmeasured cell: the page stays small at 64+ hosts.
           f'<path d="{grid}" stroke="{GRID_LINE}" stroke-width="1" pointer-events="none"/>',
           f'<text x="{left - 6}" y="{top - 6}" text-anchor="end" fill="#6b7280">src \\ dst</text>']

    def label_colour(h: str) -> str:
        st = statuses.get(h)
        return STATUS_COLOURS[st][0] if st in (Status.FAIL, Status.WARN, Status.ERROR) else "#1f2937"

    for i, h in enumerate(hosts):
        y = top + i * cell + cell / 2
        x = left + i * cell + cell / 2
        weight = ' font-weight="700"' if h in marked else ""
        dot = (f'<circle cx="{left - 10}" cy="{y:.1f}" r="4" fill="{label_colour(h)}"/>' if h in marked else "")
        out.append(f'{dot}<text class="row-label" x="{left - 18}" y="{y:.1f}" dy="0.35em" text-anchor="end" '
                   f'fill="{label_colour(h)}"{weight}>{_esc(h)}</text>')
        out.append(f'<text class="col-label" transform="translate({x:.1f},{top - 8}) rotate(-{angle})" '
                   f'dy="0.35em" fill="{label_colour(h)}"{weight}>{_esc(h)}</text>')
        out.append(f'<rect class="self" x="{left + i * cell}" y="{top + i * cell}" width="{cell}" '
                   f'height="{cell}" fill="{SELF_FILL}"><title>{_esc(h)}</title></rect>')
    for (src, dst), ln in links.items():
        if src not in index or dst not in index or src == dst:
            continue
        x, y = left + index[dst] * cell, top + index[src] * cell
        geometry = f'x="{x}" y="{y}" width="{cell}" height="{cell}"'
        data = f'data-src="{_esc(src)}" data-dst="{_esc(dst)}"'
        if ln.get("error") or ln.get("gbps") is None:
            tip = f"{src} \u2192 {dst}: failed: {ln.get('error') or 'no result'}"
            pad = cell * 0.28
            out.append(f'<rect class="cell failed" {data} {geometry} fill="{STATUS_COLOURS[Status.FAIL][0]}" '
                       f'stroke="{GRID_LINE}"><title>{_esc(tip)}</title></rect>'
                       f'<path d="M{x + pad:.1f},{y + pad:.1f}L{x + cell - pad:.1f},{y + cell - pad:.1f}'
                       f'M{x + cell - pad:.1f},{y + pad:.1f}L{x + pad:.1f},{y + cell - pad:.1f}" '
                       f'stroke="{STATUS_COLOURS[Status.FAIL][1]}" stroke-width="2" pointer-events="none"/>')
            continue
        gbps = float(ln["gbps"])
        ratio = gbps / median if median else 1.0
        retrans = ln.get("retransmits")
        tip = (f"{src} \u2192 {dst}: {rate(gbps)} ({ratio:.0%} of median)"
               + (f", {retrans} retransmits" if retrans is not None else ""))
        out.append(f'<rect class="cell" {data} data-gbps="{gbps:.6g}" {geometry} fill="{_ratio_colour(ratio)}" '
                   f'stroke="{GRID_LINE}"><title>{_esc(tip)}</title></rect>')
        if show_values:
            out.append(f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2:.1f}" dy="0.35em" text-anchor="middle" '
                       f'font-size="{value_font}" fill="#111827" pointer-events="none">'
                       f'{_short_rate(gbps, mbit)}</text>')
    # Flagged hosts: outline their whole row and column so that a straggler's band stands out.
    for h, r in marked.items():
        i = index[h]
        colour = STATUS_COLOURS[r.status][0]
        band = f'fill="none" stroke="{colour}" stroke-width="{band_w}" pointer-events="none"'
        d = band_w / 2  # the outline sits just outside the row's and column's cells
        out.append(f'<rect class="flagged-row" data-host="{_esc(h)}" x="{left - d}" y="{top + i * cell - d:.1f}" '
                   f'width="{n * cell + 2 * d}" height="{cell + 2 * d}" {band}/>'
                   f'<rect class="flagged-col" data-host="{_esc(h)}" x="{left + i * cell - d}" y="{top - d:.1f}" '
                   f'width="{cell + 2 * d}" height="{n * cell + 2 * d}" {band}/>')
    out.append("</svg>")
    unit = "Mbit/s" if mbit else "Gbit/s"
    values = (f"Values in {unit}." if show_values else
              f"{n} hosts: the values are in each cell's tooltip (hover), not written in the cells.")
    return "".join(out), values


# --------------------------------------------------------------------------------------- busbw plot

def _nice_ceiling(x: float) -> float:
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


def _busbw(report: Report) -> str:
    title = "<h2>All-reduce bus bandwidth</h2>"
    r = next((r for r in report.results if r.check == "allreduce" and r.host == CLUSTER), None)
    if r is None:
        return f'<section id="allreduce">{title}{_absent("the all-reduce did not run (add allreduce to --checks)")}' \
               f'</section>'
    rows = [row for row in r.metrics.get("sizes") or []
            if row.get("bytes") and row.get("busbw_GBps") is not None]
    if not rows:
        return (f'<section id="allreduce">{title}'
                f'{_absent("no busbw measured: " + CELL[r.status] + " - " + r.message)}</section>')
    m = r.metrics
    caption = (f'{_esc(m.get("world_size") or "?")} ranks on {len(m.get("hosts") or [])} hosts, '
               f'{_esc(m.get("backend") or "?")}; busbw = algbw &times; 2(n-1)/n, as nccl-tests reports it. '
               f'{_badge(r.status)} {_esc(r.message)}')
    table = "".join(f'<tr><td>{_esc(human_bytes(row["bytes"]))}</td><td>{row.get("time_s", 0):.4g}</td>'
                    f'<td>{row.get("algbw_GBps", 0):.4g}</td><td>{row["busbw_GBps"]:.4g}</td></tr>' for row in rows)
    numbers = (f'<details><summary>numbers</summary><table class="sizes"><thead><tr><th>size</th><th>s / iter</th>'
               f'<th>algbw GB/s</th><th>busbw GB/s</th></tr></thead><tbody>{table}</tbody></table></details>')
    return (f'<section id="allreduce">{title}<p class="caption">{caption}</p>'
            f'{_busbw_svg(rows, m.get("min_busbw"))}{numbers}</section>')


def _busbw_svg(rows: List[Dict[str, Any]], min_busbw: Optional[float]) -> str:
    xs = [math.log2(row["bytes"]) for row in rows]
    lo, hi = math.floor(min(xs)), math.ceil(max(xs))
    if hi == lo:  # one size: centre it
        lo, hi = lo - 1, hi + 1
    top_value = max([row["busbw_GBps"] for row in rows] + [float(min_busbw or 0)])
    ymax = _nice_ceiling(top_value * 1.05)
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
                   f'{_esc(human_bytes(2 ** e))}</text>')
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
                   f'stroke-width="1.5"><title>{_esc(tip)}</title></circle>')
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------------------- page

def to_html(report: Report) -> str:
    ids = _anchor_ids(report.results)
    counts = report.counts()
    title = f"preflight: {counts['fail']} failed, {counts['error']} errors, {counts['warn']} warned " \
            f"({report.started_at})"
    parts: Iterable[str] = (_summary(report), _matrix(report, ids), _details(report, ids), _environment(report),
                            _heatmap(report), _busbw(report))
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_esc(title)}</title><style>{CSS}{_status_css()}</style></head>'
            f'<body><main>{"".join(parts)}</main></body></html>\n')
