"""The HTML report (--html): pure tests of to_html on hand-built Reports, and a real headless chromium rendering
the page of a real run (4 namespace hosts, one shaped to a quarter of the others' rate)."""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from preflight.hostside.outcome import Status
from preflight.checks.iperf3 import CELL_MIN_PX, HEATMAP_MAX_PX
from preflight.hostside.display import STATUS_COLOURS
from preflight.render.html import to_html
from preflight.results import HostRecord, Report, Result
from preflight.hostside.schedule import pair_rounds
from tests.cli import test_cli_cluster as cli_cluster  # its CLI run helper; a module import is not re-collected

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
GOOD_GBPS, SLOW_GBPS = 9.4, 2.3


# --------------------------------------------------------------------------------------- hand-built reports

def cluster_report(n: int = 4, straggler: str | None = "node03", failed_link: tuple | None = None,
                   allreduce: bool = True) -> Report:
    """n hosts measured like the iperf3 check does (ring + random rounds), a straggler, a libaio FAIL."""
    names = [f"node{i + 1:02d}" for i in range(n)]
    links = []
    for rnd in pair_rounds(n, 2, 0):
        for a, b in rnd:
            src, dst = names[a], names[b]
            link = {"src": src, "dst": dst, "retransmits": 0, "error": None,
                    "gbps": SLOW_GBPS if straggler in (src, dst) else GOOD_GBPS}
            if failed_link == (src, dst):
                link.update(gbps=None, error="unable to connect to server: Connection timed out")
            links.append(link)
    results = []
    for h in names:
        results.append(Result(h, "ssh", Status.PASS, "connected"))
        results.append(Result(h, "libaio", Status.FAIL if h == "node02" else Status.PASS,
                              "libaio.so.1 not found" if h == "node02" else "ok",
                              "apt-get install libaio-dev" if h == "node02" else ""))
        mine = [ln for ln in links if h in (ln["src"], ln["dst"])]
        status = Status.FAIL if h == straggler else Status.PASS
        metrics = {"network": "198.18.1.0/24", "links": mine}
        message = f"median {GOOD_GBPS} Gbit/s"
        if h == straggler:
            message = f"{h}: median 2.3 Gbit/s vs cluster median 9.4 Gbit/s (24%) (straggler: below 70%)"
            metrics.update(ratio=0.245, reference_gbps=GOOD_GBPS)
        results.append(Result(h, "iperf3", status, message, "ethtool eth0" if h == straggler else "", metrics))
    results.append(Result("*", "iperf3", Status.PASS, "chosen 198.18.1.0/24", metrics={"stragglers": {}}))
    if allreduce:
        sizes = [{"bytes": 1 << k, "time_s": 0.01 * (1 << (k - 16)), "iters": 5, "algbw_GBps": 0.5 + 0.05 * k,
                  "busbw_GBps": 0.9 + 0.1 * k} for k in range(16, 25)]
        results.append(Result("*", "allreduce", Status.PASS, "busbw 3.3 GB/s at 16 MiB",
                              metrics={"sizes": sizes, "world_size": n, "hosts": names, "backend": "gloo"}))
    hosts = [HostRecord(h, f"198.18.1.{i + 1}", 8, True) for i, h in enumerate(names)]
    return Report("2026-11-23T10:00:00+00:00", 42.0, hosts, results, ["ssh", "libaio", "iperf3", "allreduce"],
                  env={"NCCL_SOCKET_IFNAME": "=eth0", "NCCL_DEBUG": "WARN"},
                  reasons={"NCCL_SOCKET_IFNAME": "fastest measured network", "NCCL_DEBUG": "why it failed"},
                  notes=["network checks failed (node03): fix them first"])


class Elements(HTMLParser):
    """Start tags with their attributes, and the text, of a page (the standard library's HTML parser)."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list = []
        self.text: list = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag, **attrs):
        return [a for t, a in self.tags if t == tag and all(a.get(k.rstrip("_")) == v for k, v in attrs.items())]


def test_matrix_rows_columns_cluster_row_last_and_cells_link_to_their_details():
    page = to_html(cluster_report())
    el = Elements(page)
    assert len(el.find("table", id="matrix")) == 1
    rows = [a["data-host"] for t, a in el.tags if t == "tr" and "data-host" in a]
    assert rows == ["node01", "node02", "node03", "node04", "*"]
    head = re.search(r'<table id="matrix"><thead>(.*?)</thead>', page).group(1)
    assert re.findall(r"<th[^>]*>([^<]+)</th>", head) == ["host", "ssh", "libaio", "iperf3", "allreduce"]
    ids = {a["id"] for _, a in el.tags if "id" in a}
    targets = [a["href"][1:] for t, a in el.tags if t == "a" and a.get("href", "").startswith("#r-")]
    assert len(targets) == 4 * 3 + 2 and set(targets) <= ids
    assert "r-node02-libaio" in ids and "r-cluster-allreduce" in ids
    assert 'class="st st-fail" data-check="libaio"' in page
    # Details: non-pass first, each with its message and fix.
    order = [a["data-status"] for _, a in el.tags if "data-status" in a]
    assert order == ["fail", "pass"]
    assert page.index("libaio.so.1 not found") < page.index('data-status="pass"')
    assert "apt-get install libaio-dev" in page
    # The same finding on several hosts is one entry (64 hosts missing one path: one line), anchors kept.
    assert "<b>node01, node02, node03, node04 :: ssh</b>" in page and "<b>node02::libaio</b>" in page


def test_environment_reasons_and_notes():
    page = to_html(cluster_report())
    assert "<code>NCCL_SOCKET_IFNAME</code>" in page and "fastest measured network" in page
    assert "export NCCL_SOCKET_IFNAME==eth0" in page
    assert "network checks failed (node03): fix them first" in page


def test_every_string_from_the_hosts_is_escaped():
    evil = '<script>alert(1)</script><img src=x onerror="alert(2)">'
    report = cluster_report(failed_link=("node01", "node02"))
    for r in report.results:
        r.message += evil
        r.fix = (r.fix or "x") + evil
        for ln in r.metrics.get("links") or []:
            if ln["error"]:
                ln["error"] += evil
    report.env["X" + evil] = evil
    report.reasons["X" + evil] = evil
    report.notes.append(evil)
    report.started_at += evil
    page = to_html(report)
    el = Elements(page)
    assert not el.find("script") and not el.find("img")
    assert "<script" not in page and "onerror=\"" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # The failed link's error reaches its tooltip, escaped.
    assert re.search(r"node01 \u2192 node02: failed: unable to connect.*?&lt;img", page)


def test_self_contained_no_external_assets_no_javascript():
    page = to_html(cluster_report())
    el = Elements(page)
    assert not el.find("script") and not el.find("link") and not el.find("img") and not el.find("iframe")
    assert "url(" not in page and "@import" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")


def test_heat_map_cells_values_failed_links_and_the_straggler_band():
    report = cluster_report(failed_link=("node01", "node02"))
    page = to_html(report)
    el = Elements(page)
    (svg,) = el.find("svg", id="heatmap")
    assert svg["data-hosts"] == "4"
    cells = [a for t, a in el.tags if t == "rect" and a.get("class", "").startswith("cell")]
    measured = {(ln["src"], ln["dst"]) for r in report.results for ln in r.metrics.get("links") or []}
    assert {(c["data-src"], c["data-dst"]) for c in cells} == measured
    assert len([a for t, a in el.tags if t == "rect" and a.get("class") == "self"]) == 4
    failed = [c for c in cells if c["class"] == "cell failed"]
    assert [(c["data-src"], c["data-dst"]) for c in failed] == [("node01", "node02")]
    assert failed[0]["fill"] == STATUS_COLOURS[Status.FAIL][0]
    slow = {c["fill"] for c in cells if "node03" in (c["data-src"], c["data-dst"]) and c not in failed}
    fast = {c["fill"] for c in cells if "node03" not in (c["data-src"], c["data-dst"]) and c not in failed}
    assert slow and fast and not slow & fast
    assert all(f.startswith("hsl(0,") for f in slow)  # red: 24% of the median is below the scale's floor
    # The straggler's row and column are outlined and its label stands out; nobody else's.
    assert [a["data-host"] for t, a in el.tags if a.get("class") == "flagged-row"] == ["node03"]
    assert [a["data-host"] for t, a in el.tags if a.get("class") == "flagged-col"] == ["node03"]
    assert '<li data-host="node03">' in page and "(straggler: below 70%)" in page
    # 4 hosts: cells are large enough for their values (Gbit/s here), and each has a tooltip.
    assert ">9.4</text>" in page and ">2.3</text>" in page and "Values in Gbit/s." in page
    assert "node01 \u2192 node02: failed" in page and "9.40 Gbit/s (" in page


def test_heat_map_at_64_hosts_stays_bounded():
    n = 64
    page = to_html(cluster_report(n=n, straggler="node33"))
    el = Elements(page)
    (svg,) = el.find("svg", id="heatmap")
    assert svg["data-hosts"] == str(n)
    # The grid is at most HEATMAP_MAX_PX plus the labels; cells shrink but stay at least CELL_MIN_PX.
    assert float(svg["width"]) <= HEATMAP_MAX_PX + 300 and float(svg["height"]) <= HEATMAP_MAX_PX + 200
    self_cells = [a for t, a in el.tags if t == "rect" and a.get("class") == "self"]
    assert CELL_MIN_PX <= float(self_cells[0]["width"]) <= HEATMAP_MAX_PX / n
    # No values written in 10-px cells, only tooltips; unmeasured pairs are the grid's background, not elements.
    svg_text = re.search(r'<svg id="heatmap".*?</svg>', page).group(0)
    assert ">9.4</text>" not in svg_text and "tooltip" in page
    cells = [a for t, a in el.tags if t == "rect" and a.get("class", "").startswith("cell")]
    assert len(cells) < 4 * n  # the measured links only (ring + 2 rounds), not n * n
    assert svg_text.count("<title>") == len(cells) + n
    assert len(page) < 200_000, len(page)
    assert [a["data-host"] for t, a in el.tags if a.get("class") == "flagged-row"] == ["node33"]


def test_busbw_plot_has_log2_axis_ticks_labels_and_one_point_per_size():
    page = to_html(cluster_report())
    el = Elements(page)
    (svg,) = el.find("svg", id="busbw")
    (line,) = [a for t, a in el.tags if t == "polyline"]
    points = [tuple(map(float, p.split(","))) for p in line["points"].split()]
    assert len(points) == 9 == len(el.find("circle", class_="point"))
    xs = [x for x, _ in points]
    steps = {round(b - a, 1) for a, b in zip(xs, xs[1:])}
    assert len(steps) == 1  # sizes double: equal steps on a log2 axis
    assert [y for _, y in points] == sorted((y for _, y in points), reverse=True)  # busbw grows: y goes up
    assert "message size (bytes, log2 scale)" in page and "busbw (GB/s)" in page
    assert ">64 KiB</text>" in page and ">16 MiB</text>" in page
    assert len(el.find("line", class_="ytick")) == 6
    assert "16 MiB: busbw 3.3 GB/s" in page


def test_sections_without_data_say_why():
    only_ssh = Report("t", 1.0, [HostRecord("node01", "a", 1, True)],
                      [Result("node01", "ssh", Status.PASS, "connected")], ["ssh"])
    page = to_html(only_ssh)
    assert 'id="heatmap"' not in page and 'id="busbw"' not in page
    assert "iperf3 did not run (add iperf3 to --checks)" in page
    assert "the all-reduce did not run (add allreduce to --checks)" in page
    assert "no environment recommended" in page

    single = Report("t", 1.0, [HostRecord("node01", "a", 1, True)], [
        Result("*", "iperf3", Status.SKIP, "needs at least 2 reachable hosts to measure between them"),
        Result("*", "allreduce", Status.SKIP, "torch is not importable")], ["iperf3", "allreduce"])
    page = to_html(single)
    assert "no heat map: needs at least 2 reachable hosts" in page
    assert "no busbw measured: skip - torch is not importable" in page
    assert page.count('class="absent"') == 3  # heat map, busbw, environment


def test_cli_html_option_is_validated_and_written(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "preflight", "run", "--html", str(tmp_path / "no" / "r.html")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "--html" in bad.stderr and "does not exist" in bad.stderr
    page = tmp_path / "r.html"
    ok = subprocess.run([sys.executable, "-m", "preflight", "run", "--checks", "python", "--python", sys.executable,
                         "--html", str(page)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                        stdin=subprocess.DEVNULL)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = page.read_text()
    assert text.startswith("<!doctype html>") and 'data-host="localhost"' in text


# --------------------------------------------------------------------------------------- headless chromium

@pytest.fixture
def browser():
    """Debian's chromium through its own chromedriver (selenium-manager never downloads anything)."""
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def full_page_screenshot(driver, path: Path) -> None:
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    path.write_bytes(base64.b64decode(shot["data"]))


def rgb(hex_colour: str) -> str:
    """'#c6f0d2' as the browser's computed style writes it: 'rgb(198, 240, 210)'."""
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def box(driver, element) -> dict:
    return driver.execute_script("const r = arguments[0].getBoundingClientRect();"
                                 "return {w: r.width, h: r.height};", element)


def assert_page_renders(driver, hosts: list, straggler: str, sizes: int) -> None:
    by = "css selector"
    matrix = driver.find_element(by, "#matrix")
    assert matrix.is_displayed()
    rows = driver.find_elements(by, "#matrix tbody tr")
    assert [r.get_attribute("data-host") for r in rows] == hosts + ["*"]
    colour = {s: set(driver.execute_script(
        f"return [...document.querySelectorAll('#matrix td.st-{s.value}')].map(c => getComputedStyle(c)"
        f".backgroundColor);")) for s in (Status.PASS, Status.FAIL)}
    assert colour[Status.PASS] == {rgb(STATUS_COLOURS[Status.PASS][0])}
    assert colour[Status.FAIL] == {rgb(STATUS_COLOURS[Status.FAIL][0])}

    heatmap = driver.find_element(by, "svg#heatmap")
    size = box(driver, heatmap)
    assert heatmap.is_displayed() and size["w"] > 100 and size["h"] > 100, size
    # One script for all cells: a WebDriver round trip per cell takes seconds at 64 hosts.
    cells = driver.execute_script(
        "return [...document.querySelectorAll('svg#heatmap rect.cell')].map(c => ({src: c.dataset.src, "
        "dst: c.dataset.dst, fill: getComputedStyle(c).fill, w: c.getBoundingClientRect().width}));")
    assert len(driver.find_elements(by, "svg#heatmap rect.self")) == len(hosts)
    assert len(hosts) <= len(cells) <= len(hosts) * (len(hosts) - 1)
    assert all(c["w"] > 0 for c in cells)
    fills: dict = {}
    for c in cells:
        fills.setdefault(straggler in (c["src"], c["dst"]), set()).add(c["fill"])
    assert fills[True] and fills[False] and not fills[True] & fills[False], fills
    band = driver.find_element(by, f'svg#heatmap rect.flagged-row[data-host="{straggler}"]')
    assert box(driver, band)["w"] > 0

    points = driver.find_elements(by, "svg#busbw circle.point")
    assert len(points) == sizes and all(p.is_displayed() for p in points)
    line = driver.find_element(by, "svg#busbw polyline.series")
    assert len(line.get_attribute("points").split()) == sizes and box(driver, line)["w"] > 100


def test_browser_renders_a_64_host_report(browser, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(to_html(cluster_report(n=64, straggler="node33")))
    browser.get(page.as_uri())
    assert_page_renders(browser, [f"node{i:02d}" for i in range(1, 65)], "node33", 9)
    # Still fits beside the labels on a laptop screen.
    assert box(browser, browser.find_element("css selector", "svg#heatmap"))["w"] <= 1000
    # A PASS cell's link opens the collapsed passes and lands on the result.
    passes = browser.find_element("css selector", 'details[data-status="pass"]')
    assert passes.get_attribute("open") is None
    browser.find_element("css selector", '#matrix tr[data-host="node05"] td[data-check="ssh"] a').click()
    assert browser.current_url.endswith("#r-node05-ssh")
    assert passes.get_attribute("open") is not None
    entry = browser.find_element("xpath", '//*[@id="r-node05-ssh"]/ancestor-or-self::div[contains(@class, "result")]')
    assert entry.is_displayed() and "node05" in entry.text


# --------------------------------------------------------------------------------------- a real run, rendered


RATE = 200  # Mbit/s, as tests/checks/iperf3/test_iperf3.py: measured at 95% on this 2-core machine
# Shortest sweep that still plots 5 sizes, and 1-s iperf3 tests: the run takes ~20 s instead of ~40 s.
FAST_CONFIG = ("[iperf3]\nduration_s = 1.0\n"
               "[allreduce]\nmin_bytes = 65536\nmax_bytes = 1048576\niters = 2\n")


def test_browser_renders_a_real_run_with_a_straggler(netcluster_factory, browser, tmp_path):
    cluster = netcluster_factory(4)
    straggler = "node03"
    for h in cluster.hosts:
        cluster.shape(h, RATE / 4 if h.name == straggler else RATE)
    config = tmp_path / "thresholds.toml"
    config.write_text(FAST_CONFIG)
    page, report = tmp_path / "report.html", tmp_path / "report.json"
    proc = cli_cluster.preflight(cluster, "--hostfile", cluster.hostfile(tmp_path / "hostfile"),
                                 "--checks", "interfaces,iperf3,allreduce,nvme", "--nvme-path", "/nonexistent/nvme",
                                 "--config", config, "--json", report, "--html", page, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the missing NVMe path and the straggler fail
    data = json.loads(report.read_text())
    cells = {(r["host"], r["check"]): r for r in data["results"]}
    assert cells[(straggler, "iperf3")]["status"] in ("warn", "fail"), cells[(straggler, "iperf3")]["message"]
    # The all-reduce's straggler rounds name the host shaped to a quarter as well: below 50%, FAIL.
    allreduce = cells[("*", "allreduce")]
    assert allreduce["status"] == "fail" and f"straggler: {straggler}" in allreduce["message"], allreduce["message"]
    assert cells[(straggler, "allreduce")]["status"] == "fail", cells[(straggler, "allreduce")]["message"]

    browser.get(page.as_uri())
    try:
        assert_page_renders(browser, [h.name for h in cluster.hosts], straggler,
                            len(cells[("*", "allreduce")]["metrics"]["sizes"]))
        fails = browser.find_elements("css selector", "#matrix td.st-fail")
        expected = {(h.name, "nvme") for h in cluster.hosts} | {(straggler, "allreduce"), ("*", "allreduce")}
        if cells[(straggler, "iperf3")]["status"] == "fail":
            expected.add((straggler, "iperf3"))
        assert {(f.find_element("xpath", "..").get_attribute("data-host"), f.get_attribute("data-check"))
                for f in fails} == expected
        listed = browser.find_elements("css selector", "#stragglers li")
        assert [li.get_attribute("data-host") for li in listed] == [straggler]
    finally:
        full_page_screenshot(browser, tmp_path / "report.png")  # the CI artifact, kept even when a check fails
    assert (tmp_path / "report.png").stat().st_size > 10_000
    cli_cluster.assert_nothing_left(cluster)
