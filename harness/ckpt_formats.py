"""The checkpoint formats a save names - megatron's distributed optimizer's sharding types and FSDP2's - as one closed
vocabulary (ckpt-memory's, golden's, the engines' and the memory model's). A StrEnum: each member is its string, so a
results file, a flag and megatron's own metadata read the same."""

from __future__ import annotations

from enum import StrEnum


class CkptFormat(StrEnum):
    DEFAULT = "default"  # the engine's own default (McoreEngine: dp_reshardable since R1)
    DP_RESHARDABLE = "dp_reshardable"
    FULLY_RESHARDABLE = "fully_reshardable"
    FULLY_RESHARDABLE_MEM_EFFICIENT = "fully_reshardable_mem_efficient"
    FULLY_SHARDED_MODEL_SPACE = "fully_sharded_model_space"  # deprecated upstream; on disk as fully_reshardable
    FSDP2_DEFAULT = "fsdp2_default"  # the fsdp2 engine's own default
    FSDP2_SHARDED = "fsdp2_sharded"
    FSDP2_FULL = "fsdp2_full"
