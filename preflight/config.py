"""Thresholds: the documented defaults (defaults.toml beside this file) merged with the user's --config TOML.

Every numeric key of defaults.toml carries its allowed range on a comment line just above it, the one source of
those ranges (``load_thresholds`` enforces them, the tests check that every numeric key has one)::

    # range: 0 < x <= 0.5
    max_free_fraction = 0.1
    # range: 0 <= x <= 100000 (each)
    xid_fail = [48, 61]
"""
from __future__ import annotations

import copy
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from preflight.inputs import MAX_CONFIG_BYTES, InputError, read_text_limited

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULTS_PATH = Path(__file__).with_name("defaults.toml")

_SECTION = re.compile(r"^\[([A-Za-z0-9_]+)\]\s*$")
_KEY = re.compile(r"^([A-Za-z0-9_]+)\s*=")
_NUM = r"-?[0-9][0-9_]*(?:\.[0-9_]+)?(?:[eE][-+]?[0-9]+)?"
_RANGE = re.compile(r"^#\s*range:\s*(?:(?P<lo>%s)\s*(?P<lo_op><=|<)\s*)?x(?:\s*(?P<hi_op><=|<)\s*(?P<hi>%s))?"
                    r"(?P<each>\s*\(each\))?\s*$" % (_NUM, _NUM))


# Keys whose values must be ordered: (section, smaller, larger); a FAIL threshold beyond its WARN one is a typo.
ORDERED = [("iperf3", "straggler_fail_fraction", "straggler_warn_fraction"), ("gpu", "temp_warn_c", "temp_fail_c"),
           ("allreduce", "min_bytes", "max_bytes"), ("ds_config", "gpu_mem_warn_fraction", "gpu_mem_fail_fraction"),
           ("nvme", "min_test_mib", "test_mib")]


class ConfigError(Exception):
    """A bad --config file; the message names the file and the key."""


@dataclass(frozen=True)
class Range:
    """lo (<|<=) x (<|<=) hi, from a '# range:' line; ``each``: applies to every element of a list or table."""

    text: str
    lo: Optional[float] = None
    lo_strict: bool = False
    hi: Optional[float] = None
    hi_strict: bool = False
    each: bool = False

    def holds(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_strict else x < self.lo):
            return False
        return not (self.hi is not None and (x >= self.hi if self.hi_strict else x > self.hi))


def load_defaults() -> Dict[str, Dict[str, Any]]:
    with DEFAULTS_PATH.open("rb") as fh:
        return tomllib.load(fh)


def documented_ranges(text: Optional[str] = None) -> Dict[Tuple[str, str], Range]:
    """{(section, key): Range} from the '# range:' comment lines of defaults.toml."""
    text = DEFAULTS_PATH.read_text() if text is None else text
    out: Dict[Tuple[str, str], Range] = {}
    section, pending = "", None
    for line in text.splitlines():
        line = line.strip()
        m = _SECTION.match(line)
        if m:
            section, pending = m.group(1), None
            continue
        if line.startswith("# range:"):
            r = _RANGE.match(line)
            if not r:
                raise ValueError("defaults.toml: cannot parse %r" % line)
            pending = Range(line.split(":", 1)[1].strip(),
                            float(r["lo"]) if r["lo"] else None, r["lo_op"] == "<",
                            float(r["hi"]) if r["hi"] else None, r["hi_op"] == "<", bool(r["each"]))
            continue
        k = _KEY.match(line)
        if k:
            if pending is not None:
                out[(section, k.group(1))] = pending
            pending = None
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value in an error line: huge integers by their size (their decimal text alone can be megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 18:
        return "an integer of %d bits" % value.bit_length()
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def check_number(where: str, value: Any, rng: Optional[Range]) -> None:
    """Raise ConfigError naming ``where`` unless value is a finite number inside rng (every element with each)."""
    values = (list(value.values()) if isinstance(value, dict) else list(value)) \
        if isinstance(value, (list, dict)) else [value]
    for v in values:
        if not _is_number(v):
            raise ConfigError(f"{where} = {_shown(v)}: expected a number")
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{where} = {_shown(v)}: expected a finite number")
        if rng is not None and not rng.holds(v):
            raise ConfigError(f"{where} = {_shown(v)} is out of range; expected {rng.text}")


def _numeric(default: Any) -> bool:
    if isinstance(default, (list, dict)):
        vals = list(default.values()) if isinstance(default, dict) else default
        return bool(vals) and all(_is_number(v) for v in vals)
    return _is_number(default)


def load_thresholds(path: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """Defaults, overlaid with the user's file. Types must match the defaults'; numbers must lie in their range."""
    merged = load_defaults()
    if path is None:
        return merged
    try:
        user = tomllib.loads(read_text_limited(path, "--config", MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; pass an existing TOML file to --config") from None
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; --config takes a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits (int-to-str conversion limit)
        why = "an integer of more than 4300 digits" if "digits" in str(exc) else str(exc)
        raise ConfigError(f"{path}: not usable TOML: {why}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    ranges = documented_ranges()
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
                raise ConfigError(f"{path}: {section}.{key} = {_shown(value)} must be a {type(default).__name__}"
                                  f" like the default {default!r}")
            if _numeric(default) or (isinstance(default, (list, dict)) and (section, key) in ranges):
                check_number(f"{path}: {section}.{key}", value, ranges.get((section, key)))
            result[section][key] = value
    for section, low, high in ORDERED:
        a, b = result.get(section, {}).get(low), result.get(section, {}).get(high)
        if _is_number(a) and _is_number(b) and float(a) > float(b):  # type: ignore[arg-type]
            raise ConfigError(f"{path}: {section}.{low} = {_shown(a)} must not exceed {section}.{high} = {_shown(b)}")
    return result
