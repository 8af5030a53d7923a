"""Thresholds config: defaults load, user overrides merge, mistakes are named."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preflight import checks as registry
from preflight import config
from preflight.config import ConfigError, DefaultsError, load_defaults, load_thresholds

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_document_every_key_with_a_comment():
    lines = config.default_page().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.lstrip().startswith("#") and not line.startswith("["):
            # Each key is preceded (directly or through its comment block) by a comment line.
            j = i - 1
            while j >= 0 and "=" in lines[j] and not lines[j].lstrip().startswith("#"):
                j -= 1
            assert j >= 0 and lines[j].lstrip().startswith("#"), f"undocumented threshold: {line}"


def test_user_config_overrides_one_key(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text("[ssh]\nwarn_rtt_ms = 50\n")
    merged = load_thresholds(str(cfg))
    assert merged["ssh"]["warn_rtt_ms"] == 50
    assert merged["python"] == load_defaults()["python"]


@pytest.mark.parametrize("text, words", [
    ("[shh]\nwarn_rtt_ms = 5\n", "unknown section [shh]"),
    ("[ssh]\nwarn_rtt = 5\n", "unknown key ssh.warn_rtt"),
    ("[ssh]\nwarn_rtt_ms = 'fast'\n", "must be a float"),
    ("[ssh\n", "not valid TOML"),
])
def test_bad_config_names_file_and_key(tmp_path, text, words):
    cfg = tmp_path / "t.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_thresholds(str(cfg))
    assert str(cfg) in str(err.value) and words in str(err.value)


def test_every_numeric_key_documents_a_range_that_its_default_satisfies():
    from preflight.config import _numeric, check_number, documented_ranges, load_defaults
    defaults, ranges = load_defaults(), documented_ranges()
    missing = [f"{s}.{k}" for s in defaults for k, v in defaults[s].items() if _numeric(v) and (s, k) not in ranges]
    assert missing == []
    for (section, key), rng in ranges.items():
        check_number(f"{section}.{key}", defaults[section][key], rng)  # raises if a default breaks its own range


@pytest.mark.parametrize("body, words", [
    ("[iperf3]\nextra_rounds = 1000000000000\n", "iperf3.extra_rounds = 1000000000000 is out of range"),
    ("[nvme]\nmax_free_fraction = 5.0\n", "nvme.max_free_fraction = 5.0 is out of range; expected 0 < x <= 0.5"),
    ("[ports]\nmax_probe_s = -inf\n", "ports.max_probe_s = -inf: expected a finite number"),
    ("[allreduce]\nsingle_node_busbw = { \"H100\" = nan }\n", "allreduce.single_node_busbw = nan"),
    ("[allreduce]\nmin_bytes = 2048\nmax_bytes = 1024\n", "must not exceed allreduce.max_bytes"),
])
def test_out_of_range_numbers_name_the_key(tmp_path, body, words):
    from preflight.config import ConfigError, load_thresholds
    path = tmp_path / "c.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as exc:
        load_thresholds(str(path))
    assert words in str(exc.value)


def test_range_parser_reads_strict_and_open_bounds():
    from preflight.config import documented_ranges
    r = documented_ranges("[a]\n# range: 0 < x <= 1\nk = 0.5\n# range: x <= 3\nj = 1\n# range: 2 <= x (each)\nl = [2]\n")
    assert r[("a", "k")].holds(1) and not r[("a", "k")].holds(0) and not r[("a", "k")].holds(1.01)
    assert r[("a", "j")].holds(-5) and not r[("a", "j")].holds(4)
    assert r[("a", "l")].each and r[("a", "l")].holds(2) and not r[("a", "l")].holds(1)


# --- the assembled defaults: the coordinator's sections, then each check's TOML beside it ---------------------

def test_the_defaults_are_the_coordinators_sections_then_each_checks_file_in_registry_order():
    d = config.registry_defaults()
    assert list(d.values) == ["checks", "agent", "history"] + registry.ORDER  # [history]: issue 25
    assert {s for s, p in d.sources.items() if p == config.DEFAULTS_PATH} == {"checks", "agent", "history"}
    for name in registry.ORDER:
        assert d.sources[name] == registry.thresholds_path(name)
    for path in set(d.sources.values()):  # every file whole, every comment kept, in the page
        assert path.read_text().rstrip("\n") in d.page, path


def _rules(kind):
    return sorted(key for key, r in config.registry_defaults().rules.items() if getattr(r, kind) is not None)


def test_every_status_key_lists_its_choices_and_its_default_is_one():
    rules = config.registry_defaults().rules
    statuses = [(s, k) for s, v in load_defaults().items() for k, x in v.items() if k.endswith("_status")]
    assert len(statuses) >= 3
    for key in statuses:
        choices = rules[key].choices
        assert choices is not None and set(choices.values) == {"warn", "fail"}, key
        assert load_defaults()[key[0]][key[1]] in choices.values


@pytest.mark.parametrize("section, key", _rules("choices"))
def test_a_value_outside_the_choices_names_the_file_the_key_and_the_allowed_values(tmp_path, section, key):
    choices = config.registry_defaults().rules[(section, key)].choices
    cfg = tmp_path / "t.toml"
    value = '["wran"]' if choices.each else '"wran"'
    cfg.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as err:
        load_thresholds(str(cfg))
    line = str(err.value)
    assert str(cfg) in line and f"{section}.{key}" in line and "'wran'" in line and choices.text in line
    assert "\n" not in line


def test_choices_match_any_case_and_keep_the_listed_spelling(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[libaio]\nunusable_status = "WARN"\n[versions]\nignore = ["Torch", "nccl"]\n')
    merged = load_thresholds(str(cfg))
    assert merged["libaio"]["unusable_status"] == "warn" and merged["versions"]["ignore"] == ["torch", "nccl"]
    cfg.write_text('[versions]\nignore = ["torch", 3]\n')
    with pytest.raises(ConfigError, match=r"versions.ignore = 3 is not allowed; expected one of \"torch\""):
        load_thresholds(str(cfg))
    cfg.write_text('[driver_cuda]\nminor_compat_status = "fial"\n')
    with pytest.raises(ConfigError, match=r"driver_cuda.minor_compat_status = 'fial' is not allowed; "
                                          r"expected one of \"warn\", \"fail\"$"):
        load_thresholds(str(cfg))


@pytest.mark.parametrize("section, low", _rules("at_most"))
def test_every_at_most_rule_is_enforced(tmp_path, section, low):
    high = config.registry_defaults().rules[(section, low)].at_most
    defaults = load_defaults()[section]
    assert defaults[low] < defaults[high]  # so that swapping them breaks the rule and keeps both in range
    cfg = tmp_path / "t.toml"
    cfg.write_text(f"[{section}]\n{low} = {defaults[high]!r}\n{high} = {defaults[low]!r}\n")
    with pytest.raises(ConfigError, match=rf"{section}\.{low} = .* must not exceed {section}\.{high} = "):
        load_thresholds(str(cfg))
    cfg.write_text(f"[{section}]\n{low} = {defaults[high]!r}\n")  # equal is allowed
    assert load_thresholds(str(cfg))[section][low] == defaults[high]


def test_config_py_has_no_check_specific_rule():
    source = Path(config.__file__).read_text()
    assert [n for n in registry.ORDER if re.search(rf"\b{n}\b", source, re.I)] == []


@pytest.mark.parametrize("own, files, words", [
    ("[own]\nx = 1\n", {}, "a.toml: missing; the check 'a' keeps its [a] thresholds there"),
    ("[own]\nx = 1\n", {"a": "[b]\nx = 1\n"}, "a.toml: holds [b]; a check's TOML holds its own [a] section only"),
    ("[own]\nx = 1\n", {"a": "# nothing\n"}, "a.toml: holds no section"),
    ("[a]\nx = 1\n", {"a": "[a]\n"}, "d.toml: [a] belongs to the check 'a'; move it to"),
    ("[own]\n", {"a": '[a]\n# choices: warn, fail\nk = "warn"\n'}, "cannot parse '# choices: warn, fail'"),
    ("[own]\n", {"a": "[a]\n# range: x in 0..1\nk = 1\n"}, "cannot parse '# range: x in 0..1'"),
    ("[own]\n", {"a": "[a]\n# at most: nope\nk = 1\n"}, "'# at most: nope' above a.k names no number of [a]"),
    ("[own]\n", {"a": "[a]\n# at most: j\nk = 2\nj = 1\n"}, "a.k = 2 must not exceed a.j = 1"),
    ("[own]\n", {"a": '[a]\n# choices: "warn"\nk = "fail"\n'}, "a.k = 'fail' is not allowed; expected one of "
                                                              '"warn" (the default breaks its own rule line)'),
    ("[own]\n", {"a": "[a]\nk = 1\n# range: 0 < x\n"}, "a.toml: a rule line at the end of [a] has no key below it"),
    ("[own]\n", {"a": "[a]\n# range: 0 < x\n# range: 1 < x\nk = 2\n"}, "[a] has two '# range:' lines for one key"),
])
def test_defaults_that_do_not_hold_together_are_named(tmp_path, own, files, words):
    (tmp_path / "d.toml").write_text(own)
    for name, text in files.items():
        (tmp_path / f"{name}.toml").write_text(text)
    with pytest.raises(DefaultsError) as err:
        config.assemble(["a"], lambda n: tmp_path / f"{n}.toml", tmp_path / "d.toml")
    assert words in str(err.value)


def test_a_check_without_thresholds_has_its_bare_section(tmp_path):
    (tmp_path / "d.toml").write_text("[own]\nx = 1\n")
    (tmp_path / "a.toml").write_text("[a]\n# this check has no thresholds\n")
    (tmp_path / "b.toml").write_text("[b]\n# choices: \"on\", \"off\"\nmode = \"on\"\n")
    d = config.assemble(["a", "b"], lambda n: tmp_path / f"{n}.toml", tmp_path / "d.toml")
    assert d.values == {"own": {"x": 1}, "a": {}, "b": {"mode": "on"}}
    assert d.page == ('[own]\nx = 1\n\n[a]\n# this check has no thresholds\n\n'
                      '[b]\n# choices: "on", "off"\nmode = "on"\n')


# --- the CLI: the page prints, loads back, and a typo stops the run before any host --------------------------

def _preflight(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "preflight", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, **kw)


def test_the_printed_defaults_load_back_as_a_config(tmp_path):
    printed = _preflight("config", "--defaults")
    assert printed.returncode == 0 and printed.stderr == "", printed.stderr
    assert printed.stdout == config.default_page()
    assert "# range: 0 < x <= 0.5\nmax_free_fraction = 0.1" in printed.stdout  # the comments are the documentation
    assert '# choices: "warn", "fail"\nno_compiler_status = "warn"' in printed.stdout
    assert _preflight("list", "--thresholds").stdout == printed.stdout
    page = tmp_path / "thresholds.toml"
    page.write_text(printed.stdout)
    assert load_thresholds(str(page)) == load_defaults()
    check = _preflight("node-check", "--checks", "python", "--python", sys.executable, "--config", str(page))
    assert check.returncode == 0 and "Traceback" not in check.stderr, check.stdout + check.stderr
    run = _preflight("run", "--checks", "python", "--python", sys.executable, "--config", str(page), "-q")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stdout + run.stderr


def test_config_without_what_to_print_is_a_usage_error():
    r = _preflight("config")
    assert r.returncode == 2 and "--defaults" in r.stderr and "Traceback" not in r.stderr


def test_a_status_typo_in_a_config_is_exit_2_naming_key_and_values_before_any_host(tmp_path):
    from tests.cli.test_bad_input import Listener, run
    cfg = tmp_path / "site.toml"
    cfg.write_text('[libaio]\nunusable_status = "wran"\n')
    listener = Listener()
    try:
        proc = run(tmp_path, listener, ["--config", str(cfg)])
        assert listener.accepts == 0, "a host was contacted"
    finally:
        listener.close()
    want = f'{cfg}: libaio.unusable_status = \'wran\' is not allowed; expected one of "fail", "warn"'
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"preflight: error: {want}"], proc.stderr
    node = _preflight("node-check", "--config", str(cfg), "--python", sys.executable)
    assert node.returncode == 2 and node.stderr.splitlines() == [f"preflight: error: {want}"], node.stderr
