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
{mutate}
proc = subprocess.Popen([REAL] + sys.argv[1:], stdout=subprocess.PIPE)
for line in proc.stdout:
    if line.startswith(TAG) and socket.gethostname() == TARGET:
        payload = json.loads(line[len(TAG):])
        out = mutate(payload)
        line = out if isinstance(out, bytes) else TAG + json.dumps(payload).encode() + b"\\n"
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
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
