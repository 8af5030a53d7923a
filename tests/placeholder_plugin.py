"""A pytest plugin (``-p tests.placeholder_plugin``) that records every message and fix the checks' ``evaluate``
returns (their findings too) and every cause line the report prints, while other tests run: the texts of every
fixture the unit tests feed the checks. At the end of the session they go to ``$PREFLIGHT_TEXTS`` as JSON lines
``{"source": "gpu.evaluate", "test": "tests/checks/gpu/test_gpu.py::...", "text": "..."}`` for tests/verdict/test_no_placeholder.py to
grep. Tests that need namespace hosts or Slurm are deselected: the checks' unit tests are what it is for.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, List

_TEXTS: List[dict] = []
_CURRENT = {"test": ""}
# Fixtures of the namespace-cluster and Slurm tests: slow, and their texts are the scenarios' reports.
_CLUSTER_FIXTURES = {"cluster", "cluster3", "netcluster_factory", "slurm_cluster", "slurmcluster"}


def _texts_of(outcome: Any) -> List[str]:
    from preflight.hostside.outcome import Outcome
    outcomes = outcome.values() if isinstance(outcome, dict) else [outcome]
    found = []
    for one in outcomes:
        if isinstance(one, Outcome):
            found += [one.message, one.fix] + [t for f in one.findings for t in (f.message, f.fix)]
    return [t for t in found if t]


def _wrap_evaluate(module: Any, name: str) -> None:
    original = getattr(module, "evaluate", None)
    if original is None or getattr(original, "_placeholder_wrapped", False):
        return

    @functools.wraps(original)
    def evaluate(*args: Any, **kwargs: Any) -> Any:
        outcome = original(*args, **kwargs)
        for text in _texts_of(outcome):
            _TEXTS.append({"source": f"{name}.evaluate", "test": _CURRENT["test"], "text": text})
        return outcome

    evaluate._placeholder_wrapped = True  # type: ignore[attr-defined]
    module.evaluate = evaluate
    spec = getattr(module, "SPEC", None)
    if spec is not None and getattr(spec, "evaluate", None) is original:
        try:
            object.__setattr__(spec, "evaluate", evaluate)
        except (AttributeError, TypeError):
            pass


def _wrap_cause_line() -> None:
    from preflight import causes
    original = causes.Cause.line

    @functools.wraps(original)
    def line(self: Any) -> str:
        text = original(self)
        _TEXTS.append({"source": "causes.Cause.line", "test": _CURRENT["test"], "text": text})
        return text

    causes.Cause.line = line  # type: ignore[method-assign]


def _no_clusters() -> None:
    """Namespace and Slurm clusters are not built here: a test that needs one skips (it is a scenario, not a
    fixture of a check's unit tests, and takes minutes)."""
    import pytest

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        pytest.skip("placeholder grep: the checks' unit tests only, no namespace hosts")

    for module_name, class_name in (("tests.netcluster", "NetCluster"), ("tests.slurmcluster", "SlurmCluster")):
        try:
            module = __import__(module_name, fromlist=[class_name])
        except Exception:  # noqa: BLE001 - a helper that does not import here builds nothing either
            continue
        setattr(getattr(module, class_name), "__init__", refuse)


def pytest_configure(config: Any) -> None:
    from preflight import checks as registry
    for name in registry.ORDER:
        _wrap_evaluate(registry.load(name), name)
    _wrap_cause_line()
    _no_clusters()


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    keep, drop = [], []
    for item in items:
        (drop if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())) else keep).append(item)
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)


def pytest_runtest_setup(item: Any) -> None:
    _CURRENT["test"] = item.nodeid


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("PREFLIGHT_TEXTS")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            for entry in _TEXTS:
                fh.write(json.dumps(entry) + "\n")
