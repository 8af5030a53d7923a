"""The HTML report's Trends section (preflight/render/html.py) from the history's metrics.trend (preflight/history/):
a real 4-host run (tests/fixtures/history/run-4hosts.json) recorded 8 times with run-to-run jitter, then once with one
host's NVMe write rate planted at 40%; one sparkline per (host, check, figure), the baseline band, the named point
in red, a hostile host name escaped, and no section without history.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from preflight import history
from preflight.render.html import to_html
from preflight.results import Report

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "history" / "run-4hosts.json"
HOSTILE = '<img src=x onerror="alert(1)">&node04'
WRITE = "paths[/tmp].write_Bps"


def run(i: int, slow: float = 1.0) -> Report:
    """Run i of the fixture: node04 renamed to HOSTILE, every NVMe rate jittered +-1%; node02's write times slow."""
    data = copy.deepcopy(json.loads(FIXTURE.read_text()))
    rename = {"node04": HOSTILE}
    for h in data["hosts"]:
        h["name"] = rename.get(h["name"], h["name"])
    for r in data["results"]:
        r["host"] = rename.get(r["host"], r["host"])
        if r["check"] == "nvme":
            for p in r["metrics"].get("paths", []):
                jitter = 1 + 0.01 * ((i % 3) - 1)
                p["write_Bps"] *= jitter * (slow if r["host"] == "node02" else 1.0)
                p["read_Bps"] *= jitter
    return Report.from_dict(data)


def test_the_report_draws_each_hosts_figures_against_its_own_past(tmp_path):
    db = tmp_path / "h.db"
    for i in range(8):
        report = run(i)
        assert history.record_report(report, {}, db) is not None
        # No WARN across the healthy runs, and no sparkline before min_runs earlier runs.
        assert not any("baseline" in r.metrics for r in report.results)
        assert any("trend" in r.metrics for r in report.results) == (i >= history.Settings().min_runs)
    report = run(8, slow=0.4)
    history.record_report(report, {}, db)

    entries = [(r.host, r.check, e) for r in report.results for e in r.metrics.get("trend", [])]
    nvme = {(h, e["key"]): e for h, c, e in entries if c == "nvme"}
    assert {h for h, _ in nvme} == {"node01", "node02", "node03", HOSTILE}
    for e in nvme.values():  # the payload: numbers only, the 8 earlier runs oldest first, the band around the median
        assert len(e["series"]) == 8 and all(type(x) is float for x in e["series"])
        assert e["low"] < e["median"] < e["high"]
    slow = nvme[("node02", WRITE)]
    assert slow["flagged"] is True and slow["value"] < slow["low"] and slow["value"] < 0.5 * slow["median"]
    assert [k for k, e in nvme.items() if e["flagged"]] == [("node02", WRITE)]
    assert {r.host: r for r in report.results if r.check == "nvme"}["node02"].metrics["baseline"][0]["key"] == WRITE

    page = to_html(report)
    assert page.count('<section id="trends">') == 1 and '<a href="#trends">' in page
    section = page.split('<section id="trends">', 1)[1].split("</section>", 1)[0]
    rows = re.findall(r"<tr [^>]*>.*?</tr>", section)
    assert len(rows) == len(entries) and section.count("<svg") == len(entries)  # one per (host, check, figure)
    assert all('<rect class="band"' in row and "<polyline points=" in row for row in rows)
    flagged = [row for row in rows if 'class="flagged"' in row]
    assert len(flagged) == 1 and "node02" in flagged[0] and WRITE in flagged[0]
    assert '<circle class="now flagged"' in flagged[0] and page.count('class="now flagged"') == 1
    # Each polyline is the 8 earlier runs and this one; the flagged dot lies below the band (SVG y grows down).
    points = re.search(r'<polyline points="([^"]+)"', flagged[0]).group(1).split()
    assert len(points) == 9
    band = re.search(r'<rect class="band" x="0" y="([\d.]+)" width="\d+" height="([\d.]+)"', flagged[0])
    dot = re.search(r'<circle class="now flagged" cx="[\d.]+" cy="([\d.]+)"', flagged[0])
    assert float(dot.group(1)) > float(band.group(1)) + float(band.group(2))
    # The hostile host name is text, never markup
    assert "<img" not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;node04" in section


def test_no_history_no_trends_section():
    page = to_html(run(0))
    assert '<section id="trends">' not in page and 'href="#trends"' not in page and "<svg class=\"spark\"" not in page


def test_the_payload_is_bounded():
    past = [3.0 + 0.01 * (i % 5) for i in range(200)]
    e = history.trend("w_Bps", 1.0, past, "higher", True, history.Settings(runs=200))
    assert len(e["series"]) == history.TREND_POINTS and e["series"] == [float(f"{x:.6g}") for x in past[-50:]]
    assert history.trend("w_Bps", 1.0, past[:4], "higher", False, history.Settings()) is None
