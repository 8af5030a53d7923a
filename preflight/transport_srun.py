"""Run commands on the nodes of the current Slurm allocation as job steps: the Transport interface over srun.

Every call is one step, ``srun --overlap --exact -N1 -n1 --unbuffered --nodelist=HOST -- ARGV``, that shares
the allocation with the job's other steps; nothing needs SSH keys between nodes. Sample of what this module
parses (``scontrol show node -o``, one line per node):

    NodeName=slm1 Arch=x86_64 CoresPerSocket=1 ... NodeAddr=198.18.0.2 NodeHostName=slm1 Version=22.05.8 ...

Properties shared with the SSH transport: a deadline on every call, stdout and stderr read concurrently (the
local subprocess readers), stdin as the agent's lifeline (srun forwards it to the task and forwards its EOF), and
nothing left behind: kill() signals srun itself only, never its process group, because srun's helper process
must survive to cancel the step (killing both leaves the step running until InactiveLimit, default never).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import Optional, Dict, Sequence

from preflight.transport import RunningCommand, Transport, TransportError, _FailedCommand, _LocalCommand

# --unbuffered: without it slurmstepd forwards a task's output line by line, and the agent's frames carry
# payloads with no trailing newline (its hello): the coordinator waited for a hello that sat in slurmstepd.
SRUN_FLAGS = ("--overlap", "--exact", "-N1", "-n1", "--kill-on-bad-exit=1", "--unbuffered")
SCONTROL_TIMEOUT_S = 20.0
# After the lifeline closes, a step ends in 0.1-3 s (measured on the test bed: slurmstepd reaps the task and
# reports to srun). An srun still there after this is talking to a node or a slurmctld that does not answer.
CLOSE_GRACE_S = 10.0
_NODE_RE = re.compile(r"\bNodeName=(\S+)")
_ADDR_RE = re.compile(r"\bNodeAddr=(\S+)")

_addr_lock = threading.Lock()
_addr_cache: Dict[str, str] = {}


def node_addresses(names: Sequence[str] = ()) -> Dict[str, str]:
    """{NodeName: NodeAddr} of the cluster, from one `scontrol show node -o` per process (cached)."""
    with _addr_lock:
        if not _addr_cache or any(n not in _addr_cache for n in names):
            proc = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True,
                                  timeout=SCONTROL_TIMEOUT_S, stdin=subprocess.DEVNULL)
            if proc.returncode == 0:
                for line in proc.stdout.splitlines():
                    name, addr = _NODE_RE.search(line), _ADDR_RE.search(line)
                    if name and addr:
                        _addr_cache[name[1]] = addr[1]
        return dict(_addr_cache)


class _SrunCommand(_LocalCommand):
    def kill(self) -> None:
        self._killed = True
        # EOF first: the agent stops its children itself; then srun alone gets SIGKILL (see the module docstring).
        self.close_stdin()
        try:
            os.kill(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class SrunTransport(Transport):
    """One node of the current allocation; each command runs as its own overlapping job step."""

    def __init__(self, name: str, job_id: str = "", extra_flags: Sequence[str] = ()):
        self.name = name
        self.address = name
        self.job_id = job_id or os.environ.get("SLURM_JOB_ID", "")
        self.extra_flags = list(extra_flags)
        self.user = f"srun step of job {self.job_id}" if self.job_id else "srun step"
        self.connect_seconds = 0.0
        self.via = "srun"
        self.close_grace_s = CLOSE_GRACE_S
        self._commands: list = []
        self._commands_lock = threading.Lock()

    def srun_argv(self, argv: Sequence[str]) -> list:
        job = [f"--jobid={self.job_id}"] if self.job_id else []
        return ["srun", *SRUN_FLAGS, *job, f"--nodelist={self.name}", *self.extra_flags, "--", *argv]

    def connect(self) -> None:
        """Resolve the node's address (the one other nodes reach it at); steps need no connection."""
        start = time.monotonic()
        if not shutil.which("srun"):
            raise TransportError("srun not found on this machine", "run preflight on a Slurm submit host, or pass "
                                 "--transport ssh with a hostfile")
        try:
            self.address = node_addresses([self.name]).get(self.name, self.name)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TransportError(f"scontrol show node failed: {exc}", "check that slurmctld is reachable") from None
        self.connect_seconds = time.monotonic() - start

    def start(self, argv: Sequence[str], stdin: bytes = b"", keep_stdin_open: bool = False,
              max_output: Optional[int] = None) -> RunningCommand:
        try:
            cmd = _SrunCommand(self.srun_argv(argv), stdin, keep_stdin_open, max_output)
        except FileNotFoundError:
            return _FailedCommand(127, "srun: not found on this machine")
        with self._commands_lock:
            self._commands = [c for c in self._commands if not c.done] + [cmd]
        return cmd

    def close(self) -> None:
        """No srun left on the submit host: lifelines closed, a grace for the steps to end, then kill() (the
        srun client alone, so that its helper cancels the step). Without it an srun whose node or controller
        stopped answering outlives the run."""
        with self._commands_lock:
            commands, self._commands = self._commands, []
        for cmd in commands:
            cmd.close_stdin()
        deadline = time.monotonic() + self.close_grace_s
        for cmd in commands:
            if not cmd.join(max(0.0, deadline - time.monotonic())):
                cmd.kill()
                cmd.join(5)

