"""The persistent agent's hello, said before the rest of the agent is imported: what a host pays before it is ready.

The BOOTSTRAP (agent.py) imports this module first and, for a serve request, says hello at once; the agent's own
imports (json, signal, threading, dataclasses through seams: about as much again as the interpreter's start) follow
while the coordinator's first request is on its way. Only os, sys and the C modules _socket and binascii here, so the
hello costs the interpreter's start and little more. The frame it writes (agent.serve() reads no byte of it)::

    @@PF 0 h 118\n{"hostname": "node01", "pid": 4242, "python": "3.11.7", "machine": {"boot_id": "ddb4...", ...}}
"""
# No `from __future__ import annotations`: one more module to import; the annotations are strings instead.
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

# What serve_input() (remote.py) sends as the request after the code; any other line gets no early hello (the agent
# then parses it and answers as it always did).
SERVE = b'{"op": "serve"}'
SERVE_STEP = b'{"op": "serve", "step": true}'
# Set once the hello went out, so that serve() does not say it twice.
SENT = [False]

MACHINE_ADDRESSES_MAX = 16  # addresses in the hello: enough to tell network namespaces apart, and a small hello


def _inet6(raw: bytes) -> str:
    try:
        import _socket  # the C module: socket.py would import enum, selectors and more for one function
    except ImportError:
        import socket as _socket  # type: ignore[no-redef]
    return _socket.inet_ntop(_socket.AF_INET6, raw)


def _first_line(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(256).decode("ascii", "replace").strip().splitlines()[0][:64]
    except (OSError, IndexError):
        return ""


def _local_addresses() -> "List[str]":
    """This network namespace's own addresses, loopback and link-local left out: IPv4 from the kernel's routing
    trie (``|-- 198.18.0.1`` then ``/32 host LOCAL``), IPv6 global ones from /proc/net/if_inet6."""
    found = set()
    try:
        with open("/proc/net/fib_trie", "rb") as fh:
            last = ""
            for raw in fh:
                line = raw.decode("ascii", "replace").strip()
                if line.startswith("|-- "):
                    last = line[4:]
                elif line == "/32 host LOCAL" and last and not last.startswith("127."):
                    found.add(last)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6", "rb") as fh:
            for raw in fh:
                fields = raw.decode("ascii", "replace").split()
                if len(fields) >= 4 and fields[3] == "00" and len(fields[0]) == 32:  # scope 00: global
                    found.add(_inet6(bytes.fromhex(fields[0])))
    except (OSError, ValueError):
        pass
    return sorted(found)[:MACHINE_ADDRESSES_MAX]


def machine_identity() -> "Dict[str, Any]":
    """Which machine this is, beyond its name, for the hello: the coordinator tells two hostfile names of one
    machine (DeepSpeed would start both names' ranks on it) from two machines. machine_id (systemd's, else
    D-Bus's), the kernel's boot_id (shared by containers on one kernel), the namespace's addresses (which tell
    containers and network namespaces apart) and the NVIDIA GPUs the driver lists. A few /proc reads, no
    process, so the hello stays as quick as it was, e.g.::

        {"machine_id": "3d1219c7...", "boot_id": "ddb49c75-0e4a-...", "addresses": ["198.18.0.1"], "gpus": 8}
    """
    out: Dict[str, Any] = {}
    machine_id = _first_line("/etc/machine-id") or _first_line("/var/lib/dbus/machine-id")
    if machine_id:
        out["machine_id"] = machine_id
    boot_id = _first_line("/proc/sys/kernel/random/boot_id")
    if boot_id:
        out["boot_id"] = boot_id
    out["addresses"] = _local_addresses()
    try:
        out["gpus"] = len(os.listdir("/proc/driver/nvidia/gpus"))  # one directory per GPU, by PCI bus id
    except OSError:
        pass  # no NVIDIA driver loaded: no GPUs for CUDA
    return out


def python_version() -> str:
    """platform.python_version() without importing platform (and re): the first word of sys.version."""
    return sys.version.split()[0]


def hostname() -> str:
    """socket.gethostname() without importing socket: the kernel's node name, which is what it returns on Linux."""
    return os.uname().nodename


def _json(value: "Any") -> str:
    """JSON for the hello's few types (dict, list, str, int): json would import re and its decoder for one dumps."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_json(str(k))}: {_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int):
        return str(value)
    out = ['"']
    for ch in str(value):
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or "\x7f" <= ch <= "\x9f" or "\ud800" <= ch <= "\udfff":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def hello_payload(node: "Optional[str]" = None) -> bytes:
    """The hello's JSON: this host's name, the agent's pid, its Python, which machine it is (and the Slurm node of
    a shared step's task)."""
    hello: Dict[str, Any] = {"hostname": hostname(), "pid": os.getpid(), "python": python_version(),
                             "machine": machine_identity()}
    if node is not None:
        hello["node"] = node
    return _json(hello).encode()


def frame(rid: int, kind: bytes, data: bytes, line: bool) -> bytes:
    """One frame as agent._frame writes it: ``@@PF rid kind len\\n`` + data, or in a shared step one line of base64
    ended by a '.' (``@@PL rid kind BASE64.\\n``, the hello is never split)."""
    if not line:
        return b"%s %d %s %d\n" % (b"@@PF", rid, kind, len(data)) + data
    import binascii  # a C module; base64.py imports struct and re

    return b"%s %d %s %s.\n" % (b"@@PL", rid, kind, binascii.b2a_base64(data, newline=False))


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(1, view)
        view = view[n:]


def early(request: bytes) -> None:
    """Say hello now when the request is the coordinator's serve request: the agent's imports come after it. A shared
    step's task (SERVE_STEP) needs its node's name from slurmd; without it the agent reports the error itself."""
    request = request.strip()
    if request == SERVE:
        node = None
    elif request == SERVE_STEP and os.environ.get("SLURMD_NODENAME"):
        node = os.environ["SLURMD_NODENAME"]
    else:
        return
    write_all(frame(0, b"h", hello_payload(node), line=node is not None))
    SENT[0] = True
