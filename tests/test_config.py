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
