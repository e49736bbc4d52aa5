"""refit's checks: per bucket size, the stream complete and right, its memory and what repeated exports keep; per
case, the policy a Hugging Face model loaded from the stream computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness import baselines
from harness import platform as harness_platform
from harness.checks import Agreement, CheckData, CheckResult, cannot_tell, case_failed
from harness.checks.numeric import fmt_err
from harness.checks.step_outputs import LogprobDiff, coverage_problem, first_step_logprobs, hf_logprob_rtol
from harness.checks.tensors import assemble
from harness.checks.weight_stream import Expected, check_complete, check_values, first, reference
from harness.dtypes import dtype
from harness.engines.logprob_head import case_temperature
from harness.launch.results import CaseResult
from harness.probes.memory import MIB
from harness.suite_defs.refit import figures
from harness.suite_defs.refit.params import RefitParams, size_text
from harness.suite_defs.refit.payload import Export, RefitRankData

if TYPE_CHECKING:
    import torch

# What an export may hold beyond its bucket and the tensors it must build: the collectives' and Python's objects
# (names, shapes, a bridge's conversion plan walked per tensor). Measured on gloo ranks: see docs/suites.md#refit.
OVERHEAD = 1 * MIB
# A rank's memory left allocated per repeated export: megatron's and torch's per-collective bookkeeping. A bucket
# kept alive per export is the stream, bucket by bucket (tiny's 330 KiB at fp32).
RETAINED_PER_REFIT = 16 * 1024


@dataclass
class ExportPeaks(CheckData):
    """An export's host peak per rank (bytes) against the bound it is judged by, at one bucket size."""

    bucket_bytes: int
    bound_bytes: int
    peaks: dict[int, int]


def data(result: CaseResult) -> list[RefitRankData]:
    return [r.payload_as(RefitRankData) for r in result.ranks]


def where(res: CaseResult, size: int | None = None) -> str:
    """'tiny+untied at tp1-pp2-cp1-dp2 on mcore, buckets of 8 KiB'."""
    c = res.case
    name = c.model.name + (f"+{c.params.variant}" if isinstance(c.params, RefitParams) and c.params.variant else "")
    heat = f", temperature {case_temperature(c):g}" if case_temperature(c) != 1.0 else ""
    return f"{name} at {c.layout.id} on {c.engine}{heat}" + (f", buckets of {size_text(size)}" if size else "")


def trained(res: CaseResult) -> dict[str, torch.Tensor]:
    """The trained parameters (and expert biases) of every rank assembled, under megatron's global names."""

    return assemble([d.params for d in data(res)]).tensors


def must_build(full: dict[str, torch.Tensor], res: CaseResult) -> int:
    """The largest tensor an export must build at once, in the case's dtype: the largest parameter gathered whole (a
    fused QKV or gate/up weight; one expert's)."""
    return max(t.numel() for t in full.values()) * dtype(res.case.options.dtype).torch.itemsize


def judge(results: list[CaseResult], params: RefitParams) -> list[CheckResult]:
    out: list[CheckResult] = []
    books: dict[str, Any] = {}
    for res in results:
        if not res.ok:
            out.append(case_failed("refit.run", res))
            continue
        ranks = data(res)
        full = trained(res)
        ref = reference(full, res.case.model)
        hf = ranks[0].hf
        expected = Expected({k: shape for k, (shape, _) in hf.expected.items()}, set(hf.tied), "HF") if hf else \
            Expected({k: tuple(t.shape) for k, t in ref.items()}, set(), "the harness's mapping")
        biggest = must_build(full, res)
        for i, export in enumerate(ranks[0].exports):
            per_rank = [(r.rank, d.exports[i]) for r, d in zip(res.ranks, ranks)]
            at = where(res, export.bucket_bytes)
            sent = [(r, e.sent) for r, e in per_rank]
            out.append(check_complete("refit.complete", res.case.id, at, sent, expected))
            out.append(check_values("refit.values", res.case.id, at, sent, expected, ref, ranks[0].stream or {}))
            out.append(check_memory(res, at, per_rank, biggest))
            out.append(check_repeats(res, at, per_rank))
        out.append(check_policy(res, ranks))
        out.append(check_baseline(res, params, books))
    return out


def check_baseline(res: CaseResult, params: RefitParams, books: dict[str, Any]) -> CheckResult:
    """Each rank's export peak per bucket size against its baseline entry (figures.key)."""

    platform = harness_platform.detect_platform(res.case.backend).key
    if platform not in books:
        books[platform] = baselines.Book(params.baselines_dir, platform, "refit")
    key, cid = figures.key(res.case), res.case.id
    source = books[platform].source(key)
    path = source.path
    verdicts = {m: baselines.compare(source.data, key, m, v) for m, v in figures.samples(res).items()}
    rows = [f"  {m}: {v.measured * 1024:.0f} KiB, baseline " + ("-" if v.baseline is None else
            f"{v.baseline * 1024:.0f} +- {(v.tolerance or 0) * 1024:.0f}") + f": {v.status}"
            for m, v in verdicts.items()]
    shown = baselines.BaselineFigures(key, verdicts)
    missing = [m for m, v in verdicts.items() if v.status is baselines.BaselineStatus.MISSING]
    if missing:
        return CheckResult("refit.baseline", cid, False, f"{where(res)}: no baseline for {key} {missing[0]} on "
                                                         f"platform {source.platform} ({path}); record it with: "
                                                         f"{figures.record_command(res.case)}", rows,
                           data=shown)
    off = (baselines.BaselineStatus.REGRESSION, baselines.BaselineStatus.IMPROVEMENT)
    moved = [m for m, v in verdicts.items() if v.status in off]
    across = baselines.across_note(source, res.case, bool(moved), figures.record_command(res.case))
    if not moved:
        return CheckResult("refit.baseline", cid, True, f"{where(res)}: every rank's export peak within its baseline "
                                                        f"({key}){across}", rows, data=shown)
    m = max(moved, key=lambda x: abs(verdicts[x].delta))
    v = verdicts[m]
    worse = v.status is baselines.BaselineStatus.REGRESSION
    verb = "above" if worse else "below (improvement: " + (
        "see below)" if across else f"refresh the baseline with `{figures.record_command(res.case)}`)")
    base, tol = (v.baseline or 0) * 1024, (v.tolerance or 0) * 1024
    return CheckResult("refit.baseline", cid, False, f"{where(res)}: {m} {v.measured * 1024:.0f} KiB is "
                                                     f"{v.delta * 1024:+.0f} KiB {verb} baseline {base:.0f} +- "
                                                     f"{tol:.0f} KiB{across}", rows, improvement=not worse, data=shown)


def check_memory(res: CaseResult, at: str, per_rank: list[tuple[int, Export]], biggest: int) -> CheckResult:
    """Per rank: the export's host peak within a bucket + 2 x the largest tensor it must build (its gathered pieces
    and the whole) + OVERHEAD; its largest single allocation within that tensor."""
    cid, name = res.case.id, "refit.memory"
    for r, e in per_rank:
        over = _over_budget(e)
        if over:
            return CheckResult(name, cid, False, f"{at}: rank {r}, {over}")
    rows = [f"  rank {r}: peak {e.peak.host_peak / 1024:.0f} KiB, largest allocation {e.largest / 1024:.1f} KiB at "
            f"{e.largest_at}" for r, e in per_rank]
    for r, e in per_rank:
        if e.largest > biggest:
            return CheckResult(name, cid, False, f"{at}: rank {r} built {e.largest / 1024:.1f} KiB at once, beyond "
                                                 f"the largest tensor the export must build ({biggest / 1024:.1f} "
                                                 f"KiB), at {e.largest_at}", rows, value=e.largest)
    bound = per_rank[0][1].bucket_bytes + 2 * biggest + OVERHEAD
    r, worst = max(per_rank, key=lambda x: x[1].peak.host_peak)
    ok = worst.peak.host_peak <= bound
    return CheckResult(name, cid, ok, f"{at}: rank {r}'s export peak {worst.peak.host_peak / 1024:.0f} KiB "
                                      f"{'within' if ok else 'beyond'} bucket + 2 x largest tensor "
                                      f"({biggest / 1024:.1f} KiB) + {OVERHEAD // MIB} MiB = {bound / 1024:.0f} KiB; "
                                      f"largest allocation {worst.largest / 1024:.1f} KiB", rows,
                       value=worst.peak.host_peak / MIB, show=not ok,
                       data=ExportPeaks(per_rank[0][1].bucket_bytes, bound, {r: e.peak.host_peak for r, e in per_rank}))


def _over_budget(e: Export) -> str:
    """'' when every bucket holds at most the bucket size (a larger tensor alone in its own); else the first that
    does not."""
    import torch

    sizes: dict[int, list[int]] = {}
    for s in e.sent:
        numel = 1
        for d in s.shape:
            numel *= d
        sizes.setdefault(s.bucket, []).append(numel * getattr(torch, s.dtype).itemsize)
    for b, tensors in sorted(sizes.items()):
        if sum(tensors) > max(e.bucket_bytes, max(tensors)):
            return (f"bucket {b} holds {sum(tensors) / 1024:.1f} KiB in {len(tensors)} tensors, beyond the bucket size "
                    f"{size_text(e.bucket_bytes)}")
    return ""


def check_repeats(res: CaseResult, at: str, per_rank: list[tuple[int, Export]]) -> CheckResult:
    """Repeated exports of the same weights: the same stream each time, and at most RETAINED_PER_REFIT left
    allocated per export."""
    cid, name = res.case.id, "refit.repeat"
    for r, e in per_rank:
        if e.differ:
            return CheckResult(name, cid, False, f"{at}: rank {r}, the same weights exported again: {e.differ[0]}",
                               [f"  {x}" for x in e.differ])
    kept = [(r, e.retention) for r, e in per_rank if e.retention is not None]
    if not kept:
        return cannot_tell(name, cid, f"{at}: no repeated exports measured")
    r, worst = max(kept, key=lambda x: x[1].per_save)
    ok = worst.per_save <= RETAINED_PER_REFIT
    site = worst.top[0][0] if worst.top else "(no stack)"
    msg = (f"{at}: {worst.saves} exports of the same weights give the same stream on every rank, and rank {r} "
           f"keeps {worst.per_save / 1024:.1f} KiB per export (bound {RETAINED_PER_REFIT // 1024} KiB; what "
           f"torch.distributed keeps for itself apart: {worst.bookkeeping / worst.saves / 1024:.1f} KiB)")
    return CheckResult(name, cid, ok, msg if ok else msg + f"; most of it from {site}", value=worst.per_save)


def check_policy(res: CaseResult, ranks: list[RefitRankData]) -> CheckResult:
    """The HF model loaded from the stream (no key missing, none unexpected) computes the Megatron model's
    log-probs of a held-out batch."""

    cid, name, at = res.case.id, "refit.policy", where(res)
    hf = ranks[0].hf
    if hf is None:
        return cannot_tell(name, cid, f"{at}: no Hugging Face model holds it ({ranks[0].hf_none})")
    if hf.load_error or hf.missing or hf.unexpected:
        why = hf.load_error or "; ".join(x for x in (hf.missing and f"missing {first(hf.missing)}",
                                                     hf.unexpected and f"unexpected {first(hf.unexpected)}") if x)
        return CheckResult(name, cid, False, f"{at}: the HF model does not load from the stream strictly: {why}")
    got = first_step_logprobs(res, lambda d: d.held_out if isinstance(d, RefitRankData) else [])
    if got is None or hf.logprobs is None:
        return CheckResult(name, cid, False, f"{at}: no held-out log-probs captured")
    megatron, counts = got
    problem = coverage_problem(counts)
    if problem:
        return CheckResult(name, cid, False, f"{at}: held-out log-probs: {problem}")
    rtol = hf_logprob_rtol(res.case.options.dtype)
    diff = LogprobDiff.of(hf.logprobs, megatron, rtol)
    if diff.bad.any():
        s = diff.first_sample
        return CheckResult(name, cid, False, f"{at}: the HF model loaded from the stream differs from the Megatron "
                                             f"model at {int(diff.bad.sum())}/{megatron.numel()} held-out tokens "
                                             f"(worst rel {fmt_err(diff.worst)} > {rtol:.0e}); first: sample {s}, "
                                             f"positions {diff.positions(s)}", value=diff.worst,
                           data=Agreement(diff.worst, rtol, int(diff.bad.sum()), megatron.numel()))
    return CheckResult(name, cid, True, f"{at}: the HF model loaded from the stream computes the Megatron model's "
                                        f"log-probs of {megatron.numel()} held-out tokens, worst rel "
                                        f"{fmt_err(diff.worst)} <= {rtol:.0e}", value=diff.worst,
                       data=Agreement(diff.worst, rtol, 0, megatron.numel()))


def table_figures(result: CaseResult) -> dict[str, Any]:
    """Per bucket size: the largest export peak and allocation over the ranks (KiB), and the buckets sent."""
    out: dict[str, Any] = {}
    ranks = data(result)
    for i, e in enumerate(ranks[0].exports):
        size = size_text(e.bucket_bytes).replace(" ", "")
        out[f"peak_kib@{size}"] = round(max(d.exports[i].peak.host_peak for d in ranks) / 1024, 1)
        out[f"largest_kib@{size}"] = round(max(d.exports[i].largest for d in ranks) / 1024, 1)
        out[f"buckets@{size}"] = max((s.bucket for s in e.sent), default=-1) + 1
    return out


__all__ = ["judge", "table_figures"]
