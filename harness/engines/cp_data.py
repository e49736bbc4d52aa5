"""Context-parallel data layout in pure torch: megatron's zigzag split for sbhd and packed THD batches.

megatron-core splits a sequence into 2*cp chunks and gives CP rank r chunks r and 2cp-1-r (so the
causal work is balanced). For packed (THD) batches it does this per sequence, each padded to a
multiple of 2*cp, through Transformer Engine's `thd_get_partitioned_indices`; CPU ranks have no TE,
so `thd_batch_on_this_cp_rank` replaces megatron's `get_thd_batch_on_this_cp_rank` here.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions within a sequence of the tokens CP rank `rank` holds after the 2*cp zigzag split."""
    import torch

    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def padded_cu_seqlens(seqlens: list[int], cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens, cu_seqlens_padded) of a pack: each sequence padded to a multiple of 2*cp."""
    import torch

    multiple = 2 * cp
    padded = [-(-n // multiple) * multiple for n in seqlens]
    zero = torch.zeros(1, dtype=torch.int32)
    return (torch.cat([zero, torch.tensor(seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)]),
            torch.cat([zero, torch.tensor(padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)]))


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Indices into a padded pack of the tokens CP rank `rank` holds (per sequence zigzag)."""
    import torch

    bounds = cu_seqlens_padded.tolist()
    parts = [start + zigzag_positions(end - start, cp, rank) for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def local_thd_positions(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position within the sequence) of every token CP rank `rank` holds."""
    import torch

    bounds = cu_seqlens_padded.tolist()
    seq_ids, positions = [], []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        pos = zigzag_positions(end - start, cp, rank)
        positions.append(pos)
        seq_ids.append(torch.full_like(pos, i))
    if not positions:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    return torch.cat(seq_ids), torch.cat(positions)


def pack_thd(samples: list[dict[str, torch.Tensor]], cp: int
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Samples (dicts of [L_i] tensors) -> one [1, T_padded] pack, cu_seqlens, cu_seqlens_padded.

    Padding tokens are zeros (loss_mask 0), appended after each sequence, so causal attention keeps
    them away from the real tokens.
    """
    import torch

    seqlens = [int(s["tokens"].shape[0]) for s in samples]
    cu, cu_padded = padded_cu_seqlens(seqlens, cp)
    out = {}
    for key in samples[0]:
        pieces = []
        for s, start, end in zip(samples, cu_padded[:-1].tolist(), cu_padded[1:].tolist()):
            value = s[key]
            pad = (end - start) - value.shape[0]
            pieces.append(torch.cat([value, value.new_zeros(pad)]) if pad else value)
        out[key] = torch.cat(pieces).unsqueeze(0)
    return out, cu, cu_padded


def thd_batch_on_this_cp_rank(batch: dict[str, Any], cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                              cp: int, rank: int, cp_group=None):
    """megatron's get_thd_batch_on_this_cp_rank without Transformer Engine: (local batch, PackedSeqParams)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = cu_seqlens_padded.diff()
    max_seqlen = int(padded.max()) if padded.numel() else 0
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, cp_group=cp_group,
    )
    if cp > 1:
        index = thd_partitioned_indices(cu_seqlens_padded, cp, rank)
        batch = {k: (v.index_select(1, index) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v)
                 for k, v in batch.items()}
    return batch, params


def whole_sequences(local: torch.Tensor, group: Any) -> torch.Tensor:
    """[n, seq] whole sequences from every CP rank's zigzag part ([n, seq / cp] each), gathered over the CP group.
    Every rank computes from the same whole sequences, so a rank's gradient is its own part's slice of theirs (no
    sum over the ranks: each already holds the whole)."""
    import torch
    import torch.distributed as dist

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = _gather_parts().apply(local, group, rank, cp)
    seq = local.shape[1] * cp
    order = torch.cat([zigzag_positions(seq, cp, r, device=local.device) for r in range(cp)]).argsort()
    return torch.cat(list(parts.unbind(0)), dim=1)[:, order]


@cache
def _gather_parts() -> Any:
    """The autograd function of `whole_sequences` (made at first use: this module does not import torch)."""
    import torch
    import torch.distributed as dist

    class GatherParts(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, cp: int) -> torch.Tensor:
            ctx.rank = rank
            parts = [torch.empty_like(local) for _ in range(cp)]
            dist.all_gather(parts, local.contiguous(), group=group)
            return torch.stack(parts)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            return grad[ctx.rank], None, None, None

    return GatherParts
