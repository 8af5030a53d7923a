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

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

from preflight.hostside.agent import FRAME, LINE_FRAME
from preflight.transport.base import (FailedCommand, ProcessCommand, RunningCommand, Transport, TransportError,
                                      TransportOption)

if TYPE_CHECKING:
    from preflight.transport.hop import SSHOptions

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


class _SrunCommand(ProcessCommand):
    def kill(self) -> None:
        self._killed = True
        # EOF first: the agent stops its children itself; then srun alone gets SIGKILL (see the module docstring).
        # Not waiting for a send that is stuck in a full pipe: srun's end breaks it.
        self.close_stdin(wait=False)
        try:
            os.kill(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class SrunTransport(Transport):
    """One node of the current allocation; each command runs as its own overlapping job step. Every node's agent
    starts at once as one SharedStep (open_shared) unless ``--srun-steps per-node``."""

    HELP = "srun job steps (the default inside a Slurm allocation without --hostfile; needs no SSH keys)"
    OPTIONS = (TransportOption("--srun-steps", "srun_steps", "with --transport srun: every node's agent in one step "
                               "(shared, the default: faster to launch, one step for slurmctld) or a step per node",
                               ("shared", "per-node"), "shared"),)
    IN_ALLOCATION = True
    SHARES_SESSIONS = True

    @classmethod
    def from_options(cls, host: str, ssh: "SSHOptions", options: Mapping[str, Any]) -> Transport:
        return cls(host)  # the allocation from SLURM_JOB_ID

    @classmethod
    def unusable(cls, env: Mapping[str, str]) -> str:
        if env.get("SLURM_JOB_ID"):
            return ""
        return ("--transport srun runs job steps in an allocation, and SLURM_JOB_ID is not set: "
                "run inside salloc/sbatch")

    @classmethod
    def open_shared(cls, transports: Sequence[Transport], argv: Sequence[str], stdin: bytes,
                    options: Mapping[str, Any]) -> Optional["SharedStep | SharedSteps"]:
        nodes = [t for t in transports if isinstance(t, SrunTransport)]
        if not nodes or options.get("srun_steps", "shared") != "shared":
            return None
        groups = step_groups([n.name for n in nodes], STEP_NODES_MAX)
        steps = [SharedStep(names, argv, stdin, nodes[0].job_id) for names in groups]
        return steps[0] if len(steps) == 1 else SharedSteps(steps)

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
            return FailedCommand(127, "srun: not found on this machine")
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



# --------------------------------------------------------------------------------------------------- one step

# One step over every node: srun broadcasts its stdin to every task (--input=all) and labels each task's output
# (--label). No --kill-on-bad-exit: one node's agent ending must not end the others'.
STEP_FLAGS = ("--overlap", "--exact", "--ntasks-per-node=1", "--unbuffered", "--label", "--input=all")
_LABELLED = re.compile(rb"^\s*(\d+): ?(.*)$", re.S)
_LINE_FRAME = re.compile(re.escape(LINE_FRAME) + rb" (\d+) ([a-z]) ([A-Za-z0-9+/=]*)\.")
_PARTIAL_MAX = 8192  # a line frame is at most ~1.1 KB; more text without one is noise
# Nodes per shared step, at most. srun writes every line of its stdin to every node of the step (--input=all), so
# one step's srun spends CPU in proportion to N nodes' requests x its N nodes: its price per line and per byte for
# each node written to is measured by bench/slurm_scale.py, and its model puts a 4,000-node gate through one step at
# minutes of srun CPU (docs/performance.md, "Slurm at 4,000 nodes"). Steps of at most 128 nodes (the largest step
# measured) cut that by N/128; each costs one srun client, one launch and one step-create more.
STEP_NODES_MAX = 128


def step_groups(names: Sequence[str], most: int) -> list:
    """names in consecutive groups of at most `most`, as equal as can be (300 in 128s: 100, 100, 100)."""
    if not names:
        return []
    count = -(-len(names) // max(1, most))
    size, extra = divmod(len(names), count)
    groups, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        groups.append(list(names[start:end]))
        start = end
    return groups


class _StepChannel(RunningCommand):
    """One node's agent inside a SharedStep, seen as the command its agent session talks to.

    Requests go out addressed to the node; its frames come back re-framed as the agent's own byte stream, so
    the session (preflight.remote._Session) reads them exactly as over SSH or a step of its own.
    """

    def __init__(self, step: "SharedStep", name: str):
        super().__init__()
        self._step = step
        self.name = name
        self.bound = False

    def send(self, data: bytes) -> None:
        self._step.send_to(self.name, data)

    def close_stdin(self, wait: bool = True) -> None:
        """This node's lifeline: its agent stops what runs, reaps, says "q" and leaves the step."""
        if not self.done:
            try:
                self._step.send_to(self.name, b'{"op": "exit", "id": 0}\n')
            except (OSError, NotImplementedError):
                pass  # the step is gone, and this agent with it

    def kill(self) -> None:
        self._killed = True
        self.close_stdin()
        self._finish(-9)


class StepOutput:
    """srun's labelled output of a SharedStep, demultiplexed into each node's channel as its agent's byte stream.

    Everything here is from the hosts: a task is bound to a node only by a hello naming a node of the step that
    no other task has named, frames of unbound tasks and malformed frames are dropped, and partial lines are
    bounded.
    """

    def __init__(self, channels: Dict[str, _StepChannel]):
        self.channels = channels
        self._by_label: Dict[bytes, _StepChannel] = {}
        self._partial: Dict[bytes, bytearray] = {}
        self._lines = {False: bytearray(), True: bytearray()}
        self.srun_stderr = bytearray()
        self.unbound_hellos = 0  # tasks that named no node of the step, or one already taken

    def feed(self, data: bytes, is_err: bool) -> None:
        buf = self._lines[is_err]
        buf.extend(data)
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > _PARTIAL_MAX:
                    del buf[:]
                return
            line = bytes(buf[:nl])
            del buf[:nl + 1]
            m = _LABELLED.match(line)
            if m is None:
                if is_err:  # srun's own words (launch failures, a node that does not answer)
                    self.srun_stderr.extend(line[:500] + b"\n")
                    del self.srun_stderr[:-4096]
                continue
            label, text = m[1], m[2]
            if is_err:
                channel = self._by_label.get(label)
                if channel is not None:
                    channel._feed(text + b"\n", True)
                continue
            self._task_output(label, text)

    def _task_output(self, label: bytes, text: bytes) -> None:
        partial = self._partial.setdefault(label, bytearray())
        partial.extend(text)
        end = 0
        for m in _LINE_FRAME.finditer(partial):
            end = m.end()
            self._frame(label, int(m[1]), m[2], m[3])
        del partial[:end]
        start = partial.find(LINE_FRAME)
        if start < 0:  # keep what could still begin a frame
            del partial[:max(0, len(partial) - len(LINE_FRAME))]
        elif start > 0:
            del partial[:start]
        if len(partial) > _PARTIAL_MAX:
            del partial[:]

    def _frame(self, label: bytes, rid: int, kind: bytes, b64: bytes) -> None:
        try:
            data = base64.b64decode(b64, validate=True)
        except ValueError:
            return
        channel = self._by_label.get(label)
        if channel is None:
            if kind != b"h":
                return
            try:
                node = json.loads(data.decode()).get("node")
            except (ValueError, AttributeError, UnicodeDecodeError):
                node = None
            channel = self.channels.get(node) if isinstance(node, str) else None
            if channel is None or channel.bound:
                self.unbound_hellos += 1
                return
            channel.bound = True
            self._by_label[label] = channel
        if kind == b"q":
            channel._finish(0)
            return
        channel._feed(b"%s %d %s %d\n" % (FRAME, rid, kind, len(data)) + data, False)  # as agent._frame writes


class SharedStep:
    """Every node's persistent agent as one job step: ``srun -N n --ntasks-per-node=1 --label --input=all``.

    Measured against a step per node (bench/slurm_vs_ssh.py), it launches in 0.54-0.66x the time from 64 nodes
    on with a few percent of the srun clients' CPU, and slurmctld creates one step instead of n. What the
    per-node step gave for free is rebuilt here: each request line carries its node (``@slm2 {...}``; the other
    agents drop it), each output line is demultiplexed by srun's task label, and a task is bound to its node by
    its agent's hello, which must name a node of the step, once. Sample of what srun prints:

        1: @@PL 0 h eyJob3N0bmFtZSI6ICJzbG0yIiwgIm5vZGUiOiAic2xtMiJ9.
        0: @@PL 7 o eyJsaWJhaW8iOiB7ImZhY3RzIjog
        0: Li4ufX0=.

    The stdin lifeline is shared: its EOF (the run's end, or the coordinator killed) stops every agent. One node
    is stopped by an addressed exit; a node whose agent is gone gets a step of its own (SrunTransport).
    """

    def __init__(self, names: Sequence[str], argv: Sequence[str], stdin: bytes, job_id: str = ""):
        self.names = list(names)
        self.job_id = job_id or os.environ.get("SLURM_JOB_ID", "")
        self.channels: Dict[str, _StepChannel] = {name: _StepChannel(self, name) for name in self.names}
        self.demux = StepOutput(self.channels)
        job = [f"--jobid={self.job_id}"] if self.job_id else []
        self.argv = ["srun", *STEP_FLAGS, f"--nodes={len(self.names)}", f"--ntasks={len(self.names)}", *job,
                     f"--nodelist={','.join(self.names)}", "--", *argv]
        self._cmd: RunningCommand
        try:
            # The run's own thread opens the shared steps and outlives them: srun dies with it, so a kill -9 of the
            # coordinator ends srun the way kill() does (srun alone; its helper cancels the step). Without it,
            # srun was seen still waiting 30 s after every node's agent had left (CI, two workers).
            self._cmd = _SrunCommand(self.argv, stdin, True, None, die_with_parent=True)
        except FileNotFoundError:
            self._cmd = FailedCommand(127, "srun: not found on this machine")
        self._cmd.stream_to(self.demux.feed)
        self._cmd.add_done_callback(self._ended)

    def send_to(self, name: str, data: bytes) -> None:
        prefix = b"@" + name.encode() + b" "
        # One send: the command's own lock keeps each node's lines whole between concurrent senders.
        self._cmd.send(b"".join(prefix + line + b"\n" for line in data.splitlines() if line))

    def _ended(self) -> None:
        """srun is gone: so is every node's agent in it."""
        why = self.demux.srun_stderr.decode(errors="replace").strip().splitlines()
        rc = self._cmd.rc if self._cmd.rc is not None else -1
        for channel in self.channels.values():
            if not channel.done:
                if why:
                    channel._feed(("\n".join(why[-3:]) + "\n").encode(), True)
                if rc:
                    channel._note_error(f"the shared srun step ended (rc={rc})")
                channel._finish(rc)

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """EOF to every agent, a grace for the step to end, then srun alone is killed (its helper cancels it)."""
        self._cmd.close_stdin()
        if not self._cmd.join(grace_s):
            self._cmd.kill()
            self._cmd.join(5)


class SharedSteps:
    """Several SharedSteps as one session (open_shared past STEP_NODES_MAX nodes): every node's channel, and one
    close() that gives every step its EOF first and then the same grace, so that closing takes one grace, not one
    per step."""

    def __init__(self, steps: Sequence[SharedStep]):
        self.steps = list(steps)
        self.channels: Dict[str, _StepChannel] = {k: v for step in self.steps for k, v in step.channels.items()}

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        for step in self.steps:
            step._cmd.close_stdin(wait=False)
        deadline = time.monotonic() + grace_s
        for step in self.steps:
            step.close(max(0.0, deadline - time.monotonic()))
