"""The "Adding a check" guide (docs/adding-a-check.md, linked from the README) is real code and a real procedure: its
example loads as a check, passes the registry's Protocol check, collects on this machine and evaluates against its
own thresholds file; and its seven steps, followed word for word in a copy of the repository (the module, the TOML
beside it, the registry line, the README row, then the page's own commands: docgen, ruff and mypy, the docs tests),
are all it takes: that copy lists the check, prints its section in the defaults, validates a --config against its
rule lines and runs it through the agent with node-check."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

from pathlib import Path

import pytest

from preflight.hostside import outcome as oc
from preflight.hostside import seams
from preflight.config import tomllib

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "adding-a-check.md").read_text()


def _blocks(lang: str) -> list[str]:
    section = PAGE[PAGE.index("# Adding a check"):]  # the page is the section
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def _load(source: str):
    spec = importlib.util.spec_from_loader("preflight.checks.shm_free", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "preflight.checks"  # its imports are relative, as in every check
    sys.modules[spec.name] = module
    try:
        exec(compile(source, "docs/adding-a-check.md:shm_free.py", "exec"), module.__dict__)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_readme_example_check_works():
    (code,) = _blocks("python")
    (toml,) = _blocks("toml")
    module = _load(code)
    seams.validate_spec(module.SPEC, module.__name__)
    thresholds = tomllib.loads(toml)
    assert set(thresholds) == {module.NAME} and f"[{module.NAME}]" in module.__doc__
    assert f"{module.NAME}.toml beside this module" in module.__doc__
    facts = module.collect(seams.HostContext({}, time.monotonic() + 10))
    outcome = module.evaluate(facts, thresholds)
    assert outcome.status in (oc.Status.PASS, oc.Status.WARN, oc.Status.SKIP) and outcome.message
    low = module.evaluate({"free_mib": 10, "size_mib": 64}, thresholds)
    assert low.status == oc.Status.WARN and "10 MiB free of 64 (expected >= 512)" in low.message
    assert module.evaluate({"free_mib": 4096, "size_mib": 8192}, thresholds).status == oc.Status.PASS


def _env() -> dict[str, str]:
    """This test's interpreter first on PATH, so that the page's `python3` is the one running the suite (a venv's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _add_readme_row(readme: Path, row: str) -> None:
    """The row after the last one of the README's checks table (the example is last in ORDER)."""
    text = readme.read_text()
    section = text.index("\n## Checks")
    table_end = text.index("\n## ", section + 1)
    last_row = text.rindex("\n| `", section, table_end)
    at = text.index("\n", last_row + 1)
    readme.write_text(text[:at + 1] + row + text[at + 1:])


def _bash(root: Path, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=root, capture_output=True, text=True,
                          timeout=900, env=_env(), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def with_example(tmp_path_factory):
    """A copy of the repository's code, docs and tests, with the page's steps done in it, in the page's order."""
    root = tmp_path_factory.mktemp("example")
    skip = shutil.ignore_patterns("__pycache__")
    for folder in ("preflight", "docs", "tests"):
        shutil.copytree(REPO / folder, root / folder, ignore=skip)
    for name in ("README.md", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    if (REPO / ".mypy_cache").is_dir():  # CI ran mypy on the checkout first: start warm (minutes cold on 2 cores)
        shutil.copytree(REPO / ".mypy_cache", root / ".mypy_cache")
    (code,) = _blocks("python")
    (toml,) = _blocks("toml")
    (row,) = _blocks("markdown")
    docgen, lint, docs_tests = _blocks("bash")
    # 1. the module, 2. its thresholds, 3. the registry line
    checks_dir = root / "preflight" / "checks"
    (checks_dir / "shm_free.py").write_text(code)
    (checks_dir / "shm_free.toml").write_text(toml)
    registry = checks_dir / "__init__.py"
    text = registry.read_text()
    order = re.search(r"^ORDER = \[\n(.*?)^\]", text, re.S | re.M)
    assert order, "ORDER is no longer a list literal in preflight/checks/__init__.py; update this test"
    registry.write_text(text[:order.end(1)] + '    "shm_free",\n' + text[order.end(1):])
    # Without steps 4 and 5 the docs tests fail, naming both: the page's steps are all needed.
    before = _bash(root, docs_tests)
    assert before.returncode == 1 and "README's checks table differs" in before.stdout \
        and "docs/checks.md is stale" in before.stdout, before.stdout[-3000:] + before.stderr[-2000:]
    # 4. the README row; 5. docgen, 6. ruff and mypy, 7. the docs tests: the page's commands as written.
    _add_readme_row(root / "README.md", row)
    steps = {}
    for step, command in (("docgen", docgen), ("lint", lint), ("docs tests", docs_tests)):
        steps[step] = _bash(root, command)
        assert steps[step].returncode == 0, (step, command, steps[step].stdout[-3000:], steps[step].stderr[-3000:])
    return root, steps


def test_the_pages_commands_pass_in_the_copy(with_example):
    root, steps = with_example
    assert "## shm_free" in (root / "docs" / "checks.md").read_text()  # docgen wrote its section
    assert "Success: no issues found" in steps["lint"].stdout
    assert "All checks passed!" in steps["lint"].stdout
    assert re.search(r"^2 passed", steps["docs tests"].stdout, re.M), steps["docs tests"].stdout[-2000:]


def _preflight(root: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preflight", *argv], cwd=root, capture_output=True, text=True,
                          timeout=120, env=_env(), stdin=subprocess.DEVNULL)


def test_the_module_its_toml_and_one_registry_line_are_all_a_check_needs(with_example, tmp_path):
    root, _ = with_example
    (toml,) = _blocks("toml")
    where = subprocess.run([sys.executable, "-c", "import preflight; print(preflight.__file__)"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(root / "preflight" / "__init__.py")  # the copy runs, not the checkout
    listed = _preflight(root, "list")
    assert listed.returncode == 0 and "shm_free" in listed.stdout and "free space in /dev/shm" in listed.stdout
    page = _preflight(root, "config", "--defaults")
    assert page.returncode == 0 and page.stdout.endswith(toml), page.stderr  # its section, comments and all
    config = tmp_path / "site.toml"
    config.write_text(page.stdout)  # the whole printed page, the new section included, is a valid --config
    run = _preflight(root, "node-check", "--checks", "shm_free", "--python", sys.executable, "-v",
                     "--config", str(config))
    assert run.returncode == 0 and "::shm_free " in run.stdout, run.stdout + run.stderr
    # The operator's value reaches the check on the host ...
    config.write_text("[shm_free]\nmin_free_mib = 1048576\n")
    run = _preflight(root, "node-check", "--checks", "shm_free", "--python", sys.executable, "-v",
                     "--config", str(config))
    assert "(expected >= 1048576)" in run.stdout or "no /dev/shm here" in run.stdout, run.stdout + run.stderr
    # ... and its range line is enforced like any other check's.
    config.write_text("[shm_free]\nmin_free_mib = -1\n")
    bad = _preflight(root, "node-check", "--checks", "shm_free", "--config", str(config))
    assert bad.returncode == 2 and "shm_free.min_free_mib = -1 is out of range; expected 0 <= x <= 1048576" \
        in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_its_option_is_in_run_help_the_plugin_and_the_docs_and_sets_its_threshold(with_example):
    """The example's one Option (its SPEC.options), with nothing else added for it: `preflight run --help` and
    `node-check --help` offer it, the pytest plugin has its --preflight- form, docs/checks.md lists it, and the
    value reaches the check through limits() (held to the key's range rule, exit 2 before anything runs)."""
    root, _ = with_example
    (code,) = _blocks("python")
    (option,) = _load(code).SPEC.options
    assert option.flag == "--shm-min-free" and option.threshold == "min_free_mib"
    for command in ("run", "node-check"):
        shown = _preflight(root, command, "--help")
        assert shown.returncode == 0 and f"{option.flag} {option.metavar}" in shown.stdout, shown.stdout
    plugin = subprocess.run([sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "--help"],
                            cwd=root, capture_output=True, text=True, timeout=300, env=_env(),
                            stdin=subprocess.DEVNULL)
    assert "--preflight-shm-min-free=MIB" in plugin.stdout, plugin.stdout[-3000:] + plugin.stderr[-2000:]
    docs = (root / "docs" / "checks.md").read_text()
    section = docs[docs.index("## shm_free"):]
    assert f"- `{option.flag} {option.metavar}` (`preflight run`, `preflight node-check` and the pytest plugin's " \
           f"`--preflight-shm-min-free`; sets the `min_free_mib` threshold for the run): {option.help}" in section
    run = _preflight(root, "node-check", "--checks", "shm_free", "--python", sys.executable, "-v",
                     "--shm-min-free", "1048576")
    assert "(expected >= 1048576)" in run.stdout or "no /dev/shm here" in run.stdout, run.stdout + run.stderr
    bad = _preflight(root, "node-check", "--checks", "shm_free", "--shm-min-free", "-1")
    assert bad.returncode == 2 and bad.stderr.strip() == "preflight: error: --shm-min-free: shm_free.min_free_mib " \
        "= -1 is out of range; expected 0 <= x <= 1048576", bad.stderr
