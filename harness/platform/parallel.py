"""All of megatron-core's process-global parallel state: set up and torn down here, nowhere else."""

from __future__ import annotations

import gc

from harness.spec import Layout


def init_parallel_state(layout: Layout, *, on_cpu: bool, seed: int,
                        create_gloo_process_groups: bool = True, dynamic_cp_flag: str | None = None) -> None:
    """Model-parallel groups for the layout, RNG tracker, microbatch calculator cleared.

    dynamic_cp_flag: also the dynamic-CP groups (every power of two up to DP x CP), through megatron's
    keyword for them ("hybrid_context_parallel" in 0.16-0.19; see harness.engines.dynamic_cp_api.dynamic_cp_api).
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
        create_gloo_process_groups=create_gloo_process_groups,
        **extra,
    )
    seed_rng(seed, on_cpu=on_cpu)


_GROUPS_BEFORE: set | None = None


def _live_groups() -> set:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map) if dist.is_initialized() else set()


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
        for group in _live_groups() - _GROUPS_BEFORE:
            dist.destroy_process_group(group)
        _GROUPS_BEFORE = None
    # Gloo groups stop their threads only when the last reference goes; models, DDP buckets and
    # optimizers of the finished case hold them in reference cycles.
    gc.collect()
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    try:
        from megatron.core import num_microbatches_calculator as nmc

        nmc.destroy_num_microbatches_calculator()
    except (ImportError, AttributeError):
        pass


def layout_coords() -> dict[str, int]:
    """This rank's position in megatron's parallel state (after it is initialised)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(), "dp": ps.get_data_parallel_rank(),
        "last_stage": int(ps.is_pipeline_last_stage(ignore_virtual=True)),
    }
