"""The terminal report in a real pty (script(1)) at 80, 120 and 200 columns: every host name and status reads in
full, no line is wider than the terminal, and host text cannot inject markup or escape sequences. The verdict and
the count line end it."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\r")
STATUSES = {"PASS", "WARN", "FAIL", "skip", "ERROR"}


def in_pty(argv, columns: int, timeout: float = 300) -> str:
    if not shutil.which("script"):
        pytest.skip("script(1) (util-linux) is needed for a real pty")
    inner = f"stty cols {columns} rows 50; " + shlex.join(argv)
    proc = subprocess.run(["script", "-qec", inner, "/dev/null"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "TERM": "xterm",
                                                                          "HOME": "/root", "LANG": "C.UTF-8"})
    return ANSI.sub("", proc.stdout)


def matrix_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("preflight matrix"))
    end = next(i for i, ln in enumerate(lines) if i > start and (
        ln.startswith(("recommended environment", "preflight: ", "READY", "NOT READY")) or re.match(r"\d+ passed", ln)))
    return lines[start:end]


@pytest.fixture(scope="module")
def cluster4():
    from tests.netcluster import NetCluster
    if reason := NetCluster.unavailable_reason():
        pytest.skip(reason)
    with NetCluster(4, names=["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]) as cluster:
        yield cluster


@pytest.mark.parametrize("columns", [80, 120, 200])
def test_matrix_fits_and_reads_in_full(cluster4, tmp_path, columns):
    hostfile = cluster4.hostfile(tmp_path / "hostfile")
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--python", sys.executable,
            "--ssh-config", str(cluster4.ssh_config), "--ssh-key", str(cluster4.user_key),
            "--known-hosts", str(cluster4.known_hosts),
            "--checks", "python,libaio,nvme,interfaces,memlock,versions,ports,launcher_ssh",
            "--nvme-path", "/nonexistent"]
    out = in_pty(argv, columns)
    assert "Traceback" not in out, out[-3000:]
    table = matrix_lines(out)
    assert max(len(ln) for ln in table) <= columns, "\n".join(table)
    words = set(" ".join(table).split())
    for host in ("gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04", "cluster"):
        assert host in words, "\n".join(table)
    assert {"PASS", "FAIL"} <= words, "\n".join(table)  # nvme FAILs on the missing path
    assert not any(w.endswith("…") for w in words), "\n".join(table)
    (tmp_path / f"matrix-{columns}.txt").write_text("\n".join(table) + "\n")
    # Issue 26: the report ends with the verdict, then the count line; the missing path is its one cause.
    last = [ln for ln in out.splitlines() if ln.strip()][-2:]
    assert last[0] == "NOT READY: 4 hosts need fixing (gpu-node-[01-04] nvme)", out[-2000:]
    assert re.match(r"\d+ passed, 4 failed", last[1]), out[-2000:]
    assert any(ln.startswith("gpu-node-[01-04]::nvme FAILED - ") for ln in out.splitlines()), out[-3000:]


def test_addresses_as_host_names_are_never_split_at_80_columns(cluster4, tmp_path):
    """A hostfile of addresses (the issue's 127.0.0./1): more hosts than checks, so hosts are the rows."""
    addresses = [h.addresses[0] for h in cluster4.hosts]
    hostfile = cluster4.hostfile(tmp_path / "hostfile", names=addresses)
    argv = [sys.executable, "-m", "preflight", "run", "--hostfile", str(hostfile), "--python", sys.executable,
            "--ssh-key", str(cluster4.user_key), "--known-hosts", str(cluster4.known_hosts),
            "--ssh-config", "/dev/null", "--checks", "python,memlock"]
    out = in_pty(argv, 80)
    assert "Traceback" not in out, out[-3000:]
    table = matrix_lines(out)
    assert max(len(ln) for ln in table) <= 80, "\n".join(table)
    words = set(" ".join(table).split())
    assert set(addresses) | {"host", "ssh", "python", "memlock"} <= words, "\n".join(table)
    assert [ln for ln in out.splitlines() if ln.strip()][-2] == "READY", out[-2000:]


def test_host_text_is_never_markup_or_an_escape_sequence(tmp_path):
    """A hostfile whose name and content carry rich markup and escape sequences: one plain error line."""
    weird = tmp_path / "[/oops]"
    weird.mkdir(parents=True)
    hostfile = weird / "hosts"
    hostfile.write_text("node[/x]\x1b]0;pwned\x07 slots=8\n")
    proc = subprocess.run(["script", "-qec", shlex.join([sys.executable, "-m", "preflight", "run", "--hostfile",
                                                         str(hostfile)]), "/dev/null"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    raw = proc.stdout
    assert "Traceback" not in raw and "MarkupError" not in raw, raw
    assert "[/oops]" in raw  # the path is shown as it is, not eaten as markup
    assert "\x1b]0;pwned" not in raw and "\x07" not in raw  # the OSC title sequence is never sent raw


def test_the_progress_line_keeps_ticking_while_one_phase_waits(tmp_path):
    """A long phase (the all-reduce waiting on ranks) must not look frozen: its elapsed time advances."""
    if not shutil.which("script"):
        pytest.skip("script(1) (util-linux) is needed for a real pty")
    program = tmp_path / "phase.py"
    program.write_text("import time\nfrom rich.console import Console\n"
                       "from preflight.render.terminal import TerminalProgress\n"
                       "p = TerminalProgress(Console(stderr=True))\np.phase('allreduce: [bold]4 ranks', 1)\n"
                       "time.sleep(1.5)\np.done()\n")
    proc = subprocess.run(["script", "-qec", shlex.join([sys.executable, str(program)]), "/dev/null"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    shown = set(re.findall(r"\[ *(\d+\.\d)s\] allreduce: \[bold\]4 ranks", proc.stdout))
    assert len(shown) >= 5, proc.stdout[-2000:]  # one phase() call, yet many distinct elapsed times
