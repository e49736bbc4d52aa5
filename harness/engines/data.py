"""Synthetic token batches: one seed gives the same global batch on every layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.spec import Case

if TYPE_CHECKING:
    import torch


def global_batch(case: Case, step: int) -> torch.Tensor:
    """[global_batch_size, seq_length + 1] token ids for a training step."""
    import torch

    gen = torch.Generator().manual_seed(case.options.seed * 1_000_003 + step)
    return torch.randint(0, case.model.vocab_size, (case.global_batch_size, case.model.seq_length + 1),
                         generator=gen)


def first_sample(case: Case, dp_rank: int, microbatch: int) -> int:
    """Index in the global batch of the first sample of a DP rank's micro-batch (see microbatches)."""
    return dp_rank * (case.global_batch_size // case.layout.dp) + microbatch * case.micro_batch_size


def microbatches(case: Case, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's contiguous slice of the global batch, cut into micro-batches."""
    import torch

    batch = global_batch(case, step)
    per_dp = case.global_batch_size // case.layout.dp
    mine = batch[dp_rank * per_dp:(dp_rank + 1) * per_dp]
    mbs = case.micro_batch_size
    seq = case.model.seq_length
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous()
    out = [
        {"tokens": mine[i:i + mbs, :-1].contiguous(), "labels": mine[i:i + mbs, 1:].contiguous(),
         "position_ids": position_ids}
        for i in range(0, per_dp, mbs)
    ]
    if case.options.loss_mask:
        first = dp_rank * per_dp
        for i, mb in zip(range(0, per_dp, mbs), out):
            mb["loss_mask"] = torch.stack([loss_mask(case, first + i + j) for j in range(mbs)])
    return out


def loss_mask(case: Case, sample: int) -> torch.Tensor:
    """[seq_length] 1.0 where a token counts in the loss: a tail of (sample x 7) mod (seq / 2) tokens of the
    sample (by its index in the global batch) is masked, as padding is, so samples count different numbers."""
    import torch

    seq = case.model.seq_length
    mask = torch.ones(seq)
    masked = (sample * 7) % (seq // 2)
    if masked:
        mask[seq - masked:] = 0.0
    return mask
