"""A SuiteRun as data: DIR/results.json, everything a report shows, so reports are rendered without the suite."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import platform, schema
from harness.files import atomic_write
from harness.report.provenance import engine_distribution, versions

if TYPE_CHECKING:
    from harness.checks import CheckResult
    from harness.suite_run import SuiteRun


def to_json(run: SuiteRun) -> dict[str, Any]:
    """A run as data (results.json): everything a report shows, so reports are rendered without the suite."""
    from dataclasses import asdict

    return {
        "schema": schema.RESULTS, "suite": run.suite.name, "model": run.model, "world_size": run.world_size,
        "engine": run.engine, "backend": run.backend, "platform": platform.detect_platform(run.backend).key,
        "versions": versions(), "date": datetime.now(UTC).isoformat(timespec="seconds"), "wall_s": run.wall_s,
        "judge_s": run.judge_s,
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
        "checks": [_check_json(c) for c in run.checks],
    }


def _jsonable(params: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    return asdict(params) if is_dataclass(params) and not isinstance(params, type) else {}


def write_results(run: SuiteRun, out_dir: Path) -> Path:
    """DIR/results.json, written atomically."""

    path = out_dir / "results.json"
    atomic_write(path, json.dumps(to_json(run), indent=2, default=str))
    return path


def run_adjustments(run: SuiteRun) -> dict[str, int]:
    """Each harness adjustment of the run with the number of cases it applied to, in first-seen order."""
    from collections import Counter

    return dict(Counter(a for r in run.results for a in r.adjustments()))


def _check_json(check: CheckResult) -> dict[str, Any]:
    """A check as results.json holds it: its fields (data {} where it has none) and its status (pass | fail |
    inconclusive)."""
    from dataclasses import asdict

    out = asdict(check)
    return {**out, "data": out["data"] or {}, "status": check.status}
