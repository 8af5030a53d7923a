"""The placeholder words a report must never print where a fact belongs (issue 30, item 2).

``assert_no_placeholder(text)`` fails naming the word and its line when ``text`` holds one, e.g. the grouped line
``node[1-3]::ssh FAILED - unknown SSH host key for ADDRESS (ssh-ed25519 FINGERPRINT)`` (each host's own address and
fingerprint belong there). Words that are names, not placeholders, pass: ``$PATH``, ``on the PATH of ...``,
``REMOTE HOST IDENTIFICATION HAS CHANGED`` (ssh's own warning), an option's metavar ``--deepspeed-config PATH``.
Namespace tests import it to grep their reports.
"""
from __future__ import annotations

import re
from typing import List

# What preflight.causes once wrote for each host's own words, and what a fix once said instead of a value.
WORDS = ("HOST", "HOSTNAME", "ADDRESS", "FINGERPRINT", "PORT", "PATH")
_WORD = re.compile(r"(?<![\w$/{-])(" + "|".join(WORDS) + r")(?![\w}=])")
# A word in capitals beside another (ssh's "REMOTE HOST IDENTIFICATION"), or an option's metavar (--x PATH).
_CAPS = re.compile(r"[A-Z][A-Z0-9_]+$")
# PATH as the variable: "on PATH", "the PATH", "its PATH", "host's PATH", "PATH of", "PATH entry".
_PATH_BEFORE = re.compile(r"(?:\bon|\bthe|\bits|\bin|\bno|\bfirst|'s|\byour)\s+$")
_PATH_AFTER = re.compile(r"^\s+(?:of|entry|entries|lookup|variable)\b")
# A replacement field of an f-string that lost its f ("`ds_report` on {host} lists the ops"): a lower-case Python
# name, maybe indexed, called or formatted. ${VAR}, {a,b}, JSON and nft's "{ 22, 80 }" are not that shape.
_FIELD = re.compile(r"(?<![$\w{])\{[a-z_][a-z0-9_.]*(?:\[[^\]{}]*\]|\([^(){}]*\))*(?:![rsa])?(?::[^{}]*)?\}")


def placeholders(text: str) -> List[str]:
    """The placeholder words of ``text``, each as ``WORD in: <its line>``; [] when there is none."""
    found = []
    for line in str(text).splitlines():
        for m in _WORD.finditer(line):
            word, before, after = m.group(1), line[:m.start()], line[m.end():]
            prev = before.split()[-1] if before.split() else ""
            nxt = after.split()[0] if after.split() else ""
            if _CAPS.match(prev.strip("(\"'`,;:")) or _CAPS.match(nxt.strip(")\"'`,;:.")):
                continue  # one word of a phrase in capitals
            if prev.startswith("--") or (prev.startswith("-") and len(prev) == 2 and word != "HOST"):
                continue  # an option's metavar in a usage text: the user picks the value
            if word == "PATH" and (_PATH_BEFORE.search(before) or _PATH_AFTER.match(after)):
                continue  # the environment variable, named
            found.append(f"{word} in: {line.strip()}")
        found += [f"unformatted {m.group(0)} in: {line.strip()}" for m in _FIELD.finditer(line)]
    return found


def assert_no_placeholder(text: str, where: str = "") -> None:
    """Fail with each placeholder word of ``text`` and its line (``where`` says whose text it is)."""
    found = placeholders(text)
    assert not found, f"placeholder word{'s' if len(found) > 1 else ''} {('in ' + where) if where else ''}:\n" + \
        "\n".join(found)
