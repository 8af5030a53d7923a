"""The "Adding a check" example (docs/adding-a-check.md, linked from the README) is real code: it loads as a
check, passes the registry's Protocol check, collects on this machine and evaluates against its own defaults
section."""
from __future__ import annotations

import importlib.util
import re
import sys
import time

from pathlib import Path

from preflight.hostside import outcome as oc
from preflight.hostside import seams
from preflight.config import tomllib

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "adding-a-check.md").read_text()


def _blocks(lang: str) -> list[str]:
    section = PAGE[PAGE.index("# Adding a check"):]  # the page is the section
    return re.findall(r"```%s\n(.*?)```" % lang, section, re.S)


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
    facts = module.collect(seams.HostContext({}, time.monotonic() + 10))
    outcome = module.evaluate(facts, thresholds)
    assert outcome.status in (oc.Status.PASS, oc.Status.WARN, oc.Status.SKIP) and outcome.message
    low = module.evaluate({"free_mib": 10, "size_mib": 64}, thresholds)
    assert low.status == oc.Status.WARN and "10 MiB free of 64 (expected >= 512)" in low.message
    assert module.evaluate({"free_mib": 4096, "size_mib": 8192}, thresholds).status == oc.Status.PASS
