"""Offload and reload of a megatron model's parameters, gradients and optimizer state, as RL frameworks run them
while the rollout engine has the GPU, and a census of what the device still holds.

The moves:
- DDP's buffers: megatron-core's own `_ParamAndGradBuffer.offload_to_cpu` / `reload_from_cpu` (the gradient buffer
  freed, the parameter buffer of the distributed optimizer copied to the host and freed);
- parameters outside a parameter buffer (DDP without the distributed optimizer) and the optimizer's state (Adam's
  moments; the fp32 master copies of low-precision parameters): each storage's bytes copied to the host and the
  storage freed (`untyped_storage().resize_(0)`), every view of it left in place and refilled on reload - what
  megatron's optimizer `offload_to_cpu` does with `.cpu()` / `.cuda()` on GPU ranks.

On CPU ranks the device is the host, so `.cpu()` returns the tensor itself and megatron's buffer offload (a
`.cpu().pin_memory()`) cannot run. The host copy is then a separate allocation made beforehand (megatron's buffer
copies into an existing `param_data_cpu`), and the freed storages really leave the rank's live tensors: the census
counts every live tensor's storage that is not a host copy, so what an offload leaves - or a reload forgets - shows
as on a GPU's allocator.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Moved:
    """A storage moved to the host: its bytes there and its size on the device."""

    storage: Any  # torch.UntypedStorage of the device tensor (kept: its views stay valid)
    host: Any  # torch.Tensor (uint8) holding the bytes
    nbytes: int
    what: str  # the first tensor's description, for messages


@dataclass(frozen=True)
class Census:
    """The device's live tensors (CPU ranks: every live tensor that is not a host copy): distinct storages and
    their bytes, the largest named, those new since the previous census with what holds them; on GPU ranks also
    torch's allocated bytes (what C++ holds too: workspaces, saved tensors)."""

    bytes: int
    storages: int
    largest: list[tuple[str, int]] = field(default_factory=list)  # (shape dtype, bytes), largest first
    new: list[str] = field(default_factory=list)  # "holder shape dtype size" of storages new since the previous one
    allocated: int = 0


@dataclass
class HostStore:
    """Where offloaded storages live until reload; `host_ptrs` tells census which storages are host copies."""

    on_cpu: bool
    moved: list[Moved] = field(default_factory=list)
    buffer_copies: list[Any] = field(default_factory=list)  # CPU ranks: the param_data_cpu given to DDP buffers

    def host_ptrs(self) -> set[int]:
        return {m.host.untyped_storage().data_ptr() for m in self.moved} | {
            t.untyped_storage().data_ptr() for t in self.buffer_copies}

    def move(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Move each distinct storage of the named tensors to the host; the bytes moved."""
        import torch

        seen = {m.storage.data_ptr() for m in self.moved}
        total = 0
        for what, t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=not self.on_cpu)
            host.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), non_blocking=False)
            self.moved.append(Moved(storage, host, storage.nbytes(), what))
            storage.resize_(0)
            total += host.numel()
        return total

    def restore(self) -> int:
        """Every moved storage back at its size with its bytes; the bytes restored."""
        import torch

        total = 0
        for m in self.moved:
            m.storage.resize_(m.nbytes)
            torch.empty(0, dtype=torch.uint8, device=m.storage.device).set_(m.storage).copy_(m.host)
            total += m.nbytes
        self.moved.clear()
        return total


def buffers(models: list) -> Iterator[Any]:
    """Every DDP parameter-and-gradient buffer of the model chunks (dense and expert)."""
    for model in models:
        yield from model.buffers
        yield from model.expert_parallel_buffers


def offload_buffers(models: list, store: HostStore) -> None:
    """megatron's own buffer offload: gradients freed, the distributed optimizer's parameter buffer moved."""
    import torch

    for buf in buffers(models):
        has_params = buf.param_data is not None
        if has_params and store.on_cpu and buf.param_data_cpu is None:
            # megatron makes its host copy with .cpu().pin_memory(): on a CPU rank an alias of the buffer itself
            # (then freed with it) where it does not raise; a separate allocation of the same size instead
            buf.param_data_cpu = torch.empty_like(buf.param_data)
            store.buffer_copies.append(buf.param_data_cpu)
        buf.offload_to_cpu(move_params=has_params, move_grads=True)


def reload_buffers(models: list) -> None:
    for buf in buffers(models):
        buf.reload_from_cpu(move_params=buf.param_data is not None, move_grads=True)


def loose_params(models: list) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters that no DDP parameter buffer holds (all of them without the distributed optimizer)."""
    for model in models:
        in_buffers = {id(p) for buf in [*model.buffers, *model.expert_parallel_buffers] if buf.param_data is not None
                      for p in buf.params}
        for name, p in model.module.named_parameters():
            if id(p) not in in_buffers:
                yield name, p


def optimizer_tensors(optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The optimizer's own tensors as megatron's offload_to_cpu walks them: its parameter groups' parameters (the
    fp32 master copies, or views of the parameters where there are none) and its state (Adam's moments)."""
    import torch
    from megatron.core.optimizer import ChainedOptimizer

    for i, opt in enumerate(optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]):
        inner = opt.optimizer
        if inner is None:  # a stub (no parameters on this rank)
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                yield f"optimizer {i} parameter {tuple(p.shape)}", p
                if p.grad is not None:  # a mixed-precision optimizer's fp32 gradient copy, kept until zero_grad
                    yield f"optimizer {i} gradient {tuple(p.grad.shape)}", p.grad
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield f"optimizer {i} {key} {tuple(value.shape)}", value


def model_storages(models: list) -> set[int]:
    """The data pointers of the model's own storages: its parameters' and its DDP buffers' (parameters and
    gradients: each parameter's main_grad is a view of the gradient buffer). An optimizer's parameter group may hold
    the parameters themselves (fp32 without the distributed optimizer) or views of the parameter buffer (fp32 with
    it): those are the model's, not the optimizer's."""
    out = set()
    for model in models:
        out |= {p.untyped_storage().data_ptr() for p in model.module.parameters()}
        for buf in buffers([model]):
            out.add(buf.grad_data.untyped_storage().data_ptr())
            if buf.param_data is not None:
                out.add(buf.param_data.untyped_storage().data_ptr())
    out.discard(0)
    return out


def optimizer_state(optimizer: Any, models: list) -> Iterator[tuple[str, torch.Tensor]]:
    """The optimizer's tensors that are its own (Adam's moments, fp32 master copies and their gradients), not the
    model's: what a colocated framework offloads before the export, while the parameters stay for it."""
    mine = model_storages(models)
    for what, t in optimizer_tensors(optimizer):
        if t.untyped_storage().data_ptr() not in mine:
            yield what, t


def not_resident_params(models: list) -> list[str]:
    """The model's parameters whose storage holds no bytes (offloaded): what an export must not read."""
    return [f"{name} {tuple(p.shape)}" for model in models for name, p in model.module.named_parameters()
            if p.numel() and not p.untyped_storage().nbytes()]


def census(store: HostStore | None, exempt: Iterable[Any] = (), previous: set[int] | None = None,
           owners: dict[int, str] | None = None) -> tuple[Census, set[int]]:
    """The device's live tensors now (garbage collected first): every live tensor's distinct storage on the device
    (CPU ranks: every CPU tensor) that is neither a host copy of the store nor among `exempt` (what the caller keeps
    of its own: its records); and the storages' addresses, for the next census's `previous`. owners: id(object) ->
    name of the objects (modules, dispatchers) whose attributes name a new storage's holder."""
    import torch

    gc.collect()
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    skip = store.host_ptrs() if store else set()
    skip |= {t.untyped_storage().data_ptr() for t in _tensors_in(exempt)}
    sizes: dict[int, tuple[str, int]] = {}
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta and obj.is_cuda == on_gpu:
            try:
                storage = obj.untyped_storage()
                ptr, n = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a tensor without storage (sparse, nested) or data (a tracer's fake tensors)
                continue
            if n and ptr not in skip:
                sizes[ptr] = (f"{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}", n)
                found.setdefault(ptr, obj)
    largest = sorted(sizes.values(), key=lambda s: -s[1])[:5]
    new: list[tuple[bool, int, str]] = []
    if previous is not None:
        # what accumulates sits in a list: those first (a replaced attribute's new tensor is new here too), then by size
        for ptr in sorted(set(sizes) - previous, key=lambda p: -sizes[p][1])[:20]:
            what, n = sizes[ptr]
            holder = _holder(found[ptr], owners or {}) or "a tensor"
            new.append((not holder.endswith("[]"), -n, f"{holder} {what} {n / 1024:.1f} KiB"))
    allocated = torch.cuda.memory_allocated() if on_gpu else 0
    return (Census(sum(n for _, n in sizes.values()), len(sizes), largest, [text for *_, text in sorted(new)][:5],
                   allocated), set(sizes))


def _holder(t: Any, owners: dict[int, str]) -> str:
    """The attribute that holds a tensor, itself or in a list: 'decoder.layers.0.mlp.token_dispatcher.kept[]'."""
    for ref in gc.get_referrers(t):
        if isinstance(ref, dict):
            if name := _attribute(ref, t, owners):
                return name
        elif isinstance(ref, list):
            for d in gc.get_referrers(ref):
                if isinstance(d, dict) and (name := _attribute(d, ref, owners)):
                    return name + "[]"
    return ""


def _attribute(d: dict, value: Any, owners: dict[int, str]) -> str:
    import torch

    for obj in gc.get_referrers(d):
        if id(obj) not in owners:
            continue
        held = [vars(obj)] + ([obj._buffers, obj._parameters] if isinstance(obj, torch.nn.Module) else [])
        if any(h is d for h in held):
            key = next((k for k, v in d.items() if v is value), "?")
            return f"{owners[id(obj)]}.{key}"
    return ""


def _tensors_in(obj: Any) -> Iterator[Any]:
    import dataclasses

    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name))
