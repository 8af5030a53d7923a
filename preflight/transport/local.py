"""This machine as a host: commands run as local processes, without SSH (the cluster when no hostfile is given).

``LocalTransport("localhost").run(["uname", "-n"], timeout=10)`` -> CommandResult(0, "node01\\n", "", 0.002).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from preflight.transport.base import FailedCommand, ProcessCommand, RunningCommand, Transport

if TYPE_CHECKING:
    from preflight.transport.hop import SSHOptions


class LocalTransport(Transport):
    """This machine, without SSH (the default cluster when no hostfile is given)."""

    HELP = "this machine alone (the cluster when no hostfile is given)"

    def __init__(self, name: str = "localhost"):
        self.name = name
        self.address = "127.0.0.1"

    @classmethod
    def from_options(cls, host: str, ssh: "SSHOptions", options: Mapping[str, Any]) -> Transport:
        return cls(host)

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        try:
            return ProcessCommand(argv, stdin, keep_stdin_open, max_output)
        except FileNotFoundError:
            return FailedCommand(127, f"{argv[0]}: not found on this machine")
