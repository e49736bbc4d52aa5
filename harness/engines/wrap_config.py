"""The "wrap config" layer real RL frameworks put in front of DDP construction (regression R2).

A high-level wrap config (what the user set) plus an optional override dict become the keyword
arguments of megatron's DistributedDataParallelConfig. Merging both is the correct behaviour;
passing only the override dict to a bridge lets the bridge's own defaults win (mbridge's
`get_model` defaults to use_distributed_optimizer=True and grad_reduce_in_fp32=True).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.spec import CaseOptions


@dataclass(frozen=True)
class WrapConfig:
    """What the user configured for data-parallel wrapping, in DistributedDataParallelConfig's names."""

    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    grad_reduce_in_fp32: bool
    overlap_param_gather: bool = False
    average_in_collective: bool = False
    bucket_size: int | None = None  # gradient bucket size in elements (None: megatron's default, not passed)

    @classmethod
    def from_options(cls, options: CaseOptions) -> WrapConfig:
        return cls(use_distributed_optimizer=options.use_distributed_optimizer,
                   overlap_grad_reduce=options.overlap_grad_reduce,
                   grad_reduce_in_fp32=options.grad_reduce_in_fp32, bucket_size=options.bucket_size)


def ddp_config_dict(wrap: WrapConfig, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """DDP keyword arguments: the whole wrap config (a bucket size where one is set), then the user's overrides on
    top. Every construction path builds its DDP config from this, so each gets what the case configured."""
    configured = {k: v for k, v in asdict(wrap).items() if k != "bucket_size" or v is not None}
    return {**configured, **(overrides or {})}
