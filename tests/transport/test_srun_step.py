"""The shared srun step's protocol without daemons: the agent's routing and line frames, and the coordinator's
demultiplexing of srun's labelled output (tests/slurm/test_slurm.py runs both through a real srun)."""
import json
import os
import random
import re
import select
import subprocess
import sys
import time

from preflight.hostside import agent
from preflight.remote import serve_input
from preflight.transport.srun import StepOutput, _StepChannel

_BINARY = re.compile(rb"@@PF (\d+) ([a-z]) (\d+)\n")


def _line_frames(capfd, frames) -> bytes:
    """What the agent writes in a shared step for these (rid, kind, data) frames."""
    capfd.readouterr()
    agent._line_frames[0] = True
    try:
        for frame in frames:
            agent._frame(*frame)
    finally:
        agent._line_frames[0] = False
    return capfd.readouterr().out.encode()


def _labelled(label: int, stream: bytes, rng: random.Random) -> list:
    """stream as `srun --unbuffered --label` forwards it: cut into chunks, each labelled and ended by a newline."""
    out, i = [], 0
    while i < len(stream):
        n = rng.randint(1, 300)
        chunk = stream[i:i + n]
        i += n
        out += [b"%d: %s\n" % (label, line) for line in chunk.split(b"\n") if line]
    return out


def _frames(channel: _StepChannel) -> list:
    """(rid, kind, data) of every frame the channel passed on, parsed as the agent session reads them."""
    out, buf = [], bytes(channel._out)
    while buf:
        m = _BINARY.match(buf)
        assert m, buf[:80]
        n = int(m[3])
        out.append((int(m[1]), m[2], buf[m.end():m.end() + n]))
        buf = buf[m.end() + n:]
    return out


def test_labelled_split_lines_rebuild_each_nodes_frames_and_forged_hellos_are_dropped(capfd):
    rng = random.Random(7)
    big = os.urandom(5000)
    n1 = _line_frames(capfd, [(0, b"h", json.dumps({"hostname": "a", "node": "n1"}).encode()),
                              (7, b"o", big), (7, b"e", b"warning\n"), (7, b"x", b"0")])
    n2 = _line_frames(capfd, [(0, b"h", json.dumps({"node": "n2"}).encode()), (3, b"o", b"{}"), (3, b"x", b"1")])
    assert max(len(line) for line in n1.splitlines()) < 1100  # no line a line buffer would split
    # From other tasks: a second claim to n1, a node not in the step, a frame before any hello, bad base64.
    forged = _line_frames(capfd, [(0, b"h", json.dumps({"node": "n1"}).encode()), (9, b"o", b"forged")])
    stranger = _line_frames(capfd, [(0, b"h", json.dumps({"node": "n9"}).encode()), (1, b"o", b"x")])
    orphan = _line_frames(capfd, [(4, b"o", b"before hello")])
    channels = {name: _StepChannel(None, name) for name in ("n1", "n2")}  # type: ignore[arg-type]
    demux = StepOutput(channels)
    streams = [_labelled(0, n1, rng), _labelled(1, n2, rng), _labelled(2, forged, rng),
               _labelled(3, stranger, rng), _labelled(4, orphan, rng),
               [b"1: @@PL 3 o !!notbase64.\n", b"1: noise from a profile script\n", b"5: " + b"A" * 20000 + b"\n"]]
    # The first hellos of n1 and n2 come first (as they would: each task's first line); the rest interleaves.
    lines = streams[0][:1] + streams[1][:1]
    rest = [s[1:] if i < 2 else s for i, s in enumerate(streams)]
    while any(rest):
        s = rng.choice([s for s in rest if s])
        lines.append(s.pop(0))
    data = b"".join(lines) + b"srun: error: slm9: task 9: Exited with exit code 1\n"
    i = 0
    while i < len(data):  # and the pipe from srun cuts anywhere
        n = rng.randint(1, 4096)
        demux.feed(data[i:i + n], False)
        i += n
    got1, got2 = _frames(channels["n1"]), _frames(channels["n2"])
    assert got1[0][:2] == (0, b"h") and json.loads(got1[0][2])["node"] == "n1"
    assert b"".join(d for r, k, d in got1 if k == b"o") == big
    assert [(r, k, d) for r, k, d in got1 if k != b"o"][1:] == [(7, b"e", b"warning\n"), (7, b"x", b"0")]
    assert got2[1:] == [(3, b"o", b"{}"), (3, b"x", b"1")]
    assert b"forged" not in channels["n1"]._out and demux.unbound_hellos == 2


def _read_frames(proc, want, timeout: float) -> list:
    """Line frames from the agent's stdout until one matches want(rid, kind), decoded."""
    import base64
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([proc.stdout], [], [], 0.5)[0]:
            continue
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(rb"@@PL (\d+) ([a-z]) ([A-Za-z0-9+/=]*)\.$", line.strip())
        assert m, line
        got.append((int(m[1]), m[2], base64.b64decode(m[3])))
        if want(int(m[1]), m[2]):
            return got
    raise AssertionError(f"no such frame within {timeout}s: {got}")


def test_an_agent_in_a_shared_step_takes_only_its_nodes_requests_and_leaves_on_exit():
    # Unbuffered stdout: select() sees only the pipe, so a buffered reader could hold the answer's lines unseen.
    proc = subprocess.Popen([sys.executable, "-c", agent.BOOTSTRAP, "pf-step-test"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, bufsize=0, env=dict(os.environ, SLURMD_NODENAME="n1"))
    try:
        # The requests follow the code at once, before the hello: they are in the pipe while the agent starts, and
        # the BOOTSTRAP must not swallow them into a buffered reader that serve() never reads (it reads fd 0).
        proc.stdin.write(serve_input(step=True))
        call = {"op": "call", "func": "hostside.agent.loaded", "params": {"names": []}, "timeout": 30}
        proc.stdin.write(b"@n2 " + json.dumps(dict(call, id=5)).encode() + b"\n")  # another node's
        proc.stdin.write(b"@n1 " + json.dumps(dict(call, id=6)).encode() + b"\n")
        proc.stdin.flush()
        frames = _read_frames(proc, lambda rid, kind: rid == 6 and kind == b"x", 60)
        assert frames[0][:2] == (0, b"h") and json.loads(frames[0][2])["node"] == "n1"
        assert {rid for rid, _, _ in frames} == {0, 6}, frames
        value = agent.read_result(b"".join(d for r, k, d in frames if k == b"o"))["value"]
        assert value["agent"] == proc.pid  # answered by a worker of this agent
        # Its stdin stays open (the other nodes' lifeline); an exit addressed to it ends it alone.
        proc.stdin.write(b'@n1 {"op": "exit", "id": 0}\n')
        proc.stdin.flush()
        assert _read_frames(proc, lambda rid, kind: kind == b"q", 30)[-1][:2] == (0, b"q")
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()
