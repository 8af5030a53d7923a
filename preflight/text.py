"""Host text made safe to show: ``plain`` for a terminal, ``xml_safe`` for JUnit XML.

Sample: ``plain("disk\\x1b]0;pwned\\x07 [/b]")`` -> ``disk\\x1b]0;pwned\\x07 [/b]`` (escapes shown as text).
"""
from __future__ import annotations

import re

# Text from hosts (and from files, paths, exceptions) is data. On a terminal every C0/C1 control except newline
# and tab, DEL, lone surrogates (unencodable) and the bidi overrides that reorder what is shown are printed as
# \xNN / \uNNNN: an ESC that would start a CSI (``\x1b[2J``) or OSC (``\x1b]0;title\x07``) sequence becomes
# the four characters ``\x1b``, so nothing a host sends can move the cursor, retitle the window or hide text.
_TERMINAL_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u200e\u200f\u202a-\u202e"
                              r"\u2066-\u2069]")
# XML 1.0's Char production: anything else (NUL, ESC, lone surrogates, U+FFFE) makes the document ill-formed.
_XML_INVALID = re.compile(r"[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _escape_char(m: "re.Match[str]") -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def plain(text: object) -> str:
    """``text`` made safe for a terminal: controls and escape sequences shown escaped, never interpreted."""
    return _TERMINAL_UNSAFE.sub(_escape_char, str(text))


def xml_safe(text: object) -> str:
    """``text`` with every character XML 1.0 forbids written as \\xNN (ElementTree escapes <, & and quotes)."""
    return _XML_INVALID.sub(_escape_char, str(text))
