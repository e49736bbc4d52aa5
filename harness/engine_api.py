"""The engine API: every name a user's engine may import, from this module only (docs/engines.md lists them).

What is exported here keeps its name and meaning: a rename keeps the old name as a deprecated alias for a release
(importing it warns, naming the new one). Every other module of the harness is internal and may move. Importing
this module imports no torch (the harness process resolves a user's engine before any rank starts).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from harness.backends import Backend
from harness.dtypes import DType, dtype
from harness.engines.base import (
    Checkpointing,
    Engine,
    ExportsWeights,
    HasGradBuffers,
    HasLogprobHead,
    HasOptimizerState,
    PadsVocabulary,
    ParamShard,
    PeftExporting,
    ProbesMTP,
    RefusesCases,
    RunsRLCycles,
    StepOutput,
    TokenLogprobs,
    TrainsRLBatches,
)
from harness.engines.fsdp2 import FSDP2Engine
from harness.engines.logprob_head import LogprobHead
from harness.engines.loss_agg import BatchTotals, MicroBatchLoss
from harness.engines.mbridge import hf_config
from harness.engines.mcore import McoreEngine
from harness.engines.model_config import layer_spec, transformer_config
from harness.engines.offloading import Offloading
from harness.engines.policy_loss import PolicyStats
from harness.engines.weight_export import buckets
from harness.errors import BadInput, MissingDependency
from harness.launch.context import RankContext
from harness.spec import Case, CaseOptions, Layout, ModelSpec

if TYPE_CHECKING:
    from harness.engines.cp_modes import CPEngine

__all__ = [
    # the engine protocol and the optional capabilities a suite checks for
    "Engine", "StepOutput", "ParamShard", "TokenLogprobs", "HasGradBuffers", "HasOptimizerState", "Checkpointing",
    "PeftExporting", "RefusesCases", "TrainsRLBatches", "RunsRLCycles", "ExportsWeights", "HasLogprobHead",
    "PadsVocabulary",
    "ProbesMTP",
    # the harness's engines, to subclass, and their parts
    "McoreEngine", "FSDP2Engine", "CPEngine", "Offloading", "LogprobHead",
    # what a factory is called with
    "Case", "CaseOptions", "ModelSpec", "Layout", "RankContext",
    # the model's configuration as the harness builds it
    "transformer_config", "layer_spec", "hf_config", "DType", "dtype", "Backend",
    # the override points' own types and helpers
    "MicroBatchLoss", "BatchTotals", "PolicyStats", "buckets",
    # errors a factory or a refusal raises
    "BadInput", "MissingDependency",
]

# old name -> (its replacement, what to write instead): each kept for one release after its rename
_DEPRECATED: dict[str, tuple[Any, str]] = {
    "hf_llama_config": (hf_config, "hf_config"),
    "torch_dtype": (lambda name: dtype(name).torch, "dtype(name).torch"),
}


def __getattr__(name: str) -> Any:
    if name == "CPEngine":  # dynamic-cp's engine imports torch: loaded when asked for
        from harness.engines.cp_modes import CPEngine

        return CPEngine
    if name in _DEPRECATED:
        value, instead = _DEPRECATED[name]
        warnings.warn(f"harness.engine_api.{name} is deprecated: use {instead}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
