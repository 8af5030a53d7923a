"""The "Adding a check" example (docs/adding-a-check.md, linked from the README) is real code: it loads as a
check, passes the registry's Protocol check, collects on this machine and evaluates against its own thresholds
file; and its three pieces (the module, the TOML beside it, one registry line) added to a copy of preflight are all
it takes: that copy lists it, prints its section in the defaults, validates a --config against its rule lines and
runs it through the agent with node-check."""
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

REPO = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="module")
def with_example(tmp_path_factory):
    """A copy of preflight/ with the page's module, its TOML beside it and the registry line: nothing else."""
    root = tmp_path_factory.mktemp("example")
    shutil.copytree(REPO / "preflight", root / "preflight", ignore=shutil.ignore_patterns("__pycache__"))
    (code,) = _blocks("python")
    (toml,) = _blocks("toml")
    checks_dir = root / "preflight" / "checks"
    (checks_dir / "shm_free.py").write_text(code)
    (checks_dir / "shm_free.toml").write_text(toml)
    registry = checks_dir / "__init__.py"
    text = registry.read_text()
    order = re.search(r"^ORDER = \[\n(.*?)^\]", text, re.S | re.M)
    assert order, "ORDER is no longer a list literal in preflight/checks/__init__.py; update this test"
    registry.write_text(text[:order.end(1)] + '    "shm_free",\n' + text[order.end(1):])
    return root


def _preflight(root: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    return subprocess.run([sys.executable, "-m", "preflight", *argv], cwd=root, capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_the_module_its_toml_and_one_registry_line_are_all_a_check_needs(with_example, tmp_path):
    root = with_example
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
