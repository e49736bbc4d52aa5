"""What megatron-core reads of Transformer Engine where TE is not installed, on GPU ranks (the CPU layer does the
same on gloo ranks, reversibly: harness/platform/cpu_layer.py)."""

from __future__ import annotations

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def define_router_gemm() -> bool:
    """megatron-core 0.16's `moe_utils.router_gating_linear` (every MoE router's logits) reads `te_general_gemm`, a
    name its module defines only when TE imports: without TE every MoE forward raised NameError. None there, which
    megatron reads as torch's matmul. True where it was defined here."""
    import importlib
    from typing import Any

    try:
        moe_utils: Any = importlib.import_module(MOE_UTILS)
    except ImportError:  # a megatron-core without MoE
        return False
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
