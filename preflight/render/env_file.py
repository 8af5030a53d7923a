"""The recommended environment as DeepSpeed's ``.deepspeed_env`` (``--env-file FILE``): KEY=VALUE lines, since
its launcher reads every line as one (deepspeed/launcher/runner.py:604-611)::

    NCCL_DEBUG=WARN
    NCCL_SOCKET_IFNAME==eth1

An existing file is merged (``merge``), not overwritten: the user's other lines stay where they are, a variable
preflight sets replaces that variable's line in place, new ones are added at the end, and what changed is said::

    WANDB_PROJECT=llm                 kept
    NCCL_SOCKET_IFNAME=eth0     ->    NCCL_SOCKET_IFNAME==eth1   (replaced, line 2)
                                      NCCL_DEBUG=WARN            (added)
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, TextIO, Tuple

from preflight.recommend import env_file_text, safe_env
from preflight.render import Settings
from preflight.results import Report

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SHOWN = 80  # characters of a kept line quoted in what changed


def to_env_file(report: Report) -> str:
    return env_file_text(report.env)


def write(report: Report, out: TextIO, settings: Settings) -> None:
    out.write(to_env_file(report))


def merge(report: Report, old: Optional[str]) -> Tuple[str, List[str]]:
    """(the file's new text, what changed) for the report's recommended environment."""
    return merge_text(old, safe_env(report.env))


def merge_text(old: Optional[str], env: Dict[str, str]) -> Tuple[str, List[str]]:
    """Merge ``env`` (already through recommend.safe_env) into a .deepspeed_env's text (None: no file yet).

    A line of a variable in ``env`` is replaced in place; a later line of the same variable is dropped, as
    DeepSpeed reads the lines in order and the last one wins (runner.py:604-611, add_export). Empty lines are
    dropped: the launcher raises ValueError on a line without '=' (runner.py:610, ``key, val = var.split('=', 1)``).
    Every other line is kept as it is, a comment too, and said to break the job's start when it does: a line without
    '=' raises that ValueError, and one whose name is not a variable name ends up in the remote shell's
    ``export NAME=VALUE;`` (multinode_runner.py:103-105), where a '#' comments out the rest of the command."""
    if old is None:
        text = env_file_text(env)
        return text, ([f"wrote {len(env)} variable{'s' if len(env) != 1 else ''}: {', '.join(env)}"] if env else [])
    out: List[str] = []
    said: List[str] = []
    done: Dict[str, str] = {}
    kept = dropped_empty = 0
    for n, line in enumerate(old.splitlines(), 1):
        key, sep, value = line.partition("=")
        name = key.strip()
        if sep and name in env:
            new = f"{name}={env[name]}"
            if name in done:
                said.append(f"removed line {n} ({_show(line)}): a second {name}, which would win over line "
                            f"{done[name]}")
                continue
            done[name] = str(n)
            if value.strip() != env[name]:
                said.append(f"replaced {_show(line)} with {new} (line {n})")
            out.append(new)
            continue
        if not line.strip():
            dropped_empty += 1
            continue
        out.append(line)
        kept += 1
        if not sep:
            said.append(f"kept line {n} ({_show(line)}), but DeepSpeed's launcher cannot read it: a line without '=' "
                        "raises ValueError before any rank starts (runner.py:610); remove it")
        elif not _NAME.fullmatch(name):
            said.append(f"kept line {n} ({_show(line)}), but {name!r} is not a variable name: the launcher runs "
                        f"`export {name}=...;` in the remote shell, which breaks the command every host runs "
                        f"{'(the # comments out the rest of it: no rank starts)' if name.startswith('#') else ''}; "
                        "remove it".replace(" ;", ";"))
    for name, value in env.items():
        if name not in done:
            out.append(f"{name}={value}")
            said.append(f"added {name}={value}")
    if dropped_empty:
        said.append(f"dropped {dropped_empty} empty line{'s' if dropped_empty != 1 else ''} (the launcher raises "
                    "ValueError on one, runner.py:610)")
    if kept:
        said.append(f"kept {kept} other line{'s' if kept != 1 else ''} of yours")
    return "".join(f"{line}\n" for line in out), said


def _show(line: str) -> str:
    text = line.strip()
    return repr(text[:SHOWN] + ("..." if len(text) > SHOWN else ""))
