"""megatron-core's dynamic (hybrid) context-parallel API, feature-probed across releases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.errors import MissingDependency
from harness.upstream import hybrid_cp_split


@dataclass(frozen=True)
class DynamicCPApi:
    """megatron-core's names for dynamic CP: `hybrid_*` in releases 0.16-0.19, `dynamic_*` on the dev branch. The
    split of a sample over its local CP group is megatron's own where the release has it (0.16), else made of the
    parts that stayed (harness.upstream.hybrid_cp_split)."""

    flag: str  # initialize_model_parallel keyword and TransformerConfig field
    schedule_module: str  # has BalancedCPScheduler
    split: Any  # get_batch_on_this_<...>_cp_rank(batch, local_cp_size)


_APIS = (("hybrid_context_parallel", "megatron.core.pipeline_parallel.hybrid_cp_schedule",
          "get_batch_on_this_hybrid_cp_rank"),
         ("dynamic_context_parallel", "megatron.core.pipeline_parallel.dynamic_cp_schedule",
          "get_batch_on_this_dynamic_cp_rank"))


def dynamic_cp_api() -> DynamicCPApi:
    """The installed megatron-core's dynamic-CP API (feature-probed), or MissingDependency naming what is missing."""
    import importlib
    import inspect

    from megatron.core import parallel_state, utils

    init_args = inspect.signature(parallel_state.initialize_model_parallel).parameters
    missing = []
    for flag, module, split in _APIS:
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
