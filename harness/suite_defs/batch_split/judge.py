"""batch-split's checks: every case against its mode's reference (the global batch as one micro-batch on one rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.checks import CheckResult, StepSeries, cannot_tell, case_failed
from harness.checks.numeric import beyond, fmt_err, severity, within
from harness.checks.step_outputs import (
    LogprobDiff,
    PerToken,
    TrainedRankData,
    coverage_problem,
    first_step_logprobs,
    reports_batch,
    step_aux_losses,
    trained,
)
from harness.checks.tensors import assemble, rel_error
from harness.dtypes import dtype
from harness.engines.base import StepOutput
from harness.engines.loss_agg import readings, reference_loss
from harness.engines.mtp import MTPProbe
from harness.engines.policy_loss import NLL, PPO_CLIP, advantage
from harness.engines.rl_batch import rl_batch
from harness.launch.results import CaseResult
from harness.spec import Case, ModelSpec

if TYPE_CHECKING:
    import torch

REFERENCE = "one micro-batch on one rank"
# The zero gradient elements are counted on fp32 main grads, and an element whose terms cancel reads 0.0 in one
# summation order and a rounding residue in another: a cut (other matmul shapes, another reduction order) and its
# reference may count a few apart. Measured: 1-2 of small-moe's 9.0M elements (about one in 2^22) at CP 2,
# PP 2 and on fsdp2; 1 of tiny-moe's 132K at PP 2 (seq-mean-token-sum, temperature 0.7, entropy bonus 0.01, every
# other figure within 1e-6). Judged within ZERO_COUNT_SLACK fp32 unit roundoffs (2^-24) per element and at least
# ZERO_COUNT_FLOOR elements: 8 on small-moe, 5 on small, 2 on the tiny models. A lost or zeroed gradient moves the
# count by whole rows or tensors (a softmax normaliser outside autograd at TP 2: 256 elements on tiny).
ZERO_COUNT_SLACK = 16
ZERO_COUNT_FLOOR = 2


def zero_count_tolerance(n_elements: int) -> int:
    """How many zero gradient elements a cut may count apart from its reference (the summation order's)."""
    return max(ZERO_COUNT_FLOOR, int(ZERO_COUNT_SLACK * n_elements * 2.0 ** -24))


@dataclass(frozen=True)
class BatchSplitRankData(TrainedRankData):
    """A rank's steps and parameters (TrainedRankData), its forward-only log-prob pass of the first step's batch, and
    its DP rank's micro-batches of that batch (sample indices), for messages."""

    logprob_pass: list[StepOutput] = field(default_factory=list)
    microbatches: list[list[int]] = field(default_factory=list)
    mtp: MTPProbe | None = None  # an --mtp-layers case's measurements (no steps)


def data(result: CaseResult) -> list[BatchSplitRankData]:
    return [r.payload_as(BatchSplitRankData) for r in result.ranks]


def step_figures(result: CaseResult) -> dict[str, list[float]]:
    """Per step: the global batch's loss (the last-stage, TP-rank-0 ranks' shares summed), the gradient norm and the
    zero gradient elements (what the optimizer reported on rank 0)."""
    ranks = data(result)
    losses: dict[int, float] = {}
    for d in ranks:
        if reports_batch(d.coords):
            for i, out in enumerate(d.steps):
                if out.loss_sum is not None:
                    losses[i] = losses.get(i, 0.0) + out.loss_sum
    first = ranks[0].steps if ranks else []
    return {"loss": [losses[i] for i in sorted(losses)],
            "grad norm": [float("nan") if o.grad_norm is None else o.grad_norm for o in first],
            "zero grads": [float("nan") if o.num_zeros is None else float(o.num_zeros) for o in first]}


def forward_logprobs(result: CaseResult, what: PerToken = "logprobs") -> tuple[torch.Tensor, torch.Tensor] | None:
    """The forward-only pass's log-probs (or entropies) over the global batch and how many ranks reported each
    token (checks.step_outputs.first_step_logprobs of the pass); None when none was captured."""
    return first_step_logprobs(result, lambda d: d.logprob_pass if isinstance(d, BatchSplitRankData) else [], what)


def where(result: CaseResult, ref_engine: str | None = None) -> str:
    """'token-mean, cut tokens96 at tp1-pp1-cp2-dp2 (micro-batches of 2-5 samples)'; the engine named where it is not
    the reference's."""
    p = result.case.params
    sizes = sorted({len(m) for m in data(result)[0].microbatches}) if result.ok and result.ranks else []
    shape = "" if not sizes else f" (micro-batches of {sizes[0]}{'' if len(sizes) == 1 else f'-{sizes[-1]}'} " \
        f"sample{'s' if sizes[-1] > 1 else ''})"
    at = f"one rank as {p.like}'s DP ranks" if p.like else result.case.layout.id
    engine = f" on {result.case.engine}" if ref_engine and result.case.engine != ref_engine else ""
    heat = (f", temperature {p.temperature:g}" if p.temperature != 1.0 else "") + \
        (f", entropy bonus {p.entropy_coef:g}" if p.entropy_coef else "") + \
        (f", {p.policy_loss}" if p.policy_loss != NLL else "") + \
        (f", vocabulary {p.vocab_size} padded to {result.case.model.padded_vocab_size(result.case.layout.tp)}"
         if p.vocab_size else "") + (f", {p.mtp_layers} MTP layer{'s' if p.mtp_layers > 1 else ''}"
                                     if p.mtp_layers else "")
    return f"{p.mode}, cut {p.cut} at {at}{engine}{heat}{shape}"


def judge(results: list[CaseResult]) -> list[CheckResult]:
    """Each case against its mode's reference (one micro-batch on one rank): the forward-only log-probs; and against
    the reference that runs the same micro-batches on one rank (an MoE model's, whose load-balancing loss is per
    micro-batch, so its gradient moves with the cut - tiny-moe's loss by up to 1e-4 rel after two steps; a dense
    model's is the first): the loss, gradient norm and zero gradients of each step, the parameters, the
    load-balancing loss. Every case's first-step loss is judged against the mode's formula (_aggregation)."""
    refs = {(r.case.params.mode, r.case.params.like and r.case.params.cut, r.case.params.like): r
            for r in results if is_reference(r)}
    forward = {r.case.id: forward_logprobs(r) for r in results if r.ok}
    out: list[CheckResult] = []
    for res in results:
        if not res.ok:
            out.append(case_failed("batch-split.run", res))
            continue
        got_forward = forward[res.case.id]
        p = res.case.params
        ref = refs.get((p.mode, "", ""))
        same = refs.get((p.mode, p.cut, res.case.layout.id), ref)
        at = where(res, ref.case.engine if ref is not None else None)
        out.append(_aggregation(res, at, got_forward))
        if is_reference(res):
            continue
        if ref is None or not ref.ok or same is None or not same.ok:
            out.append(CheckResult("batch-split.loss", res.case.id, False,
                                   f"{at}: its reference ({REFERENCE}) did not run"))
            continue
        rtol = dtype(res.case.options.dtype).rtol
        got, want_same = step_figures(res), step_figures(same)
        for figure, check in (("loss", "loss"), ("grad norm", "grad_norm")):
            out.append(_steps(res, same, at, figure, check, got[figure], want_same[figure], rtol))
        out.append(_zero_counts(res, same, at, got["zero grads"], want_same["zero grads"]))
        aux, ref_aux = step_aux_losses(res), step_aux_losses(same)
        if aux is not None or ref_aux is not None:
            out.append(_steps(res, same, at, "load-balancing loss", "aux_loss", aux or [], ref_aux or [], rtol))
        out.append(_params(res, same, at, rtol))
        out.append(_logprobs(res, at, got_forward, forward[ref.case.id], rtol))
    return out


def is_reference(result: CaseResult) -> bool:
    return result.case.layout.world_size == 1


def what(ref: CaseResult) -> str:
    """How a reference ran, for messages."""
    return f"{ref.case.params.like}'s micro-batches on one rank" if ref.case.params.like else REFERENCE


def _step_counts_differ(res: CaseResult, at: str, figure: str, check: str, got: list[float],
                        want: list[float]) -> CheckResult | None:
    """A failed check where the run and its reference reported the figure for different numbers of steps."""
    if len(got) != len(want) or not got:
        return CheckResult(f"batch-split.{check}", res.case.id, False,
                           f"{at}: the {figure} of {len(got)} steps, the reference's of {len(want)}")
    return None


def _steps(res: CaseResult, ref: CaseResult, at: str, figure: str, check: str, got: list[float], want: list[float],
           tol: float) -> CheckResult:
    cid, name = res.case.id, f"batch-split.{check}"
    if (differ := _step_counts_differ(res, at, figure, check, got, want)) is not None:
        return differ
    errs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(got, want)]
    worst = max(range(len(errs)), key=lambda i: severity(errs[i]))
    ok = within(errs[worst], tol)
    rows = [f"  step {i}: {a:.8g} vs {b:.8g}  rel {fmt_err(e)}" for i, (a, b, e) in enumerate(zip(got, want, errs))]
    series = StepSeries(figure, list(got), list(want), ref.case.id, tol)
    if ok:
        return CheckResult(name, cid, ok, f"{at}: {figure} of {len(got)} steps equal the reference's "
                                          f"({what(ref)}), worst rel {fmt_err(errs[worst])}", rows, value=errs[worst],
                           data=series)
    bound = "exactly" if tol == 0 else f"rel > {tol:.0e}"
    return CheckResult(name, cid, ok, f"{at}: {figure} of step {worst} {got[worst]:.8g} vs {want[worst]:.8g} "
                                      f"({what(ref)}), rel diff {fmt_err(errs[worst])}, {bound}", rows,
                       value=errs[worst], data=series)


def _zero_counts(res: CaseResult, ref: CaseResult, at: str, got: list[float], want: list[float]) -> CheckResult:
    """Per step, the zero gradient elements against the reference's, within what the summation order explains."""
    cid, name, figure = res.case.id, "batch-split.num_zeros", "zero grads"
    if (differ := _step_counts_differ(res, at, figure, "num_zeros", got, want)) is not None:
        return differ
    n_elements = res.case.model.num_params()
    allowed = zero_count_tolerance(n_elements)
    # the padded vocabulary's rows (no token's) have zero gradients: as many more as this layout pads more
    padded = padded_rows(res.case) - padded_rows(ref.case)
    want = [b + padded for b in want]
    pads = f" + {padded} of the vocabulary rows this layout pads more" if padded else ""
    errs = [abs(a - b) for a, b in zip(got, want)]
    worst = max(range(len(errs)), key=lambda i: severity(errs[i]))
    rows = [f"  step {i}: {a:.0f} vs {b:.0f}  apart {e:.0f}" for i, (a, b, e) in enumerate(zip(got, want, errs))]
    kind = dtype(res.case.options.dtype)
    if not within(errs[worst], allowed) and not kind.zero_count_comparable:  # measured: 42-50 of tiny's 82K in bf16
        return cannot_tell(name, cid, f"{at}: {figure} of step {worst} {got[worst]:.0f} vs {want[worst]:.0f} "
                                      f"({what(ref)}{pads}): in {kind} whether an element underflows to exactly 0 "
                                      f"depends on the reduction order; judge the zero gradients with --dtype fp32",
                           rows, value=errs[worst])
    if within(errs[worst], allowed):
        return CheckResult(name, cid, True, f"{at}: {figure} of {len(got)} steps match the reference's "
                                            f"({what(ref)}{pads}): at most {errs[worst]:.0f} apart, the summation "
                                            f"order explains {allowed}", rows, value=errs[worst])
    slack = (f"more than the {allowed} the summation order explains ({ZERO_COUNT_SLACK} x 2^-24 of {n_elements} "
             f"elements, at least {ZERO_COUNT_FLOOR})")
    return CheckResult(name, cid, False, f"{at}: {figure} of step {worst} {got[worst]:.0f} vs {want[worst]:.0f} "
                                         f"({what(ref)}{pads}), {errs[worst]:.0f} apart, {slack}", rows,
                       value=errs[worst])


def _aggregation(res: CaseResult, at: str, got: tuple[torch.Tensor, torch.Tensor] | None) -> CheckResult:
    """The first step's loss against the mode's formula (harness/engines/loss_agg.py) over the forward-only pass's
    log-probs of the same batch on the same weights, with the response masks of the harness's own batch: an engine
    whose aggregation is wrong alike at every cut (the reference's too) passes the comparisons and fails here."""

    cid, case = res.case.id, res.case
    losses = step_figures(res)["loss"]
    if got is None or not losses:
        return CheckResult("batch-split.aggregation", cid, False,
                           f"{at}: no first-step loss or forward-only log-probs to judge the aggregation by")
    values, counts = got
    coef = case.params.entropy_coef
    entropy = forward_logprobs(res, "entropy") if coef else None
    if coef and entropy is None:
        return CheckResult("batch-split.aggregation", cid, False,
                           f"{at}: no forward-only entropy to judge the entropy bonus's aggregation by")
    coverage = coverage_problem(counts)
    if coverage:
        return CheckResult("batch-split.aggregation", cid, False, f"{at}: forward-only log-probs: {coverage}")
    batch = rl_batch(case.model, case.global_batch_size, case.options.seed, 0)
    mask = batch.response_masks(list(range(batch.size)), case.model.seq_length).double()
    import torch

    ppo = case.params.policy_loss == PPO_CLIP
    # PPO-clip at ratio 1: each token's loss is its sample's negative advantage, the KL penalty 0
    policy = (-torch.tensor([advantage(i) for i in range(batch.size)], dtype=torch.float64)[:, None]
              .expand_as(values) if ppo else -values.double())
    token_loss = policy - (coef * entropy[0].double() if entropy is not None else 0.0)
    want = reference_loss(case.params.mode, token_loss, mask)
    err = _rel(losses[0], want)
    rtol = dtype(case.options.dtype).rtol
    ok = within(err, rtol)
    of = ("PPO-clip loss at ratio 1 (its samples' negative advantages)" if ppo else "log-probs") + \
        (" and entropy bonus" if coef else "")
    said = (f"{at}: step-0 loss {losses[0]:.8g} {'equals' if ok else 'is not'} the {case.params.mode} of its "
            f"{'' if ppo else 'forward-only '}{of} over the response masks, {want:.8g} (rel {fmt_err(err)} "
            f"{'<=' if ok else '>'} {rtol:.0e})")
    if not ok:
        parts = {tuple(mb) for d in data(res) for mb in d.microbatches}
        known = readings(token_loss, mask, [list(mb) for mb in sorted(parts)], case.layout.cp)
        match = [(name, v) for name, v in known.items()
                 if name != case.params.mode and within(_rel(losses[0], v), rtol)]
        said += (f": it is the {match[0][0]} ({match[0][1]:.8g})" if match else
                 f": it is none of the {len(known)} definitions known here ({', '.join(known)})")
    return CheckResult("batch-split.aggregation", cid, ok, said, value=err)


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def without_padding(tensors: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """The embedding and output layer cut to the model's vocabulary (megatron's padded rows are no token's)."""
    return {n: t[:model.vocab_size] if n in VOCAB_TENSORS and t.shape[0] > model.vocab_size else t
            for n, t in tensors.items()}


def padded_rows(case: Case) -> int:
    """The gradient elements of the padded vocabulary's rows (the embedding's, and the output layer's if untied)."""
    m = case.model
    return (m.padded_vocab_size(case.layout.tp) - m.vocab_size) * m.hidden_size * (1 if m.tie_embeddings else 2)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want) if want else abs(got)


def _params(res: CaseResult, ref: CaseResult, at: str, rtol: float) -> CheckResult:
    cid = res.case.id
    full = without_padding(assemble([trained(r).params for r in res.ranks]).tensors, res.case.model)
    want = without_padding(assemble([trained(r).params for r in ref.ranks]).tensors, ref.case.model)
    if set(full) != set(want):
        return CheckResult("batch-split.params", cid, False,
                           f"{at}: parameter names differ from the reference's: "
                           f"{sorted(set(full) ^ set(want))[:5]}")
    errs = {n: rel_error(full[n], want[n]) for n in want}
    bad = sorted((n for n in errs if beyond(errs[n], rtol)), key=lambda n: -severity(errs[n]))
    worst = max(errs, key=lambda n: severity(errs[n]))
    steps = res.case.options.steps
    if not bad:
        return CheckResult("batch-split.params", cid, True,
                           f"{at}: {len(errs)} params after {steps} steps equal the reference's ({what(ref)}); "
                           f"worst {worst} "
                           f"rel {fmt_err(errs[worst])} <= {rtol:.0e}", value=errs[worst])
    return CheckResult("batch-split.params", cid, False,
                       f"{at}: {len(bad)}/{len(errs)} params after {steps} steps differ from {what(ref)}; "
                       f"worst {bad[0]}: rel {fmt_err(errs[bad[0]])} > {rtol:.0e}",
                       [f"  {n}: rel {fmt_err(errs[n])}" for n in bad], value=errs[bad[0]])


def _logprobs(res: CaseResult, at: str, got: tuple[torch.Tensor, torch.Tensor] | None,
              want: tuple[torch.Tensor, torch.Tensor] | None, rtol: float) -> CheckResult:
    """The forward-only pass (no gradient, the case's own cut) against the reference's, token by token."""
    cid = res.case.id
    if got is None or want is None:
        return CheckResult("batch-split.logprobs", cid, False,
                           f"{at}: the forward-only pass captured no per-token log-probs")
    (values, counts), (ref_values, _) = got, want
    coverage = coverage_problem(counts)
    if coverage:
        return CheckResult("batch-split.logprobs", cid, False, f"{at}: forward-only log-probs: {coverage}")
    diff = LogprobDiff.of(values, ref_values, rtol)
    exact = int((values == ref_values).sum())
    if not diff.bad.any():
        return CheckResult("batch-split.logprobs", cid, True,
                           f"{at}: forward-only log-probs of {values.numel()} tokens equal the reference's "
                           f"({exact} bit for bit), worst rel {fmt_err(diff.worst)} <= {rtol:.0e}", value=diff.worst)
    first = diff.first_sample
    return CheckResult("batch-split.logprobs", cid, False,
                       f"{at}: forward-only log-probs differ from {REFERENCE} at {int(diff.bad.sum())}/"
                       f"{values.numel()} tokens (worst rel {fmt_err(diff.worst)} > {rtol:.0e}); first: sample "
                       f"{first}, positions {diff.positions(first)}", value=diff.worst)
