"""Judging dynamic-cp (harness/suite_defs/dynamic_cp/suite.py) in the parent: every case of a mix against its no-CP
reference, from the tensors the ranks returned (coverage of every token, log-probs, loss, gradients)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.checks import CheckResult, ParamErrors, case_failed
from harness.checks.numeric import beyond, fmt_err, nonfinite_count, nonfinite_summary, severity, within
from harness.checks.tensors import rel_error
from harness.dtypes import dtype
from harness.engines.cp_modes import CPMode, TokenOutputs
from harness.launch.results import CaseResult, RankResult


@dataclass(frozen=True)
class DynamicCPRankData:
    """What a dynamic-cp rank returns: the log-probs it computed, per part of a sample and with the local CP size
    it ran at, its loss sum and token count; rank 0 also the engine's merged log-probs per sample (in the
    original order) and the full gradient of every parameter."""

    records: list[TokenOutputs]
    loss_sum: float
    num_tokens: int
    merged: list[torch.Tensor] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def cp_data(rank: RankResult) -> DynamicCPRankData:
    return rank.payload_as(DynamicCPRankData)


def expected_local_cp(length: int, max_per_rank: int) -> int:
    """The smallest local CP size a sample may run at: the next power of two of
    ceil(length / max_seqlen_per_dp_cp_rank) (docs/architecture.md, R3)."""
    cp = 1
    while cp * max_per_rank < length:
        cp *= 2
    return cp


def judge(results: list[CaseResult]) -> list[CheckResult]:
    """Every case against the no-CP reference of its mix: coverage, log-probs, loss, gradients."""
    out: list[CheckResult] = []
    by_mix: dict[str, list[CaseResult]] = {}
    for res in results:
        by_mix.setdefault(res.case.params.mix, []).append(res)
    for group in by_mix.values():
        ref = next((r for r in group if r.case.params.cp_mode == "none"), None)
        for res in group:
            cid = res.case.id
            if not res.ok:
                out.append(case_failed("dynamic-cp.run", res))
                continue
            out.append(_check_coverage(res))
            if res is ref:
                continue
            if ref is None or not ref.ok:
                out.append(CheckResult("dynamic-cp.logprobs", cid, False,
                                       "the no-CP reference of this mix did not run"))
                continue
            # CP changes only the reduction order (attention over gathered K/V, gradient sums): fp32 measured
            # ~1e-7 (log-probs) to ~2e-6 (gradients); a wrong chunk, sample or scale is >= 1e-2
            rtol = dtype(res.case.options.dtype).rtol
            out.append(_check_logprobs(res, ref, rtol))
            out.append(_check_loss(res, ref, rtol))
            out.append(_check_grads(res, ref, rtol))
    return out


def _check_coverage(res: CaseResult) -> CheckResult:
    """Every real token of every sample computed exactly once; dynamic: at the expected local CP size."""
    o = res.case.params
    lengths = o.seqlens
    counts = [torch.zeros(n, dtype=torch.long) for n in lengths]
    local_cp: dict[int, set[int]] = {}
    problems = []
    for rank in res.ranks:
        for rec in cp_data(rank).records:
            if not 0 <= rec.sample < len(lengths):
                problems.append(f"rank {rank.rank} computed tokens of sample {rec.sample}, which is not in the batch")
                continue
            counts[rec.sample].index_add_(0, rec.positions, torch.ones_like(rec.positions))
            local_cp.setdefault(rec.sample, set()).add(rec.local_cp)
    for i, c in enumerate(counts):
        if (c != 1).any():
            missing, dup = int((c == 0).sum()), int((c > 1).sum())
            problems.append(f"sample {i} (length {lengths[i]}): {missing} tokens never computed, "
                            f"{dup} computed more than once (max {int(c.max())} times)")
    rows = []
    if o.cp_mode == CPMode.DYNAMIC:
        for i, n in enumerate(lengths):
            # The harness's own arithmetic, not the engine's padding (the code under test): the
            # sample padded to a multiple of 2 x world size, as the zigzag split needs.
            padded = n + (-n % (2 * res.case.layout.world_size))
            need = expected_local_cp(padded, o.max_seqlen_per_dp_cp_rank)
            got = sorted(local_cp.get(i, set()))
            rows.append(f"  sample {i}: length {n}, local CP {','.join(map(str, got)) or '-'} (needs >= {need})")
            # The scheduler may give a sample more ranks than it needs (to fill idle ones), never fewer.
            ok = len(got) == 1 and need <= got[0] <= res.case.layout.world_size and got[0] & (got[0] - 1) == 0
            if not ok:
                problems.append(f"sample {i} (length {n}): ran at local CP size {got or 'never'}, needs one power "
                                f"of two >= {need} (ceil({padded} / max_seqlen_per_dp_cp_rank="
                                f"{o.max_seqlen_per_dp_cp_rank}) rounded up)")
    sizes = sorted({s for v in local_cp.values() for s in v})
    if problems:
        return CheckResult("dynamic-cp.coverage", res.case.id, False,
                           f"{res.case.layout.id} {o.cp_mode}: {problems[0]}" +
                           (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
                           [f"  {p}" for p in problems] + rows)
    return CheckResult("dynamic-cp.coverage", res.case.id, True,
                       f"every token of {len(lengths)} samples computed once; local CP sizes {sizes}", rows,
                       show=o.cp_mode == CPMode.DYNAMIC)


def _check_logprobs(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
    lengths = res.case.params.seqlens
    got = _rank0(res).merged
    want = _reference_logprobs(ref)
    head = f"{res.case.layout.id} {res.case.params.cp_mode}"
    if len(got) != len(want):
        return CheckResult("dynamic-cp.logprobs", res.case.id, False,
                           f"{head}: the merged output has {len(got)} samples, the batch has {len(want)} "
                           f"(lengths merged {[len(t) for t in got]}, batch {list(lengths)})")
    rows, worst, bad = [], (0.0, -1), []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            bad.append(i)
            rows.append(f"  sample {i}: {len(g)} log-probs merged, length {len(w)} expected")
            worst = max(worst, (float("inf"), i))
            continue
        abs_err = float((g.double() - w.double()).abs().max()) if len(w) else 0.0
        rel = abs_err / max(float(w.abs().max()), 1e-12) if len(w) else 0.0
        n_bad = nonfinite_count(g) + nonfinite_count(w)
        rows.append(f"  sample {i}: length {len(w)}, max abs {fmt_err(abs_err)}, rel {fmt_err(rel)}"
                    + (f", {n_bad} non-finite log-probs" if n_bad else ""))
        if beyond(rel, rtol):
            bad.append(i)
        worst = max(worst, (rel, i), key=lambda t: severity(t[0]))
    if bad:
        i = bad[0]
        return CheckResult("dynamic-cp.logprobs", res.case.id, False,
                           f"{head}: log-probs of sample {i} differ from no CP: {rows[i].strip()} "
                           f"(tolerance rel {rtol:.0e}; {len(bad)}/{len(want)} samples off)", rows, value=worst[0])
    return CheckResult("dynamic-cp.logprobs", res.case.id, True,
                       f"{head}: log-probs of {len(want)} samples equal no CP, worst sample {worst[1]} rel "
                       f"{worst[0]:.2e} <= {rtol:.0e}", rows, value=worst[0], show=True)


def _check_loss(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
    got, want = loss_per_token(res), loss_per_token(ref)
    rel = abs(got - want) / abs(want) if want else abs(got - want)
    ok = within(rel, rtol)
    return CheckResult("dynamic-cp.loss", res.case.id, ok,
                       f"{res.case.layout.id} {res.case.params.cp_mode}: per-token loss {got:.8f} vs no CP "
                       f"{want:.8f} (tokens {_tokens(res)} vs {_tokens(ref)}), rel {fmt_err(rel)} "
                       f"{'<=' if ok else '>'} {rtol:.0e}", value=rel)


def _check_grads(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
    got, want = _rank0(res).grads, _rank0(ref).grads
    head = f"{res.case.layout.id} {res.case.params.cp_mode}"
    if set(got) != set(want):
        return CheckResult("dynamic-cp.grads", res.case.id, False,
                           f"{head}: parameter names differ from no CP: {sorted(set(got) ^ set(want))[:5]}")
    errs = {n: rel_error(got[n], want[n]) for n in want}
    drawn = ParamErrors(ref.case.id, rtol, {n: float(e) for n, e in errs.items()})
    worst = max(errs, key=lambda n: severity(errs[n]))
    bad = sorted((n for n in errs if beyond(errs[n], rtol)), key=lambda n: -severity(errs[n]))
    if bad:
        ratio = float(got[bad[0]].norm() / want[bad[0]].norm().clamp_min(1e-30))
        _, nonfinite = nonfinite_summary({n: got[n] for n in bad})
        return CheckResult("dynamic-cp.grads", res.case.id, False,
                           f"{head}: {len(bad)}/{len(errs)} gradients differ from no CP; worst {bad[0]}: rel "
                           f"{fmt_err(errs[bad[0]])} > {rtol:.0e} (norm ratio {ratio:.4f})"
                           + (f" (non-finite: {nonfinite})" if nonfinite else ""),
                           [f"  {n}: rel {fmt_err(errs[n])}" for n in bad], value=errs[bad[0]], data=drawn)
    return CheckResult("dynamic-cp.grads", res.case.id, True,
                       f"{head}: {len(errs)} gradients equal no CP, worst {worst} rel {errs[worst]:.2e} <= {rtol:.0e}",
                       value=errs[worst], data=drawn)


def _rank0(res: CaseResult) -> DynamicCPRankData:
    return next(cp_data(r) for r in res.ranks if r.rank == 0)


def _reference_logprobs(ref: CaseResult) -> list[torch.Tensor]:
    """The no-CP run's log-probs per sample, assembled here (no engine merge involved)."""
    lengths = ref.case.params.seqlens
    out = [torch.full((n,), float("nan")) for n in lengths]
    for rank in ref.ranks:
        for rec in cp_data(rank).records:
            if 0 <= rec.sample < len(lengths):
                out[rec.sample][rec.positions] = rec.logprobs
    return out


def loss_per_token(res: CaseResult) -> float:
    s = sum(cp_data(r).loss_sum for r in res.ranks)
    return s / max(_tokens(res), 1)


def _tokens(res: CaseResult) -> int:
    return sum(cp_data(r).num_tokens for r in res.ranks)
