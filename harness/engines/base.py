"""The Engine protocol: what the suites need from any training engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ParamShard:
    """One rank's piece of a parameter, with what is needed to rebuild the full tensor."""

    name: str  # global name, layer index made global (decoder.layers.3.mlp...)
    tensor: torch.Tensor  # CPU copy
    partition_dim: int | None  # None: replicated across TP
    tp_rank: int
    tp_size: int
    tp_parts: int = 1  # >1: the full tensor is that many blocks along partition_dim, each sharded (SwiGLU fc1)


def tp_shard(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, parts: int = 1) -> torch.Tensor:
    """This TP rank's shard of a full tensor; with parts > 1 each block is sharded separately."""
    return torch.cat([block.chunk(tp_size, dim=dim)[tp_rank] for block in full.chunk(parts, dim=dim)], dim=dim)


def tp_unshard(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Inverse of tp_shard over the shards of TP ranks 0..tp_size-1."""
    split = [s.chunk(parts, dim=dim) for s in shards]
    return torch.cat([torch.cat([sp[i] for sp in split], dim=dim) for i in range(parts)], dim=dim)


@dataclass
class TokenLogprobs:
    """Per-token log-probs of one micro-batch as one rank computed them (the label token's log-prob)."""

    samples: torch.Tensor  # [mbs] indices into the global batch
    positions: torch.Tensor  # [s_local] positions within the sequence (after the CP split)
    logprobs: torch.Tensor  # [mbs, s_local]


@dataclass
class StepOutput:
    """Sums over this rank's micro-batches; only last-pipeline-stage ranks report losses. Engines that
    capture per-token log-probs for a step put them in token_logprobs (None: not captured)."""

    loss_sum: float | None
    num_tokens: int | None
    token_logprobs: list[TokenLogprobs] | None = None
    # what the optimizer's step reported (every rank the same): the global gradient norm before clipping, the
    # zero gradient elements (None unless CaseOptions.log_num_zeros_in_grad) and the learning rate it applied
    grad_norm: float | None = None
    num_zeros: int | None = None
    lr: float | None = None


class Engine(Protocol):
    def build(self) -> None: ...

    def train_step(self, step: int) -> StepOutput: ...

    def param_shards(self) -> list[ParamShard]: ...


@runtime_checkable
class HasOptimizerState(Protocol):
    """An engine that hands out its Adam state (exp_avg, exp_avg_sq, step) as `<global name>#<key>` shards of the
    parameter's layout, whole over DP, from DP rank 0 (other ranks: []) - McoreCheckpoints does."""

    def optimizer_state_shards(self) -> list[ParamShard]: ...
