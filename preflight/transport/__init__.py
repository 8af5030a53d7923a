"""How the coordinator reaches a host: one module per transport behind ``base.Transport``, looked up by name.

    "local"  this machine (local.py): the cluster when no hostfile is given
    "ssh"    SSH with paramiko (ssh.py; jump hosts in jump.py, one hop in hop.py, known_hosts.py, liveness.py)
    "srun"   job steps of the current Slurm allocation (srun.py)

``create("ssh", "node01", SSHOptions())`` -> an SSHTransport for node01, not yet connected. The public names of
the modules are re-exported here, so ``from preflight.transport import SSHTransport`` keeps working; a setting
such as ``SEND_STALL_S`` is read where it is defined (``preflight.transport.base``), and is patched there.
"""
from __future__ import annotations

from typing import Callable, Dict, List

from preflight.transport.base import (RC_TIMEOUT, CommandResult, FailedCommand, ProcessCommand, RunningCommand,
                                      StdinStalled, Transport, TransportError, raise_fd_limit)
from preflight.transport.hop import SSHOptions
from preflight.transport.known_hosts import KnownHosts
from preflight.transport.local import LocalTransport
from preflight.transport.srun import SharedStep, SrunTransport
from preflight.transport.ssh import SSHTransport

__all__ = ["RC_TIMEOUT", "CommandResult", "FailedCommand", "KnownHosts", "LocalTransport",
           "ProcessCommand", "RunningCommand", "SSHOptions", "SSHTransport", "SharedStep", "SrunTransport",
           "StdinStalled", "Transport", "TransportError", "TRANSPORTS", "create", "names", "raise_fd_limit"]

# (host name, SSH options) -> a transport for that host. Only SSH reads the options; each transport takes what
# it needs from the same two arguments, so the runner has one call for all.
TransportFactory = Callable[[str, SSHOptions], Transport]


def _local(host: str, ssh: SSHOptions) -> Transport:
    return LocalTransport(host)


def _ssh(host: str, ssh: SSHOptions) -> Transport:
    return SSHTransport(host, ssh)


def _srun(host: str, ssh: SSHOptions) -> Transport:
    return SrunTransport(host)  # the allocation from SLURM_JOB_ID


# The registry: a new transport is one module plus one line here.
TRANSPORTS: Dict[str, TransportFactory] = {"local": _local, "ssh": _ssh, "srun": _srun}


def names() -> List[str]:
    return list(TRANSPORTS)


def create(kind: str, host: str, ssh: SSHOptions) -> Transport:
    """A transport of the registered kind for host; ValueError naming the known kinds for any other kind."""
    factory = TRANSPORTS.get(kind)
    if factory is None:
        raise ValueError(f"unknown transport {kind!r}: one of {', '.join(TRANSPORTS)}")
    return factory(host, ssh)
