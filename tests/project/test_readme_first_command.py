"""The README's first command works verbatim on a fresh machine: in a copy of the checkout, with a new HOME (so a
new virtualenv), it installs preflight from PyPI's dependencies and runs it on this machine."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def first_command() -> str:
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return commands[0]


def test_readme_first_command_verbatim(tmp_path):
    command = first_command()
    assert "venv" in command  # a stock Debian/Ubuntu Python refuses `pip install` outside one (PEP 668)
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", ".venv", "results"))
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "LANG": "C.UTF-8", "TERM": "dumb"}
    proc = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=900, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    assert re.search(r"\d+ passed, \d+ failed.* in [\d.]+s", out), out[-3000:]
    assert proc.returncode in (0, 1), out[-3000:]  # it ran and gated: 1 means this machine has a FAIL
    assert (home / ".preflight" / "bin" / "preflight").exists()
    venv_py = home / ".preflight" / "bin" / "python"
    site = subprocess.run([str(venv_py), "-c", "import preflight, sys; print(preflight.__file__)"],
                          capture_output=True, text=True, env=env, cwd=home).stdout
    assert str(home) in site  # the venv's own copy, not this checkout's editable install
