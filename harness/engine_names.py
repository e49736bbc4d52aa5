"""The built-in engines' names, as `--engine` takes them (a user's engine is named by its import path,
`package.module:factory`, instead); harness/engines/__init__.py maps each to its class."""

from __future__ import annotations

from enum import StrEnum


class EngineName(StrEnum):
    MCORE = "mcore"  # megatron-core directly: the reference construction path
    MBRIDGE = "mbridge"
    MEGATRON_BRIDGE = "megatron-bridge"
    FSDP2 = "fsdp2"
