"""A SuiteRun as data (DIR/results.json) and the printed report rendered from that data alone;
`harness report DIR` renders results directories as Markdown, JUnit XML and PNG plots (report/files.py,
junit.py, plots.py). Nothing here imports the driver, the suites or torch at module level."""

from __future__ import annotations

import functools
import json
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.outcomes import check_failed

if TYPE_CHECKING:
    from harness.suite_run import SuiteRun

TIMING_PHASES = ("rank_start", "imports", "init", "build", "steps", "collect", "prime", "save", "teardown")


def versions() -> dict[str, str]:
    """The versions a results file records (a copy: callers may add to it)."""
    return dict(_versions())


@functools.cache  # read once per process: results.json is written after every case (22 ms a call here, with
def _versions() -> dict[str, str]:  # `git status`); what a run records is the code it started with anyway
    out = {}
    for dist in ("torch", "megatron-core", "transformer-engine", "megatron-bridge", "mbridge", "transformers", "peft"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["harness"] = metadata.version("megatron-regression-harness") if _installed() else "src"
    commit = _git_commit()
    if commit:
        out["harness_commit"] = commit
    return out


@functools.cache  # results.json is written after every case; the installed set does not change
def engine_distribution(engine: str) -> dict[str, str | None]:
    """The installed distribution that provides an engine, and its version: for `pkg.mod:factory` the
    distribution of `pkg` (None when it is not installed as one, e.g. a module on PYTHONPATH)."""
    from harness.engines import BUILTIN

    if engine in BUILTIN:  # a built-in engine: what is judged is the package it builds with
        name = {"mbridge": "mbridge", "megatron-bridge": "megatron-bridge",
                "fsdp2": "torch"}.get(engine, "megatron-core")
    else:
        top = engine.partition(":")[0].split(".")[0]
        name = (metadata.packages_distributions().get(top) or [""])[0]
    try:
        return {"name": name, "version": metadata.version(name) if name else None}
    except metadata.PackageNotFoundError:
        return {"name": name, "version": None}


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _installed() -> bool:
    try:
        metadata.version("megatron-regression-harness")
        return True
    except metadata.PackageNotFoundError:
        return False


def _git_commit() -> str:
    """Short HEAD of the harness checkout, '-dirty' when it has uncommitted changes; '' outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              timeout=5).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if head and git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def format_run(run: SuiteRun) -> str:
    """The human report of a run: rendered from its results data (as results.json holds it)."""
    return format_results(to_json(run))


def _checked(check: dict) -> str:
    """What a check judged: its case, and the layout it judged the case's work at where it has one."""
    return check["case_id"] + (f" -> {check['target']}" if check.get("target") else "")


def format_results(data: dict[str, Any]) -> str:
    """The human report from a results.json's data alone: per-case verdict and suite figures, phase
    timings, then every failure (no suite code, no torch)."""
    from harness.tables import table

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
        row += [outcome if outcome == "pass" else outcome.upper(), ",".join(failing) or "-"]
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
            out.append(f"{c['check']} {c['case_id']}: {c['message']}")
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


def run_adjustments(run: SuiteRun) -> dict[str, int]:
    """Each harness adjustment of the run with the number of cases it applied to, in first-seen order."""
    from collections import Counter

    return dict(Counter(a for r in run.results for a in r.adjustments()))


def _count(outcomes: list[str]) -> str:
    from collections import Counter

    from harness.outcomes import OUTCOMES

    n = Counter(outcomes)
    return ", ".join(f"{n[k]} {k}" for k in OUTCOMES if n[k]) or "no cases"


def count_outcomes(outcomes) -> str:
    """e.g. '17 pass, 2 regression, 1 error' (in the order of OUTCOMES)."""
    return _count([o.outcome for o in outcomes])


def summary_table(cases: list[dict[str, Any]], width: int = 140) -> str:
    """One row per case (results.json's cases): number, layout, options, outcome and, unless it passed, why."""
    from harness.tables import table

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


def to_json(run: SuiteRun) -> dict[str, Any]:
    """A run as data (results.json): everything a report shows, so reports are rendered without the suite."""
    from dataclasses import asdict

    from harness.platform import detect_platform

    return {
        "suite": run.suite.name, "model": run.model, "world_size": run.world_size, "engine": run.engine,
        "backend": run.backend, "platform": detect_platform(run.backend).key, "versions": versions(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "wall_s": run.wall_s,
        "passed": run.passed, "verdict": run.verdict, "exit_code": run.exit_code, "adjustments": run_adjustments(run),
        "judged": run.judged, "interrupted": str(run.interrupted) if run.interrupted else None,
        "stopped": run.stopped or None,
        "cases_planned": run.planned, "label": run.label, "engine_dist": dict(engine_distribution(run.engine)),
        "params": _jsonable(run.params),
        "cases": [
            {"id": r.case.id, "layout": r.case.layout.id, "variant": r.case.variant, "options": asdict(r.case.options),
             "params": _jsonable(r.case.params),
             "status": r.status, "outcome": o.outcome, "reason": o.reason, "error": r.error,
             "wall_s": r.wall_s, "timings": r.timings(),
             "rank_timings": {str(x.rank): x.timings for x in r.ranks},
             "rank_memory": {str(x.rank): asdict(x.memory) if x.memory else None for x in r.ranks},
             "fresh_ranks": r.fresh_ranks, "notes": r.notes, "adjustments": r.adjustments(),
             **{"metrics": {}, "data": {}, **(run.describe(r).figures or {})}}
            for o in run.outcomes() for r in [o.result]
        ],
        "checks": [{**asdict(c), "status": c.status} for c in run.checks],  # status: pass | fail | inconclusive
    }


def _jsonable(params: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    return asdict(params) if is_dataclass(params) and not isinstance(params, type) else {}


def write_results(run: SuiteRun, out_dir: Path) -> Path:
    """DIR/results.json, written atomically."""
    from harness.files import atomic_write

    path = out_dir / "results.json"
    atomic_write(path, json.dumps(to_json(run), indent=2, default=str))
    return path
