"""Norms of megatron's local spec under sequence parallelism (an MoE model with TP > 1 on ranks without apex or
Transformer Engine).

megatron's torch norm (`WrappedTorchNorm`) refuses sequence parallelism, because it leaves its weights unmarked:
under SP each TP rank normalises its own chunk of the sequence, so a norm weight's gradient is a partial sum that
megatron all-reduces over TP for the parameters marked `sequence_parallel` (finalize_model_grads), as apex's and
TE's norms mark theirs. This norm is torch's, marked; megatron's MoE layer refuses TP without SP, so the CPU tier
needs it for every MoE layout with TP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.adjustments import note


class SequenceParallelTorchNorm:
    """torch's RMSNorm / LayerNorm (as megatron's WrappedTorchNorm builds it) with its weights marked
    `sequence_parallel` where the config runs sequence parallel."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> Any:
        import torch

        kind = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = kind(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron reads it
        return norm


def mark_norms_sequence_parallel(spec: Any) -> int:
    """Replace megatron's WrappedTorchNorm by SequenceParallelTorchNorm everywhere in a layer or block spec (in
    place); returns how many places it replaced (and notes the adjustment when it did)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen: set[int] = set()

    def walk(node: Any) -> int:
        if id(node) in seen or node is None or isinstance(node, (str, int, float, bool, type)):
            return 0
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            return sum(walk(x) for x in node)
        if not dataclasses.is_dataclass(node):
            return 0
        n = 0
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if value is WrappedTorchNorm:
                setattr(node, f.name, SequenceParallelTorchNorm)
                n += 1
            else:
                n += walk(value)
        return n

    replaced = walk(spec)
    if replaced:
        note("norms: torch's RMSNorm / LayerNorm with their weights marked sequence_parallel (megatron's torch norm "
             "refuses sequence parallelism, which its MoE layer needs with TP; harness/engines/sp_norm.py)")
    return replaced
