"""JUnit XML for CI test reports: a testsuite per run, a testcase per case; regressions, improvements
and unjudged cases are failures (the failed checks' messages and details), errors are errors, an
inconclusive case is a skip of type "inconclusive" (the checks that could not tell, and why); a run
in which nothing was judged gets a failing testcase of its own."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from harness.outcomes import Outcome, check_failed

if TYPE_CHECKING:
    from harness.report.runs import RunFile


def render(runs: list[RunFile], page: str | None = None) -> str:
    """page: the HTML report beside it, named in each testsuite's properties (`report`) for a CI system to link."""
    root = ET.Element("testsuites")
    for run in runs:
        d = run.data
        n = run.counts()
        # A run in which nothing was judged, or that ended early, is a failure of its own (a testcase, so
        # CI shows it).
        unjudged_run = run.nothing_judged or run.partial
        suite = ET.SubElement(root, "testsuite", name=run.title, tests=str(len(d["cases"]) + bool(unjudged_run)),
                              failures=str(n["regression"] + n["improvement"] + n["unjudged"] + bool(unjudged_run)),
                              errors=str(n["error"]),
                              skipped=str(n["skipped"] + n["inconclusive"]), time=f"{d.get('wall_s', 0):.1f}",
                              timestamp=str(d.get("date", "")))
        props = ET.SubElement(suite, "properties")
        for k, v in {"platform": d.get("platform", ""), **d.get("versions", {}),
                     **({"report": page} if page else {})}.items():
            ET.SubElement(props, "property", name=k, value=str(v))
        checks: dict[str, list[dict]] = {}
        for c in d["checks"]:
            checks.setdefault(c["case_id"], []).append(c)
        for c in d["cases"]:
            tc = ET.SubElement(suite, "testcase", classname=f"{d['suite']}.{d['engine']}.{d['model']}",
                               name=c["id"].split("/", 3)[-1], time=f"{c.get('wall_s', 0):.1f}")
            outcome, reason = c.get("outcome", Outcome.PASS), c.get("reason", "")
            if outcome == Outcome.UNJUDGED:
                ET.SubElement(tc, "failure", message=reason, type="unjudged")
            elif outcome in (Outcome.REGRESSION, Outcome.IMPROVEMENT):
                failed = [x for x in checks.get(c["id"], []) if check_failed(x)]
                text = "\n\n".join("\n".join([f"{x['check']} {x['case_id']}: {x['message']}", *x.get("details", [])])
                                   for x in failed)
                ET.SubElement(tc, "failure", message=reason, type=outcome).text = text
            elif outcome == Outcome.ERROR:
                ET.SubElement(tc, "error", message=reason, type="error").text = c.get("error", "")
            elif outcome == Outcome.SKIPPED:
                ET.SubElement(tc, "skipped", message=reason)
            elif outcome == Outcome.INCONCLUSIVE:  # JUnit has no such outcome: a skip of its own type, with every check
                blind = [x for x in checks.get(c["id"], []) if x.get("inconclusive")]
                ET.SubElement(tc, "skipped", message=reason, type="inconclusive").text = "\n".join(
                    f"{x['check']} {x['case_id']}: {x['message']}" for x in blind)
            if outcome != Outcome.INCONCLUSIVE and any(x.get("inconclusive") for x in checks.get(c["id"], [])):
                props = ET.SubElement(tc, "properties")  # a judged case that some checks could not judge
                for x in checks[c["id"]]:
                    if x.get("inconclusive"):
                        ET.SubElement(props, "property", name=f"inconclusive:{x['check']}", value=x["message"])
        if unjudged_run:
            what = "partial" if run.partial else "nothing judged"
            tc = ET.SubElement(suite, "testcase", classname=f"{d['suite']}.{d['engine']}.{d['model']}", name=what)
            ET.SubElement(tc, "failure", message=unjudged_run, type=what.replace(" ", "-"))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
