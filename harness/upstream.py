"""Where the megatron-core and bridge releases the harness runs on differ, probed on the installed ones.

Every upstream API whose signature or behaviour moved between the tested stacks (harness.stack.TESTED) is reached
through here: a feature probe, never a version compare. Version numbers appear only in messages and in the known
upstream defects below (`KnownDefect.fixed_in`, the first release with the fix, as a bisect found it).
tests/test_upstream.py imports every upstream name the harness touches on the installed stack.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _source(module: str) -> str:
    """A module's source text, read without importing it ('' where it is not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    try:
        return Path(spec.origin).read_text()
    except OSError:
        return ""


# -- megatron-core: signatures ------------------------------------------------------------------------------
def split_on_cp_rank(batch: dict, cp_group: Any = None) -> dict:
    """megatron's zigzag split of a (not packed) batch over a CP group (default: this rank's).

    0.19 added a required `is_hybrid_cp` and, without an explicit group, splits over the world group; 0.16 took the
    CP group from parallel_state. The group is always passed."""
    from megatron.core import parallel_state as ps
    from megatron.core import utils

    group = cp_group if cp_group is not None else ps.get_context_parallel_group()
    split = utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(split).parameters:
        return split(batch, is_hybrid_cp=False, cp_group=group)
    return split(batch, cp_group=group)


def hybrid_cp_split(utils_split: Callable | None) -> Callable[[dict, int], tuple[dict, Any]]:
    """(batch of one sample, local CP size) -> (this rank's part as [1, L] tensors, PackedSeqParams): megatron's
    `get_batch_on_this_hybrid_cp_rank` where the release has it (0.16), else the same split from its parts (0.19
    removed the function; the groups, PackedSeqParams and the zigzag split stayed)."""
    if utils_split is not None:
        return utils_split
    return _hybrid_cp_split_from_parts


def _hybrid_cp_split_from_parts(sample: dict, local_cp_size: int) -> tuple[dict, Any]:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    group = ps.get_hybrid_data_context_parallel_groups(group_size=local_cp_size) if local_cp_size > 1 else None
    batch = {k: v.unsqueeze(0) if k != "attention_mask" else v for k, v in sample.items()}
    length = batch["tokens"].shape[1]
    cu = torch.tensor([0, length], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=length, max_seqlen_kv=length,
                             local_cp_size=local_cp_size, cp_group=group)
    if group is not None and group.size() > 1:
        batch = split_on_cp_rank(batch, group)
    return batch, params


def clear_moe_metrics() -> None:
    """Empty megatron's MoE auxiliary-loss tracker where it is loaded. 0.16 keeps it as a module dict that the getter
    returns; 0.19 keeps it in a MoEMetricsTracker (the getter returns a copy) and has destroy_moe_metrics_tracker."""
    import sys

    logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if logging is not None and hasattr(logging, "destroy_moe_metrics_tracker"):
        logging.destroy_moe_metrics_tracker()
        return
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def async_save_kwargs() -> dict[str, Any]:
    """dist_checkpointing.save's keywords for megatron's own asynchronous save: 0.19 defaults to NVRx's
    (nvidia-resiliency-ext) and takes async_strategy="mcore" for megatron's, deprecated but still there."""
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_sharded_save": True, "async_strategy": "mcore"}
    return {"async_sharded_save": True}


def can_save_async() -> bool:
    from megatron.core import dist_checkpointing

    return "async_sharded_save" in inspect.signature(dist_checkpointing.save).parameters


# The function that starts the async writer's results queue (a Manager megatron spawns): its name per release.
WRITE_RESULTS_QUEUE = ("get_write_results_queue", "_get_write_results_queue")  # 0.19, 0.16


def write_results_queue_name(module: Any) -> str | None:
    """The name of the async writer's results-queue starter in megatron's filesystem_async module, None where the
    release has none."""
    return next((n for n in WRITE_RESULTS_QUEUE if hasattr(module, n)), None)


def skip_threshold_field() -> str | None:
    """OptimizerConfig's field that makes megatron skip a step whose gradient norm exceeds it (0.19:
    grad_norm_skip_threshold), None where the release has none (a non-finite norm is skipped on every release)."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    return "grad_norm_skip_threshold" if "grad_norm_skip_threshold" in names else None


@functools.cache
def frozen_expert_bias_honoured() -> bool:
    """Whether megatron-core's expert-bias update skips a router whose `frozen_expert_bias` is set (the mechanism
    Megatron-LM#4785 asked for; megatron's training loop sets it when it freezes the router). Read from the source,
    without importing megatron."""
    return "frozen_expert_bias" in _source("megatron.core.distributed.finalize_model_grads")


# -- bridges ---------------------------------------------------------------------------------------------------
def mbridge_build_refusal() -> str | None:
    """Why the installed mbridge cannot build a model on the installed megatron-core (None: it can): mbridge 0.15.1
    compares against ModelType.encoder_and_decoder, which megatron-core 0.18 removed (mbridge#155, verl#6936)."""
    util = _source("mbridge.core.util")
    if "ModelType.encoder_and_decoder" not in util:
        return None
    if "encoder_and_decoder" in _source("megatron.core.enums"):
        return None
    return (f"mbridge {_version('mbridge')} cannot build a model on megatron-core {_version('megatron-core')}: it "
            "reads ModelType.encoder_and_decoder, which megatron-core 0.18 removed (mbridge#155): install an mbridge "
            "that fixes it, or use --engine megatron-bridge (verl's recommended path)")


def bridge_saves_hf_adapter(bridge: Any) -> Callable | None:
    """megatron-bridge's own HF PEFT adapter save (AutoBridge.save_hf_adapter, releases after 0.3.1), None where
    the release has none."""
    return getattr(bridge, "save_hf_adapter", None)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "(not installed)"


# -- known upstream defects --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KnownDefect:
    """An upstream defect a check knows of: reported as inconclusive ("known upstream defect ..., fixed in ...")
    where the installed release has it, judged where the fix exists and is used."""

    issue: str  # owner/repo#N
    what: str
    package: str  # the distribution that carries the defect
    fixed_in: str | None  # the first release with the fix, where one is known
    fixed: Callable[[], bool]  # a probe of the installed release

    def said(self) -> str:
        fix = (f"fixed in {self.package} {self.fixed_in}" if self.fixed_in else
               f"not fixed in any {self.package} release up to {_version(self.package)}")
        return f"known upstream defect ({self.issue}): {self.what}; {fix}"

    def present(self) -> bool:
        return not self.fixed()


def _version_at_least(dist: str, first: str) -> Callable[[], bool]:
    """A probe for a defect no feature shows: the installed release is `first` or later (an expectation range)."""
    def probe() -> bool:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.version import Version

        try:
            return Version(version(dist)) >= Version(first)
        except PackageNotFoundError:
            return False
    return probe


FROZEN_EXPERT_BIAS = KnownDefect(
    "NVIDIA/Megatron-LM#4785", "megatron-core updates a frozen router's expert bias (aux-loss-free balancing)",
    "megatron-core", "0.17.0", frozen_expert_bias_honoured)
# HybridDeviceOptimizer makes fp32 master copies only of low-precision parameters and looks every parameter up there
# after a load (_update_fp32_params_by_new_state: KeyError); the file is unchanged through 0.19.2.
OFFLOAD_FP32_LOAD = KnownDefect(
    "NVIDIA/Megatron-LM (HybridDeviceOptimizer)", "the optimizer CPU offload cannot load the state of fp32 parameters "
    "(KeyError in _update_fp32_params_by_new_state)", "megatron-core", None, lambda: False)
# Megatron-Bridge#5634 / PR #5635: expert LoRA exported wrong at ETP > 1
BRIDGE_EXPERT_LORA = KnownDefect(
    "NVIDIA-NeMo/Megatron-Bridge#5634", "megatron-bridge exports expert LoRA adapters wrong at ETP > 1",
    "megatron-bridge", "0.4.0", _version_at_least("megatron-bridge", "0.4.0"))
