"""Turn a SuiteRun into the printed table and DIR/results.json; `harness report DIR` renders
results directories as Markdown, JUnit XML and PNG plots (report/files.py, junit.py, plots.py)."""

from __future__ import annotations

import functools
import json
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.driver import SuiteRun
from harness.platform import detect_platform

TIMING_PHASES = ("rank_start", "imports", "init", "build", "steps", "collect", "save", "teardown")


def versions() -> dict[str, str]:
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


@functools.lru_cache(maxsize=None)  # results.json is written after every case; the installed set does not change
def engine_distribution(engine: str) -> dict[str, str | None]:
    """The installed distribution that provides an engine, and its version: for `pkg.mod:factory` the
    distribution of `pkg` (None when it is not installed as one, e.g. a module on PYTHONPATH)."""
    from harness.engines import BUILTIN

    if engine in BUILTIN:  # a built-in engine: what is judged is the package it builds with
        name = {"mbridge": "mbridge", "megatron-bridge": "megatron-bridge", "fsdp2": "torch"}.get(engine, "megatron-core")
    else:
        top = engine.partition(":")[0].split(".")[0]
        name = (metadata.packages_distributions().get(top) or [None])[0]
    try:
        return {"name": name, "version": metadata.version(name) if name else None}
    except metadata.PackageNotFoundError:
        return {"name": name, "version": None}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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


def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_run(run: SuiteRun) -> str:
    """The human report: per-case verdict and suite figures, phase timings, then every failure."""
    out = [f"== {run.suite.name}: model {run.model}, world size {run.world_size}, backend {run.backend}, "
           f"engine {run.engine}"]
    by_case: dict[str, list] = {}
    for c in run.checks:
        by_case.setdefault(c.case_id, []).append(c)
    metric_keys: list[str] = []
    metrics = {}
    for r in run.results:
        m = run.suite.metrics(r) or {}
        metrics[r.case.id] = m
        for k in m:
            if k not in metric_keys:
                metric_keys.append(k)
    check_cols: list[str] = []
    for c in run.checks:
        col = c.check.split(".", 1)[-1]
        if c.value is not None and col not in check_cols:
            check_cols.append(col)
    rows = []
    outcomes = run.outcomes()
    for o in outcomes:
        r = o.result
        checks = by_case.get(r.case.id, [])
        values = {c.check.split(".", 1)[-1]: c.value for c in checks if c.value is not None}
        verdict = o.outcome if o.outcome == "pass" else o.outcome.upper()
        row = [r.case.layout.id, r.case.options.short() or "-"]
        for k in metric_keys:
            v = metrics[r.case.id].get(k)
            row.append(" ".join(f"{x:.6f}" for x in v) if isinstance(v, list) else ("-" if v is None else str(v)))
        row += [f"{values[k]:.2e}" if k in values else "-" for k in check_cols]
        failing = [c.check.split(".")[-1] for c in checks if not c.passed]
        row += [verdict, ",".join(failing) or "-"]
        rows.append(row)
    out.append(fmt_table(["layout", "options", *metric_keys, *check_cols, "verdict", "failed checks"], rows))
    out.append("")
    out.append("phase timings (s, slowest rank):")
    trows = []
    for r in run.results:
        t = r.timings()
        trows.append([r.case.layout.id, *(f"{t[p]:.2f}" if p in t else "-" for p in TIMING_PHASES), f"{r.wall_s:.1f}"])
    out.append(fmt_table(["layout", *TIMING_PHASES, "wall"], trows))
    adjusted = run_adjustments(run)
    if adjusted:
        out.append("")
        out.append("judged with these harness adjustments to the engine under test (cases):")
        out += [f"  - {what} ({n}/{len(run.results)})" for what, n in adjusted.items()]
    shown = [c for c in run.checks if c.passed and c.show and c.details]
    if shown:
        out.append("")
        for c in shown:
            out.append(f"{c.check} {c.case_id}: {c.message}")
            out += [f"    {d}" for d in c.details]
    failures = [c for c in run.checks if not c.passed]
    if failures:
        out.append("")
        out.append("failures:")
        for c in failures:
            out.append(f"FAIL {c.check} {c.case_id}: {c.message}")
            out += [f"    {d}" for d in c.details[:20]]
            if len(c.details) > 20:
                out.append(f"    ... {len(c.details) - 20} more")
    out.append("")
    out.append("summary:")
    out.append(format_summary(outcomes))
    n_pass = sum(c.passed for c in run.checks)
    out.append("")
    out.append(f"{run.suite.name}: {n_pass} checks passed, {len(run.checks) - n_pass} failed "
               f"({len(run.results)} cases, {run.wall_s:.1f}s): {count_outcomes(outcomes)}")
    if run.interrupted is not None:
        out.append(f"{run.suite.name}: INTERRUPTED ({run.interrupted}) after {len(run.results)} of {run.planned} "
                   f"cases: the finished cases are judged above and kept in results.json (exit {run.exit_code})")
    elif run.verdict == "nothing judged":
        out.append(f"{run.suite.name}: NOTHING JUDGED - no check ran (every case skipped or none planned); "
                   f"this is not a pass (exit {run.exit_code})")
    return "\n".join(out)


def run_adjustments(run: SuiteRun) -> dict[str, int]:
    """Each harness adjustment of the run with the number of cases it applied to, in first-seen order."""
    from collections import Counter

    return dict(Counter(a for r in run.results for a in r.adjustments()))


def count_outcomes(outcomes) -> str:
    """e.g. '17 pass, 2 regression, 1 error' (in the order of driver.OUTCOMES)."""
    from collections import Counter

    from harness.driver import OUTCOMES

    n = Counter(o.outcome for o in outcomes)
    return ", ".join(f"{n[k]} {k}" for k in OUTCOMES if n[k]) or "no cases"


def format_summary(outcomes, width: int = 140) -> str:
    """One row per case: number, layout, options, outcome and, unless it passed, the reason."""
    rows = []
    for i, o in enumerate(outcomes, 1):
        reason = o.reason if len(o.reason) <= width else o.reason[: width - 3] + "..."
        rows.append([str(i), o.result.case.layout.id, o.result.case.options.short() or "-", o.outcome, reason or "-"])
    return fmt_table(["#", "layout", "options", "outcome", "reason"], rows)


def to_json(run: SuiteRun) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "suite": run.suite.name, "model": run.model, "world_size": run.world_size, "engine": run.engine,
        "backend": run.backend, "platform": detect_platform(run.backend).key, "versions": versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_s": run.wall_s,
        "passed": run.passed, "verdict": run.verdict, "adjustments": run_adjustments(run),
        "judged": run.judged, "interrupted": str(run.interrupted) if run.interrupted else None,
        "cases_planned": run.planned, "label": run.label, "engine_dist": dict(engine_distribution(run.engine)),
        "cases": [
            {"id": r.case.id, "layout": r.case.layout.id, "options": asdict(r.case.options),
             "status": r.status, "outcome": o.outcome, "reason": o.reason, "error": r.error,
             "wall_s": r.wall_s, "timings": r.timings(),
             "rank_timings": {str(x.rank): x.timings for x in r.ranks},
             "rank_memory": {str(x.rank): x.data.get("rank_memory") for x in r.ranks},
             "fresh_ranks": r.fresh_ranks, "notes": r.notes, "adjustments": r.adjustments(),
             "metrics": run.suite.metrics(r) or {},
             "data": run.suite.report_data(r) if r.ok and hasattr(run.suite, "report_data") else {},
             **({"baseline_key": run.suite.key(r.case), "samples": run.suite.samples(r)}
                if r.ok and hasattr(run.suite, "samples") else {})}
            for o in run.outcomes() for r in [o.result]
        ],
        "checks": [asdict(c) for c in run.checks],
    }


def write_results(run: SuiteRun, out_dir: Path) -> Path:
    """DIR/results.json, written atomically."""
    from harness.report.files import write_text

    path = out_dir / "results.json"
    write_text(path, json.dumps(to_json(run), indent=2, default=str))
    return path
