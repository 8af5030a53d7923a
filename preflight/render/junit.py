"""JUnit XML (``--junit-xml FILE``): one testcase per (host, check), classname = host, name = check::

    <testsuites><testsuite name="preflight" tests="7" failures="1" errors="2" skipped="1" ...>
      <testcase classname="node01" name="..." time="0.200"><failure message="..." type="fail">...
      <testcase classname="node03" name="CHECK" time="0.000">
        <properties><property name="blocked_by" value="CONNECTION" /></properties>
        <error message="blocked: ..." type="blocked">...
      <testcase classname="node01" name="CHECK" time="0.000">
        <properties><property name="blocked_by" value="CHECK" /><property name="blocked_host" value="node02" />
        </properties><error message="..." type="blocked">...

A victim (a FAIL or ERROR that only follows from another (host, check)'s fault: its host's failed connection, or
another host's, ``Report.victims``) stays an error, as every cell that is not a pass is something a CI parser must
see; its type is "blocked", its ``blocked_by`` property names the check that blocked it and ``blocked_host`` that
check's host when it is another ("cluster" for the cluster-wide row). A blocked result whose blocker passed is no
victim: it is written as its status says.
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
    victims = report.victims()
    bad = (Status.FAIL, Status.ERROR, Status.WARN) if report.strict else (Status.FAIL, Status.ERROR)
    failures = errors = skipped = 0
    suite = ET.Element("testsuite", name="preflight", tests=str(len(report.results)), time=f"{report.duration_s:.3f}",
                       timestamp=report.started_at)
    for i, r in enumerate(report.results):
        case = ET.SubElement(suite, "testcase", classname=xml_safe(display_host(r.host)), name=xml_safe(r.check),
                             time=f"{r.duration_s:.3f}")
        message = xml_safe(r.message)
        text = xml_safe(r.message + (f"\nfix: {r.fix}" if r.fix else ""))
        if r.blocked_by is not None:
            properties = ET.SubElement(case, "properties")
            ET.SubElement(properties, "property", name="blocked_by", value=xml_safe(r.blocked_by))
            if r.blocked_host is not None:
                ET.SubElement(properties, "property", name="blocked_host",
                              value=xml_safe(display_host(r.blocked_host)))
        if i in victims and r.status in bad:
            ET.SubElement(case, "error", message=message, type="blocked").text = text
            errors += 1
        elif r.status == Status.FAIL:
            ET.SubElement(case, "failure", message=message, type="fail").text = text
            failures += 1
        elif r.status == Status.ERROR:
            ET.SubElement(case, "error", message=message, type="error").text = text
            errors += 1
        elif r.status == Status.SKIP:
            ET.SubElement(case, "skipped", message=message)
            skipped += 1
        elif r.status == Status.WARN:
            if report.strict:
                ET.SubElement(case, "failure", message=message, type="warning").text = text
                failures += 1
            else:
                ET.SubElement(case, "system-out").text = "WARN: " + text
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", str(skipped))
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def write(report: Report, out: TextIO, settings: Settings) -> None:
    out.write(to_junit(report))
