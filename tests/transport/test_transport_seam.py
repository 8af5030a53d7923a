"""The transport seam: a transport is one module + one registry line (preflight/transport/__init__.py TRANSPORTS).

Its class declares its help line, its own flags, how it is made from the run's options and whether it opens one
shared session for all its hosts (srun's SharedStep); the coordinator (runner, CLI, self-check) names no transport.
"""
from __future__ import annotations

import io
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

from preflight import transport as transports
from preflight.config import load_defaults
from preflight.hostfile import HostSpec
from preflight.hostside.outcome import Status
from preflight.runner import RunOptions, Runner
from preflight.transport import LocalTransport, RunningCommand, SSHOptions, Transport, TransportOption

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "preflight"
# Where a transport may be named: its own modules, and the checks where the launch itself differs.
ALLOWED = (PACKAGE / "transport", PACKAGE / "checks")
# The coordinator's files that name no transport at all, comments and docstrings included.
WHOLLY = ("runner.py", "cli.py", "selfcheck.py")
WHOLLY_PACKAGES = (PACKAGE / "cli",)  # preflight/cli/: the parser and one module per command
WORDS = ("srun", "sharedstep", "shared_step")


def _code_words(path: Path, root: Path = ROOT) -> List[str]:
    """The names and string literals of a module's code: its comments and docstrings left out."""
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME or (tok.type == tokenize.STRING
                                         # a statement that is a string alone is a docstring
                                         and not ((i == 0 or tokens[i - 1].type in (tokenize.INDENT, tokenize.NEWLINE,
                                                                                    tokenize.NL, tokenize.DEDENT))
                                                  and tokens[i + 1].type == tokenize.NEWLINE)):
            found.append(f"{path.relative_to(root)}:{tok.start[0]}: {tok.string[:80]}")
    return found


def test_the_coordinator_names_no_transport():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(path.is_relative_to(allowed) for allowed in ALLOWED):
            continue
        if (path.name in WHOLLY and path.parent == PACKAGE) or path.parent in WHOLLY_PACKAGES:
            hits += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                     for n, line in enumerate(path.read_text().splitlines(), 1)
                     if any(w in line.lower() for w in WORDS)]
        else:
            hits += [w for w in _code_words(path) if any(word in w.split(": ", 1)[1].lower() for word in WORDS)]
    assert not hits, "a transport named outside preflight/transport/:\n" + "\n".join(hits)


def test_the_grep_finds_a_transport_named_in_code(tmp_path):
    """The test above can fail: code naming srun is a hit, the same word in a comment or docstring is not."""
    (tmp_path / "preflight").mkdir()
    module = tmp_path / "preflight" / "m.py"
    module.write_text('"""Talks to srun."""\n# srun here\nX = 1\nif kind == "srun":\n    pass\n')
    hits = [w for w in _code_words(module, tmp_path) if "srun" in w.split(": ", 1)[1].lower()]
    assert hits == ['preflight/m.py:4: "srun"'], hits


class _Session:
    def __init__(self, names: Sequence[str]) -> None:
        self.channels: Mapping[str, RunningCommand] = {}  # no end adopted: each host starts its own agent
        self.names = list(names)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Here(LocalTransport):
    """A transport made in this test: this machine, reached as a remote host would be (connect, agent, probe)."""

    HELP = "this machine, as a test transport"
    OPTIONS = (TransportOption("--here-mode", "here_mode", "how the test transport starts", ("one", "each"), "one"),)
    SHARES_SESSIONS = True
    made: List[Mapping[str, Any]] = []
    sessions: List[_Session] = []

    @classmethod
    def from_options(cls, host: str, ssh: SSHOptions, options: Mapping[str, Any]) -> Transport:
        cls.made.append(dict(options))
        return cls(host)

    @classmethod
    def open_shared(cls, transports: Sequence[Transport], argv: Sequence[str], stdin: bytes,
                    options: Mapping[str, Any]) -> Optional[_Session]:
        if options.get("here_mode") != "one":
            return None
        cls.sessions.append(_Session([t.name for t in transports]))
        return cls.sessions[-1]


def test_a_new_transport_is_its_class_and_one_registry_line(monkeypatch):
    """The runner makes it from the run's options, opens its shared session for all its hosts, closes it, and
    records the connection as a shared-session transport's; nothing else of the coordinator changes."""
    monkeypatch.setitem(transports.TRANSPORTS, "here", Here)
    options = {**transports.defaults(), "here_mode": "one"}
    assert "here_mode" in options and transports.defaults()["here_mode"] == "one"
    report = Runner(RunOptions(hosts=[HostSpec("localhost", 1, 0)], checks=["libaio"], thresholds=load_defaults(),
                               transport="here", python=sys.executable, transport_options=options)).run()
    assert Here.made and Here.made[-1]["here_mode"] == "one"
    assert [s.names for s in Here.sessions] == [["localhost"]] and Here.sessions[-1].closed
    ssh = next(r for r in report.results if r.check == "ssh")
    assert ssh.status == Status.PASS, ssh
    assert report.hosts[0].reachable and {r.check for r in report.results} >= {"ssh", "libaio"}
    Here.sessions.clear()
    Runner(RunOptions(hosts=[HostSpec("localhost", 1, 0)], checks=[], thresholds=load_defaults(), transport="here",
                      python=sys.executable, transport_options={"here_mode": "each"})).run()
    assert not Here.sessions  # its own option said: no shared session


def test_the_cli_takes_a_new_transports_name_help_and_flags_from_the_registry():
    """In a fresh interpreter: register the transport, then `preflight run --help` lists it with its help line and
    its own flag; the CLI itself is not edited."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
sys.path.insert(0, {str(Path(__file__).parent)!r})
from preflight import transport
from test_transport_seam import Here
transport.TRANSPORTS["here"] = Here
from preflight.cli import main
sys.exit(main(["run", "--help"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stderr
    assert "{ssh,srun,here}" in text and "here: this machine, as a test transport" in text, text
    assert "--here-mode {one,each}" in text and "how the test transport starts" in text


def test_srun_declares_its_own_seam():
    """srun (the shipped shared-session transport) reads SLURM_JOB_ID itself and owns --srun-steps."""
    srun = transports.kind("srun")
    assert "SLURM_JOB_ID is not set" in srun.unusable({}) and srun.unusable({"SLURM_JOB_ID": "7"}) == ""
    assert transports.defaults()["srun_steps"] == "shared"
    assert transports.default_kind(True, False) == "srun" and transports.default_kind(True, True) == "ssh"
    assert transports.kind("ssh").open_shared([], ["true"], b"", {}) is None
    assert srun.open_shared([], ["true"], b"", {"srun_steps": "shared"}) is None  # no srun host: no step
