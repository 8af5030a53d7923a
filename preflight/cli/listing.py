"""``preflight list``: every check, one line each: ``gpu  [per host]  GPUs visible, ...``."""
from __future__ import annotations

from typing import TextIO

from preflight import checks as registry
from preflight.cli.parser import EXIT_OK, drop_stdout


def cmd_list(out: TextIO) -> int:
    width = max(len(n) for n in registry.ORDER)
    lines = []
    for name in registry.ORDER:
        module = registry.load(name)
        scope = {"host": "per host", "cluster": "cluster", "connection": "per host"}[module.SPEC.scope]
        default = "" if module.SPEC.default else "  (opt-in)"
        lines.append(f"{name:<{width}}  [{scope}]  {module.SPEC.description}{default}\n")
    try:
        out.write("".join(lines))
        out.flush()
    except BrokenPipeError:  # `preflight list | head -1`: the reader has what it wanted
        drop_stdout()
    return EXIT_OK
