"""Every argv that carries a host name or a host-reported value puts `--` before it (or passes it as an option's
argument, or glued to a key like ``of=``), so that no such value can ever become an option (`ssh -Eadvlog`).

An AST walk over preflight/ (checks included): each list literal that starts like a command (a program name, or an
option when it extends an argv) and holds a non-literal element whose expression names a host-ish variable.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from preflight.checks import iperf3, launcher_ssh

ROOT = Path(__file__).resolve().parents[2]
HOSTISH = re.compile(r"(host|addr|address|name|dev|ip|bind|master|target|peer|iface|path|server|node)", re.I)
PROGRAM = re.compile(r"^[a-z][a-z0-9_.+-]*$")
# Words after which getopt (or iproute2's keyword parser) takes the next word as a value whatever it starts with:
# options that take an argument (ssh -o/-p/-l/-i, iperf3 -c/-B/-p/-t/-P, cc -o) and `ip ... to|dev|name`.
# A flag like ssh's -x takes none: a value after it is a positional and needs `--`.
VALUE_WORDS = {"-o", "-p", "-l", "-i", "-c", "-B", "-t", "-P", "-J", "--connect-timeout", "-F", "to", "dev", "name",
               # pdsh's host list, and the deepspeed launcher's options with a value (preflight rehearse)
               "-w", "--hostfile", "--master_addr", "--master_port", "--ssh_port", "--deepspeed_config",
               # and the rehearsal script's own options
               "--preflight-run", "--steps", "--model-params", "--init-timeout", "--lifetime"}


def _names(node: ast.AST) -> str:
    parts = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            parts.append(n.id)
        elif isinstance(n, ast.Attribute):
            parts.append(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and isinstance(getattr(n, "_sub", None), bool):
            parts.append(n.value)
    for n in ast.walk(node):  # params["addr"]: subscript keys name the value too
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            parts.append(n.slice.value)
    return " ".join(parts)


def _glued(node: ast.AST) -> bool:
    """'of=' + path, 'x=%s' % v, f'--k={v}': the value cannot start an option by itself."""
    if isinstance(node, ast.BinOp) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
        return node.left.value.startswith("-") or "=" in node.left.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).startswith("-") or "=" in str(node.values[0].value)
    return False


def unsafe_argvs():
    found = []
    for path in sorted((ROOT / "preflight").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.List) or not node.elts:
                continue
            first = node.elts[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)
                    and (PROGRAM.match(first.value) or first.value.startswith("-"))):
                continue
            if [e.value for e in node.elts[:2] if isinstance(e, ast.Constant)] == ["sh", "-c"]:
                continue  # after `sh -c SCRIPT`, every word is a positional parameter ($0, $1, ...), never an option
            after_dashdash = False
            for i, elt in enumerate(node.elts):
                if isinstance(elt, ast.Constant):
                    after_dashdash = after_dashdash or elt.value == "--"
                    continue
                if isinstance(elt, ast.Starred) or not HOSTISH.search(_names(elt)) or after_dashdash or _glued(elt):
                    continue
                if isinstance(elt, ast.Name) and elt.id.isupper():
                    continue  # a constant of the code (SCRIPT = "rehearse_train.py"), not a value from a host
                prev = node.elts[i - 1] if i else None
                if isinstance(prev, ast.Constant) and prev.value in VALUE_WORDS:
                    continue  # an option's own argument
                found.append(f"{path.relative_to(ROOT)}:{elt.lineno}: {ast.unparse(node)[:120]}")
    return found


def test_every_argv_with_a_host_value_has_dashdash():
    assert unsafe_argvs() == []


def test_the_walker_finds_an_unguarded_argv(tmp_path, monkeypatch):
    """The walker can fail: the launcher_ssh argv as it was before `--`."""
    tree = ast.parse('argv = ["ssh", "-o", "BatchMode=yes", "-x", host, "hostname"]')
    lst = tree.body[0].value
    assert isinstance(lst, ast.List) and HOSTISH.search(_names(lst.elts[4])) and not _glued(lst.elts[4])


def test_ssh_argv_puts_dashdash_before_the_host():
    argv = launcher_ssh.ssh_argv("-Eadvlog", 5)
    assert argv[argv.index("--") + 1] == "-Eadvlog"


def test_ssh_really_treats_a_dash_name_as_a_host(tmp_path):
    """OpenSSH itself: after `--`, '-Eadvlog' is a host name (fails to resolve), never the -E log option."""
    if subprocess.run(["sh", "-c", "command -v ssh"], capture_output=True).returncode:
        pytest.skip("no ssh client")
    argv = launcher_ssh.ssh_argv("-E" + str(tmp_path / "advlog"), 1)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and not (tmp_path / "advlog").exists()


def test_iperf3_client_refuses_an_address_that_is_not_one():
    out = iperf3.client({"addr": "-sD", "port": 5201}, None)
    assert "not an IP address" in str(out.get("error")), out
