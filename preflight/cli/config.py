"""``preflight config --defaults`` (and ``preflight list --thresholds``): the thresholds' defaults as one TOML page."""
from __future__ import annotations

from typing import TextIO

from preflight.cli.parser import EXIT_OK, EXIT_USAGE, drop_stdout
from preflight.config import ConfigError, default_page


def cmd_config_defaults(out: TextIO, err: TextIO) -> int:
    """``preflight config --defaults``: the documented defaults page on stdout; it loads back as a --config."""
    try:
        page = default_page()
    except ConfigError as exc:  # a check's TOML missing from the install, or one that breaks its own rules
        print(f"preflight: error: {exc}", file=err)
        return EXIT_USAGE
    try:
        out.write(page)
        out.flush()
    except BrokenPipeError:  # `preflight config --defaults | head`
        drop_stdout()
    return EXIT_OK
