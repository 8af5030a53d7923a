"""How the coordinator reaches a host: one module per transport behind ``base.Transport``, looked up by name.

    "local"  this machine (local.py): the cluster when no hostfile is given
    "ssh"    SSH with paramiko (ssh.py; jump hosts in jump.py, one hop in hop.py, known_hosts.py, liveness.py)
    "srun"   job steps of the current Slurm allocation (srun.py)

``create("ssh", "node01", SSHOptions())`` -> an SSHTransport for node01, not yet connected; a transport's own
flags (``Transport.OPTIONS``, e.g. srun's ``--srun-steps``) reach it as the fourth argument, by dest. The public
names of the modules are re-exported here, so ``from preflight.transport import SSHTransport`` keeps working; a setting
such as ``SEND_STALL_S`` is read where it is defined (``preflight.transport.base``), and is patched there.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Type

from preflight.transport.base import (RC_TIMEOUT, CommandResult, FailedCommand, ProcessCommand, RunningCommand,
                                      SharedSession, StdinStalled, Transport, TransportError, TransportOption,
                                      raise_fd_limit)
from preflight.transport.hop import SSHOptions
from preflight.transport.known_hosts import KnownHosts
from preflight.transport.local import LocalTransport
from preflight.transport.srun import SharedStep, SrunTransport
from preflight.transport.ssh import SSHTransport

__all__ = ["RC_TIMEOUT", "CommandResult", "FailedCommand", "KnownHosts", "LocalTransport",
           "ProcessCommand", "RunningCommand", "SSHOptions", "SSHTransport", "SharedStep", "SrunTransport",
           "SharedSession", "StdinStalled", "Transport", "TransportError", "TransportOption", "TRANSPORTS", "create",
           "default_kind", "defaults", "kind", "names", "options", "raise_fd_limit"]

# The registry: a new transport is one module plus one line here. The class says the rest (base.Transport):
# its help line, its own flags, how it is made from the run's options, when it is the default, a shared session.
TRANSPORTS: Dict[str, Type[Transport]] = {"local": LocalTransport, "ssh": SSHTransport, "srun": SrunTransport}


def names() -> List[str]:
    return list(TRANSPORTS)


def kind(name: str) -> Type[Transport]:
    """The registered transport class of that name; ValueError naming the known kinds for any other name."""
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise ValueError(f"unknown transport {name!r}: one of {', '.join(TRANSPORTS)}")
    return cls


def create(name: str, host: str, ssh: SSHOptions, options: Optional[Mapping[str, Any]] = None) -> Transport:
    """A transport of the registered kind for host, from the run's options (each kind reads its own)."""
    return kind(name).from_options(host, ssh, options or defaults())


def options() -> List[TransportOption]:
    """Every transport's own flags, in registry order."""
    return [option for cls in TRANSPORTS.values() for option in cls.OPTIONS]


def defaults() -> Dict[str, Any]:
    """Every transport option at its default, by dest."""
    return {option.dest: option.default for option in options()}


def default_kind(in_allocation: bool, hostfile: bool, otherwise: str = "ssh") -> str:
    """The transport a run uses without --transport: the allocation's own inside one (when no hostfile names the
    hosts), else ``otherwise``."""
    if in_allocation and not hostfile:
        for name, cls in TRANSPORTS.items():
            if cls.IN_ALLOCATION:
                return name
    return otherwise
