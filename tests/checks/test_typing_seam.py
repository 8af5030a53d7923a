"""mypy holds every check to the seam: with the project's own [tool.mypy] (pyproject.toml), a check module that
reads an attribute ``ClusterView`` does not have (``cluster.hostz``), or leaves ``coordinate`` unannotated, fails
``python3 -m mypy``; a correct one passes, and the public ``FakeCluster`` is a ``ClusterView`` to mypy too.

Each probe is written into a copy of the package (preflight/checks/probe.py there), so that it is checked exactly
as a check of this tree would be, and the working tree is never touched.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from preflight import checks
from preflight.hostside.seams import ClusterView

REPO = Path(__file__).resolve().parents[2]

GOOD = '''"""A tiny cluster check, as a check author writes one."""
from typing import Any, Dict

from ..hostside.seams import ClusterView


def coordinate(cluster: ClusterView) -> Dict[str, Any]:
    return {"hosts": [h.name for h in cluster.hosts], "master": cluster.address(cluster.master.name)}
'''

WRONG_ATTRIBUTE = GOOD.replace("for h in cluster.hosts]", "for h in cluster.hostz]")

UNANNOTATED = '''"""A cluster check whose coordinate takes no annotation: mypy would not look into its body at all."""


def coordinate(cluster):
    return {"hosts": [h.name for h in cluster.hostz]}
'''

FAKE_IS_A_VIEW = '''"""The public test double satisfies the seam, to mypy as to isinstance."""
from preflight.hostside.seams import ClusterView
from preflight.testing import FakeCluster, FakeService
from preflight.hostside.seams import ServiceHandle

view: ClusterView = FakeCluster(3)
service: ServiceHandle = FakeService(ready={"port": 5201})
'''


def mypy_on(tmp_path: Path, source: str, where: str = "preflight/checks/probe.py") -> subprocess.CompletedProcess:
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "preflight", tree / "preflight", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / where).write_text(source)
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "cache"), where],
                          cwd=tree, capture_output=True, text=True, timeout=600)


def test_a_correct_check_passes(tmp_path):
    res = mypy_on(tmp_path, GOOD)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Success: no issues found" in res.stdout


def test_a_wrong_attribute_on_the_seam_fails(tmp_path):
    res = mypy_on(tmp_path, WRONG_ATTRIBUTE)
    assert res.returncode == 1, res.stdout + res.stderr
    assert 'preflight/checks/probe.py:8: error: "ClusterView" has no attribute "hostz"' in res.stdout, res.stdout


def test_an_unannotated_coordinate_fails_instead_of_going_unchecked(tmp_path):
    res = mypy_on(tmp_path, UNANNOTATED)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "preflight/checks/probe.py:4: error: Function is missing a type annotation" in res.stdout, res.stdout


def test_the_public_fake_cluster_is_a_cluster_view_to_mypy(tmp_path):
    res = mypy_on(tmp_path, FAKE_IS_A_VIEW, "preflight/probe.py")
    assert res.returncode == 0, res.stdout + res.stderr
    # and the probe is really checked: the same assignment from a plain object fails
    res = mypy_on(tmp_path / "negative", FAKE_IS_A_VIEW.replace("FakeCluster(3)", "object()"), "preflight/probe.py")
    assert res.returncode == 1, res.stdout + res.stderr
    assert '(expression has type "object", variable has type "ClusterView")' in res.stdout, res.stdout


@pytest.mark.parametrize("name", [s.name for s in checks.all_specs() if s.scope == "cluster"])
def test_every_cluster_check_takes_a_cluster_view(name):
    coordinate = checks.spec(name).coordinate
    assert coordinate is not None
    assert typing.get_type_hints(coordinate)["cluster"] is ClusterView, name


COORDINATOR_UNANNOTATED = '''"""A coordinator module with an unannotated helper."""


def address(node):
    return node.transport.adress
'''

SPEC_NOT_MODULE = '''"""The runner's way to a check: its CheckSpec, whose attributes mypy knows (a module's NAME it would not)."""
from preflight import checks as registry
from preflight.hostside.seams import CheckSpec


def names(specs: list[CheckSpec]) -> list[str]:
    return [s.NAME for s in specs] + [registry.spec("gpu").nme]
'''


@pytest.mark.parametrize("where", ["preflight/probe.py", "preflight/transport/probe.py", "preflight/render/probe.py"])
def test_the_coordinator_is_strict_too(tmp_path, where):
    res = mypy_on(tmp_path, COORDINATOR_UNANNOTATED, where)
    assert res.returncode == 1 and "no-untyped-def" in res.stdout, res.stdout + res.stderr


def test_the_runner_reaches_the_checks_through_a_typed_spec(tmp_path):
    res = mypy_on(tmp_path, SPEC_NOT_MODULE, "preflight/probe.py")
    assert res.returncode == 1, res.stdout + res.stderr
    assert '"CheckSpec" has no attribute "NAME"' in res.stdout and '"CheckSpec" has no attribute "nme"' in res.stdout


def test_no_module_is_left_out_of_strict_typing():
    import tomllib
    overrides = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if o.get("disallow_untyped_defs") is True]
    loose = [o for o in overrides if o.get("disallow_untyped_defs") is False]
    assert [o["module"] for o in strict] == [["preflight", "preflight.*"]]
    assert loose == []  # the CLI was the last module left out (issue 32: mypy strict on all of preflight/)
