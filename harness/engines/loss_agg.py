"""The loss aggregation modes RL frameworks use, over a global batch cut into micro-batches.

Every mode is a weighted sum of per-token losses over the valid (response-mask) tokens of the whole global batch,
L = sum_s sum_t w(s) * loss(s, t) * mask(s, t), so a micro-batch's share of L needs the global batch's totals,
which frameworks all-reduce before the step (verl's `global_batch_info`, NeMo-RL's `global_valid_toks`):
- `token-mean`: w = 1 / (valid tokens of the global batch, summed over DP x CP);
- `seq-mean-token-mean`: w = 1 / (the sample's valid tokens x the global batch's samples with any valid token): the
  mean over samples of each sample's token mean (a fully masked sample has no mean and is not counted);
- `seq-mean-token-sum`: w = 1 / (samples of the global batch): the mean over samples of each sample's token sum;
- `token-sum`: w = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.engines.cp_data import zigzag_positions
from harness.errors import BadInput

if TYPE_CHECKING:
    import torch

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum")
# How an engine's loss takes the sequence at CP > 1 (its `loss_form`):
# - "chunk": this CP rank's part of each sequence, with each sample's valid tokens over the whole sequence
#   (`MicroBatchLoss.sample_tokens`); the shares of the CP ranks add up to the micro-batch's (megatron's own loss_func);
# - "sequence": whole sequences gathered over CP before the loss (verl's): every CP rank computes the same share.
CHUNK, SEQUENCE = "chunk", "sequence"
LOSS_FORMS = (CHUNK, SEQUENCE)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise BadInput(f"loss aggregation {mode!r}: choose one of {', '.join(MODES)}")


@dataclass(frozen=True)
class BatchTotals:
    """The global batch's normalisers, the same on every rank."""

    tokens: int  # valid loss tokens of the global batch (over DP x CP)
    samples: int  # samples of the global batch (over DP)
    nonempty: int  # samples with at least one valid token (over DP)


@dataclass
class MicroBatchLoss:
    """What a micro-batch's share of the global loss is computed from, on this rank."""

    mode: str
    token_loss: torch.Tensor  # [n, s] per-token loss (-log-prob of the label): this CP rank's part of the sequence
    # (the "chunk" loss form) or the whole sequence ("sequence")
    mask: torch.Tensor  # [n, s] 1.0 at valid response tokens
    sample_tokens: torch.Tensor  # [n] each sample's valid tokens over the whole sequence (every CP rank's part)
    totals: BatchTotals


def aggregate(inputs: MicroBatchLoss) -> torch.Tensor:
    """This micro-batch's share of the global batch's loss in its mode (the module docstring's weights)."""
    import torch

    masked = inputs.token_loss.float() * inputs.mask.float()
    per_sample = masked.sum(dim=1)
    t = inputs.totals
    if inputs.mode == "token-mean":
        return per_sample.sum() / max(t.tokens, 1)
    if inputs.mode == "seq-mean-token-mean":
        counts = inputs.sample_tokens.to(per_sample.dtype)
        means = torch.where(counts > 0, per_sample / counts.clamp(min=1), torch.zeros_like(per_sample))
        return means.sum() / max(t.nonempty, 1)
    if inputs.mode == "seq-mean-token-sum":
        return per_sample.sum() / max(t.samples, 1)
    if inputs.mode == "token-sum":
        return per_sample.sum()
    raise ValueError(f"loss aggregation {inputs.mode!r}: not one of {', '.join(MODES)}")


def reference_loss(mode: str, token_loss: torch.Tensor, mask: torch.Tensor) -> float:
    """The mode's loss of a whole global batch in one piece ([G, seq] each): what every cut must add up to."""
    import torch

    counts = mask.sum(dim=1)
    totals = BatchTotals(int(counts.sum()), int(mask.shape[0]), int((counts > 0).sum()))
    return float(aggregate(MicroBatchLoss(mode, token_loss, mask, counts.to(torch.int64), totals)))


def readings(token_loss: torch.Tensor, mask: torch.Tensor, microbatches: list[list[int]], cp: int
             ) -> dict[str, float]:
    """What the loss of a global batch ([G, seq] each) comes to under each definition frameworks give the modes: a
    loss that is not its mode's is named by the one it matches. microbatches: every DP rank's, as sample indices;
    cp: the CP size the loss was cut over."""
    import torch

    counts = mask.sum(dim=1)
    out = {mode: reference_loss(mode, token_loss, mask) for mode in MODES}
    means = torch.where(counts > 0, (token_loss * mask).sum(dim=1) / counts.clamp(min=1), torch.zeros_like(counts))
    out["seq-mean-token-mean over every sample, fully masked ones counted"] = float(means.sum() / max(len(counts), 1))
    if len(microbatches) > 1:
        means_mb = [float((token_loss[mb] * mask[mb]).sum() / mask[mb].sum().clamp(min=1)) for mb in microbatches]
        out["token-mean per micro-batch (each micro-batch's own tokens' mean, summed over the micro-batches)"] = \
            sum(means_mb)
        out["token-mean per micro-batch, averaged over the micro-batches (each one weighed alike)"] = \
            sum(means_mb) / len(means_mb)
    if cp > 1 and token_loss.shape[1] % (2 * cp) == 0:
        nonempty = max(int((counts > 0).sum()), 1)
        parts = 0.0
        for r in range(cp):
            at = zigzag_positions(token_loss.shape[1], cp, r)
            n = mask[:, at].sum(dim=1)
            parts += float(torch.where(n > 0, (token_loss[:, at] * mask[:, at]).sum(dim=1) / n.clamp(min=1),
                                       torch.zeros_like(n)).sum())
        out[f"seq-mean-token-mean with each CP rank's part of a sample taken for the sample (CP {cp})"] = \
            parts / nonempty
    return out
