"""What a case may not leave behind in a warm rank: patched functions, modes, groups, threads, megatron globals.

A pooled rank snapshots these before its first case and compares after each one; any difference
retires the pool (the next case gets fresh ranks) and is reported with the case.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

# module path -> attributes whose identity must not change across cases
_WATCHED: dict[str, tuple[str, ...]] = {
    "torch.distributed": ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                          "broadcast", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
                          "new_group", "init_process_group"),
    "torch.cuda": ("current_device", "synchronize", "Stream", "Event", "current_stream", "default_stream",
                   "stream", "is_available"),
    "torch.Tensor": ("cuda", "to", "type", "pin_memory", "backward"),
    "megatron.core.distributed.param_and_grad_buffer": ("dist_reduce_scatter_func", "dist_all_gather_func"),
    "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup":
        ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync"),
    "megatron.core.tensor_parallel.mappings._CopyToModelParallelRegion": ("forward", "backward"),
    "megatron.core.tensor_parallel.mappings._ReduceFromModelParallelRegion": ("forward", "backward"),
    "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication": ("forward", "backward"),
    "megatron.core.pipeline_parallel.schedules": ("get_forward_backward_func", "forward_step", "backward_step"),
}


def _resolve(path: str) -> Any:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def start_lazy_threads() -> None:
    """Start the threads torch starts at first use and keeps for the process's life, before the first snapshot.

    OpenMP gives every thread that runs a parallel op its own team of torch.get_num_threads() - 1 workers, kept
    for that thread's life. The main thread's team comes up at a rank's first parallel op; without it every case
    of a rank given more than one thread (world size 1 on 2 cores, world size 4 on 16) read as a leak and retired
    the warm ranks (`harness run --suite golden --world-size 1` ran each of its 10 cases in fresh ranks). Each
    of the world group's gloo threads gets its team at its first large copy: an all-gather over the world group
    (torch.distributed.checkpoint's save plans do one), after which golden's fsdp2 `tiny-moe` resume at world
    size 1 read as a leak of one thread (named pt_gloo_runloop, after the thread that started it) and retired
    the warm ranks."""
    import torch

    torch.ones(1 << 20).sum()  # above ATen's grain size (32768 elements): runs on every intra-op thread
    start_gloo_thread_teams()


def start_gloo_thread_teams(rounds: int = 4, at_once: int = 4) -> None:
    """Give each gloo thread of the world group its OpenMP team: rounds of all-gathers queued at_once (more than
    the group's threads, 2, so each thread takes one), each copying above ATen's grain size. A collective: every
    rank calls it the same number of times."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    chunk = torch.ones(1 << 16)
    for _ in range(rounds):
        outs = [[torch.empty_like(chunk) for _ in range(dist.get_world_size())] for _ in range(at_once)]
        for work in [dist.all_gather(out, chunk, async_op=True) for out in outs]:
            work.wait()


def snapshot() -> dict[str, Any]:
    """Identities of watched functions plus process-global state a case must restore."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    from harness.probes import proc

    snap: dict[str, Any] = {}
    for path, attrs in _WATCHED.items():
        try:
            owner = _resolve(path)
        except (ImportError, AttributeError):
            continue
        for attr in attrs:
            raw = (owner.__dict__.get(attr, getattr(owner, attr, None)) if isinstance(owner, type)
                   else getattr(owner, attr, None))
            snap[f"{path}.{attr}"] = id(raw)
    snap["torch function modes"] = torch._C._len_torch_function_stack()
    snap["torch dispatch modes"] = torch._C._len_torch_dispatch_stack()
    snap["process groups"] = len(c10d._world.pg_map)
    snap["threads"] = proc.thread_names()
    snap["default dtype"] = str(torch.get_default_dtype())
    snap["grad enabled"] = torch.is_grad_enabled()
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import random as mp_random

        snap["megatron model parallel initialised"] = ps.model_parallel_is_initialized()
        snap["megatron RNG tracker initialised"] = mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    except ImportError:
        pass
    return snap


def leaks(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Human-readable differences: what the case left changed."""
    out = []
    for key, value in after.items():
        if key not in before:
            continue  # a module first imported by this case
        if key == "threads":
            # a destroyed process group still referenced keeps its gloo threads (three per group) running,
            # and a warm rank's next case would share the machine with them
            if len(value) > len(before[key]):
                new = Counter(value) - Counter(before[key])
                named = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(new.items()))
                out.append(f"threads: {len(before[key])} -> {len(value)} (new: {named}; a process group or pool "
                           f"the case made outlived it)")
            continue
        if before[key] != value:
            if key.endswith(("modes", "groups", "dtype", "enabled", "initialised")):
                out.append(f"{key}: {before[key]} -> {value}")
            else:
                out.append(f"{key} was replaced and not restored")
    return out
