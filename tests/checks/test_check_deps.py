"""Checks depend on each other only through declared reads, and the coordinator names no check; read with ast.

1. No check imports another (``from .iperf3 import host_subnets``, ``from ..driver_cuda import ...``): shared pure
   helpers live in preflight/hostside, and another check's facts are read from ``cluster.facts`` with the
   dependency declared in ``SPEC.reads`` (the registry refuses a read of an unknown or a later check). Imports
   inside one check's subpackage (allreduce/verdict.py -> allreduce/common.py) are its own business.
2. The coordinator's generic modules (cli/, recommend.py, config.py and the HTML renderer) hold no string equal
   to a registered check's name and import no check module: what they do for a check, the check declares. Words
   inside option names (``--nvme-path``, ``--ssh-port``) are not names of checks.
"""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional, Tuple

import pytest

import preflight
from preflight import checks as registry
from preflight import testing
from preflight.hostside import seams
from tests.project.test_layout import _resolve_from  # one resolver of relative imports for both walkers

PACKAGE = Path(preflight.__file__).resolve().parent
CHECKS_DIR = PACKAGE / "checks"
CHECKS_PACKAGE = "preflight.checks"


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool = False) -> List[Tuple[int, str]]:
    """(line, dotted name) of everything a module imports: ``X`` for ``import X``, ``X.a`` for ``from X import a``
    (``a`` may be a submodule, as in ``from . import interfaces``, or a name such as ``ORDER``)."""
    out: List[Tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_package)
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return out


def _check_of(name: str) -> Optional[str]:
    """The registered check a dotted name belongs to ('allreduce' for preflight.checks.allreduce.common.NAME), or
    None (the registry and its attributes, such as preflight.checks.ORDER, or anything outside the checks)."""
    if not name.startswith(CHECKS_PACKAGE + "."):
        return None
    first = name[len(CHECKS_PACKAGE) + 1:].split(".")[0]
    return first if first in registry.ORDER else None


def sideways_imports(source: str, module: str, is_package: bool = False) -> List[str]:
    """Each import, in the check module ``module``, of another check or of the registry, as 'line N: what'."""
    own = _check_of(module)
    found = set()
    for line, name in imported_names(source, module, is_package):
        other = _check_of(name)
        if other is not None and other != own:
            found.add((line, f"{CHECKS_PACKAGE}.{other}"))
        elif other is None and (name == CHECKS_PACKAGE or name.startswith(CHECKS_PACKAGE + ".")):
            found.add((line, f"{CHECKS_PACKAGE} (the registry)"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def check_modules() -> List[Path]:
    return sorted(p for p in CHECKS_DIR.rglob("*.py") if p != CHECKS_DIR / "__init__.py")


def test_no_check_imports_another():
    problems = []
    for path in check_modules():
        found = sideways_imports(path.read_text(), _module_of(path), path.name == "__init__.py")
        problems += [f"{path.relative_to(PACKAGE.parent)} {f}" for f in found]
    assert check_modules() and problems == []


@pytest.mark.parametrize("module, source, expected", [
    ("preflight.checks.ports", "from .iperf3 import host_subnets\n", ["line 1: preflight.checks.iperf3"]),
    ("preflight.checks.iperf3", "def f():\n    from . import interfaces as itf\n",
     ["line 2: preflight.checks.interfaces"]),
    ("preflight.checks.allreduce.supervisor", "from ..driver_cuda import format_nccl_version\n",
     ["line 1: preflight.checks.driver_cuda"]),
    ("preflight.checks.python", "from .allreduce.supervisor import torch_view\n",
     ["line 1: preflight.checks.allreduce"]),
    ("preflight.checks.gpu", "import preflight.checks.nvme\n", ["line 1: preflight.checks.nvme"]),
    ("preflight.checks.gpu", "from preflight.checks import ds_config\n", ["line 1: preflight.checks.ds_config"]),
    ("preflight.checks.gpu", "from .. import checks\n", ["line 1: preflight.checks (the registry)"]),
    ("preflight.checks.gpu", "from . import ORDER, load\n", ["line 1: preflight.checks (the registry)"]),
    # Allowed: the check's own subpackage, the host-side support, the standard library.
    ("preflight.checks.allreduce.verdict", "from .common import NAME\nfrom .stragglers import find\n", []),
    ("preflight.checks.ds_config.keycheck", "from ...hostside.outcome import Status\nimport difflib\n", []),
    ("preflight.checks.ports", "from ..hostside.netinfo import host_subnets\nimport ipaddress\n", []),
])
def test_the_import_rule_catches_what_it_should(module, source, expected):
    assert sideways_imports(source, module) == expected


def test_subpackage_init_resolves_its_relative_imports_against_itself():
    # allreduce/__init__.py: `from .common import NAME` is its own; `from ..iperf3 import x` is another check.
    assert sideways_imports("from .common import NAME\n", "preflight.checks.allreduce", True) == []
    assert sideways_imports("from ..iperf3 import choose\n", "preflight.checks.allreduce", True) == \
        ["line 1: preflight.checks.iperf3"]


# --- declared reads --------------------------------------------------------------------------------------------

def _evaluate(facts, thresholds):
    return None


def _spec(name: str, reads: tuple) -> seams.CheckSpec:
    return seams.CheckSpec(name, "x", "cluster", True, _evaluate, coordinate=lambda cluster: {}, reads=reads)


def test_every_registered_check_reads_only_earlier_registered_checks():
    for spec in registry.all_specs():  # load() runs check_reads on each
        for read in spec.reads:
            assert registry.ORDER.index(read) < registry.ORDER.index(spec.name), (spec.name, read)
    # The checks that read others' facts say so.
    assert "interfaces" in registry.spec("iperf3").reads and "interfaces" in registry.spec("ports").reads
    assert {"python", "ports", "iperf3"} <= set(registry.spec("allreduce").reads)


def test_a_read_of_an_unknown_or_a_later_check_is_an_error_at_load():
    with pytest.raises(TypeError, match=r"ports: reads 'iperf3', which runs after it in ORDER"):
        registry.check_reads(_spec("ports", ("interfaces", "iperf3")), "ports")
    with pytest.raises(TypeError, match=r"x: reads 'bogus', which is not a registered check"):
        registry.check_reads(_spec("allreduce", ("bogus",)), "x")
    registry.check_reads(_spec("allreduce", ("ports", "iperf3")), "fine")
    with pytest.raises(TypeError, match="reads must be a tuple of check names"):
        seams.validate_spec(_spec("ports", ["interfaces"]), "ports")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reads names the check itself"):
        seams.validate_spec(_spec("ports", ("ports",)), "ports")


def test_load_refuses_a_module_whose_reads_are_wrong(monkeypatch):
    module = SimpleNamespace(__name__="preflight.checks.ports", SPEC=_spec("ports", ("allreduce",)))
    monkeypatch.setattr(registry.importlib, "import_module", lambda name, package=None: module)
    with pytest.raises(TypeError, match="preflight.checks.ports: reads 'allreduce', which runs after it"):
        registry.load("ports")


# --- the coordinator names no check -----------------------------------------------------------------------------

def _html_module() -> Path:
    moved = PACKAGE / "render" / "html.py"
    return moved if moved.is_file() else PACKAGE / "html.py"


COORDINATOR_MODULES = [*sorted((PACKAGE / "cli").glob("*.py")), PACKAGE / "recommend.py", PACKAGE / "config.py",
                       _html_module()]


def named_checks(source: str, module: str, names: List[str]) -> List[str]:
    """Each string constant equal to a check's name, and each import of a check module, as 'line N: what'."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.add((node.lineno, repr(node.value)))
    for line, name in imported_names(source, module):
        if _check_of(name) in names:
            found.add((line, f"import {CHECKS_PACKAGE}.{_check_of(name)}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


@pytest.mark.parametrize("path", COORDINATOR_MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_the_coordinator_names_no_check(path):
    found = named_checks(path.read_text(), _module_of(path), registry.ORDER)
    assert found == [], f"{path.relative_to(PACKAGE.parent)} names checks: {found}"


def test_the_name_rule_catches_what_it_should():
    names = list(registry.ORDER)
    source = ('from preflight.checks import ds_config\n'
              'from preflight.checks.ds_config.parse import usage_error\n'
              'if n == "ds_config" or check in ("interfaces", "iperf3"):\n'
              '    pass\n')
    assert named_checks(source, "preflight.cli", names) == [
        "line 1: import preflight.checks.ds_config", "line 2: import preflight.checks.ds_config",
        "line 3: 'ds_config'", "line 3: 'interfaces'", "line 3: 'iperf3'"]
    fine = ('from preflight import checks as registry\nfrom preflight.checks import ORDER\n'
            'p.add_argument("--nvme-path", "--ssh-port", help="the ssh check and python3")\nx = registry.ORDER\n')
    assert named_checks(fine, "preflight.cli", names) == []


# --- what the CLI does for a check, the check declares -----------------------------------------------------------

def test_an_opt_in_check_runs_when_an_option_it_is_selected_by_is_given(tmp_path):
    from preflight.cli import select_checks
    by = [s.name for s in registry.all_specs() if s.selected_by and not s.default]
    assert by, "no opt-in check declares selected_by"
    every = select_checks(None, "", None)
    assert not set(by) & set(every)
    for spec in registry.all_specs():
        if spec.name in by:
            given = testing.check_options(**{option: str(tmp_path / "x") for option in spec.selected_by})
            assert spec.name in select_checks(None, "", given)
            assert spec.name not in select_checks(None, spec.name, given)  # --skip still wins
            assert select_checks("gpu", "", given) == ["gpu"]  # so does --checks
    assert all(registry.spec(n).scope != "connection" for n in every)  # it runs anyway, first


def test_a_check_turns_options_into_host_params_and_refuses_a_bad_one(tmp_path):
    from preflight.cli import UsageError, merge_params, params_from_options
    good = tmp_path / "ds.json"
    good.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": '
                    '{"device": "nvme", "nvme_path": "/local_nvme"}}}')
    got = params_from_options(seams.CheckOptions(deepspeed_config=str(good)))
    assert [name for name, params in got.items() if params.get("nvme_paths") == ["/local_nvme"]]
    assert all(params == {} for params in params_from_options(seams.CheckOptions()).values())
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,,}')
    with pytest.raises(UsageError, match=r"bad.json:1:\d+: DeepSpeed config does not parse"):
        params_from_options(seams.CheckOptions(deepspeed_config=str(bad)))
    host_params = {"nvme_paths": ["/scratch", "/local_nvme"]}
    merge_params(host_params, {"nvme_paths": ["/local_nvme", "/other"], "required_ops": ["cpu_adam"]})
    assert host_params == {"nvme_paths": ["/scratch", "/local_nvme", "/other"], "required_ops": ["cpu_adam"]}


def test_selected_by_names_check_options_only():
    with pytest.raises(TypeError, match=r"selected_by must be a tuple of CheckOptions fields or its own options' "
                                        r"dests \(deepspeed_config, "):
        seams.validate_spec(seams.CheckSpec("x", "x", "cluster", False, _evaluate, coordinate=lambda c: {},
                                            selected_by=("deepspeed_cfg",)), "x")
    with pytest.raises(TypeError, match="params_from_options must be a function"):
        seams.validate_spec(seams.CheckSpec("x", "x", "cluster", False, _evaluate, coordinate=lambda c: {},
                                            params_from_options="nope"), "x")  # type: ignore[arg-type]
