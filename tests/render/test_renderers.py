"""The renderer registry (preflight/render): each output is registered once, and that one entry is the CLI's flag,
the pytest plugin's option and the writer of a real run's file.

The extra renderer that proves it lives in this test (a module written to a temporary directory, which the
subprocesses import), not in the package: registering it is the whole of what adding an output takes.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preflight import checks, cli, pytest_plugin, render

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 120
FLAG = "--result-lines"
# A whole renderer: one module, one register() call.
EXTRA = '''
from preflight import render


def write(report, out, settings):
    for r in report.results:
        out.write(f"{r.host} {r.check} {r.status.value}\\n")


render.register(render.Renderer("result_lines", "--result-lines", "write one 'host check status' line per result",
                                write, pytest_help="write one 'host check status' line per result"))
'''


def _options(parser) -> dict:
    """{option string: argparse action} of `preflight run`."""
    run = parser._subparsers._group_actions[0].choices["run"]
    return {s: a for a in run._actions for s in a.option_strings}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> list:
    """The registry as a copy, so what a test registers is gone after it."""
    monkeypatch.setattr(render, "RENDERERS", list(render.RENDERERS))
    return render.RENDERERS


@pytest.fixture
def extra_module(tmp_path: Path) -> Path:
    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "extra_renderer.py").write_text(EXTRA)
    return folder


def _lines(report_json: Path) -> list:
    data = json.loads(report_json.read_text())
    return [f"{r['host']} {r['check']} {r['status']}" for r in data["results"]]


def test_every_output_is_one_entry_and_the_cli_and_the_plugin_offer_it_from_there():
    names = [r.name for r in render.RENDERERS]
    assert names == ["terminal", "json", "junit", "env_file", "html", "prometheus"]
    options = _options(cli.build_parser())
    flags = [r.flag for r in render.file_outputs()]
    assert flags == ["--json", "--junit-xml", "--env-file", "--html", "--prom-textfile"]
    for output in render.file_outputs():
        assert options[output.flag].help == output.help and options[output.flag].dest == output.dest
    plugin = {f.cli: f for f in pytest_plugin.flags()}
    # pytest's own --junitxml writes a testcase per item: the plugin offers every other file output.
    assert [f for f in flags if f in plugin] == ["--json", "--env-file", "--html", "--prom-textfile"]
    assert all(plugin[r.flag].help == r.pytest_help for r in render.pytest_outputs())
    assert list(plugin)[-1] == "--strict"


def test_register_refuses_a_taken_name_or_flag_and_a_flag_that_is_not_a_long_option(registry):
    def write(report, out, settings):
        out.write("")

    for bad in (render.Renderer("json", "--json-too", "h", write), render.Renderer("other", "--html", "h", write),
                render.Renderer("short", "-s", "h", write), render.Renderer("odd", "--9lives", "h", write)):
        with pytest.raises(ValueError, match=repr(bad.name)):
            render.register(bad)
    assert len(registry) == 6  # nothing was added


def test_a_registered_renderer_is_a_cli_and_plugin_option(registry):
    def write(report, out, settings):
        out.write("x")

    render.register(render.Renderer("result_lines", FLAG, "write lines", write, pytest_help="write the lines"))
    options = _options(cli.build_parser())
    assert options[FLAG].help == "write lines"
    args = cli.build_parser().parse_args(["run", FLAG, "out.txt"])
    assert args.result_lines == "out.txt"
    assert "--preflight-result-lines" in [f.option for f in pytest_plugin.flags()]


def test_a_renderer_registered_by_another_module_writes_its_file_in_a_real_cli_run(extra_module: Path,
                                                                                    tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(extra_module), str(ROOT)]))
    program = "import sys, extra_renderer\nfrom preflight.cli import main\nsys.exit(main(sys.argv[1:]))\n"

    def preflight(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", program, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)

    shown = preflight("run", "--help")
    assert shown.returncode == 0 and FLAG in shown.stdout and "one 'host check status' line" in shown.stdout
    lines, report = tmp_path / "lines.txt", tmp_path / "report.json"
    proc = preflight("run", "--checks", "memlock", "--python", sys.executable, FLAG, str(lines), "--json", str(report))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert lines.read_text().splitlines() == _lines(report)
    assert [line.split()[1] for line in _lines(report)] == ["ssh", "memlock"]
    # The CLI validates it like its own outputs: a missing directory is one line naming the flag, exit 2.
    bad = preflight("run", "--checks", "memlock", FLAG, str(tmp_path / "no" / "lines.txt"))
    assert bad.returncode == 2 and f"{FLAG} {tmp_path / 'no' / 'lines.txt'}: directory" in bad.stderr, bad.stderr
    # Only one output may take stdout.
    both = preflight("run", "--checks", "memlock", FLAG, "-", "--json", "-")
    assert both.returncode == 2 and f"only one of --json/--junit-xml/--env-file/--html/--prom-textfile/{FLAG} can " \
        "be '-'" in both.stderr, both.stderr
    # '-': the lines on stdout alone, the terminal report on stderr.
    out = preflight("run", "--checks", "memlock", "--python", sys.executable, FLAG, "-")
    assert [line.split()[1] for line in out.stdout.splitlines()] == ["ssh", "memlock"], out.stdout
    assert "preflight matrix" in out.stderr


def test_a_renderer_registered_by_another_module_is_a_pytest_option_that_writes_its_file(
        extra_module: Path, pytester: pytest.Pytester):
    """`-p extra_renderer` loads the module before the entry-point plugins, so the option is there at once."""
    (pytester.path / "extra_renderer.py").write_text((extra_module / "extra_renderer.py").read_text())
    shown = pytester.runpytest_subprocess("-p", "extra_renderer", "--help", timeout=RUN_TIMEOUT)
    assert "--preflight-result-lines" in shown.stdout.str()
    lines, report = pytester.path / "lines.txt", pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "extra_renderer", "--preflight-local", "--preflight-checks=memlock",
                                           f"--preflight-python={sys.executable}", f"--preflight-result-lines={lines}",
                                           f"--preflight-json={report}", "-v", timeout=RUN_TIMEOUT)
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["localhost::ssh *", "localhost::memlock *"])
    assert lines.read_text().splitlines() == _lines(report)
    # The CLI's error about the flag names the plugin's option.
    bad = pytester.runpytest_subprocess("-p", "extra_renderer", "--preflight-local",
                                        f"--preflight-result-lines={pytester.path / 'no' / 'x'}", timeout=RUN_TIMEOUT)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: preflight: --preflight-result-lines " in bad.stderr.str(), bad.stderr.str()


def _check_names_in(text: str) -> set:
    return {name for name in checks.ORDER if re.search(rf"\b{name}\b", text)}


def test_no_renderer_names_a_check():
    """The renderers know checks only through the registry: what a check draws (a heat map, a plot) is its own
    SPEC.html, so a new check needs no edit here. Code, comments and docstrings alike."""
    assert _check_names_in('"iperf3 heat map" and the all-reduce') == {"iperf3"}  # the rule can fail
    found = {path.name: names for path in sorted((ROOT / "preflight" / "render").glob("*.py"))
             if (names := _check_names_in(path.read_text()))}
    assert found == {}
    sections = [spec.name for spec in checks.all_specs() if spec.html]
    assert sections == ["iperf3", "allreduce"]  # the page's sections, contributed by the checks themselves
