"""All of megatron-core's process-global parallel state: set up and torn down here, nowhere else."""

from __future__ import annotations

from harness.spec import Layout


def init_parallel_state(layout: Layout, *, on_cpu: bool, seed: int,
                        create_gloo_process_groups: bool = True) -> None:
    """Model-parallel groups for the layout, RNG tracker, microbatch calculator cleared."""
    from megatron.core import parallel_state

    from harness.platform.cpu_layer import seed_rng

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        create_gloo_process_groups=create_gloo_process_groups,
    )
    seed_rng(seed, on_cpu=on_cpu)


def teardown_parallel_state() -> None:
    """Destroy every group and global megatron-core created for a case."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    parallel_state.destroy_model_parallel()
    mp_random._CUDA_RNG_STATE_TRACKER = None
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    try:
        from megatron.core import num_microbatches_calculator as nmc

        nmc.destroy_num_microbatches_calculator()
    except (ImportError, AttributeError):
        pass
