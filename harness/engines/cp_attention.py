"""A pure-torch context-parallel core attention for ranks without Transformer Engine.

megatron's local DotProductAttention asserts CP == 1; this module takes its place in the local
layer spec when CP > 1. Each rank holds the query chunks megatron's zigzag split gave it (chunks r
and 2cp-1-r of 2cp); K and V are all-gathered over the CP group (forward all-gather, backward
all-reduce + slice, which gloo supports), the causal mask is applied on global positions, and GQA
heads are expanded. Packed (THD) batches are supported too: per sequence zigzag over its padded
length (`cu_seqlens_q_padded`), attention only within a sequence, padding keys masked out. The CP
group comes from `packed_seq_params.cp_group` when the caller gives one (per-micro-batch groups of
dynamic CP) and from the static CP group otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from harness.engines.cp_data import local_thd_positions, zigzag_positions


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over a group; the backward sums the gradients and keeps the local part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank], None


def causal_attention(q, k, v, q_pos, k_pos, scale):
    """sbhd q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np*hn], causal on global positions."""
    return masked_attention(q, k, v, q_pos[:, None] < k_pos[None, :], scale)


def masked_attention(q, k, v, mask, scale):
    """sbhd attention with GQA; `mask` [sq, sk] is True where a query must not see a key."""
    np_, ng = q.shape[2], k.shape[2]
    if np_ != ng:
        k = k.repeat_interleave(np_ // ng, dim=2)
        v = v.repeat_interleave(np_ // ng, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1)


class ReferenceCPAttention(torch.nn.Module):
    """Drop-in core attention for the local spec: causal self-attention, GQA, static or per-batch CP."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.config = config
        self.static_cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        kv = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv)

    def _group(self, packed_seq_params):
        group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
        if group is not None:
            return group
        if self.static_cp_group is not None:
            return self.static_cp_group
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        group = self._group(packed_seq_params)
        cp = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if cp > 1 else 0
        if cp > 1:  # K and V in one collective each way: on gloo a collective's latency is most of a CP step
            key, value = _GatherSeq.apply(torch.cat([key, value], dim=-1), group).split(key.shape[-1], dim=-1)
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "sbhd") == "thd":
            return self._thd(query, key, value, packed_seq_params, cp, rank)
        seq = query.shape[0] * cp
        if cp > 1:
            q_pos = zigzag_positions(seq, cp, rank, query.device)
            k_pos = torch.cat([zigzag_positions(seq, cp, r, query.device) for r in range(cp)])
        else:
            q_pos = k_pos = torch.arange(seq, device=query.device)
        return causal_attention(query, key, value, q_pos, k_pos, self.softmax_scale)

    def _thd(self, query, key, value, params, cp: int, rank: int):
        """Packed [t, heads, dim] tokens: causal within each sequence, padding keys masked out."""
        cu_padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_padded = cu_padded.cpu()
        real_len = params.cu_seqlens_q.cpu().diff()
        q_seq, q_pos = local_thd_positions(cu_padded, cp, rank)
        k_parts = [local_thd_positions(cu_padded, cp, r) for r in range(cp)]
        k_seq, k_pos = torch.cat([p[0] for p in k_parts]), torch.cat([p[1] for p in k_parts])
        visible = ((q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
                   & (k_pos < real_len[k_seq])[None, :])
        # A padding query past its sequence's real tokens still sees them, so no row is all masked.
        out = masked_attention(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                               ~visible.to(query.device), self.softmax_scale)
        return out.squeeze(1)
