"""How a status looks in a report, shared by the coordinator's renderers and the checks' own HTML sections.

Standard library only: the checks import it for their ``SPEC.html`` sections, and the checks travel to the hosts.
Sample::

    CELL[Status.SKIP] -> 'skip'
    badge("fail")     -> '<span class="badge st-fail">FAIL</span>'  (the page's CSS colours .st-fail)
    absent("no data") -> '<p class="absent">no data</p>'
"""
from __future__ import annotations

from html import escape
from typing import Any, Dict, Optional, Tuple, Union

from .outcome import Status

# A status's word in a matrix cell (terminal and HTML) and in an HTML badge. SKIP is lower case: it is not a
# verdict on the host, so it should not shout like the others.
CELL: Dict[Status, str] = {Status.PASS: "PASS", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "skip",
                           Status.ERROR: "ERROR"}

# The one definition of the status colours (background, text) of the HTML report: its matrix cells and badges
# (through the .st-<status> classes) and what a check's section draws itself (a failed link, a flagged host).
# Passing cells are pale so that the rest stands out.
STATUS_COLOURS: Dict[Status, Tuple[str, str]] = {
    Status.PASS: ("#c6f0d2", "#14532d"),
    Status.WARN: ("#fcd34d", "#451a03"),
    Status.FAIL: ("#dc2626", "#ffffff"),
    Status.SKIP: ("#e5e7eb", "#4b5563"),
    Status.ERROR: ("#a21caf", "#ffffff"),
}


def esc(value: Any) -> str:
    """Any value as HTML text or attribute value: host text is data, never markup."""
    return escape(str(value), quote=True)


def badge(status: Union[Status, str], text: Optional[str] = None) -> str:
    """A status badge; ``status`` is a Status or its JSON value (``"fail"``, as a result dict holds it)."""
    status = Status(status)
    return f'<span class="badge st-{status.value}">{esc(text or CELL[status])}</span>'


def absent(why: str) -> str:
    """What a section shows instead of its data when there is none, and why."""
    return f'<p class="absent">{esc(why)}</p>'
