"""Judges of the golden suite: a case's trajectory against the stored one of its model and dtype.

Tolerances come from measurement: a recorded metric's tolerance is SPREAD_FACTOR x its spread over every
layout and repeat that recorded it, at least the dtype's rtol of its value (the floor is applied when
judging, where the dtype is known). A recording whose figures spread beyond the dtype's golden_max_spread of
their value is refused: a trajectory that does not repeat cannot judge anything.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import TYPE_CHECKING

from harness import baselines
from harness import platform as harness_platform
from harness.checks import CheckResult, TrajectoryFigures
from harness.dtypes import dtype
from harness.suite_defs.golden.figures import hands_out_moments, is_optimizer_state, record_command, trajectory
from harness.suite_defs.golden.figures import key as key_of
from harness.suite_defs.golden.params import SUITE, GoldenParams

if TYPE_CHECKING:
    from harness.launch.results import CaseResult

# The relative floor and the largest spread a recording may have: the dtype's (harness/dtypes.py).
SPREAD_FACTOR = 4
# figures that are set, not computed: judged exactly against their recorded spread. (The zero count is not
# one of them: an element that sums to exactly 0.0 in one reduction order may not in another - `small`'s
# first-step count differs by 1 between layouts.)
EXACT = ("lr", "step")


def _dtype_of(key: str) -> str:
    return key.split("/")[1] if key.count("/") >= 2 else "fp32"


def tolerance(metric: str, values: list[float]) -> float:
    """SPREAD_FACTOR x the recorded spread (the dtype's relative floor is added when judging)."""
    return SPREAD_FACTOR * (max(values) - min(values))


def noisy_metrics(samples: dict[str, dict[str, list[float]]]) -> list[str]:
    """Metrics whose recorded values (every layout, every repeat) spread beyond the dtype's golden_max_spread of
    their median."""
    out = []
    for key, metrics in sorted(samples.items()):
        limit = dtype(_dtype_of(key)).golden_max_spread
        for metric, values in sorted(metrics.items()):
            if not all(math.isfinite(v) for v in values):
                out.append(f"{key} {metric}: non-finite values {values}")
                continue
            spread, med = max(values) - min(values), abs(statistics.median(values))
            exact = metric.split(".")[-1] in EXACT
            if (exact and spread > 0) or (not exact and spread > limit * max(med, 1e-12)):
                out.append(f"{key} {metric}: spread {spread:.3g} over {len(values)} runs (layouts x repeats) > "
                           f"{'0 (set, not computed)' if exact else f'{limit:g} of {med:.6g}'}")
    return out


def _allowed(metric: str, want: float, stored_tol: float, dtype_name: str) -> float:
    if metric.split(".")[-1] in EXACT:
        return stored_tol
    return max(stored_tol, dtype(dtype_name).golden_rtol * abs(want))


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want) if want else abs(got - want)


def check(results: list[CaseResult], params: GoldenParams) -> list[CheckResult]:
    """Each case's per-step figures and final fingerprints against the golden trajectory of its model and dtype."""

    out: list[CheckResult] = []
    books: dict[str, baselines.Book] = {}
    by_id = {r.case.id: r for r in results}
    for res in results:
        platform = harness_platform.detect_platform(res.case.backend).key
        if platform not in books:
            books[platform] = baselines.Book(params.baselines_dir, platform, SUITE)
        key = key_of(res.case)
        source = books[platform].source(key)
        path, entry = source.path, source.data.get("entries", {}).get(key)
        if entry is None:
            msg = (f"no golden trajectory for {key} on platform {platform} ({path}); record it with: "
                   f"{record_command(res.case)}")
            out += [CheckResult("golden.trajectory", res.case.id, False, msg),
                    CheckResult("golden.params", res.case.id, False, msg)]
            continue
        role = res.case.params.role
        if role == "":
            judged = judge(res.case.id, key, res.case.options.dtype, trajectory(res), entry,
                           moments=hands_out_moments(res))
        elif role == "first-half":  # its steps here; the rest with the resume after it
            last = res.case.options.steps // 2
            half = {m: e for m, e in entry.items() if m.startswith("step") and int(m[4:6]) <= last}
            judged = judge(res.case.id, key, res.case.options.dtype, trajectory(res), half)[:1]
        elif role == "resume":
            judged = [_check_resume(res, by_id.get(res.case.after[0]), key, entry)]
        else:
            judged = []
        # one trajectory for every stack: a move names what differs from the stack that recorded it
        record = record_command(res.case)
        out += [dataclasses.replace(c, message=c.message + baselines.across_note(source, res.case, c.failed, record))
                for c in judged]
    return out


def _check_resume(res: CaseResult, first: CaseResult | None, key: str, entry: dict) -> CheckResult:
    """The first half's steps, the resumed second half's and its final fingerprints, against the unbroken
    trajectory: a format that drops or misplaces optimizer state, the step counter or the learning rate
    leaves it at the first step after the load."""

    p, half = res.case.params, res.case.options.steps // 2
    where = f"resumed at {res.case.layout.id} from a {p.ckpt_format} checkpoint saved after step {half}"
    if first is None:
        return CheckResult("golden.resume", res.case.id, False, f"{where}: the first half did not run")
    if first.case.layout != res.case.layout:
        where = where.replace("saved after", f"saved at {first.case.layout.id} after")
    measured = {**trajectory(first), **trajectory(res, first_step=half + 1)}
    moments = hands_out_moments(res)
    steps, params = judge(res.case.id, key, res.case.options.dtype, measured, entry, moments=moments)
    if steps.failed:
        return CheckResult("golden.resume", res.case.id, False, f"{where}: {steps.message}", steps.details,
                           data=steps.data)
    if params.failed:
        return CheckResult("golden.resume", res.case.id, False, f"{where}: {params.message}", params.details)
    return CheckResult("golden.resume", res.case.id, True,
                       f"{where}: {steps.message}{_not_judged(_unjudged(entry, measured, moments))}",
                       value=steps.value, data=steps.data)


def _unjudged(entry: dict, measured: dict[str, float], moments: bool) -> list[str]:
    """The golden values' Adam state figures an engine that hands out no optimizer state cannot report."""
    return [] if moments else sorted(m for m in entry if is_optimizer_state(m) and m not in measured)


def _not_judged(unjudged: list[str]) -> str:
    return (f"; not judged: the golden values' {len(unjudged)} Adam state figures (the engine hands out no "
            f"optimizer state)" if unjudged else "")


def judge(case_id: str, key: str, dtype_name: str, measured: dict[str, float], entry: dict, *,
          moments: bool = True) -> list[CheckResult]:
    """The trajectory check (per step, the first step that left the tolerance) and the fingerprint check.
    moments: the engine handed out its Adam state (HasOptimizerState); where it does not, the golden values'
    moments are named as not judged, and where it does, a moment the run did not report fails like a parameter."""
    rows: list[tuple[str, float, float, float, bool]] = []  # metric, got, want, allowed, ok
    for metric in sorted(set(entry) & set(measured)):
        got, want = measured[metric], float(entry[metric]["value"])
        allowed = _allowed(metric, want, float(entry[metric]["tolerance"]), dtype_name)
        ok = math.isfinite(got) and abs(got - want) <= allowed
        rows.append((metric, got, want, allowed, ok))
    params = [r for r in rows if not r[0].startswith("step")]
    moved = sorted(params, key=lambda r: -_rel(r[1], r[2]))
    weights = [r for r in moved if r[0].startswith("param.")]
    largest = ""  # the first half of a resumed run has no fingerprints
    if weights:
        name, got, want = weights[0][0][len("param."):], weights[0][1], weights[0][2]
        largest = f"largest parameter change: {name} norm rel {_rel(got, want):.1e}"

    def describe(r) -> str:
        metric, got, want, allowed, _ = r
        figure = metric.split(".", 1)[1] if metric.startswith("step") else metric
        return (f"{figure} {got:.8g} vs golden {want:.8g} (rel {_rel(got, want):.1e} > "
                f"{allowed / abs(want) if want else allowed:.0e})")

    steps = [r for r in rows if r[0].startswith("step")]
    drawn = TrajectoryFigures(key, [(m, got, want, allowed) for m, got, want, allowed, _ in steps])
    missing = sorted(m for m in entry if m.startswith("step") and m not in measured)
    unjudged = _unjudged(entry, measured, moments)
    lost = sorted(m for m in entry if not m.startswith("step") and m not in measured and m not in unjudged)
    extra = sorted(m for m in measured if m not in entry)
    details = [f"  {'ok ' if r[4] else 'NO '} {r[0]}: {r[1]:.8g} vs {r[2]:.8g} (allowed +-{r[3]:.2g})" for r in rows]
    details += [f"  NO  {m}: not reported" for m in lost] + [f"  NO  {m}: not in the golden values" for m in extra]
    out = []
    bad_steps = [r for r in steps if not r[4]]
    if bad_steps or missing:
        if bad_steps:
            first = min(int(r[0][4:6]) for r in bad_steps)
            at = [r for r in bad_steps if int(r[0][4:6]) == first]
            msg = f"step {first}: " + "; ".join(describe(r) for r in at) + (f"; {largest}" if largest else "")
        else:
            more = " ..." if len(missing) > 3 else ""
            msg = f"the run reported no {', '.join(missing[:3])}{more} (in the golden trajectory)"
        out.append(CheckResult("golden.trajectory", case_id, False, msg, details, data=drawn))
    else:
        worst = max(steps, key=lambda r: _rel(r[1], r[2]), default=None)
        n = len({r[0][:6] for r in steps})
        out.append(CheckResult("golden.trajectory", case_id, True,
                               f"{n} steps within the golden trajectory of {key}" +
                               (f" (largest deviation: {worst[0]} rel {_rel(worst[1], worst[2]):.1e})"
                                if worst else ""),
                               details, value=_rel(worst[1], worst[2]) if worst else 0.0, data=drawn))
    bad_params = [r for r in params if not r[4]]
    if bad_params or lost or extra:
        if bad_params:
            head = (f"after the last step: {len(bad_params)} of {len(params)} fingerprints left the golden values; "
                    f"{describe(moved[0])}")
        elif lost:
            instead = f"; reported instead: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}" if extra else ""
            head = (f"the run reported no {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''} ({len(lost)} of "
                    f"the {len(params) + len(lost)} fingerprints judged): a parameter or optimizer state the engine "
                    f"no longer hands out{instead}")
        else:
            head = f"{', '.join(extra[:3])} not in the golden trajectory (a parameter or figure it never saw)"
        out.append(CheckResult("golden.params", case_id, False, head, details))
    else:
        out.append(CheckResult("golden.params", case_id, True,
                               f"{len(params)} parameter{' and moment' if moments else ''} norms within the golden "
                               f"values" + (f" ({largest})" if largest else "") + _not_judged(unjudged),
                               value=_rel(moved[0][1], moved[0][2]) if moved else 0.0))
    return out
