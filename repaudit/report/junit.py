"""JUnit XML for `repaudit gate --junit`, in the Ant / Jenkins / GitLab dialect that CI systems read.

One <testsuites> holding one <testsuite>; one <testcase> per cell pair (classname
`repaudit.<run name>`, name `<cell> vs <reference>`), plus one per reference cell that did not
complete. A failing pair carries <failure message="verdict and reasons" type="...">metrics</failure>;
a passing one carries them in <system-out>; a combination the run refused (never run, see
compare.gate) is a case with <skipped message="why" type="refused"/>. tests/data/junit.xsd is the schema it is
tested against.
"""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from ..compare.gate import GateResult, case_details, case_message
from ..files import write_bytes_atomic

# XML 1.0 forbids most control characters even when escaped; prompt ids and reasons are user text.
_INVALID_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(s: object) -> str:
    """Text safe for an XML 1.0 document: characters XML cannot hold become \\xNN / \\uNNNN escapes."""
    return _INVALID_XML.sub(lambda m: repr(m.group(0))[1:-1] if ord(m.group(0)) < 0x10000 else "?", str(s))


def _classname(suite: str) -> str:
    # CI systems split the classname on dots into package / class: keep the run name one component.
    return "repaudit." + (re.sub(r"[.\s]+", "_", suite) or "run")


def _seconds(x: float | None) -> str:
    return f"{max(0.0, x or 0.0):.3f}"


def junit_xml(g: GateResult, timestamp: float | None = None, hostname: str | None = None) -> bytes:
    cases = g.all_cases
    failures = len(g.failures)
    total_time = sum(p.seconds or 0.0 for p in cases)
    tests, skipped = str(len(cases) + len(g.refused)), str(len(g.refused))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(timestamp if timestamp is not None else time.time()))
    root = ET.Element("testsuites", {"name": "repaudit", "tests": tests, "failures": str(failures),
                                     "errors": "0", "skipped": skipped, "time": _seconds(total_time)})
    suite = ET.SubElement(root, "testsuite", {
        "name": xml_text(_classname(g.suite)), "tests": tests, "failures": str(failures), "errors": "0",
        "skipped": skipped, "time": _seconds(total_time), "timestamp": stamp,
        "hostname": xml_text(hostname if hostname is not None else socket.gethostname() or "localhost"),
    })
    props = ET.SubElement(suite, "properties")
    for k, v in g.properties.items():
        ET.SubElement(props, "property", {"name": xml_text(k), "value": xml_text(v)})
    classname = xml_text(_classname(g.suite))
    for p in cases:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": xml_text(p.name), "time": _seconds(p.seconds)})
        details = xml_text(case_details(p, g.thresholds))
        if not p.passed:
            kind = p.failure_type or "divergence"
            fail = ET.SubElement(case, "failure", {"message": xml_text(case_message(p)), "type": kind})
            fail.text = details
        else:
            ET.SubElement(case, "system-out").text = details
    for cell, reason in g.refused:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": xml_text(cell), "time": _seconds(0)})
        ET.SubElement(case, "skipped", {"message": xml_text(reason), "type": "refused"})
    ET.indent(root, space="  ")
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8") + b"\n"


def write_junit(path: Path, g: GateResult) -> Path:
    return write_bytes_atomic(path, junit_xml(g))
