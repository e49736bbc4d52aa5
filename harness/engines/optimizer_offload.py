"""megatron's optimizer CPU offload (CaseOptions.optimizer_cpu_offload): the OptimizerConfig fields it sets, and
where it cannot run or resume (probed on megatron-core's OptimizerConfig and version)."""

from __future__ import annotations

from harness.adjustments import note
from harness.backends import Backend
from harness.dtypes import DType
from harness.upstream import OFFLOAD_FP32_LOAD

# CaseOptions.optimizer_cpu_offload: the whole optimizer state on the host (HybridDeviceOptimizer; megatron asserts
# AdamW mode, OptimizerConfig's default), with the precision-aware optimizer where Transformer Engine is installed:
# megatron-core 0.16.1's OptimizerConfig asks TE's version for it (is_te_min_version: a TypeError without TE), though
# the offloaded optimizer itself does not use TE
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
PRECISION_AWARE = {"use_precision_aware_optimizer": True}


def offload_config() -> dict:
    """OptimizerConfig's fields of CaseOptions.optimizer_cpu_offload here (the adjustment noted where TE is not)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return {**OFFLOAD, **PRECISION_AWARE}

    note("optimizer CPU offload without the precision-aware optimizer: megatron-core's OptimizerConfig needs "
         "Transformer Engine installed for use_precision_aware_optimizer")
    return dict(OFFLOAD)


def offload_unsupported(backend: Backend, dtype: str) -> str:
    """'' where CaseOptions.optimizer_cpu_offload can run and resume; otherwise why not, naming what it needs."""
    if backend != Backend.NCCL:
        return ("megatron's optimizer CPU offload (HybridDeviceOptimizer) moves the state between CUDA streams: it "
                "runs on NCCL ranks only")
    import dataclasses
    from importlib.metadata import version

    from megatron.core.optimizer import OptimizerConfig

    missing = sorted((set(OFFLOAD) | set(PRECISION_AWARE)) - {f.name for f in dataclasses.fields(OptimizerConfig)})
    if missing:
        return (f"megatron-core {version('megatron-core')}'s OptimizerConfig has no {', '.join(missing)}: optimizer "
                f"CPU offload needs a megatron-core that offers them")

    if dtype == DType.fp32 and OFFLOAD_FP32_LOAD.present():
        return (f"{OFFLOAD_FP32_LOAD.said()} (megatron-core {version('megatron-core')}'s HybridDeviceOptimizer makes "
                f"fp32 master copies only of low-precision parameters); a resume with the offload needs bf16")
    return ""
