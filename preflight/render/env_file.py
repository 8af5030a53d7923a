"""The recommended environment as DeepSpeed's ``.deepspeed_env`` (``--env-file FILE``): KEY=VALUE lines and
nothing else, since a blank line crashes its launcher::

    NCCL_DEBUG=WARN
    NCCL_SOCKET_IFNAME==eth1
"""
from __future__ import annotations

from typing import TextIO

from preflight.recommend import env_file_text
from preflight.render import Settings
from preflight.results import Report


def to_env_file(report: Report) -> str:
    return env_file_text(report.env)


def write(report: Report, out: TextIO, settings: Settings) -> None:
    out.write(to_env_file(report))
