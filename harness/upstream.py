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

from harness.errors import MissingDependency


def _source(module: str) -> str:
    """A module's source text, read from its file without importing it or its parent packages (find_spec on a
    dotted name imports the parents: mbridge's __init__ imports megatron-core and torch); '' where it is not
    installed."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return ""
    if spec is None:
        return ""
    roots = [Path(p) for p in spec.submodule_search_locations or []]  # a namespace package (megatron) has several
    candidates = [r.joinpath(*rest[:-1], f"{rest[-1]}.py") for r in roots] if rest else \
        [Path(spec.origin)] if spec.origin else []
    for path in candidates:
        try:
            return path.read_text()
        except OSError:
            continue
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


# -- megatron-core: dynamic (hybrid) context parallel ---------------------------------------------------------------
@dataclass(frozen=True)
class DynamicCPApi:
    """megatron-core's names for dynamic CP: `hybrid_*` in releases 0.16-0.19, `dynamic_*` on the dev branch. The
    split of a sample over its local CP group is megatron's own where the release has it (0.16), else made of the
    parts that stayed (hybrid_cp_split)."""

    flag: str  # initialize_model_parallel keyword and TransformerConfig field
    schedule_module: str  # has BalancedCPScheduler
    split: Any  # (batch of one sample, local_cp_size) -> (this rank's part, PackedSeqParams)


_DYNAMIC_CP_APIS = (("hybrid_context_parallel", "megatron.core.pipeline_parallel.hybrid_cp_schedule",
                     "get_batch_on_this_hybrid_cp_rank"),
                    ("dynamic_context_parallel", "megatron.core.pipeline_parallel.dynamic_cp_schedule",
                     "get_batch_on_this_dynamic_cp_rank"))


def dynamic_cp_api() -> DynamicCPApi:
    """The installed megatron-core's dynamic-CP API (feature-probed), or MissingDependency naming what is missing."""
    import importlib

    from megatron.core import parallel_state, utils

    init_args = inspect.signature(parallel_state.initialize_model_parallel).parameters
    missing = []
    for flag, module, split in _DYNAMIC_CP_APIS:
        try:
            schedule = importlib.import_module(module)
        except ImportError:
            missing.append(f"{module}")
            continue
        parts = [flag in init_args, hasattr(schedule, "BalancedCPScheduler")]
        if all(parts):
            return DynamicCPApi(flag, module, hybrid_cp_split(getattr(utils, split, None)))
        missing.append(", ".join(name for name, ok in zip(
            (f"initialize_model_parallel({flag}=)", f"{module}.BalancedCPScheduler"), parts) if not ok))
    raise MissingDependency("dynamic CP needs megatron-core's hybrid_context_parallel API (releases 0.16-0.19) or "
                            "the dev branch's dynamic_context_parallel; the installed one lacks: " + "; ".join(missing))


def check_dynamic_cp_available() -> None:
    """MissingDependency naming the megatron-core versions that have dynamic CP."""
    dynamic_cp_api()


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
    """The name of the async writer's results-queue starter in megatron's filesystem_async module (which keeps the
    queue in its `_results_queue`), None where the release has none."""
    if not hasattr(module, "_results_queue"):
        return None
    return next((n for n in WRITE_RESULTS_QUEUE if callable(getattr(module, n, None))), None)


def dispatcher_moves_to_cpu(dispatcher: Any) -> bool:
    """Whether megatron's MoE token dispatcher module moves its split sizes to the host through
    maybe_move_tensor_to_cpu (0.16 - 0.19), the function the CPU layer replaces."""
    return callable(getattr(dispatcher, "maybe_move_tensor_to_cpu", None))


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


def mtp_detach_refusal() -> str | None:
    """Why the installed megatron-core cannot train multi-token prediction with its heads detached from the main
    model, as RL frameworks train it (None: it can): TransformerConfig.mtp_detach_heads, which 0.19.2 has and 0.16.1
    lacks. Read from the source, without importing megatron."""
    if "mtp_detach_heads" in _source("megatron.core.transformer.transformer_config"):
        return None
    return (f"megatron-core {_version('megatron-core')} has no TransformerConfig.mtp_detach_heads (MTP heads detached "
            f"from the main model, as RL frameworks train them; 0.19.2 has it): run --mtp-layers on the current stack "
            f"(nox -s cpu-suite)")


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


def bridge_transformers_mismatch() -> str | None:
    """Why the installed transformers cannot carry the installed megatron-bridge (0.6 imports transformers 5 names,
    0.3 needs transformers 4), from megatron-bridge's own metadata; None where it can (or either is not installed)."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    try:
        wanted = [Requirement(r) for r in requires("megatron-bridge") or []]
        have = version("transformers")
    except PackageNotFoundError:
        return None
    spec = next((r.specifier for r in wanted if r.name == "transformers" and not r.marker), None)
    if spec is None or spec.contains(have, prereleases=True):
        return None
    return (f"megatron-bridge {version('megatron-bridge')} needs transformers {spec}, this environment has {have}: "
            f"pip install 'transformers{spec}'")


def bridge_saves_hf_adapter(bridge: Any) -> Callable | None:
    """megatron-bridge's own HF PEFT adapter save (AutoBridge.save_hf_adapter, releases after 0.3.1), quiet (0.6
    draws a progress bar unless told not to); None where the release has none."""
    save = getattr(bridge, "save_hf_adapter", None)
    if save is None:
        return None
    if "show_progress" in inspect.signature(save).parameters:
        return functools.partial(save, show_progress=False)
    return save


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


def _release_at_least(dist: str, first: str) -> Callable[[], bool]:
    """A probe for a fix no feature shows (a changed scaling): the installed release is `first` or later (an
    expectation range, read from the releases' source: harness/upstream.py's KnownDefect entries say where)."""
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
    "megatron-core", "0.19.0", frozen_expert_bias_honoured)
# Under the per-token loss megatron scaled the auxiliary loss's gradient by each TP x CP rank's own token count, so an
# MoE router trains differently at TP or CP > 1 than at pure DP (PR #5047); the router's rescaling was rewritten in
# 0.19.0 (transformer/moe/router.py, read in the 0.17.0 - 0.19.0 wheels). golden's MoE matrix leaves TP and CP out.
MOE_AUX_LOSS_SCALING = KnownDefect(
    "NVIDIA/Megatron-LM#5047", "the auxiliary loss's gradient under the per-token loss is scaled by each TP x CP "
    "rank's own token count", "megatron-core", "0.19.0", _release_at_least("megatron-core", "0.19.0"))
# HybridDeviceOptimizer makes fp32 master copies only of low-precision parameters and looks every parameter up there
# after a load (_update_fp32_params_by_new_state: KeyError); the file is unchanged through 0.19.2.
OFFLOAD_FP32_LOAD = KnownDefect(
    "megatron-core's HybridDeviceOptimizer, no upstream issue known", "the optimizer CPU offload cannot load the "
    "optimizer state of fp32 parameters (KeyError in _update_fp32_params_by_new_state)", "megatron-core", None,
    lambda: False)
# Megatron-Bridge#5634 (PR #5635 open): LoRA on SequentialMLP experts computes a wrong expert fc2 delta at ETP > 1,
# and its export gathers expert adapters over TP and PP but not EP; read unchanged in 0.6.2's source
# (peft/utils.py ParallelLinearAdapter, models/conversion/param_mapping.py), no release fixes it yet
BRIDGE_EXPERT_LORA = KnownDefect(
    "NVIDIA-NeMo/Megatron-Bridge#5634", "LoRA on SequentialMLP experts is exported for EP rank 0 only and computes a "
    "wrong fc2 delta at ETP > 1", "megatron-bridge", None, lambda: False)
