"""A loss aggregation written as RL frameworks write theirs, and engines that plug it in through a thin adapter
(docs/engines.md). The function knows no harness type: the per-token loss matrix, its mask, the mode and the
global normalisers, as a framework calls it; it takes whole sequences (a sample's token mean from its own mask)."""

from __future__ import annotations

from harness.engine_api import McoreEngine


def agg_loss(loss_mat, loss_mask, loss_agg_mode: str, global_tokens: int, global_batch_size: int):
    """The three modes a framework's release knows; any other is refused, as such releases refuse "token-sum"."""
    masked = loss_mat * loss_mask
    if loss_agg_mode == "token-mean":
        return masked.sum() / global_tokens
    if loss_agg_mode == "seq-mean-token-mean":
        per_sample = masked.sum(dim=-1) / loss_mask.sum(dim=-1).clamp(min=1)
        return per_sample.sum() / global_batch_size
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum(dim=-1).sum() / global_batch_size
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


class WholeSequenceLoss(McoreEngine):
    """The function over whole sequences (gathered over CP before the loss), normalised by the samples that have a
    valid token."""

    loss_form = "sequence"

    def aggregate_loss(self, inputs):
        return agg_loss(inputs.token_loss, inputs.mask, inputs.mode, inputs.totals.tokens, inputs.totals.nonempty)


class WholeSequenceLossOnChunks(WholeSequenceLoss):
    """The same function handed each CP rank's part of the sequences: a sample's token mean over half a sample."""

    loss_form = "chunk"


class LossOverEverySample(WholeSequenceLoss):
    """The function normalised by the global batch size, fully masked samples counted (another definition of
    seq-mean-token-mean)."""

    def aggregate_loss(self, inputs):
        return agg_loss(inputs.token_loss, inputs.mask, inputs.mode, inputs.totals.tokens, inputs.totals.samples)
