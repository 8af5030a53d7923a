"""A hostile host for end-to-end tests: a --python wrapper that runs the real agent and rewrites its results.

The wrapper lives in the cluster's state dir (the namespace hosts share the root filesystem except /tmp) and only
tampers on the host whose hostname (own UTS namespace) is ``target``; ``mutate(payload)`` edits the parsed
``@@PREFLIGHT-RESULT`` payload in place, or returns bytes to send instead of the whole line (invalid JSON, ...).
"""
from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

_TEMPLATE = '''#!{python}
import json, socket, subprocess, sys
REAL = {python!r}
TARGET = {target!r}
TAG = b"@@PREFLIGHT-RESULT "
FRAME = b"@@PF"
{mutate}

def rewrite(line):
    payload = json.loads(line[len(TAG):])
    out = mutate(payload)
    return out if isinstance(out, bytes) else TAG + json.dumps(payload).encode() + b"\\n"

# The agent speaks in frames ("@@PF <request> <o|e|x|h> <length>\\n<data>"); the result line is inside request
# output ("o") frames, possibly split over several. Output passes through line by line (so a service's READY
# line is not held back), and the result line is rewritten and framed again with its new length.
proc = subprocess.Popen([REAL] + sys.argv[1:], stdout=subprocess.PIPE)
src, dst = proc.stdout, sys.stdout.buffer
tamper = socket.gethostname() == TARGET
pending = {{}}

def emit(rid, kind, data):
    dst.write(FRAME + b" " + rid + b" " + kind + b" %d\\n" % len(data) + data)

while True:
    header = src.readline()
    if not header:
        break
    parts = header.split()
    if len(parts) != 4 or parts[0] != FRAME:
        dst.write(header)
        dst.flush()
        continue
    rid, kind, data = parts[1], parts[2], src.read(int(parts[3]))
    if not tamper or kind not in (b"o", b"x"):
        dst.write(header + data)
    elif kind == b"o":
        buf = pending.setdefault(rid, bytearray())
        buf.extend(data)
        while b"\\n" in buf:
            cut = buf.index(b"\\n") + 1
            line = bytes(buf[:cut])
            del buf[:cut]
            emit(rid, b"o", rewrite(line) if line.startswith(TAG) else line)
    else:
        rest = bytes(pending.pop(rid, b""))
        if rest:
            emit(rid, b"o", rewrite(rest) if rest.startswith(TAG) else rest)
        dst.write(header + data)
    dst.flush()
sys.exit(proc.wait())
'''


def wrapper(directory: Path, target: str, mutate_source: str, name: str = "hostile-python") -> Path:
    """Write an executable --python wrapper; mutate_source defines ``def mutate(payload)``."""
    path = Path(directory) / name
    path.write_text(_TEMPLATE.format(python=sys.executable, target=target,
                                     mutate=textwrap.dedent(mutate_source)))
    os.chmod(path, 0o755)
    return path


def deepspeed_exports(env_file: Path) -> str:
    """The export string DeepSpeed's pdsh launcher builds from a .deepspeed_env and runs in a shell on every node.

    Goes through deepspeed/launcher/multinode_runner.py exactly as deepspeed/launcher/runner.py main() does:
    ``key, val = line.split('=', 1); runner.add_export(key, val)``, then ``PDSHRunner.get_cmd``; the word after
    pdsh's own arguments is the ``export K=V; ...`` string.
    """
    import argparse
    multinode = pytest.importorskip("deepspeed.launcher.multinode_runner")
    args = argparse.Namespace(user_args=[], user_script="train.py", ssh_port=None, launcher_args="",
                              master_addr="198.18.0.1", master_port=29500, venv_script=None, no_python=False,
                              module=False, no_local_rank=False, save_pid=False, enable_each_rank_log=None)
    runner = multinode.PDSHRunner(args, "e30=")
    with open(env_file, "r") as fd:
        for var in fd.readlines():
            key, val = var.split("=", maxsplit=1)
            runner.add_export(key, val)
    cmd, _kill, _env = runner.get_cmd({}, {"node01": [0]})
    exports = cmd[cmd.index("-w") + 2]
    assert exports == "" or exports.startswith("export "), cmd
    return exports
