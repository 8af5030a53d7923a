"""Every option of every parser has help, abbreviations are refused, and a typo gets a did-you-mean (issue 26).

The parsers are walked from ``preflight.cli.build_parser()`` (subcommands included), so an option added later
without help fails here; the typo rows run the real ``python -m preflight`` and read its one line on stderr."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from preflight import cli, pytest_plugin

ROOT = Path(__file__).resolve().parents[2]


def parsers(parser: argparse.ArgumentParser, name: str = "preflight") -> Iterator[Tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def test_walk_finds_every_subcommand():
    names = [name for name, _ in parsers(cli.build_parser())]
    assert names == ["preflight"] + [f"preflight {c}" for c in
                                     ("list", "config", "hostfile", "version", "run", "node-check", "history",
                                      "diff", "rehearse")], names


def test_every_option_of_every_parser_has_help():
    missing: List[str] = []
    for name, parser in parsers(cli.build_parser()):
        for action in parser._actions:
            label = "/".join(action.option_strings) or action.dest
            if isinstance(action, argparse._SubParsersAction):
                # each subcommand has its line in `preflight --help`
                missing += [f"{name} {c.dest}" for c in action._choices_actions if not (c.help or "").strip()]
                continue
            if action.help == argparse.SUPPRESS or not (action.help or "").strip():
                missing.append(f"{name} {label}")
    assert not missing, f"options without help: {missing}"


def test_every_pytest_plugin_option_has_help():
    missing = [flag.option for flag in pytest_plugin.flags() if not flag.help.strip()]
    assert not missing


def test_the_ssh_options_help_is_printed():
    """The four options of issue 26 that had none, as `preflight run --help` prints them."""
    proc = subprocess.run([sys.executable, "-m", "preflight", "run", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip().startswith("--")}
    for option in ("--ssh-user", "--ssh-port", "--ssh-config", "--known-hosts"):
        words = lines[option].split()
        assert len(words) > 4, lines[option]  # option, metavar, then a sentence


def test_no_parser_allows_abbreviations():
    for name, parser in parsers(cli.build_parser()):
        assert parser.allow_abbrev is False, name


def test_num_gpus_is_slots():
    parser = cli.build_parser()
    assert parser.parse_args(["run", "--num_gpus", "4"]).slots == 4
    assert parser.parse_args(["run", "--slots", "4"]).slots == 4
    assert parser.parse_args(["node-check", "--num_gpus=2"]).slots == 2


def preflight(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "preflight", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("argv, words", [
    # --host was read as --hostfile (argparse's prefix matching): now refused, with the real name
    (["run", "--host", "h1"], "unrecognized arguments: --host h1 (did you mean --hostfile?)"),
    (["run", "--num-gpus", "2"], "(did you mean --num_gpus?)"),
    (["run", "--sshport=22"], "unrecognized arguments: --sshport=22 (did you mean --ssh-port?)"),
    (["run", "--strict", "--verbos"], "(did you mean --verbose?)"),
    (["node-check", "--deadlin", "5"], "(did you mean --deadline?)"),
    (["run", "--transport", "shh"], "invalid choice: 'shh'"),
    (["rnu"], "(did you mean run?)"),
    (["run", "--checks", "libaoi"], "unknown check 'libaoi' in --checks (did you mean libaio?)"),
    (["run", "--skip", "python,pytohn"], "unknown check 'pytohn' in --skip (did you mean python?)"),
    (["node-check", "--checks", "memlok"], "unknown check 'memlok' in --checks (did you mean memlock?)"),
    (["run", "--checks", "zzzzzz"], "unknown check 'zzzzzz' in --checks; known checks: ssh, "),
])
def test_typos_are_one_line_exit_2_with_did_you_mean(argv, words):
    proc = preflight(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_transport_typo_names_the_choice():
    proc = preflight("run", "--transport", "shh")
    assert "(did you mean ssh?)" in proc.stderr, proc.stderr


def test_no_suggestion_for_a_word_like_no_option():
    proc = preflight("run", "--zzzzzzzzzz")
    assert proc.returncode == 2 and "did you mean" not in proc.stderr, proc.stderr
