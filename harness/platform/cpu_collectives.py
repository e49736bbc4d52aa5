"""Collectives on CPU ranks: where gloo differs from NCCL in something megatron-core or a measurement relies on.

Installed by the CPU layer (harness/platform/cpu_layer.py), which lists these among its patched points:
- Uneven all-gather: megatron gathers a variable number of tokens per TP rank (the MoE dispatcher with TP > 1,
  `gather_from_sequence_parallel_region(output_split_sizes=...)`) with torch.distributed.all_gather over tensors
  of different lengths, which NCCL accepts and gloo refuses ("invalid tensor size"). On CPU ranks such a gather
  pads every tensor to the longest along dim 0, gathers, and copies the rows each rank sent: the same result,
  with the padded bytes on the wire (the collective recorder sees those).
- Buffers released before the caller goes on: gloo's reduce-scatter clones its whole input (NCCL reduces in
  place) and the clone lives as long as gloo's work object. A worker thread of the group holds that object until
  it is scheduled again after completing it, so the waiting rank may run on - into the optimizer step - with the
  clone (23 MiB of `small`'s gradients at DP 4) still allocated: one rank's step-1 heap read 6-7 MiB over its
  peers' in about one run of three beside a busy core. So each gloo group runs one worker thread (its
  collectives run in the order issued, as they are issued on every rank) and a coalesced collective, the way
  megatron's gradient and parameter buffers issue theirs, is followed by a one-element all-reduce on the group's
  gloo backend: when that has completed, the worker has dropped every work before it. Issued on the backend, the
  all-reduce bypasses torch's dispatcher, so collective recorders do not see it.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

UNEVEN_POINT = "torch.distributed.all_gather of tensors of different lengths (padded on gloo)"
ONE_WORKER_POINT = "gloo process groups: one worker thread each (a group's collectives run in the order issued)"
RELEASE_POINT = ("_coalescing_manager (torch, megatron's buffers): gloo's buffers freed before the caller goes on")

# Modules that hold a reference to torch's _coalescing_manager taken at import time, and the name they hold it by.
COALESCING_HOLDERS = ("torch.distributed", "torch.distributed.distributed_c10d",
                      "megatron.core.distributed.param_and_grad_buffer")
_COALESCING = "_coalescing_manager"
_DEFAULT_TIMEOUT = datetime.timedelta(seconds=1800)
_GLOO_OPTIONS: Any = ProcessGroupGloo._Options  # type: ignore[attr-defined]  # torch's stubs lack it and `_threads`


class _Done:
    """The work handle of a collective that has completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# The elements an uneven all-gather gathers, while its padded stand-in runs: a collective recorder counts these,
# not the padding (which would make an MoE rank's figures depend on the longest of its peers' token counts).
_UNPADDED: contextvars.ContextVar[int | None] = contextvars.ContextVar("unpadded_all_gather", default=None)


def unpadded_numel() -> int | None:
    """Inside the CPU layer's padded all-gather: the elements the uneven all-gather it stands in for gathers."""
    return _UNPADDED.get()


def uneven_all_gather(original: Any) -> Any:
    """torch.distributed.all_gather that also gathers tensors of different lengths along dim 0 on gloo."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape[1:]) for t in tensor_list} | {tuple(tensor.shape[1:])}
        lengths = [t.shape[0] if t.dim() else 1 for t in tensor_list]
        if len(set(lengths)) <= 1 or len(shapes) != 1 or tensor.dim() == 0:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(lengths)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        token = _UNPADDED.set(sum(lengths) * padded[0].numel())
        try:
            original(gathered, padded, group=group)
        finally:
            _UNPADDED.reset(token)
        for out, got, n in zip(tensor_list, gathered, lengths):
            out.copy_(got[:n])
        return _Done() if async_op else None

    return all_gather


class OneWorkerGloo(ProcessGroupGloo):
    """A gloo backend with one worker thread; built as torch builds one (same devices and timeout)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any = _DEFAULT_TIMEOUT) -> None:
        options: Any
        if isinstance(timeout, _GLOO_OPTIONS):
            options = timeout
        else:
            options = _GLOO_OPTIONS()
            interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
            options._devices = ([ProcessGroupGloo.create_device(interface=i) for i in interfaces]
                                or [ProcessGroupGloo.create_default_device()])
            options._timeout = timeout
        options._threads = 1
        super().__init__(store, rank, size, options)


def release(group: Any) -> None:
    """Return once the gloo worker of `group` has dropped every collective issued on it before (a no-op for a
    group without a one-worker gloo backend, where nothing orders the release)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend: Any = pg._get_backend(torch.device("cpu"))
    except RuntimeError:  # a group with no CPU backend
        return
    # torch keeps the C++ backend only: what _get_backend returns is a ProcessGroupGloo, told apart by its options
    if isinstance(backend, ProcessGroupGloo):
        gloo: Any = backend  # torch's stubs name neither `_threads` nor the backend's allreduce
        if gloo.options._threads == 1:
            gloo.allreduce([torch.zeros(1)]).wait()


def released_coalescing(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's _coalescing_manager, followed by `release` of its group once its collectives have been waited on
    (on leaving the block, or when the manager's wait() returns for async ones)."""

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False) -> Iterator[Any]:
        with original(group, device, async_ops) as cm:
            yield cm
        if not async_ops:
            release(group)
            return
        waited = cm.wait

        def wait() -> None:
            waited()
            release(group)

        cm.wait = wait

    return _coalescing_manager


def replacements() -> list[tuple[Any, str, Any]]:
    """(module, attribute, value) for every point this module patches on a gloo rank."""
    c10d = dist.distributed_c10d
    out: list[tuple[Any, str, Any]] = [(dist, "all_gather", uneven_all_gather(dist.all_gather)),
                                       (c10d, "ProcessGroupGloo", OneWorkerGloo)]
    for name in COALESCING_HOLDERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        held = getattr(module, _COALESCING, None)
        if held is not None:
            out.append((module, _COALESCING, released_coalescing(held)))
    return out
