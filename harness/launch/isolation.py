"""What a case may not leave behind in a warm rank: patched functions, modes, groups, threads, megatron globals.

A pooled rank snapshots these before its first case and compares after each one; any difference
retires the pool (the next case gets fresh ranks) and is reported with the case.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

from harness.probes import proc

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
    """Start the threads torch starts at first use and keeps for the process's life, before the first snapshot:
    OpenMP's intra-op pool comes up at a rank's first parallel op. Without it every case of a rank given more
    than one thread read as a leak of one or more threads and retired the warm ranks (`harness run --suite
    golden --world-size 1` ran each of its 10 cases in fresh ranks, when gloo ranks ran two threads on 2
    cores). A gloo rank now runs one (harness/platform/backend.py: no pool forms there); a GPU rank runs its
    share of the node's cores."""
    import torch

    torch.ones(1 << 20).sum()  # above ATen's grain size (32768 elements): runs on every intra-op thread


def no_progress_bar_monitor() -> None:
    """No tqdm monitor thread in a warm rank: transformers 5 draws progress bars as it saves and loads Hugging Face
    weights (peft-ckpt's export and log-prob checks, on the current stack), and tqdm's first bar starts a monitor
    thread that outlived the case, so every such case read as a leak and retired the warm ranks (each of
    peft-ckpt's cases then started fresh ranks and imported transformers and peft again). The monitor only tunes
    how often a bar redraws; a rank's bars go to its log."""
    try:
        from tqdm import std
    except ImportError:
        return
    std.tqdm.monitor_interval = 0


def snapshot() -> dict[str, Any]:
    """Identities of watched functions plus process-global state a case must restore."""
    import torch
    from torch.distributed import distributed_c10d as c10d

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
    snap["threads"] = proc.thread_names(lifetime=False)
    snap["intra-op threads"] = torch.get_num_threads()
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
            if key.endswith(("modes", "groups", "threads", "dtype", "enabled", "initialised")):
                out.append(f"{key}: {before[key]} -> {value}")
            else:
                out.append(f"{key} was replaced and not restored")
    return out
