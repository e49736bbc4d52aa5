"""All of megatron-core's process-global parallel state: set up and torn down here, nowhere else."""

from __future__ import annotations

import functools
import gc
from typing import Any

from harness.spec import Layout
from harness.upstream import clear_moe_metrics


def init_parallel_state(layout: Layout, *, on_cpu: bool, seed: int,
                        create_gloo_process_groups: bool = True, dynamic_cp_flag: str | None = None) -> None:
    """Model-parallel groups for the layout, RNG tracker, microbatch calculator cleared.

    dynamic_cp_flag: also the dynamic-CP groups (every power of two up to DP x CP), through megatron's
    keyword for them ("hybrid_context_parallel" in 0.16-0.19; see harness.upstream.dynamic_cp_api).
    """
    from megatron.core import parallel_state

    from harness.platform.cpu_layer import seed_rng

    global _GROUPS_BEFORE
    _GROUPS_BEFORE = _live_groups()
    extra = {dynamic_cp_flag: True} if dynamic_cp_flag else {}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        create_gloo_process_groups=create_gloo_process_groups,
        **extra,
    )
    seed_rng(seed, on_cpu=on_cpu)


_GROUPS_BEFORE: set | None = None


def _live_groups() -> set:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map) if dist.is_initialized() else set()


def destroy_groups_since(before: set) -> None:
    """Destroy the process groups created after `before` was taken, newest first: the same order on every rank
    (the order they were made in, which is every rank's), as torch destroys its own in a fixed order because
    destroying an NCCL communicator has been a collective call in some NCCL versions."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for group in reversed([g for g in c10d._world.pg_map if g not in before]):
        dist.destroy_process_group(group)


def teardown_parallel_state() -> None:
    """Destroy every group and global megatron-core created for a case."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    global _GROUPS_BEFORE
    parallel_state.destroy_model_parallel()
    # destroy_model_parallel misses some globals (0.16: _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP*);
    # any group left referenced keeps its gloo threads alive in a warm rank.
    for name, value in list(vars(parallel_state).items()):
        if (name.startswith("_") and isinstance(value, dict)
                and any(isinstance(x, dist.ProcessGroup) for x in value.values())):
            value.clear()  # megatron updates these in place (0.16: _HYBRID_DP_CP_GROUPS)
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        if name.startswith("_") and items and any(isinstance(x, dist.ProcessGroup) for x in items):
            setattr(parallel_state, name, None)
    if _GROUPS_BEFORE is not None:
        # megatron forgets its groups but does not destroy them; a warm rank would accumulate them.
        destroy_groups_since(_GROUPS_BEFORE)
        _GROUPS_BEFORE = None
    clear_megatron_caches()
    clear_moe_tracker()
    # Gloo groups stop their threads only when the last reference goes; models, DDP buckets and
    # optimizers of the finished case hold them in reference cycles.
    release_memory()
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    try:
        from megatron.core import num_microbatches_calculator as nmc

        nmc.destroy_num_microbatches_calculator()
    except (ImportError, AttributeError):
        pass


def clear_moe_tracker() -> None:
    """Empty megatron's MoE auxiliary-loss tracker: its entries keep the process groups of the case that logged them
    (the router's TP x CP group), 48 gloo threads in a warm rank at world size 4."""

    clear_moe_metrics()


def clear_megatron_caches() -> int:
    """Empty every functools cache of a loaded megatron module (functions and methods); returns how many.

    Methods cached with lru_cache keep `self` in their keys: 0.16's `RotaryEmbedding.forward`
    (maxsize 32) kept each finished case's rotary module alive, and with it the module's CP process
    group - three gloo threads and the group's buffers per case in a warm rank, measured.
    """
    import functools
    import sys

    wrappers: dict[int, functools._lru_cache_wrapper] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__.startswith("megatron."):
                items = list(vars(value).values())  # methods, as the class defines them
            elif isinstance(value, functools._lru_cache_wrapper):
                items = [value]
            else:
                continue
            for item in items:
                if isinstance(item, functools._lru_cache_wrapper) and item.__module__.startswith("megatron."):
                    wrappers[id(item)] = item
    for wrapper in wrappers.values():
        wrapper.cache_clear()
    return len(wrappers)


def release_memory() -> None:
    """Collect reference cycles, then give the freed heap back to the OS (glibc's malloc_trim), so the next case
    in a warm rank starts from the same resident memory: without the trim a rank's RSS grew 504 -> 786 MiB over
    8 step-perf cases of `small` (415 -> 482 MiB trimmed). The trim is a no-op where libc has no malloc_trim.
    On a GPU rank the caching allocator's free blocks go back too and its peaks start again, so a case's device
    figures (reserved memory, a lifetime peak) do not hold the earlier cases' of a warm rank."""
    import torch

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@functools.cache  # find_library runs `ldconfig -p` in a child process on every call
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where libc has none."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def layout_coords() -> dict[str, int]:
    """This rank's position in megatron's parallel state (after it is initialised)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(), "dp": ps.get_data_parallel_rank(),
        "last_stage": int(ps.is_pipeline_last_stage(ignore_virtual=True)),
    }
