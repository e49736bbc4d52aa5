"""The night's page: `harness report DIR` writes report.html, one self-contained static page (styles, script and
charts inlined; nothing fetched from anywhere when it is opened) - what regressed, since when, on which stack,
each failed or inconclusive check with its figures, the commands to rerun, record or bisect, and the charts."""

from __future__ import annotations

import base64
import gzip
import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from harness.files import atomic_write
from harness.outcomes import NOT_PASSING, OUTCOMES, Outcome, check_failed
from harness.report.plots import Chart
from harness.report.runs import NIGHT_PLAN, RunFile, case_outcome
from harness.selection import case_argv, parse_case_id
from harness.stack import COMPONENTS, LABELS

_COMMAND = re.compile(r"`(harness [^`]+)`")


@dataclass
class Since:
    """A case's verdict tonight against the earlier nights of the history: new tonight, or since which night."""

    text: str
    new: bool = False


@dataclass
class Earlier:
    """Tonight against the earlier nights (harness.history.nights.compare): per case that did not pass, since when
    and the bisects between the nights; where the stack changed; the cases passing again."""

    since: dict[str, Since] = field(default_factory=dict)
    bisect: dict[str, list[str]] = field(default_factory=dict)
    stack_notes: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)


@dataclass
class CaseRow:
    case_id: str
    suite: str
    engine: str
    model: str
    layout: str
    variant: str
    outcome: str
    reason: str
    failed_checks: list[str]
    anchor: str
    since: Since | None = None
    bisect: list[str] = field(default_factory=list)  # new tonight on another stack: one bisect per package changed


@dataclass
class CheckNote:
    """A failed or inconclusive check: what it said, its figures and the commands that follow it up."""

    check: str
    case_id: str
    kind: str  # "failed" / "inconclusive"
    message: str
    details: list[str]
    commands: list[str]


@dataclass
class RunSection:
    anchor: str
    title: str
    suite: str
    results: str
    verdict: str
    warnings: list[str]
    rows: list[CaseRow]
    notes: list[CheckNote]
    charts: list[tuple[str, str]]  # (name, the SVG gzipped, base64)


@dataclass
class Night:
    title: str
    dates: str
    stack: list[tuple[str, str]]
    stack_note: str
    totals: dict[str, int]
    runs: int
    warnings: list[str]
    regressions: list[CaseRow]
    fixed: list[str]
    sections: list[RunSection]
    filters: dict[str, list[str]] = field(default_factory=dict)
    history: str = ""

    @property
    def new(self) -> int:
        """Cases that did not pass tonight and passed (or did not run) the night before."""
        return sum(bool(row.since and row.since.new) for row in self.regressions)


def rerun_command(case_id: str, world_size: int) -> str:
    return shlex.join(["harness", "run", *case_argv(case_id, world_size)])


def _commands(run: RunFile, check: dict) -> list[str]:
    """The commands the check printed (backquoted `harness ...`), then the one that reruns its case."""
    found = _COMMAND.findall(" ".join([check.get("message", ""), *check.get("details", [])]))
    return [*dict.fromkeys(found), rerun_command(check["case_id"], run.data["world_size"])]


def inline_svg(svg: Path) -> str:
    """An SVG file for inlining, gzipped and base64-encoded (a night's charts are some MB as text; the page's
    script unpacks them with the browser's DecompressionStream): from its root element on, no XML prolog."""
    text = svg.read_text()
    return base64.b64encode(gzip.compress(text[text.index("<svg"):].encode(), mtime=0)).decode()


def _warnings(run: RunFile) -> list[str]:
    d = run.data
    out = [f"partial: {run.partial}"] if run.partial else []
    if run.nothing_judged:
        out.append(f"nothing judged: {run.nothing_judged}")
    if d.get("stopped"):
        out.append(f"stopped after {len(d['cases'])} of {d.get('cases_planned', '?')} cases: {d['stopped']}")
    return out


def _section(index: int, run: RunFile, charts: list[Chart], root: Path) -> RunSection:
    d = run.data
    by_case: dict[str, list[dict]] = {}
    for c in d["checks"]:
        by_case.setdefault(c["case_id"], []).append(c)
    anchor = f"run-{index}"
    rows = []
    for c in d["cases"]:
        sel = parse_case_id(c["id"])
        outcome = case_outcome(c)
        rows.append(CaseRow(c["id"], d["suite"], sel["engine"], sel["model"], sel["layout"], sel["variant"], outcome,
                            c.get("reason", ""), [x["check"] for x in by_case.get(c["id"], []) if check_failed(x)],
                            anchor))
    notes = [CheckNote(c["check"], c["case_id"], "failed" if check_failed(c) else "inconclusive", c["message"],
                       c.get("details", [])[:40], _commands(run, c))
             for c in d["checks"] if check_failed(c) or c.get("inconclusive")]
    notes += [CheckNote("case", c["id"], "failed", c.get("reason", ""), (c.get("error") or "").splitlines()[-20:],
                        [rerun_command(c["id"], d["world_size"])])
              for c in d["cases"] if c.get("outcome") == Outcome.ERROR and not by_case.get(c["id"])]
    verdict = d.get("verdict") or ("pass" if d.get("passed") else "fail")
    return RunSection(anchor, run.title, d["suite"], _relative(run.path, root), verdict, _warnings(run), rows, notes,
                      [(ch.name, inline_svg(ch.svg)) for ch in charts])


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _stack(runs: list[RunFile]) -> list[tuple[str, str]]:
    seen: dict[str, set[str]] = {}
    for r in runs:
        for name in COMPONENTS:
            v = r.data.get("versions", {}).get(name)
            if v:
                seen.setdefault(name, set()).add(str(v))
    return [(LABELS[name], " / ".join(sorted(vs))) for name, vs in seen.items()]


def _plan_warnings(root: Path, runs: list[RunFile]) -> list[str]:
    """What `harness nightly` planned and did not run (its nightly.json beside the results), which no results file
    tells: the plan of these runs' night only (it started before them, and the same day: an out directory used
    again holds the latest night's plan)."""
    try:
        plan = json.loads((root / NIGHT_PLAN).read_text())
    except (OSError, ValueError):
        return []
    dates = sorted(str(r.data["date"]) for r in runs if r.data.get("date"))
    started = plan.get("started") if isinstance(plan, dict) else None
    if not plan.get("not_run") or not started or not dates or not (
            dates[0][:10] == started[:10] and started <= dates[0]):
        return []
    shown = ", ".join(plan["not_run"][:12]) + (" ..." if len(plan["not_run"]) > 12 else "")
    why = f"interrupted ({plan['interrupted']})" if plan.get("interrupted") else "stopped"
    return [f"the nightly was {why}: {len(plan['not_run'])} of {plan.get('planned', '?')} runs did not run ({shown})"]


def night(runs: list[RunFile], charts: dict[str, list[Chart]], root: Path, earlier: Earlier | None = None) -> Night:
    sections = [_section(i, r, charts.get(str(r.path), []), root) for i, r in enumerate(runs, 1)]
    rows = [row for s in sections for row in s.rows]
    totals = Counter(row.outcome for row in rows)
    stack_note, history = "", ""
    fixed: list[str] = []
    if earlier is not None:
        for row in rows:
            row.since = earlier.since.get(row.case_id)
            row.bisect = earlier.bisect.get(row.case_id, [])
        stack_note, fixed = "; ".join(earlier.stack_notes), earlier.fixed
        history = "compared with the earlier nights in the history database"
    dates = sorted(str(r.data.get("date", ""))[:16].replace("T", " ") for r in runs if r.data.get("date"))
    filters = {"outcome": [o for o in OUTCOMES if totals[o]], "suite": sorted({row.suite for row in rows}),
               "model": sorted({row.model for row in rows}), "engine": sorted({row.engine for row in rows})}
    return Night(title="Harness nightly" if len(runs) > 1 else runs[0].title,
                 dates=f"{dates[0]} .. {dates[-1]}" if dates and dates[0] != dates[-1] else (dates[0] if dates else ""),
                 stack=_stack(runs), stack_note=stack_note, totals={o: totals[o] for o in OUTCOMES if totals[o]},
                 runs=len(runs),
                 warnings=_plan_warnings(root, runs) + [f"{s.title}: {w}" for s in sections for w in s.warnings],
                 regressions=[row for row in rows if row.outcome in NOT_PASSING], fixed=fixed, sections=sections,
                 filters=filters, history=history)


def environment() -> jinja2.Environment:
    """The pages' templates (harness/report/templates): HTML-escaped, an undefined name an error."""
    return jinja2.Environment(loader=jinja2.PackageLoader("harness.report", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def render(page: Night) -> str:
    return environment().get_template("night.html").render(night=page)


def write_page(runs: list[RunFile], charts: dict[str, list[Chart]], path: Path,
               earlier: Earlier | None = None, results_root: Path | None = None) -> Path:
    """report.html for the runs; with the earlier nights' comparison, what is new since them. results_root: the
    directory the runs' files are under (default the page's), where a nightly left its plan."""
    atomic_write(path, render(night(runs, charts, results_root or path.parent, earlier)))
    return path
