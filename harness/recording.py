"""Recording baselines: a suite run `repeats` times, its figures' median, spread and tolerance written to
baselines/<platform>/<suite>.json (harness/baselines.py reads, compares and writes that file)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness import baselines, driver
from harness import platform as harness_platform
from harness.backends import Backend
from harness.baselines import ABS_FLOOR, REL_TOLERANCE, build_entries, noisy_metrics, suite_path, write
from harness.errors import BadInput, DoesNotFit, MissingDependency
from harness.platform import backend as platform_backend
from harness.platform import resolve_backend
from harness.report.provenance import now, versions
from harness.selection import DEFAULT_WORLD_SIZE
from harness.suite_defs import (
    REGRESSION_RUNS,
    Baselined,
    RawSamples,
    RecordingPolicy,
    SizesRecording,
    baselines_dir_of,
    get_suite,
)

if TYPE_CHECKING:
    from harness.driver import Plan
    from harness.selection import CaseSelection


def record_suite(selection: Plan | CaseSelection | str, model: str | None = None, world_size: int = DEFAULT_WORLD_SIZE,
                 layout_ids: list[str] | None = None, *, repeats: int = 3, baselines_dir: str | None = None,
                 fresh_ranks: bool = False, **plan_kwargs) -> tuple[Path, str]:
    """Run the suite `repeats` times, store median / spread / tolerance per metric; (path, diff). selection: a Plan
    made by the command (its baselines_dir is the plan's), else what plan() takes, planned here once."""
    import sys

    if repeats < 3:
        raise BadInput(f"--repeats must be >= 3 so the spread can set the tolerance, got {repeats}")
    samples: dict[str, dict[str, list[float]]] = {}
    raw: dict[str, dict[str, list[float]]] = {}  # per-sample figures (e.g. step times), pooled over repeats
    suite: Baselined | None = None
    backend: Backend = Backend.GLOO
    params = None
    if isinstance(selection, driver.Plan):
        planned = selection
        baselines_dir = baselines_dir_of(planned.params)
    else:
        planned = driver.plan(selection, model, world_size, layout_ids, baselines_dir=baselines_dir, full_timing=True,
                              **plan_kwargs)
    for i in range(repeats):
        print(f"repeat {i + 1}/{repeats}", file=sys.stderr, flush=True)
        run = driver.execute(planned, fresh_ranks=fresh_ranks).stop_if_interrupted()
        if not isinstance(run.suite, Baselined):
            raise BadInput(f"suite {run.suite.name!r} has no baselines")
        suite, backend, params = run.suite, run.backend, run.params
        failed = [r for r in run.results if not r.ok and not r.skipped]
        if failed:
            raise RuntimeError(f"not recording: case {failed[0].case.id} failed:\n{failed[0].error}")
        for res in run.results:
            if res.skipped:  # e.g. a case that needs more ranks than this world size: nothing to record
                continue
            key = suite.key(res.case)
            for metric, value in suite.samples(res).items():
                samples.setdefault(key, {}).setdefault(metric, []).append(value)
            for metric, values in (suite.raw_samples(res) if isinstance(suite, RawSamples) else {}).items():
                raw.setdefault(key, {}).setdefault(metric, []).extend(values)
    assert suite is not None  # repeats >= 3
    # a suite may judge its metrics by its own policy (step-perf: exact counters, timed figures by statistics)
    noisy = suite.noisy_metrics(samples) if isinstance(suite, RecordingPolicy) else noisy_metrics(samples)
    if noisy:
        raise RuntimeError(f"not recording: {len(noisy)} metric(s) too noisy to baseline (by the suite's policy; "
                           f"memory: a spread over the repeats larger than the tolerance max({REL_TOLERANCE:.0%} of "
                           f"the median, {ABS_FLOOR} MiB); step-perf: a counter that varies); find the source of "
                           f"the variance or record on a quieter machine:\n  " + "\n  ".join(noisy))
    platform = harness_platform.detect_platform(backend).key
    path = suite_path(baselines_dir, platform, suite.name)
    provenance = {**versions(), "date": now(), "repeats": repeats,
                  "machine": platform_backend.machine_fingerprint(backend)}
    policy = suite if isinstance(suite, RecordingPolicy) else None
    entries = build_entries(samples, policy.tolerance if policy else None, raw, policy.digits if policy else 3)
    changes = write(path, suite.name, platform, entries, provenance)
    notes = suite.recording_notes(entries, params, backend) if isinstance(suite, SizesRecording) else []
    return path, "\n".join([changes, *notes]) if notes else changes


@dataclass(frozen=True)
class MissingBaselines:
    """A run of the regression suites whose platform file lacks entries of its planned cases."""

    suite: str
    model: str
    missing: list[str]  # baseline keys
    planned: int  # baselined cases the run plans and runs here (not skipped)
    path: Path


def missing_baselines(world_size: int, backend: Backend, baselines_dir: str | None = None,
                      suite: str | None = None) -> list[MissingBaselines]:
    """The regression suites' runs (suite_defs.REGRESSION_RUNS) with baselines, on this backend and world size,
    whose platform file lacks an entry of a case they plan; planned only, nothing runs. A run whose model does
    not fit here or needs what is not installed is left out (its suite skips it too)."""

    backend = resolve_backend(backend, world_size)
    platform = harness_platform.detect_platform(backend).key
    out = []
    for run in REGRESSION_RUNS:
        if (suite and run.suite != get_suite(suite).name) or (run.cpu_only and backend != Backend.GLOO):
            continue
        if not isinstance(get_suite(run.suite), Baselined):
            continue
        try:
            planned = driver.plan(run.suite, run.model, world_size, backend=backend,
                                          baselines_dir=baselines_dir)
            found, cases = planned.suite, planned.cases
        except (DoesNotFit, MissingDependency):
            continue
        assert isinstance(found, Baselined)
        path = baselines.suite_path(baselines_dir, platform, found.name)
        entries = baselines.load(path).get("entries", {})
        # a case planned as skipped (e.g. the DP-only reshard load at DP 1) is not recorded either (record_suite)
        keys = list(dict.fromkeys(found.key(c) for c in cases if not c.skip_reason))
        missing = [k for k in keys if k not in entries]
        if missing:
            out.append(MissingBaselines(found.name, cases[0].model.name, missing, len(keys), path))
    return out
