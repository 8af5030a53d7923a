"""JUnit XML (``--junit-xml FILE``): one testcase per (host, check), classname = host, name = check::

    <testsuites><testsuite name="preflight" tests="7" failures="1" errors="2" skipped="1" ...>
      <testcase classname="node01" name="..." time="0.200"><failure message="..." type="fail">...
      <testcase classname="node03" name="CHECK" time="0.000">
        <properties><property name="blocked_by" value="CONNECTION" /></properties>
        <error message="blocked: ..." type="blocked">...

A blocked cell (its host's connection check failed) stays an error, as every cell that is not a pass is something
a CI parser must see; its type is "blocked" and its ``blocked_by`` property names the check that blocked it.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import TextIO

from preflight.hostside.outcome import Status
from preflight.render import Settings
from preflight.results import Report, display_host
from preflight.text import xml_safe


def to_junit(report: Report) -> str:
    """A WARN is a pass with its text in system-out, or a failure of type "warning" with --strict."""
    c = report.counts()
    failures = c["fail"] + (c["warn"] if report.strict else 0)
    suite = ET.Element("testsuite", name="preflight", tests=str(len(report.results)), failures=str(failures),
                       errors=str(c["error"] + c["blocked"]), skipped=str(c["skip"]), time=f"{report.duration_s:.3f}",
                       timestamp=report.started_at)
    for r in report.results:
        case = ET.SubElement(suite, "testcase", classname=xml_safe(display_host(r.host)), name=xml_safe(r.check),
                             time=f"{r.duration_s:.3f}")
        message = xml_safe(r.message)
        text = xml_safe(r.message + (f"\nfix: {r.fix}" if r.fix else ""))
        if r.blocked_by is not None:
            properties = ET.SubElement(case, "properties")
            ET.SubElement(properties, "property", name="blocked_by", value=xml_safe(r.blocked_by))
        if r.status == Status.FAIL:
            ET.SubElement(case, "failure", message=message, type="fail").text = text
        elif r.status == Status.ERROR:
            ET.SubElement(case, "error", message=message, type="blocked" if r.blocked else "error").text = text
        elif r.status == Status.SKIP:
            ET.SubElement(case, "skipped", message=message)
        elif r.status == Status.WARN:
            if report.strict:
                ET.SubElement(case, "failure", message=message, type="warning").text = text
            else:
                ET.SubElement(case, "system-out").text = "WARN: " + text
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def write(report: Report, out: TextIO, settings: Settings) -> None:
    out.write(to_junit(report))
