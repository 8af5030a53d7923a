"""The agent's start-up path: what the BOOTSTRAP and hostside/hello.py import before the hello, the coordinator's
bytecode and its fallback to source, and the hello's hand-made JSON. Timings are in bench/agent_overhead.py
--startup; these tests pin what makes them: each one fails when the hello path grows a heavy import back."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile

import pytest

from preflight.hostside import hello
from preflight.hostside.agent import BOOTSTRAP
from preflight.remote import _PRECOMPILED, serve_input

# Runs the BOOTSTRAP as `python -c` does, with an audit hook that, when the agent module is first imported (just
# after the hello), writes whether the hello went out and which modules were loaded; and every compile() of a
# preflight file (the hello-path modules should run the coordinator's bytecode instead).
WRAPPER = r"""
import sys, os
def hook(event, args):
    if event == "import" and args[0] == "preflight.hostside.agent" and not seen:
        seen.append(1)
        sent = sys.modules["preflight.hostside.hello"].SENT[0]
        os.write(2, ("@@MODULES " + repr((sent, sorted(sys.modules))) + "\n").encode())
    elif event == "compile" and isinstance(args[1], str) and args[1].startswith("preflight/"):
        os.write(2, ("@@COMPILE " + args[1] + "\n").encode())
seen = []
sys.addaudithook(hook)
exec(compile(BOOTSTRAP, "<bootstrap>", "exec"))
""".replace("BOOTSTRAP", repr(BOOTSTRAP))

# What the hello path may add to a bare interpreter's modules (python -S): the BOOTSTRAP's two C modules, the stub
# packages, hello.py and the C modules it uses. Anything else is an import someone added back.
HELLO_PATH = {"marshal", "zlib", "gc", "preflight", "preflight.hostside", "preflight.hostside.hello", "_socket",
              "binascii"}  # gc is built in: the BOOTSTRAP turns it off until the agent's imports are done
# What it imported before (zipfile, importlib.abc/util in the BOOTSTRAP; json, platform, socket, signal, threading
# and the agent's own modules before the hello), each tens of ms on a loaded host.
HEAVY = {"zipfile", "importlib.abc", "importlib.util", "json", "re", "enum", "typing", "dataclasses", "platform",
         "socket", "signal", "threading", "subprocess", "traceback", "base64", "selectors", "inspect",
         "preflight.hostside.proc", "preflight.hostside.seams", "preflight.hostside.outcome",
         "preflight.hostside.tempfiles"}


def _start(code_input: bytes, *flags: str) -> tuple:
    """Run the wrapped BOOTSTRAP until its hello, then close its stdin; (hello, modules record, compiled files)."""
    proc = subprocess.Popen([sys.executable, *flags, "-c", WRAPPER, "pf-startup-test"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(code_input, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    header, _, body = out.partition(b"\n")
    assert header.startswith(b"@@PF 0 h "), (out[:300], err[-2000:])
    hello_msg = json.loads(body[:int(header.split()[3])])
    record = [line for line in err.decode().splitlines() if line.startswith("@@MODULES ")]
    assert len(record) == 1, err[-2000:]
    sent, modules = eval(record[0][len("@@MODULES "):])  # our own hook's repr of a bool and a list of str
    compiled = [line.split(" ", 1)[1] for line in err.decode().splitlines() if line.startswith("@@COMPILE ")]
    return hello_msg, sent, set(modules), compiled


def _baseline(*flags: str) -> set:
    """The modules of an interpreter that imported what the BOOTSTRAP imports first (sys, os)."""
    out = subprocess.run([sys.executable, *flags, "-c", "import sys, os; print(repr(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(eval(out))


def test_the_hello_goes_out_before_any_heavy_import():
    """Without site (-S) the interpreter loads only its core, so every module beyond it is the hello path's own:
    exactly HELLO_PATH, and the hello was sent before the agent module was imported."""
    base = _baseline("-S")
    msg, sent, modules, _ = _start(serve_input(), "-S")
    assert sent, "the hello was not sent before the agent's imports"
    added = modules - base
    assert added <= HELLO_PATH, f"the hello path imports {sorted(added - HELLO_PATH)} (allowed: {sorted(HELLO_PATH)})"
    assert not added & HEAVY
    assert msg["pid"] > 0 and msg["python"] == sys.version.split()[0] and isinstance(msg["machine"], dict)


def test_with_site_too_the_hello_path_adds_no_heavy_module():
    """As hosts run it (site on): whatever site itself loads aside, the hello path adds none of HEAVY."""
    base = _baseline()
    _, sent, modules, _ = _start(serve_input())
    assert sent
    assert not (modules - base) & HEAVY, sorted((modules - base) & HEAVY)


def _with_magic(code: bytes, magic: str) -> bytes:
    """The same zip with its bytecode filed under another Python's magic number."""
    src = zipfile.ZipFile(io.BytesIO(code))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            parts = name.split("/")
            if parts[0] == "pyc":
                parts[1] = magic
            dst.writestr("/".join(parts), src.read(name))
    return buf.getvalue()


def test_hello_path_runs_the_coordinators_bytecode_and_falls_back_to_source():
    """Same magic: none of the precompiled modules is compiled on the host. Another magic (a host with another
    Python): each of them is compiled from its source, and the agent still says hello and serves."""
    precompiled = {name for name in _PRECOMPILED if name.startswith("preflight/hostside/")}
    assert "preflight/hostside/hello.py" in precompiled
    _, _, modules, compiled = _start(serve_input(), "-S")
    assert not set(compiled) & precompiled, compiled
    assert "preflight.hostside.agent" not in modules  # recorded at its import, before it ran

    full = serve_input()
    length, _, rest = full.partition(b"\n")
    code, request = rest[:int(length)], rest[int(length):]
    other = _with_magic(code, "00000000")
    assert other != code and len(zipfile.ZipFile(io.BytesIO(other)).namelist()) == len(
        zipfile.ZipFile(io.BytesIO(code)).namelist())
    msg, sent, _, compiled = _start(b"%d\n" % len(other) + other + request, "-S")
    assert sent and msg["pid"] > 0
    assert {"preflight/hostside/hello.py", "preflight/hostside/agent.py"} <= set(compiled), compiled


@pytest.mark.parametrize("text", ["node01", 'a"b\\c', "tab\there\nnl", "\x00\x1f\x7f\x85", "naïve-ünï",
                                  "bad\udcffbytes", "\ud800"])
def test_hello_json_is_what_json_loads_reads(text):
    """The hello is JSON made without json (whose import is most of the hello's own cost): any host name, even
    one with quotes, control characters or undecodable bytes, reads back as itself."""
    value = {"hostname": text, "pid": 7, "machine": {"addresses": [text, "198.18.0.1"], "gpus": 0, "x": None,
                                                      "ok": True}}
    assert json.loads(hello._json(value).encode()) == value


def test_hello_payload_matches_the_agents_facts():
    from preflight.hostside.agent import machine_identity
    import platform
    import socket

    payload = json.loads(hello.hello_payload("n3"))
    assert payload["hostname"] == socket.gethostname()
    assert payload["python"] == platform.python_version()
    assert payload["node"] == "n3"
    assert payload["machine"]["addresses"] == machine_identity()["addresses"]
