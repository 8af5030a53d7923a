"""Thresholds config: defaults load, user overrides merge, mistakes are named."""
import pytest

from preflight.config import ConfigError, load_defaults, load_thresholds


def test_defaults_document_every_key_with_a_comment():
    from preflight.config import DEFAULTS_PATH
    lines = DEFAULTS_PATH.read_text().splitlines()
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
