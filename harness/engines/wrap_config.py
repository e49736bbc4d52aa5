"""The "wrap config" layer real RL frameworks put in front of DDP construction (regression R2).

A high-level wrap config (what the user set) plus an optional override dict become the keyword
arguments of megatron's DistributedDataParallelConfig. Merging both is the correct behaviour;
passing only the override dict to a bridge lets the bridge's own defaults win.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.spec import CaseOptions


@dataclass(frozen=True)
class WrapConfig:
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    grad_reduce_in_fp32: bool
    overlap_param_gather: bool = False

    @classmethod
    def from_options(cls, options: CaseOptions) -> "WrapConfig":
        return cls(options.use_distributed_optimizer, options.overlap_grad_reduce, options.grad_reduce_in_fp32)


def ddp_config_dict(wrap: WrapConfig, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """DDP keyword arguments: the wrap config, then the user's overrides on top."""
    return {**asdict(wrap), **(overrides or {})}
