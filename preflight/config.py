"""Thresholds: the documented defaults (defaults.toml beside this file) merged with the user's --config TOML."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULTS_PATH = Path(__file__).with_name("defaults.toml")


class ConfigError(Exception):
    """A bad --config file; the message names the file and the key."""


def load_defaults() -> Dict[str, Dict[str, Any]]:
    with DEFAULTS_PATH.open("rb") as fh:
        return tomllib.load(fh)


def load_thresholds(path: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """Defaults, overlaid with the user's file. Types must match the defaults'."""
    merged = load_defaults()
    if path is None:
        return merged
    try:
        with open(path, "rb") as fh:
            user = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass an existing TOML file to --config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    result = copy.deepcopy(merged)
    for section, values in user.items():
        if section not in merged or not isinstance(values, dict):
            known = ", ".join(sorted(merged))
            raise ConfigError(f"{path}: unknown section [{section}]; known sections: {known}")
        for key, value in values.items():
            if key not in merged[section]:
                known = ", ".join(sorted(merged[section]))
                raise ConfigError(f"{path}: unknown key {section}.{key}; known keys: {known}")
            default = merged[section][key]
            if isinstance(default, bool) != isinstance(value, bool) or (
                    not isinstance(value, type(default))
                    and not (isinstance(default, float) and isinstance(value, int))):
                raise ConfigError(f"{path}: {section}.{key} = {value!r} must be a {type(default).__name__}"
                                  f" like the default {default!r}")
            result[section][key] = value
    return result
