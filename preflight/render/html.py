"""Self-contained HTML report (``--html FILE``): summary, matrix, details, environment, then each check's own section.

Reads only the Report's structured results, like every renderer. A check adds a section of its own by declaring
``SPEC.html = HtmlSection(title, render)`` (preflight/hostside/seams.py); this page names no check. One file with
inline CSS and inline SVG, no JavaScript and no external assets: clusters are often offline. Produces e.g.::

    <!doctype html>...<section id="summary">...<table id="matrix">...<section id="details">...
    <section id="environment">...<section id="trends">(with history)...
    <section id="check-NAME" data-check="NAME"><h2>TITLE</h2>(the check's)</section>
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from preflight import __version__
from preflight import checks as registry
from preflight.hostside.display import CELL, STATUS_COLOURS, absent, badge, esc
from preflight.hostside.outcome import Status
from preflight.hostside.seams import CheckSpec
from preflight.causes import Cause, causes
from preflight.causes import verdict as verdict_line
from preflight.render import Settings
from preflight.render.terminal import summary_line
from preflight.results import CLUSTER, CLUSTER_NAME, Report, Result, display_host

# Details list order: what needs action first; SKIP before PASS because a skip carries a reason worth reading.
DETAIL_ORDER = (Status.FAIL, Status.ERROR, Status.WARN, Status.SKIP, Status.PASS)
NO_RESULT = "\u00b7"  # the matrix cell of a check not run on that row, as in the terminal matrix
SUMMARY_HOSTS = 8  # the header names this many hosts at most; the matrix lists them all
# The page's own sections in the contents line (anchor, name); the checks' sections follow them.
PAGE_SECTIONS = (("matrix-section", "matrix"), ("details", "results"), ("environment", "environment"))

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
#matrix td.none, #matrix td.blocked { color: #9ca3af; font-weight: 400; }
.result { border-left: 4px solid; padding: 6px 10px; margin: 6px 0; background: #fafafa; border-radius: 0 4px 4px 0; }
.result:target, .result:has(.anchor:target) { outline: 2px solid #2563eb; }
.result .msg { margin: 4px 0 0; white-space: pre-wrap; word-break: break-word; }
.result .fix { margin: 4px 0 0; }
.result .fix code { white-space: pre-wrap; word-break: break-word; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f3f4f6; padding: 10px; border-radius: 6px; overflow: auto; }
#env th, #env td { border-bottom: 1px solid var(--line); padding: 4px 10px 4px 0; text-align: left;
                   vertical-align: top; }
/* For the checks' own sections: .caption, .scroll, a .legend of .swatch/.ramp, a figure beside a .flagged
   list in a .maprow, and svg shapes of class cell or point that outline on hover. */
svg rect.cell:hover, svg circle.point:hover { stroke: #111827; stroke-width: 2; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; margin: 8px 0; color: var(--muted); }
.swatch { display: inline-block; width: 14px; height: 14px; vertical-align: -2px; border: 1px solid #d1d5db;
          margin-right: 4px; }
.ramp { display: inline-block; width: 160px; height: 14px; vertical-align: -2px; border-radius: 2px; }
details > summary { cursor: pointer; }
.maprow { display: flex; flex-wrap: wrap; gap: 8px 28px; align-items: flex-start; }
.flagged { flex: 1 1 300px; }
.flagged ul { padding-left: 18px; margin: 0; }
.flagged li { margin-bottom: 6px; }
#trends td { padding: 2px 10px 2px 0; vertical-align: middle; }
svg.spark rect.band { fill: #dbeafe; }
svg.spark polyline { fill: none; stroke: #2563eb; stroke-width: 1.5; }
svg.spark circle.now { fill: #2563eb; }
svg.spark circle.now.flagged { fill: #dc2626; }
"""


def _status_css() -> str:
    return "".join(f".st-{s.value} {{ background: {bg}; color: {fg}; }}\n"
                   f".result.st-border-{s.value} {{ border-left-color: {bg}; }}\n"
                   for s, (bg, fg) in STATUS_COLOURS.items())


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

def _summary(report: Report, sections: Sequence[CheckSpec]) -> str:
    ok = report.exit_code == 0
    counts = report.counts()
    found = causes(report)
    verdict = verdict_line(report, found)  # the terminal's last-but-one line: READY, READY with N warnings, ...
    badges = "".join(f"<span>{badge(s)} {counts[s.value]}</span>" for s in DETAIL_ORDER)
    if counts["blocked"]:
        badges += f'<span><span class="badge st-skip">{NO_RESULT} blocked</span> {counts["blocked"]}</span>'
    names = [h.name for h in report.hosts]
    shown = names if len(names) <= SUMMARY_HOSTS else names[:2] + ["\u2026"] + names[-1:]
    down = [h.name for h in report.hosts if not h.reachable]
    hosts = ", ".join(shown) + (f" (unreachable: {', '.join(down)})" if down else "")
    return (f'<section id="summary"><h1>preflight report</h1>'
            f'<div class="meta">started {esc(report.started_at)} &middot; {report.duration_s:.1f} s &middot; '
            f'{len(report.hosts)} host{"s" if len(report.hosts) != 1 else ""}: {esc(hosts)} &middot; '
            f'preflight {esc(__version__)}</div>'
            f'<div class="verdict st-{"pass" if ok else "fail"}">exit code {report.exit_code}: {verdict}</div>'
            f'<div class="counts">{badges}</div><p>{esc(summary_line(report))}</p>{_causes(found)}'
            f'<nav>{_contents(sections, bool(_trend_rows(report)))}</nav></section>')


def _causes(found: Sequence[Cause]) -> str:
    """One entry per cause that is not a pass, as the terminal prints it (its victims counted in it, not listed)."""
    items = "".join(f'<li class="cause st-border-{c.status.value}">{badge(c.status)} '
                    f'<code>{esc(c.line())}</code></li>' for c in found if c.status != Status.PASS)
    bad = sum(1 for c in found if c.status in (Status.FAIL, Status.ERROR))
    if not items:
        return ""
    return (f'<div id="causes"><h3>{bad} cause{"s" if bad != 1 else ""} to fix</h3>'
            f'<ul class="causes">{items}</ul></div>')


def _matrix(report: Report, ids: Dict[int, str]) -> str:
    """Hosts as rows, checks as columns, the cluster-wide row last (the page scrolls; the terminal transposes a
    few-host run instead). A blocked cell is a grey dot that links to its result."""
    cells: Dict[str, Dict[str, Tuple[int, Result]]] = {}
    for i, r in enumerate(report.results):
        cells.setdefault(r.host, {})[r.check] = (i, r)
    columns = [c for c in report.checks if any(c in row for row in cells.values())]
    rows = [h.name for h in report.hosts] + ([CLUSTER] if CLUSTER in cells else [])
    head = "".join(f'<th scope="col">{esc(c)}</th>' for c in columns)
    body = []
    victims = report.victims()
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
            if i in victims:
                tds.append(f'<td class="blocked" data-check="{esc(check)}" title="{esc(r.message)}">'
                           f'<a href="#{ids[i]}">{NO_RESULT}</a></td>')
                continue
            tds.append(f'<td class="st st-{r.status.value}" data-check="{esc(check)}" title="{esc(r.message)}">'
                       f'<a href="#{ids[i]}">{esc(CELL[r.status])}</a></td>')
        body.append(f'<tr class="{cls}" data-host="{esc(host)}"><th scope="row" title="{esc(tip)}">'
                    f'{esc(label)}</th>{"".join(tds)}</tr>')
    return (f'<section id="matrix-section"><h2>Matrix</h2><div class="scroll"><table id="matrix"><thead><tr>'
            f'<th scope="col">host</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
            f'<p class="caption">Click a cell for its message and fix. The last row holds the cluster-wide '
            f'checks; {NO_RESULT} = not run on that row (a linked {NO_RESULT}: blocked, by its host\'s connection '
            f'or another result\'s fault, which its message names).</p></section>')


def _result_item(same: List[Tuple[int, Result]], ids: Dict[int, str]) -> str:
    """One entry for results that say the same thing on several hosts (64 hosts missing one path: one entry);
    every result keeps its own anchor for the matrix's links."""
    r = same[0][1]
    hosts = ", ".join(display_host(x.host) for _, x in same)
    anchors = "".join(f'<a class="anchor" id="{ids[i]}"></a>' for i, _ in same[1:])
    took = max(x.duration_s for _, x in same)
    fix = (f'<p class="fix"><b>fix:</b> <code>{esc(r.fix)}</code></p>'
           if r.fix and r.status != Status.PASS else "")
    return (f'<div class="result st-border-{r.status.value}" id="{ids[same[0][0]]}">{anchors}{badge(r.status)} '
            f'<b>{esc(hosts)}{" :: " if len(same) > 1 else "::"}{esc(r.check)}</b> '
            f'<span class="dur">{took:.1f} s</span>'
            f'<p class="msg">{esc(r.message)}</p>{fix}</div>')


def _details(report: Report, ids: Dict[int, str]) -> str:
    groups = []
    victims = report.victims()
    # Blocked cells (victims, whatever their status) after the errors, collapsed: their causes above say why.
    for status, blocked in [(s, False) for s in DETAIL_ORDER[:2]] + [(None, True)] + \
            [(s, False) for s in DETAIL_ORDER[2:]]:
        same: Dict[Tuple[str, str, str], List[Tuple[int, Result]]] = {}
        for i, r in enumerate(report.results):
            if (i in victims) == blocked and (blocked or r.status == status):
                same.setdefault((r.check, r.message, r.fix), []).append((i, r))
        items = [_result_item(rs, ids) for rs in same.values()]
        if not items:
            continue
        count = sum(len(rs) for rs in same.values())
        title = f"{badge(status)} {count} result{'s' if count != 1 else ''}" if status is not None else ""
        if blocked:
            title = f'<span class="badge st-skip">{NO_RESULT} blocked</span> {count} result{"s" if count != 1 else ""}'
        if status == Status.PASS or blocked:
            # Collapsed: passes are the bulk and need no action; a matrix link still opens it (the browser
            # reveals a closed <details> that holds the fragment's target).
            kind = "blocked" if blocked else "pass"
            groups.append(f'<details class="group" data-status="{kind}"><summary><h3 style="display:inline">'
                          f'{title}</h3></summary>{"".join(items)}</details>')
        else:
            value = status.value if status else "blocked"
            groups.append(f'<div class="group" data-status="{value}"><h3>{title}</h3>{"".join(items)}</div>')
    return f'<section id="details"><h2>Results</h2>{"".join(groups) or absent("no results")}</section>'


def _environment(report: Report) -> str:
    if report.env:
        rows = "".join(f'<tr><th><code>{esc(k)}</code></th><td><code>{esc(v)}</code></td>'
                       f'<td>{esc(report.reasons.get(k, ""))}</td></tr>' for k, v in report.env.items())
        exports = "\n".join(f"export {k}={v}" for k, v in report.env.items())
        env = (f'<table id="env"><thead><tr><th>variable</th><th>value</th><th>why</th></tr></thead>'
               f'<tbody>{rows}</tbody></table><h3>as shell lines (<code>--env-file</code> writes them as '
               f'<code>.deepspeed_env</code>)</h3><pre>{esc(exports)}</pre>')
    else:
        env = absent("no environment recommended (the checks that inform it did not run)")
    notes = ("<h3>notes</h3><ul id=\"notes\">" + "".join(f"<li>{esc(n)}</li>" for n in report.notes) + "</ul>"
             if report.notes else "")
    return f'<section id="environment"><h2>Recommended environment</h2>{env}{notes}</section>'


# --------------------------------------------------------------------------------------- trends (history)

SPARK_W, SPARK_H, SPARK_PAD = 160, 32, 4


def _finite(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _trend_rows(report: Report) -> List[Tuple[Result, Dict[str, Any]]]:
    """(result, entry) of each figure the history compared (metrics.trend, preflight/history/); malformed or
    non-numeric entries are left out (a report read back from a file is untrusted)."""
    rows = []
    for r in report.results:
        entries = r.metrics.get("trend") if isinstance(r.metrics, dict) else None
        for e in entries if isinstance(entries, list) else []:
            if not isinstance(e, dict) or not isinstance(e.get("series"), list):
                continue
            nums = [e.get(k) for k in ("value", "median", "low", "high")]
            if all(_finite(x) is not None for x in nums) and all(_finite(x) is not None for x in e["series"]):
                rows.append((r, e))
    return rows


def _sparkline(e: Dict[str, Any]) -> str:
    """The past runs then this one as a polyline, the baseline band (median +/- the WARN's z) as a shaded rect,
    this run's point marked (red when the history named it)."""
    values = [float(x) for x in e["series"]] + [float(e["value"])]
    low, high = float(e["low"]), float(e["high"])
    lo, hi = min(values + [low]), max(values + [high])
    span = (hi - lo) or (abs(hi) or 1.0)

    def y(v: float) -> float:
        return SPARK_PAD + (hi - v) / span * (SPARK_H - 2 * SPARK_PAD)

    step = (SPARK_W - 2 * SPARK_PAD) / max(len(values) - 1, 1)
    points = " ".join(f"{SPARK_PAD + i * step:.1f},{y(v):.1f}" for i, v in enumerate(values))
    x_now, y_now = SPARK_PAD + (len(values) - 1) * step, y(values[-1])
    flagged = " flagged" if e.get("flagged") is True else ""
    return (f'<svg class="spark" width="{SPARK_W}" height="{SPARK_H}" viewBox="0 0 {SPARK_W} {SPARK_H}" '
            f'role="img"><rect class="band" x="0" y="{y(high):.1f}" width="{SPARK_W}" '
            f'height="{max(y(low) - y(high), 0.5):.1f}"><title>baseline band {low:.4g} to {high:.4g}</title></rect>'
            f'<polyline points="{points}"/><circle class="now{flagged}" cx="{x_now:.1f}" cy="{y_now:.1f}" r="2.5">'
            f'<title>this run {values[-1]:.4g}</title></circle></svg>')


def _trends(report: Report) -> str:
    """One sparkline per (host, check, figure) the history compared with the host's own past; none without
    history (or before a host has a baseline's worth of runs)."""
    rows = _trend_rows(report)
    if not rows:
        return ""
    body = []
    for r, e in rows:
        cls = ' class="flagged"' if e.get("flagged") is True else ""
        body.append(f'<tr data-host="{esc(r.host)}" data-check="{esc(r.check)}"{cls}>'
                    f'<td>{esc(display_host(r.host))}</td><td>{esc(r.check)}</td>'
                    f'<td><code>{esc(str(e.get("key", "")))}</code></td><td>{_sparkline(e)}</td>'
                    f'<td>{float(e["value"]):.4g} (median {float(e["median"]):.4g} of {len(e["series"])} runs)</td>'
                    f'</tr>')
    return (f'<section id="trends"><h2>Trends</h2><table><tbody>{"".join(body)}</tbody></table>'
            f'<p class="caption">Each host against its own last runs: the line is the past runs then this one (the '
            f'dot; red: named below its own baseline), the band its median \u00b1 the robust spread a WARN takes.'
            f'</p></section>')


# --------------------------------------------------------------------------------------- the checks' sections

def _sections() -> List[CheckSpec]:
    """The registered checks that draw a section of their own, in the registry's order."""
    return [spec for spec in registry.all_specs() if spec.html is not None]


def _contents(sections: Sequence[CheckSpec], trends: bool = False) -> str:
    links = list(PAGE_SECTIONS) + ([("trends", "trends")] if trends else [])
    links += [(f"check-{spec.name}", spec.html.title) for spec in sections if spec.html]
    return " &middot; ".join(f'<a href="#{esc(target)}">{esc(name)}</a>' for target, name in links)


def _check_section(spec: CheckSpec, report: Report) -> str:
    """A check's section, always shown: with no result of its own, the check says why (e.g. it did not run)."""
    assert spec.html is not None
    results = [r.to_dict() for r in report.results if r.check == spec.name]
    body = spec.html.render(results, [h.name for h in report.hosts])
    return (f'<section id="check-{esc(spec.name)}" data-check="{esc(spec.name)}"><h2>{esc(spec.html.title)}</h2>'
            f'{body}</section>')


# --------------------------------------------------------------------------------------- page

def to_html(report: Report) -> str:
    ids = _anchor_ids(report.results)
    counts = report.counts()
    title = f"preflight: {counts['fail']} failed, {counts['error']} errors, {counts['warn']} warned " \
            f"({report.started_at})"
    sections = _sections()
    parts = [_summary(report, sections), _matrix(report, ids), _details(report, ids), _environment(report),
             _trends(report)]
    parts += [_check_section(spec, report) for spec in sections]
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{esc(title)}</title><style>{CSS}{_status_css()}</style></head>'
            f'<body><main>{"".join(parts)}</main></body></html>\n')


def write(report: Report, out: TextIO, settings: Settings) -> None:
    out.write(to_html(report))
