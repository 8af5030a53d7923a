"""A crafted ``--python`` for namespace hosts: it speaks the agent's protocol but answers what a test asks for.

The wrapper reads the agent's stdin exactly as the real bootstrap does ("<n>\\n<zip>{"op": "serve"}"), then
answers requests in the persistent agent's frames; what it answers depends on its host name in modes.json:

    {"node01": "big:1048576", "node02": "flood", "node03": "real"}

Modes: ``real`` runs the real interpreter (the real agent); ``big:N`` answers the python check with an
N-byte ``executable``; ``flood`` sends output frames for the request forever, ignoring "kill"; ``list``,
``noduration``, ``badjson``, ``factslist`` answer with a result of the wrong shape; ``hang`` reads nothing
more and sleeps (a host that goes quiet mid-request).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

WRAPPER = r'''#!{python}
import json, os, socket, sys, time
modes = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "modes.json")))
mode = modes.get(socket.gethostname(), "real")
if mode == "real":
    os.execv({python!r}, [{python!r}] + sys.argv[1:])
if mode == "hang":
    time.sleep(3600)
stdin = sys.stdin.buffer
n = int(stdin.readline())
stdin.read(n)
out = sys.stdout.buffer
R = b"@@PREFLIGHT-RESULT "

def frame(rid, kind, data=b""):
    for i in range(0, max(1, len(data)), 65536):  # as the real agent forwards a worker's output
        chunk = data[i:i + 65536]
        out.write(b"@@PF %d %s %d\n" % (rid, kind, len(chunk)) + chunk)
    out.flush()

def answer(request):
    if request["op"] != "collect":
        return R + b'{{"ok": true, "value": {{}}, "host": {{}}}}\n'
    if mode.startswith("big:"):
        size = int(mode[4:])
        pad = (b"0123456789abcdef" * (size // 16 + 1))[:size].decode()
        facts = {{"python": "3.11.7", "executable": pad, "torch": "2.0", "torch_cuda": None, "nccl": None,
                 "torch_error": None, "deepspeed": None, "nvidia_ml_py": None}}
        payload = {{"ok": True, "value": {{"python": {{"facts": facts, "duration_s": 0.1}}}}, "host": {{}}}}
        return R + json.dumps(payload).encode() + b"\n"
    if mode == "flood":
        chunk = b"x" * 65536
        while True:
            frame(request["id"], b"o", chunk)
    return {{
        "list": R + b'{{"ok": true, "value": [1, 2], "host": {{}}}}\n',
        "noduration": R + b'{{"ok": true, "value": {{"python": {{"facts": {{"python": "3.11.7"}}}}}}, "host": {{}}}}\n',
        "factslist": R + b'{{"ok": true, "value": {{"python": {{"facts": [], "duration_s": 1}}}}, "host": {{}}}}\n',
        "badjson": R + b'{{"ok": true, "value": {{"python": \n',
    }}[mode]

first = json.loads(stdin.readline())
assert first["op"] == "serve"
frame(0, b"h")
for line in stdin:
    request = json.loads(line)
    if request["op"] in ("stop", "kill"):
        continue
    frame(request["id"], b"o", answer(request))
    frame(request["id"], b"x", b"0")
os._exit(0)
'''


class HostileHosts:
    """The wrapper and its modes file in a directory every namespace host sees (not /tmp: it is private)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="preflight-hostile-", dir="/dev/shm"))
        self.python = self.dir / "python"
        self.python.write_text(WRAPPER.format(python=sys.executable))
        self.python.chmod(0o755)
        self.dir.chmod(0o755)
        self.set({})

    def set(self, modes: dict) -> None:
        (self.dir / "modes.json").write_text(json.dumps(modes))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
