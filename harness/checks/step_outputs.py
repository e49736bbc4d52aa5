"""A step's outputs assembled over a case's ranks: the global per-token loss per step and the first step's
per-token log-probs in the original token order (from the last-stage, TP-rank-0 ranks), and how log-probs
differ from reference ones. Read by equivalence, golden and peft-ckpt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from harness.dtypes import DType, dtype
from harness.engines.base import ParamShard, StepOutput
from harness.launch.results import CaseResult, RankResult
from harness.spec import Case

PerToken = Literal["logprobs", "entropy"]  # what a rank's TokenLogprobs hold per token


def reports_batch(coords: dict[str, int]) -> bool:
    """Whether a rank's losses and per-token figures count toward the global batch's: the last pipeline stage's
    ranks of TP rank 0 (each holds its DP and CP part; the other TP ranks hold copies)."""
    return bool(coords.get("last_stage")) and coords.get("tp") == 0


@dataclass(frozen=True)
class TrainedRankData:
    """What a rank that trained returns (equivalence's payload; golden's and peft-ckpt's extend it): its place
    in the layout, each step's outputs, and its parameter shards after the last step."""

    coords: dict[str, int]  # harness.platform.parallel.layout_coords
    steps: list[StepOutput]
    params: list[ParamShard] = field(default_factory=list)


def trained(rank: RankResult) -> TrainedRankData:
    """A rank's payload as TrainedRankData (or a subclass); TypeError naming the rank otherwise."""
    return rank.payload_as(TrainedRankData)


def first_step_logprobs(result: CaseResult, outputs: Callable[[TrainedRankData], list[StepOutput]] | None = None,
                        what: PerToken = "logprobs") -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log-probs [global batch, seq], how many ranks reported each token) of the first of each rank's
    `outputs` (default: its training steps), assembled from the last-stage, TP-rank-0 ranks in the original
    token order (NaN where none did); None when the engine captured none."""
    pick = outputs or (lambda d: d.steps)
    return assemble_logprobs(result.case, [(d.coords, pick(d)) for d in map(trained, result.ranks)], what)


def assemble_logprobs(case: Case, rank_outputs: list[tuple[dict[str, int], list[StepOutput]]],
                      what: PerToken = "logprobs") -> tuple[torch.Tensor, torch.Tensor] | None:
    """first_step_logprobs over (coords, step outputs) of a case's ranks; `what`: "logprobs" or "entropy" (None
    where a rank kept none)."""
    gbs, seq = case.global_batch_size, case.model.seq_length
    values = torch.full((gbs, seq), float("nan"), dtype=torch.float64)
    counts = torch.zeros((gbs, seq), dtype=torch.long)
    for c, steps in rank_outputs:
        if not reports_batch(c):
            continue
        if not steps or steps[0].token_logprobs is None:
            return None
        for part in steps[0].token_logprobs:
            figure = getattr(part, what)
            if figure is None:
                return None
            rows, cols = part.samples.view(-1, 1), part.positions.view(1, -1)
            values[rows, cols] = figure.double()
            counts[rows, cols] += 1
    return values, counts


def coverage_problem(counts: torch.Tensor) -> str:
    """'' when every token was computed by exactly one rank; else how many were not, and the first."""
    if not (counts != 1).any():
        return ""
    never, dup = int((counts == 0).sum()), int((counts > 1).sum())
    s, p = (counts != 1).nonzero()[0].tolist()
    return (f"{never} tokens computed by no rank, {dup} by more than one "
            f"(first: sample {s} position {p}, {int(counts[s, p])} times)")


# fp32 on CPU: a Hugging Face model and Megatron differ by reduction order (~1e-7); one wrong or stale tensor, or a
# wrong slice, moves tokens by >= 1e-3
HF_LOGPROB_RTOL = 1e-5


def hf_logprob_rtol(dt: DType) -> float:
    """How far a Hugging Face model's log-probs may lie from Megatron's, relative to the largest: HF_LOGPROB_RTOL in
    fp32, the dtype's own tolerance otherwise."""
    return HF_LOGPROB_RTOL if dt == DType.fp32 else dtype(dt).rtol


@dataclass
class LogprobDiff:
    """Per-token log-probs against reference ones, relative to the reference's largest magnitude."""

    bad: torch.Tensor  # [batch, seq] True where beyond the tolerance (NaN counts as beyond)
    worst: float  # the largest relative error (inf where a value is NaN)

    @classmethod
    def of(cls, values: torch.Tensor, ref_values: torch.Tensor, rtol: float) -> LogprobDiff:
        err = (values - ref_values).abs() / (float(ref_values.abs().max()) or 1.0)
        return cls(~(err <= rtol), float(err.nan_to_num(float("inf")).max()))

    @property
    def first_sample(self) -> int:
        return int(self.bad.any(dim=1).nonzero()[0])

    def positions(self, sample: int) -> str:
        return position_ranges(self.bad[sample].nonzero().flatten().tolist())


def position_ranges(positions: list[int]) -> str:
    """[0, 1, 2, 7, 9, 10] -> '0-2, 7, 9-10'."""
    out, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            out.append(f"{start}-{p}" if p > start else f"{start}")
            start = None
    return ", ".join(out)


def step_aux_losses(result: CaseResult) -> list[float] | None:
    """An MoE model's load-balancing loss per step (summed over its MoE layers), averaged over the global batch's
    micro-batches: every rank's share summed (TP / CP ranks hold parts of a micro-batch's sequence, DP ranks other
    micro-batches, PP stages other layers). None when no rank reported one (a dense model)."""
    per_rank = [[out.aux_loss for out in trained(r).steps] for r in result.ranks]
    if not per_rank or all(x is None for steps in per_rank for x in steps):
        return None
    n_micro = result.case.global_batch_size // result.case.micro_batch_size
    steps = max(len(s) for s in per_rank)
    return [sum(s[i] or 0.0 for s in per_rank if i < len(s)) / n_micro for i in range(steps)]


def step_losses(result: CaseResult) -> list[float]:
    """Global per-token mean loss per step, from the last-stage, TP-rank-0 ranks."""
    sums: dict[int, list[float]] = {}
    for data in map(trained, result.ranks):
        if not reports_batch(data.coords):
            continue
        for i, out in enumerate(data.steps):
            if out.loss_sum is None or out.num_tokens is None:
                continue
            acc = sums.setdefault(i, [0.0, 0.0])
            acc[0] += out.loss_sum
            acc[1] += out.num_tokens
    return [s / n for _, (s, n) in sorted(sums.items())]
