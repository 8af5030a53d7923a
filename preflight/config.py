"""Thresholds: the documented defaults, assembled from the registry, merged with the user's --config TOML.

The coordinator's own sections are in defaults.toml beside this file; each registered check's ``[name]`` section
is in the TOML file beside the check (``preflight.checks.thresholds_path``). Put together in registry order they
are one TOML page (``preflight config --defaults`` prints it). Comment lines just above a key state its rules,
the one source of them (``load_thresholds`` enforces them on the defaults and on every --config)::

    # range: 0 < x <= 0.5
    max_free_fraction = 0.1
    # range: 0 <= x <= 100000 (each)
    xid_fail = [48, 61]
    # choices: "warn", "fail"
    unusable_status = "fail"
    # at most: test_mib
    min_test_mib = 64
"""
from __future__ import annotations

import copy
import math
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from preflight import checks as registry
from preflight.inputs import MAX_CONFIG_BYTES, InputError, read_text_limited

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - before 3.11
    import tomli as tomllib

# The coordinator's own sections ([checks], [agent]); a section named after a check does not belong here.
DEFAULTS_PATH = Path(__file__).with_name("defaults.toml")

_SECTION = re.compile(r"^\[([A-Za-z0-9_]+)\]\s*$")
_KEY = re.compile(r"^([A-Za-z0-9_]+)\s*=")
_NUM = r"-?[0-9][0-9_]*(?:\.[0-9_]+)?(?:[eE][-+]?[0-9]+)?"
_RANGE = re.compile(rf"^#\s*range:\s*(?:(?P<lo>{_NUM})\s*(?P<lo_op><=|<)\s*)?x(?:\s*(?P<hi_op><=|<)\s*(?P<hi>{_NUM}))?"
                    r"(?P<each>\s*\(each\))?\s*$")
_CHOICES = re.compile(r"^#\s*choices:\s*(?P<list>.+?)(?P<each>\s*\(each\))?\s*$")
_AT_MOST = re.compile(r"^#\s*at most:\s*(?P<key>[A-Za-z0-9_]+)\s*$")
_ANNOTATION = re.compile(r"^#\s*(range|choices|at most):")


class ConfigError(Exception):
    """A bad --config file; the message names the file and the key."""


class DefaultsError(ConfigError):
    """The shipped defaults do not hold together (a check's TOML missing or misplaced, a rule line that does not
    parse, a default that breaks its own rule): a bug in preflight or a broken install. Names the file."""


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


@dataclass(frozen=True)
class Choices:
    """The values a text key may take, from a '# choices: "warn", "fail"' line; ``each``: every element of a list.
    Matched without regard to case (the checks always compared them lowercased); the listed spelling is kept."""

    text: str
    values: Tuple[str, ...]
    each: bool = False

    def match(self, value: Any) -> Optional[str]:
        if not isinstance(value, str):
            return None
        return next((c for c in self.values if c.lower() == value.lower()), None)


@dataclass(frozen=True)
class Rules:
    """What the comment lines above one key say about it."""

    range: Optional[Range] = None
    choices: Optional[Choices] = None
    at_most: Optional[str] = None  # another key of the same section this one must not exceed


@dataclass(frozen=True)
class Defaults:
    """The assembled defaults: ``page`` is the documented TOML (every comment kept), ``values`` what it loads to,
    ``rules`` the rule lines of every key, ``sources`` the file each section comes from."""

    page: str
    values: Dict[str, Dict[str, Any]]
    rules: Dict[Tuple[str, str], Rules]
    sources: Dict[str, Path]


def _parse_rule(kind: str, line: str, where: str) -> Dict[str, Any]:
    if kind == "range":
        r = _RANGE.match(line)
        if not r:
            raise DefaultsError(f"{where}: cannot parse {line!r} (expected e.g. '# range: 0 < x <= 1')")
        return {"range": Range(line.split(":", 1)[1].strip(), float(r["lo"]) if r["lo"] else None, r["lo_op"] == "<",
                               float(r["hi"]) if r["hi"] else None, r["hi_op"] == "<", bool(r["each"]))}
    if kind == "choices":
        c = _CHOICES.match(line)
        try:
            values = tomllib.loads(f"v = [{c['list']}]")["v"] if c else None
        except tomllib.TOMLDecodeError:
            values = None
        if not c or not values or not all(isinstance(v, str) and v for v in values):
            raise DefaultsError(f"{where}: cannot parse {line!r} (expected e.g. '# choices: \"warn\", \"fail\"')")
        return {"choices": Choices(c["list"].strip(), tuple(values), bool(c["each"]))}
    m = _AT_MOST.match(line)
    if not m:
        raise DefaultsError(f"{where}: cannot parse {line!r} (expected e.g. '# at most: temp_fail_c')")
    return {"at_most": m["key"]}


def documented_rules(text: str, where: str = "defaults") -> Dict[Tuple[str, str], Rules]:
    """{(section, key): Rules} from the rule comment lines of a TOML text (each applies to the next key)."""
    out: Dict[Tuple[str, str], Rules] = {}
    section = ""
    pending: Dict[str, Any] = {}  # the rules read since the last key
    for line in text.splitlines():
        line = line.strip()
        m = _SECTION.match(line)
        if m:
            if pending:
                raise DefaultsError(f"{where}: a rule line at the end of [{section}] has no key below it")
            section = m.group(1)
            continue
        a = _ANNOTATION.match(line)
        if a:
            rule = _parse_rule(a.group(1), line, where)
            if set(rule) & set(pending):
                raise DefaultsError(f"{where}: [{section}] has two '# {a.group(1)}:' lines for one key")
            pending.update(rule)
            continue
        k = _KEY.match(line)
        if k:
            if pending:
                out[(section, k.group(1))] = Rules(**pending)
            pending = {}
    if pending:
        raise DefaultsError(f"{where}: a rule line at the end of [{section}] has no key below it")
    return out


def documented_ranges(text: Optional[str] = None) -> Dict[Tuple[str, str], Range]:
    """{(section, key): Range} from the '# range:' lines of a TOML text (default: the assembled defaults)."""
    rules = registry_defaults().rules if text is None else documented_rules(text)
    return {key: r.range for key, r in rules.items() if r.range is not None}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value in an error line: huge integers by their size (their decimal text alone can be megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 18:
        return f"an integer of {value.bit_length()} bits"
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


def check_choice(where: str, value: Any, choices: Choices) -> Any:
    """The value with each text in its listed spelling; ConfigError naming ``where`` and the allowed values if one
    is not among them."""
    if choices.each:
        if not isinstance(value, list):
            raise ConfigError(f"{where} = {_shown(value)}: expected a list, each one of {choices.text}")
        return [check_choice(where, v, Choices(choices.text, choices.values)) for v in value]
    chosen = choices.match(value)
    if chosen is None:
        raise ConfigError(f"{where} = {_shown(value)} is not allowed; expected one of {choices.text}")
    return chosen


def _numeric(default: Any) -> bool:
    if isinstance(default, (list, dict)):
        vals = list(default.values()) if isinstance(default, dict) else default
        return bool(vals) and all(_is_number(v) for v in vals)
    return _is_number(default)


def _apply_rules(where: str, section: str, key: str, value: Any, default: Any, rules: Optional[Rules]) -> Any:
    """The value as the thresholds keep it, or ConfigError naming ``where`` (the file) and section.key."""
    name = f"{where}: {section}.{key}"
    if _numeric(default) or (rules is not None and rules.range is not None):
        check_number(name, value, rules.range if rules else None)
    if rules is not None and rules.choices is not None:
        return check_choice(name, value, rules.choices)
    return value


def _check_order(where: str, values: Dict[str, Dict[str, Any]], rules: Dict[Tuple[str, str], Rules]) -> None:
    for (section, low), rule in rules.items():
        if rule.at_most is None:
            continue
        high = rule.at_most
        a, b = values.get(section, {}).get(low), values.get(section, {}).get(high)
        if _is_number(a) and _is_number(b) and float(a) > float(b):  # type: ignore[arg-type]
            raise ConfigError(f"{where}: {section}.{low} = {_shown(a)} must not exceed {section}.{high} = {_shown(b)}")


def _read_toml(path: Path, what: str) -> Tuple[str, Dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DefaultsError(f"{path}: missing; {what}") from None
    except OSError as exc:
        raise DefaultsError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DefaultsError(f"{path}: not valid TOML: {exc}") from None


def assemble(names: Sequence[str], locate: Callable[[str], Path], coordinator: Path = DEFAULTS_PATH) -> Defaults:
    """The defaults page: the coordinator's sections, then each check's TOML in ``names`` order.

    Every registered check has its TOML (a check without thresholds has one with its bare ``[name]`` line): a
    file left out of an install is then an error at start, not a check that fails on its first lookup. Each
    section belongs to a check (its own file) or to the coordinator (defaults.toml, and no check's name).
    """
    text, own = _read_toml(coordinator, "preflight's own sections ([checks], [agent]) live there")
    misplaced = [s for s in own if s in names]
    if misplaced:
        raise DefaultsError(f"{coordinator}: [{misplaced[0]}] belongs to the check {misplaced[0]!r}; move it to "
                            f"{locate(misplaced[0])}, beside the check")
    pieces: List[str] = [text]
    sources = {section: coordinator for section in own}
    rules = documented_rules(text, str(coordinator))
    for name in names:
        path = locate(name)
        text, values = _read_toml(path, f"the check {name!r} keeps its [{name}] thresholds there (a check without "
                                        f"thresholds has the bare [{name}] line)")
        if list(values) != [name] or not isinstance(values[name], dict):
            held = ", ".join(f"[{section}]" for section in values) or "no section"
            raise DefaultsError(f"{path}: holds {held}; a check's TOML holds its own [{name}] section only")
        pieces.append(text)
        sources[name] = path
        rules.update(documented_rules(text, str(path)))
    page = "\n".join(p.rstrip("\n") + "\n" for p in pieces)
    try:
        merged = tomllib.loads(page)
    except tomllib.TOMLDecodeError as exc:  # pragma: no cover - each piece parsed on its own above
        raise DefaultsError(f"the assembled defaults are not valid TOML: {exc}") from None
    for (section, key), rule in rules.items():
        where = str(sources[section])
        if rule.at_most is not None and not _is_number(merged[section].get(rule.at_most)):
            raise DefaultsError(f"{where}: '# at most: {rule.at_most}' above {section}.{key} names no number of "
                                f"[{section}]")
        try:
            _apply_rules(where, section, key, merged[section][key], merged[section][key], rule)
        except ConfigError as exc:
            raise DefaultsError(f"{exc} (the default breaks its own rule line)") from None
    try:
        _check_order("the defaults", merged, rules)
    except ConfigError as exc:
        raise DefaultsError(str(exc)) from None
    return Defaults(page, merged, rules, sources)


@lru_cache(maxsize=1)
def registry_defaults() -> Defaults:
    """The defaults of preflight's registered checks (read once per process)."""
    return assemble(registry.ORDER, registry.thresholds_path)


def load_defaults() -> Dict[str, Dict[str, Any]]:
    return copy.deepcopy(registry_defaults().values)


def default_page() -> str:
    """The assembled defaults as one documented TOML page, every comment kept; it loads back as a --config."""
    return registry_defaults().page


def _read_user(path: str) -> Dict[str, Any]:
    try:
        return tomllib.loads(read_text_limited(path, "--config", MAX_CONFIG_BYTES))
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


def load_thresholds(path: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """Defaults, overlaid with the user's file. Types must match the defaults'; every value must keep the rules of
    its key's comment lines (range, choices, at most)."""
    defaults = registry_defaults()
    result = copy.deepcopy(defaults.values)
    if path is None:
        return result
    user = _read_user(path)
    for section, values in user.items():
        if section not in result or not isinstance(values, dict):
            known = ", ".join(sorted(result))
            raise ConfigError(f"{path}: unknown section [{section}]; known sections: {known}")
        for key, value in values.items():
            override(result, section, key, value, path)
    _check_order(path, result, defaults.rules)
    return result


def override(result: Dict[str, Dict[str, Any]], section: str, key: str, value: Any, where: str) -> None:
    """Set section.key of loaded thresholds to value, held to what a --config value is held to (the default's
    type, the key's rule lines); ConfigError naming ``where`` (the file, ``--set ...``, ``--min-busbw``) if not.
    The order rules (``# at most:``) are checked once every value is in: ``check_order``."""
    defaults = registry_defaults()
    if section not in defaults.values:
        raise ConfigError(f"{where}: unknown section [{section}]; known sections: {', '.join(sorted(result))}")
    if key not in defaults.values[section]:
        known = ", ".join(sorted(defaults.values[section]))
        raise ConfigError(f"{where}: unknown key {section}.{key}; known keys: {known}")
    default = defaults.values[section][key]
    if isinstance(default, bool) != isinstance(value, bool) or (
            not isinstance(value, type(default))
            and not (isinstance(default, float) and isinstance(value, int))):
        raise ConfigError(f"{where}: {section}.{key} = {_shown(value)} must be a {type(default).__name__}"
                          f" like the default {default!r}")
    result[section][key] = _apply_rules(where, section, key, value, default, defaults.rules.get((section, key)))


def check_order(where: str, result: Dict[str, Dict[str, Any]]) -> None:
    """The ``# at most:`` rules of loaded thresholds, after overrides; ConfigError naming ``where``."""
    _check_order(where, result, registry_defaults().rules)
