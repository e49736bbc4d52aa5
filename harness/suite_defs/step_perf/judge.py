"""Judges of step-perf: exact counters and timed figures of a case against its baseline entry."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from harness import baselines
from harness import platform as harness_platform
from harness.backends import Tier, tier_of
from harness.checks import CheckData, CheckResult, cannot_tell, case_failed
from harness.checks.timing import MIN_EFFECT, Comparison, compare_samples, minimum_detectable_effect, paired_ratio
from harness.launch.results import CaseResult
from harness.platform import backend
from harness.probes.cpu_share import FOREIGN_LIMIT, ForeignLoad
from harness.spec import Case
from harness.suite_defs.step_perf import figures
from harness.suite_defs.step_perf.figures import FOREIGN, NOT_COUNTERS, key, record_command
from harness.suite_defs.step_perf.params import CPU_TIME_BASELINE_HOURS, SUITE, TIMED_STEPS, StepPerfParams


@dataclass
class TimedFigure:
    """One timed figure against its baseline: median ratio, its confidence interval, the smaller one-sided p."""

    ratio: float
    ci: tuple[float, float]
    p: float
    median: float
    baseline_median: float
    verdict: str

    @classmethod
    def of(cls, v: Comparison) -> TimedFigure:
        return cls(v.ratio, (v.ci_low, v.ci_high), min(v.p_slower, v.p_faster), v.median_b, v.median_a, v.verdict)


@dataclass
class TimeFigures(CheckData):
    """What step-perf.time judged: each timed figure, and the baseline's samples (the report's box plots)."""

    metrics: dict[str, TimedFigure]
    baseline_samples: dict[str, list[float]]


def check(results: list[CaseResult], params: StepPerfParams) -> list[CheckResult]:
    """Every case against its entry in the platform's baseline file."""

    out: list[CheckResult] = []
    books: dict[str, baselines.Book] = {}
    machines: dict[str, str] = {}  # backend -> fingerprint, read once per run (/proc/cpuinfo, or torch on GPUs)
    for res in results:
        if not res.ok:
            out.append(case_failed("step-perf.run", res))
            continue
        if params.overhead:
            out.append(check_overhead(res))
        platform = harness_platform.detect_platform(res.case.backend).key
        if platform not in books:
            books[platform] = baselines.Book(params.baselines_dir, platform, SUITE)
        source = books[platform].source(key(res.case))
        path = source.path
        entry = source.data.get("entries", {}).get(key(res.case))
        if entry is None:
            for name in ("counters", "time"):
                out.append(CheckResult(f"step-perf.{name}", res.case.id, False,
                                       f"no baseline for {key(res.case)} on platform {platform} ({path}); "
                                       f"record it with: {record_command(res.case)}"))
            continue
        out.append(_check_counters(res, entry, source))
        if res.case.backend not in machines:
            machines[res.case.backend] = backend.machine_fingerprint(res.case.backend)
        provenance = source.data.get("provenance", {}).get(key(res.case), {})
        if why := time_unjudged(res.case, provenance, machines[res.case.backend], now()):
            out.append(cannot_tell("step-perf.time", res.case.id, why + _steps_note(res.case)))
            continue
        out.append(_check_time(res, entry, params))
    return out


def now() -> datetime:
    return datetime.now(UTC)


def time_unjudged(case: Case, provenance: dict, machine: str, now: datetime) -> str:
    """Why this machine cannot judge the case's time against its baseline entry (its provenance), '' where it
    can: recorded on another machine, or on CPU ranks longer ago than a CPU's speed holds."""
    recorded_on = provenance.get("machine")
    if recorded_on != machine:
        return (f"not judged: no baseline for this machine - {key(case)} was recorded on "
                f"{recorded_on or 'an unrecorded machine'}, this is {machine}; a step time says nothing about the "
                f"code across machines. Judge time here with `harness compare` (A and B interleaved in one run), "
                f"or record this machine's baseline: {record_command(case)}")
    return stale_for_time(case, provenance, now)


def _steps_note(case: Case) -> str:
    """What a case planned for a time nobody judges timed (StepPerfSuite.cases), '' where it timed them all."""
    if not (isinstance(case.params, StepPerfParams) and case.params.timed_steps is None
            and case.options.steps < TIMED_STEPS):
        return ""
    return (f" (so the run timed {case.options.steps} steps, for the report, not {TIMED_STEPS}; "
            f"--timed-steps {TIMED_STEPS} times them all)")


def stale_for_time(case: Case, provenance: dict, now: datetime) -> str:
    """Why a CPU time baseline of this machine is too old to judge by, '' where it is not: a VM's speed drifts
    beyond the minimum effect within hours, and a VM restored from a snapshot keeps the boot id of the one
    that recorded (`CPU_TIME_BASELINE_HOURS`)."""
    if tier_of(case.backend) != Tier.CPU:
        return ""
    try:
        recorded = datetime.fromisoformat(provenance["date"])
    except (KeyError, TypeError, ValueError):
        return (f"not judged: the baseline of {key(case)} does not say when it was recorded; on CPU ranks "
                f"time is judged only against a baseline of the last {CPU_TIME_BASELINE_HOURS:g} h: "
                f"{record_command(case)}")
    hours = (now - (recorded if recorded.tzinfo else recorded.replace(tzinfo=UTC))).total_seconds() / 3600
    if hours <= CPU_TIME_BASELINE_HOURS:
        return ""
    return (f"not judged: the baseline of {key(case)} was recorded {hours:.1f} h ago ({provenance['date']}); "
            f"a CPU machine's speed drifts beyond the minimum effect within hours, so on CPU ranks time is judged "
            f"only against a baseline of the last {CPU_TIME_BASELINE_HOURS:g} h. Record one right before the run: "
            f"{record_command(case)}, or compare A/B interleaved (harness compare)")


# The harness's own cost of a step (its seams wrapped, barrier-aligned boundaries) against the same engine's
# uninstrumented steps: what step-perf reports must be the engine's time, not the harness's.
OVERHEAD_GOAL = 0.02


def check_overhead(res: CaseResult) -> CheckResult:
    """Timed steps against the uninstrumented steps paired with them (--overhead): fails when the harness
    costs significantly more than OVERHEAD_GOAL of a step, passes when the interval lies within it, and
    cannot tell when the interval straddles it."""
    timed, plain = figures.step_ms(res), figures.plain_ms(res)
    name, cid = "step-perf.overhead", res.case.id
    if len(plain) != len(timed) or len(plain) < 3:
        return CheckResult(name, cid, False, f"--overhead asked for, but {len(plain)} uninstrumented steps were "
                                             f"timed for {len(timed)} timed ones (need >= 3 pairs)")
    cost = paired_ratio(plain, timed)
    said = (f"the harness's instrumented step vs the same engine's uninstrumented step: {cost.describe()}; "
            f"medians {statistics.median(timed):.1f} vs {statistics.median(plain):.1f} ms")
    goal = 1 + OVERHEAD_GOAL
    if cost.ci_low > goal and cost.p_greater < 0.01:
        return CheckResult(name, cid, False, f"the harness's instrumentation costs {cost.ratio - 1:+.1%} of a step, "
                                             f"beyond the {OVERHEAD_GOAL:.0%} goal: step-perf's times are the "
                                             f"harness's as much as the engine's ({said})", value=cost.ratio)
    if cost.ci_high <= goal:
        return CheckResult(name, cid, True, f"harness overhead {cost.ratio - 1:+.1%}, within {OVERHEAD_GOAL:.0%} "
                                            f"({said})", value=cost.ratio, show=True)
    return cannot_tell(name, cid, f"harness overhead {cost.ratio - 1:+.1%}, but its interval "
                                  f"[{cost.ci_low - 1:+.1%}, {cost.ci_high - 1:+.1%}] spans the {OVERHEAD_GOAL:.0%} "
                                  f"goal at this noise: more pairs (--timed-steps) narrow it ({said})")


def _check_counters(res: CaseResult, entry: dict, source: Any = None) -> CheckResult:
    measured = figures.counters(res)
    wanted = {m: e["value"] for m, e in entry.items() if m not in NOT_COUNTERS}
    rows, problems = [], []
    for metric in sorted(set(measured) | set(wanted)):
        got, want = measured.get(metric), wanted.get(metric)
        if got == want:
            continue
        if want is None:
            problems.append(f"{metric} = {got:g}, not in the baseline (a collective or counter the baseline "
                            f"never saw)")
        elif got is None:
            problems.append(f"{metric} missing, baseline {want:g}")
        else:
            rel = f" ({(got - want) / want:+.1%})" if want else ""
            problems.append(f"{metric} {got:g} vs baseline {want:g}{rel}")
    rows = [f"  {p}" for p in problems]

    across = baselines.across_note(source, res.case, bool(problems), record_command(res.case)) if source else ""
    o = res.case.options
    overlap = [p for p in problems if "dp_reductions_in_backward" in p]
    first = min(measured) if measured else ""
    owner = first.split(".", 1)[0]  # rank0, or an MoE model's first group of ranks
    if overlap and o.overlap_grad_reduce and measured.get(f"{owner}.dp_reductions_in_backward") == 0:
        exposed = statistics.median(figures.exposed_ms(res))
        base = entry.get("exposed_comm_ms", {}).get("value")
        rows.insert(0, f"  overlap_grad_reduce=True but no DP gradient reduction was issued in backward: the "
                       f"reduction is not overlapped; exposed communication {exposed:.1f} ms"
                       + (f" vs baseline {base:.1f} ms" if base is not None else ""))
    if not problems:
        who = re.sub(r"^(ranks?)", r"\1 ", owner)  # "rank 0", or "ranks 0+1"
        return CheckResult("step-perf.counters", res.case.id, True,
                           f"{len(measured)} counters equal the baseline (FLOPs {measured[owner + '.flops']:.3g} "
                           f"on {who}){across}", value=0.0)
    head = rows[0].strip() if overlap and o.overlap_grad_reduce else problems[0]
    return CheckResult("step-perf.counters", res.case.id, False,
                       f"{res.case.layout.id}: {len(problems)} counters differ from the baseline; {head}{across}", rows,
                       value=float(len(problems)))


def timed_comparison(res: CaseResult, metric: str, entry: dict, effect: float | None,
                     params: StepPerfParams) -> Comparison:
    """A timed figure of a case against the samples of its baseline entry (the case's, all metrics);
    also what `harness bisect` judges by."""
    measured = {"step_time_ms": figures.step_ms, "exposed_comm_ms": figures.exposed_ms}[metric](res)
    calibration = entry.get("calibration_ms", {}).get("value")
    if params.normalise and calibration:
        scale = calibration / figures.calibration_ms(res)
        measured = [m * scale for m in measured]
    effect = (effect if effect is not None else params.min_effect if params.min_effect is not None
              else MIN_EFFECT[tier_of(res.case.backend)])
    return compare_samples(entry[metric]["samples"], measured, effect)


def load_explains(res: CaseResult, entry: dict, cmp: Comparison, regressed: bool, load: ForeignLoad | None,
                  what: str = "step time") -> str:
    """Why a busy machine explains a timed verdict, '' where it does not: other processes using a share s of the
    CPUs while the steps were timed slow them by up to x1/(1-s) (measured: 30% beside tiny-moe's 4 ranks,
    x1.27), so a slower figure within that is theirs; a baseline timed beside them explains an improvement down
    to x(1-s). load: the case's (`figures.foreign_load`). Also what `harness bisect` skips a step for."""
    if regressed and load is not None and load.too_busy and cmp.ratio <= load.slowdown:
        return (f"{res.case.layout.id}: {what} x{cmp.ratio:.3f}, but {load.describe()} while the steps were timed, "
                f"which slows them by up to x{load.slowdown:.2f}: run it again on a quiet machine, or compare A/B "
                f"interleaved (harness compare)")
    recorded = max(entry.get(FOREIGN, {}).get("values") or [0.0])
    if cmp.faster and recorded > FOREIGN_LIMIT and cmp.ratio >= 1 - recorded:
        return (f"{res.case.layout.id}: {what} x{cmp.ratio:.3f}, but the baseline was timed while other processes "
                f"used {recorded:.0%} of the machine's CPUs, which explains a step down to x{1 - recorded:.2f}; "
                f"re-record it on a quiet machine: {record_command(res.case)}")
    return ""


def _check_time(res: CaseResult, entry: dict, params: StepPerfParams) -> CheckResult:
    rows = []
    verdicts = {}
    for metric in ("step_time_ms", "exposed_comm_ms"):
        base = entry.get(metric, {}).get("samples")
        if not base:
            return CheckResult("step-perf.time", res.case.id, False,
                               f"the baseline of {key(res.case)} has no {metric} samples; re-record it with: "
                               f"{record_command(res.case)}")
        cmp = verdicts[metric] = timed_comparison(res, metric, entry, None, params)
        mde = minimum_detectable_effect(base, cmp.n_b, floor=cmp.min_effect)
        rows.append(f"  {metric}: {cmp.describe()}; {cmp.verdict}; detects >= {mde:.0%} slower")
    rank, mine, others = figures.slowest_rank(res)
    med = figures.phase_medians(res)
    rows.append(f"  slowest rank {rank}: compute {mine:.0f} ms vs {others:.0f} ms median of the others")
    for r, m in sorted(med.items()):
        rows.append(f"    rank {r}: " + ", ".join(f"{p} {v:.0f}" for p, v in m.items()) + " ms")
    load = figures.foreign_load(res)
    if load is not None:
        rows.append(f"  while timed, {load.describe()}")
    step, comm = verdicts["step_time_ms"], verdicts["exposed_comm_ms"]
    tokens_s = res.case.global_batch_size * res.case.model.seq_length / (step.median_b / 1000)
    data = TimeFigures({m: TimedFigure.of(v) for m, v in verdicts.items()},
                       {m: entry[m]["samples"] for m in verdicts})
    # The baseline's own repeats (their medians) differ by `drift`: a change of the step time within that is
    # what this machine does between runs, not something this check can attribute to the code.
    repeats = entry["step_time_ms"].get("values") or []
    drift = max(repeats) / min(repeats) - 1 if len(repeats) > 1 and min(repeats) > 0 else 0.0
    within_drift = drift > step.min_effect and (
        (step.slower and step.ratio <= 1 + drift) or (step.faster and step.ratio >= 1 / (1 + drift)))
    if within_drift:
        return cannot_tell("step-perf.time", res.case.id,
                           f"{res.case.layout.id}: step time x{step.ratio:.3f} is beyond the {step.min_effect:.0%} "
                           f"minimum effect but within the x{1 + drift:.2f} by which the baseline's own repeats differ "
                           f"({', '.join(f'{v:.0f}' for v in repeats)} ms): this machine's drift, not attributable "
                           f"({step.describe()}); re-record on a quieter machine or compare A/B interleaved "
                           f"(harness compare)", rows, value=step.ratio, data=data)
    if drift > step.min_effect:
        rows.append(f"  the baseline's repeats differ by x{1 + drift:.2f}: only a change beyond that is judged")
    comm_growth = comm.median_b - comm.median_a
    # Exposed communication is a few ms with a heavy tail on CPU ranks: it fails only when its growth is
    # also a real share of the step (the minimum effect of the baseline's step median), not 4 ms of
    # scheduling noise on a 2-core machine. A step that did not grow with it ran its compute faster.
    comm_grew = comm.slower and comm_growth > comm.min_effect * step.median_a
    if busy := load_explains(res, entry, step, step.slower or comm_grew, load):
        return cannot_tell("step-perf.time", res.case.id, busy, rows, step.ratio, data)
    if step.slower:
        msg = (f"{res.case.layout.id}: step time regressed: {step.describe()}; slowest rank {rank} "
               f"(compute {mine:.0f} ms vs {others:.0f} ms)")
        step_growth = step.median_b - step.median_a
        # the step waits for what it used to overlap - unless one rank is slow: a straggler's wait reads as
        # exposed communication on the other ranks, and so does a serialised reduction on a machine that slowed
        # one rank, so there both facts are named
        if comm.slower and comm_growth > 0.5 * step_growth:
            msg += f"; exposed communication grew by {comm_growth:.1f} ms of the {step_growth:.1f} ms"
            if mine <= 1.2 * others:
                msg += ": the step waits for the DP reduction (serialised, or overlap lost)"
            else:
                msg += (f", but rank {rank} computes {mine / others - 1:.0%} longer than the others: part of that "
                        f"may be their wait for it")
        return CheckResult("step-perf.time", res.case.id, False, msg, rows, value=step.ratio, data=data)
    if comm_grew:
        msg = (f"{res.case.layout.id}: exposed communication grew by {comm_growth:.1f} ms "
               f"(> {comm.min_effect:.0%} of the {step.median_a:.1f} ms step): {comm.describe()}")
        return CheckResult("step-perf.time", res.case.id, False, msg, rows, value=step.ratio, data=data)
    if step.faster:
        return CheckResult("step-perf.time", res.case.id, False,
                           f"{res.case.layout.id}: step time improved beyond the baseline: {step.describe()}; "
                           f"refresh it with `{record_command(res.case)}`", rows, value=step.ratio,
                           improvement=True, data=data)
    return CheckResult("step-perf.time", res.case.id, True,
                       f"{res.case.layout.id}: {step.describe()}; {tokens_s:.0f} tokens/s", rows,
                       value=step.ratio, show=True, data=data)
