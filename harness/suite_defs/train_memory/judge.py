"""Judges of train-memory: each rank's measured phases against the training-memory model, and the baselines."""

from __future__ import annotations

import math
from typing import Any

from harness import baselines
from harness import platform as harness_platform
from harness.backends import tier_of
from harness.checks import Captures, CheckResult, cannot_tell, case_failed
from harness.checks.training_memory import MIB, predict, training_of
from harness.launch.results import CaseResult
from harness.suite_defs.train_memory.figures import key as key_of
from harness.suite_defs.train_memory.figures import phase_figures, record_command, samples
from harness.suite_defs.train_memory.params import SUITE, UNMODELLED, TrainMemoryParams
from harness.suite_defs.train_memory.payload import TrainMemoryRankData

# How far a measured phase may lie from the model's prediction, relative, plus an absolute slack for what
# a phase allocates beyond tensors (Python objects, module construction, megatron's bookkeeping). Measured on
# CPU ranks of a 2-core x86 VM (fp32, memray heap): `small` at world sizes 2 and 4 over every default case (pure DP,
# TP 2, PP 2, with and without the distributed optimizer, full and selective recompute), 16-40 points each:
# every phase within -10% / +26% of the model; `tiny`: +0.4 to +1.4 MiB above the model in every phase (its
# tensors are < 1 MiB: the fixed costs dominate), so there the check cannot tell and says so.
REL_TOL = 0.30
ABS_SLACK = 1.5 * MIB


def expected_phases(case, rank: int) -> dict[str, int]:
    """Bytes the model says each measured phase adds on this rank (TrainingMemory.phases)."""
    m = predict(case.model, case.layout, training_of(case), rank, tier_of(case.backend))
    return m.phases(case.options.steps)


def band(expected: int) -> tuple[float, float]:
    return (1 - REL_TOL) * expected - ABS_SLACK, (1 + REL_TOL) * expected + ABS_SLACK


def check(results: list[CaseResult], params: TrainMemoryParams) -> list[CheckResult]:
    out: list[CheckResult] = []
    books: dict[str, Any] = {}
    for res in results:
        if not res.ok:
            out.append(case_failed("train-memory.run", res))
            continue
        out.append(_check_model(res))
        out.append(_check_baseline(res, _source(params, res, books)))
    return out


def _check_model(res: CaseResult) -> CheckResult:
    """Every rank's phases against the training-memory model's bands."""
    if res.case.engine in UNMODELLED:
        engine = res.case.engine
        return cannot_tell("train-memory.model", res.case.id, f"engine {engine}: {UNMODELLED[engine]}")
    rows, bad = [], []
    for r in res.ranks:
        measured = phase_figures(r, res.case.backend)
        for phase, want in expected_phases(res.case, r.rank).items():
            got = measured[phase]
            low, high = band(want)
            ok = low <= got <= high and math.isfinite(got)
            err = (got - want) / want if want else math.inf
            rows.append(f"rank {r.rank} {phase}: measured {got / MIB:.2f} MiB, model {want / MIB:.2f} MiB "
                        f"({err:+.0%}), band [{max(low, 0) / MIB:.2f}, {high / MIB:.2f}]{'' if ok else ' OUTSIDE'}")
            if not ok:
                bad.append((r.rank, phase, got, want, low, high))
    biggest = max(w for r in res.ranks for w in expected_phases(res.case, r.rank).values())
    if bad:
        rank, phase, got, want, low, high = bad[0]
        return CheckResult("train-memory.model", res.case.id, False,
                           f"rank {rank} {phase}: measured {got / MIB:.2f} MiB outside the model's band "
                           f"[{max(low, 0) / MIB:.2f}, {high / MIB:.2f}] MiB (model {want / MIB:.2f} MiB)",
                           rows, captures=captures_of(res, rank, phase))
    if biggest < ABS_SLACK:
        return cannot_tell("train-memory.model", res.case.id,
                           f"the model's largest phase is {biggest / MIB:.2f} MiB, below the "
                           f"{ABS_SLACK / MIB:.1f} MiB a phase allocates beyond its tensors: a doubled tensor "
                           f"would hide in the band; judge on a larger model (small)", rows)
    return CheckResult("train-memory.model", res.case.id, True,
                       f"every rank's build and steps inside the model's band (+-{REL_TOL:.0%} + "
                       f"{ABS_SLACK / MIB:.1f} MiB)", rows, show=True)


def _source(params: TrainMemoryParams, res: CaseResult, books: dict[str, Any]) -> Any:
    """Where the case's baseline entry is read from (each platform's files read once)."""

    platform = harness_platform.detect_platform(res.case.backend).key
    if platform not in books:
        books[platform] = baselines.Book(params.baselines_dir, platform, SUITE)
    return books[platform].source(key_of(res.case))


def _check_baseline(res: CaseResult, source: Any) -> CheckResult:
    key, path = key_of(res.case), source.path
    verdicts = {m: baselines.compare(source.data, key, m, v) for m, v in samples(res).items()}
    rows = [f"{m}: {v.measured:.2f} MiB, baseline " + ("-" if v.baseline is None else f"{v.baseline:.2f} +- "
                                                        f"{v.tolerance:.2f}") + f": {v.status}"
            for m, v in verdicts.items()]
    shown = baselines.BaselineFigures(key, verdicts)
    missing = [m for m, v in verdicts.items() if v.status is baselines.BaselineStatus.MISSING]
    if missing:
        return CheckResult("train-memory.baseline", res.case.id, False,
                           f"no baseline for {key} {missing[0]} on platform {source.platform} ({path}); record it "
                           f"with: {record_command(res.case)}", rows, data=shown)
    worse = [m for m, v in verdicts.items() if v.status is baselines.BaselineStatus.REGRESSION]
    better = [m for m, v in verdicts.items() if v.status is baselines.BaselineStatus.IMPROVEMENT]
    across = baselines.across_note(source, res.case, bool(worse or better), record_command(res.case))
    if worse or better:
        m = max(worse or better, key=lambda x: abs(verdicts[x].delta))
        v = verdicts[m]
        verb = "above" if worse else "below (improvement: " + (
            "see below)" if across else f"refresh the baseline with `{record_command(res.case)}`)")
        rank, _, phase = m.partition(".")  # rank0.step1_mib
        return CheckResult("train-memory.baseline", res.case.id, False,
                           f"{m} {v.measured:.2f} MiB is {v.delta:+.2f} MiB {verb} baseline {v.baseline:.2f} +- "
                           f"{v.tolerance:.2f} MiB{across}", rows, improvement=not worse, data=shown,
                           captures=captures_of(res, int(rank.removeprefix("rank")), phase.removesuffix("_mib")))
    return CheckResult("train-memory.baseline", res.case.id, True, f"within baseline ({key}){across}", rows,
                       data=shown)


def captures_of(res: CaseResult, rank: int, phase: str) -> Captures:
    """Every rank's memray captures of the case, kept with a failed check (the other ranks' beside the failing
    one: the excess is often what one rank holds and the others do not), and the flamegraph of the failing phase's.
    Passed checks name none: the report stage deletes what no failed check kept."""

    peaks = {(r.rank, p.phase): p.capture for r in res.ranks
             for d in (r.payload_as(TrainMemoryRankData),) for p in (d.build, *d.steps)}
    return Captures([c for c in peaks.values() if c], peaks.get((rank, phase), ""))
