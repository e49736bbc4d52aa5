"""The printed report of a run, rendered from its results.json data alone (no driver, suite or torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.outcomes import OUTCOMES, Outcome, check_failed
from harness.report.results_file import to_json
from harness.stack import describe
from harness.tables import table

if TYPE_CHECKING:
    from harness.suite_run import SuiteRun

TIMING_PHASES = ("rank_start", "imports", "init", "build", "steps", "collect", "prime", "save", "teardown")


def format_run(run: SuiteRun) -> str:
    """The human report of a run: rendered from its results data (as results.json holds it)."""
    return format_results(to_json(run))


def _checked(check: dict) -> str:
    """What a check judged: its case, and the layout it judged the case's work at where it has one."""
    return check["case_id"] + (f" -> {check['target']}" if check.get("target") else "")


def format_results(data: dict[str, Any]) -> str:
    """The human report from a results.json's data alone: per-case verdict and suite figures, phase
    timings, then every failure (no suite code, no torch)."""

    suite, cases, checks = data["suite"], data["cases"], data["checks"]
    out = [f"== {suite}: model {data['model']}, world size {data['world_size']}, backend {data['backend']}, "
           f"engine {data['engine']}"]
    by_case: dict[str, list] = {}
    for c in checks:
        by_case.setdefault(c["case_id"], []).append(c)
    metric_keys = list(dict.fromkeys(k for case in cases for k in case.get("metrics") or {}))
    check_cols = list(dict.fromkeys(c["check"].split(".", 1)[-1] for c in checks if c.get("value") is not None))
    mixed = _mixed_engines(cases)
    rows = []
    for case in cases:
        own = by_case.get(case["id"], [])
        values = {c["check"].split(".", 1)[-1]: c["value"] for c in own if c.get("value") is not None}
        row = ([_engine_of(case)] if mixed else []) + [case["layout"], case.get("variant") or "-"]
        for k in metric_keys:
            v = (case.get("metrics") or {}).get(k)
            row.append(" ".join(f"{x:.6f}" for x in v) if isinstance(v, list) else ("-" if v is None else str(v)))
        row += [f"{values[k]:.2e}" if k in values else "-" for k in check_cols]
        outcome = case.get("outcome", "")
        failing = [c["check"].split(".")[-1] for c in own if check_failed(c)]
        row += [outcome if outcome == Outcome.PASS else outcome.upper(), ",".join(failing) or "-"]
        rows.append(row)
    out.append(table([*(["engine"] if mixed else []), "layout", "options", *metric_keys, *check_cols, "verdict",
                      "failed checks"], rows))
    out.append("")
    out.append("phase timings (s, slowest rank):")
    trows = [[case["layout"], *(f"{case['timings'][p]:.2f}" if p in case["timings"] else "-" for p in TIMING_PHASES),
              f"{case['wall_s']:.1f}"] for case in cases]
    out.append(table(["layout", *TIMING_PHASES, "wall"], trows))
    if data.get("adjustments"):
        out.append("")
        out.append("judged with these harness adjustments to the engine under test (cases):")
        out += [f"  - {what} ({n}/{len(cases)})" for what, n in data["adjustments"].items()]
    shown = [c for c in checks if c["passed"] and c.get("show") and c.get("details")]
    if shown:
        out.append("")
        for c in shown:
            out.append(f"{c['check']} {_checked(c)}: {c['message']}")
            out += [f"    {d}" for d in c["details"]]
    blind = [c for c in checks if c.get("inconclusive")]
    if blind:
        out.append("")
        out.append("inconclusive (these checks ran but cannot tell right from wrong here; neither pass nor fail):")
        for c in blind:
            out.append(f"CANNOT TELL {c['check']} {_checked(c)}: {c['message']}")
            out += [f"    {d}" for d in c["details"][:20]]
    failures = [c for c in checks if check_failed(c)]
    if failures:
        out.append("")
        out.append("failures:")
        for c in failures:
            out.append(f"FAIL {c['check']} {_checked(c)}: {c['message']}")
            out += [f"    {d}" for d in c["details"][:20]]
            if len(c["details"]) > 20:
                out.append(f"    ... {len(c['details']) - 20} more")
    out.append("")
    out.append("summary:")
    out.append(summary_table(cases))

    versions = data.get("versions", {})
    if versions.get("megatron-core") or versions.get("torch"):
        out.append(f"stack: {describe(versions)}")
    n_pass = sum(c["passed"] for c in checks)
    n_blind = len(blind)
    out.append("")
    out.append(f"{suite}: {n_pass} checks passed, {len(checks) - n_pass - n_blind} failed"
               + (f", {n_blind} inconclusive" if n_blind else "") + " "
               f"({len(cases)} cases, {data['wall_s']:.1f}s): {_count([c.get('outcome', '') for c in cases])}")
    if data.get("interrupted"):
        out.append(f"{suite}: INTERRUPTED ({data['interrupted']}) after {len(cases)} of {data['cases_planned']} "
                   f"cases: the finished cases are judged above and kept in results.json (exit {data['exit_code']})")
    elif data.get("stopped"):
        out.append(f"{suite}: STOPPED after {len(cases)} of {data['cases_planned']} cases: {data['stopped']} "
                   f"(exit {data['exit_code']})")
    elif data.get("verdict") == "nothing judged":
        out.append(f"{suite}: NOTHING JUDGED - no check could judge anything (every case skipped or inconclusive, "
                   f"or none planned); "
                   f"this is not a pass (exit {data['exit_code']})")
    return "\n".join(out)


def _count(outcomes: list[str]) -> str:
    from collections import Counter

    n = Counter(outcomes)
    return ", ".join(f"{n[k]} {k}" for k in OUTCOMES if n[k]) or "no cases"


def count_outcomes(outcomes) -> str:
    """e.g. '17 pass, 2 regression, 1 error' (in the order of OUTCOMES)."""
    return _count([o.outcome for o in outcomes])


def summary_table(cases: list[dict[str, Any]], width: int = 140) -> str:
    """One row per case (results.json's cases): number, layout, options, outcome and, unless it passed, why."""

    mixed = _mixed_engines(cases)
    rows = []
    for i, case in enumerate(cases, 1):
        reason = case.get("reason") or ""
        reason = reason if len(reason) <= width else reason[: width - 3] + "..."
        rows.append([str(i), *([_engine_of(case)] if mixed else []), case["layout"], case.get("variant") or "-",
                     case.get("outcome", ""), reason or "-"])
    return table(["#", *(["engine"] if mixed else []), "layout", "options", "outcome", "reason"], rows)


def _engine_of(case: dict[str, Any]) -> str:
    """The engine of a results.json case, from its id (suite/engine/model/layout[variant])."""
    return case["id"].split("/")[1]


def _mixed_engines(cases: list[dict[str, Any]]) -> bool:
    """Whether a run's cases use more than one engine (golden's fsdp2 resumes beside mcore): then the tables
    name each case's engine."""
    return len({_engine_of(c) for c in cases}) > 1
