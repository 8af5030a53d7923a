"""The check registry and its seams: every check satisfies the CheckModule Protocol, keeps its thresholds in the
TOML beside it and reads them through one accessor, and checks/ never imports the coordinator."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from preflight import checks
from preflight.checks import libaio
from preflight.hostside import outcome as oc
from preflight.hostside import seams
from preflight.config import DEFAULTS_PATH, load_defaults, registry_defaults, tomllib

CHECKS_DIR = Path(checks.__file__).resolve().parent


def test_every_registered_check_satisfies_the_protocol_and_has_a_defaults_section():
    defaults = load_defaults()
    for module in checks.all_checks():
        assert module.SPEC.scope in seams.SCOPES and module.SPEC.name == module.NAME
        assert module.NAME in defaults, f"[{module.NAME}] missing from the assembled defaults"
        doc = module.__doc__ or ""
        assert f"[{module.NAME}]" in doc, f"{module.__name__}'s docstring must name its [{module.NAME}] section"


def test_each_check_keeps_its_thresholds_toml_beside_it():
    """nvme.py has nvme.toml beside it; a subpackage (allreduce/) has thresholds.toml inside; nothing else."""
    for module in checks.all_checks():
        source = Path(module.__file__)
        beside = source.parent / "thresholds.toml" if source.name == "__init__.py" else source.with_suffix(".toml")
        assert checks.thresholds_path(module.NAME) == beside and beside.is_file(), beside
        assert list(tomllib.loads(beside.read_text())) == [module.NAME], f"{beside} holds [{module.NAME}] only"
        assert registry_defaults().sources[module.NAME] == beside
    owned = {checks.thresholds_path(n) for n in checks.ORDER}
    assert sorted(p for p in CHECKS_DIR.rglob("*.toml") if p not in owned) == []  # no orphan left behind
    coordinator = tomllib.loads(DEFAULTS_PATH.read_text())
    assert sorted(coordinator) == ["agent", "checks", "history"] and not set(coordinator) & set(checks.ORDER)


def test_the_versions_choices_are_the_fields_it_compares():
    from preflight.checks import versions
    choices = registry_defaults().rules[("versions", "ignore")].choices
    assert choices is not None and choices.each and list(choices.values) == list(versions.FIELDS)


def test_registry_rejects_a_spec_that_breaks_the_rules_with_a_clear_error():
    def evaluate(facts, thresholds):
        return None

    with pytest.raises(TypeError, match=r"broken: scope 'cluster' needs a coordinate function"):
        seams.validate_spec(seams.CheckSpec("broken", "x", "cluster", True, evaluate), "broken")
    with pytest.raises(TypeError, match="scope 'everywhere' is not one of host, cluster, connection"):
        seams.validate_spec(seams.CheckSpec("broken", "x", "everywhere", True, evaluate), "broken")
    with pytest.raises(TypeError, match="quiet applies to scope 'cluster' only"):
        seams.validate_spec(seams.CheckSpec("broken", "x", "host", True, evaluate, collect=dict, quiet=True), "b")
    with pytest.raises(TypeError, match="SPEC must be a CheckSpec, not dict"):
        seams.validate_spec({"name": "broken"}, "broken")


def test_limits_names_a_missing_section():
    with pytest.raises(oc.ThresholdsError, match=r"no \[nvme\] section"):
        oc.limits({"gpu": {}}, "nvme")
    assert oc.limits({"nvme": {"a": 1}}, "nvme") == {"a": 1}


def test_checks_never_import_the_coordinator():
    offenders = []
    for path in CHECKS_DIR.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"^\s*(from|import)\s+(checks\b|preflight(?!\.checks\b))", line):
                offenders.append(f"{path.relative_to(CHECKS_DIR)}:{i}: {line.strip()}")
    assert offenders == []


def test_no_threshold_copies_inside_checks():
    """The TOML beside each check is the single source: no FALLBACK/_DEFAULTS/DEFAULTS dicts of thresholds, and no
    DEFAULT_* constants (nvme's host-side copies) or private wrappers of ``limits`` in check modules."""
    copies = [f"{p.name}: {m.group(0)}" for p in CHECKS_DIR.rglob("*.py")
              for m in re.finditer(r"^(FALLBACK|_DEFAULTS|DEFAULTS)\s*[:=]", p.read_text(), re.M)]
    assert copies == []
    # DEFAULT_* constants are facts of the host (the kernel's own default), never a threshold's second copy.
    host_facts = {"DEFAULT_EPHEMERAL"}
    constants = [f"{p.name}: {m.group(1)}" for p in CHECKS_DIR.rglob("*.py")
                 for m in re.finditer(r"^(DEFAULT_\w+)\s*[:=]", p.read_text(), re.M) if m.group(1) not in host_facts]
    assert constants == []
    # limits(thresholds, NAME)["key"] at the point of use: no per-module wrapper (gpu/ds_report/driver_cuda had one).
    wrappers = [f"{p.name}: {m.group(0).strip()}" for p in CHECKS_DIR.rglob("*.py")
                for m in re.finditer(r"^\s*return limits\([^)]*\)\[\w+\]\s*$", p.read_text(), re.M)]
    assert wrappers == []


def test_libaio_severities_come_from_its_section(thresholds):
    facts = {"runtime": [], "dev_links": [], "headers": [], "compiler": {"argv": ["cc"], "path": "/usr/bin/cc"},
             "search_dirs": ["/usr/lib"], "os_release": {"ID": "debian"}}
    assert libaio.evaluate(facts, thresholds).status == oc.Status.FAIL
    relaxed = dict(thresholds, libaio=dict(thresholds["libaio"], unusable_status="warn"))
    outcome = libaio.evaluate(facts, relaxed)
    assert outcome.status == oc.Status.WARN and "libaio is not installed" in outcome.message
    no_cc = dict(facts, compiler={"tried": ["cc", "gcc"]})
    strict = dict(thresholds, libaio=dict(thresholds["libaio"], unusable_status="warn", no_compiler_status="fail"))
    assert libaio.evaluate(no_cc, strict).status == oc.Status.FAIL


def test_the_coordinator_cluster_and_the_test_fake_both_satisfy_cluster_view(thresholds):
    from preflight.hostfile import HostSpec
    from preflight.remote import Agent
    from preflight.runner import Cluster, Node, Progress, RunOptions
    from preflight.transport import LocalTransport
    from preflight.testing import FakeCluster
    assert isinstance(FakeCluster(3, thresholds=thresholds), seams.ClusterView)
    node = Node(HostSpec("localhost", 1), LocalTransport("localhost"), Agent(LocalTransport("localhost")))
    real = Cluster([node], RunOptions(hosts=[node.spec], checks=[], thresholds=thresholds), {}, Progress())
    assert isinstance(real, seams.ClusterView)
    assert not isinstance(object(), seams.ClusterView)
