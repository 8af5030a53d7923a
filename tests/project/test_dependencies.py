"""The declared dependencies (pyproject.toml) and the imports under preflight/ agree: every runtime dependency is
imported by some module (no dependency that nothing imports, as psutil was), and every third-party import is
declared, at run time or in an extra (gpu, deepspeed, test)."""
from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

from preflight.config import tomllib

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Where a distribution's import name is not its own name, and the distribution may not be installed here to ask.
IMPORT_NAMES = {"nvidia-ml-py": {"pynvml"}, "pytest": {"pytest", "_pytest"}}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(requirement: str) -> str:
    """'tomli>=2; python_version < "3.11"' -> 'tomli' (PEP 508: the name comes first)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"pyproject.toml: cannot read a distribution name in {requirement!r}"
    return match.group(1)


@functools.lru_cache(maxsize=None)
def _installed() -> dict[str, set[str]]:
    """distribution (normalized) -> the top-level packages it installed here."""
    provides: dict[str, set[str]] = {}
    for package, dists in metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(_normal(dist), set()).add(package)
    return provides


def _import_names(distribution: str) -> set[str]:
    """The top-level packages a distribution provides: from its installed metadata where it is installed."""
    names = IMPORT_NAMES.get(_normal(distribution), set()) | _installed().get(_normal(distribution), set())
    return names or {distribution, distribution.lower(), distribution.replace("-", "_")}


def _imports_under_preflight() -> dict[str, set[str]]:
    """top-level module name -> the files under preflight/ that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "preflight").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found.setdefault(module.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return found


def test_every_runtime_dependency_is_imported_under_preflight():
    imported = _imports_under_preflight()
    unused = [requirement for requirement in PROJECT["dependencies"]
              if not _import_names(_distribution(requirement)) & set(imported)]
    assert not unused, f"pyproject.toml declares {unused} but nothing under preflight/ imports them: remove them"


def test_every_third_party_import_under_preflight_is_declared():
    declared = [_distribution(r) for r in PROJECT["dependencies"]]
    declared += [_distribution(r) for extra in PROJECT["optional-dependencies"].values() for r in extra]
    provided = set().union(*(_import_names(d) for d in declared))
    third_party = {name: files for name, files in _imports_under_preflight().items()
                   if name not in sys.stdlib_module_names and name != "preflight"}
    assert {"paramiko", "rich", "torch"} <= set(third_party)  # the walk sees imports, in functions too
    undeclared = {name: sorted(files) for name, files in third_party.items() if name not in provided}
    assert not undeclared, f"imported under preflight/ but not declared in pyproject.toml: {undeclared}"


def test_the_requirement_names_are_read_as_pip_reads_them():
    assert _distribution("tomli>=2; python_version < '3.11'") == "tomli"
    assert _distribution("ClusterShell>=1.9") == "ClusterShell"
    assert _distribution("nvidia-ml-py") == "nvidia-ml-py" and _import_names("nvidia-ml-py") >= {"pynvml"}


def test_readme_step_2_is_what_ci_runs_and_installs_into_the_virtualenv():
    readme = (REPO / "README.md").read_text()
    step = re.search(r"^# 2\. .*\n(.+)$", readme, re.M)
    assert step, "README.md lost its step 2"
    install, run = step.group(1).split(" && ")
    assert install == "bash tests/install-deps.sh" and run.startswith(".venv/bin/python -m pytest")
    ci = (REPO / ".ci" / "run").read_text()
    assert f"\n{install}\n" in ci and f"\n{run} " in ci  # the same two commands (CI adds its xdist options)
    script = (REPO / "tests" / "install-deps.sh").read_text()
    assert "python3 -m venv .venv" in script and ".venv/bin/python -m pip install" in script
    # PEP 668: nothing goes into the system interpreter.
    assert not re.search(r"^(?!\.venv/bin/)\S*(pip3?|python3? -m pip) install", script, re.M), script
