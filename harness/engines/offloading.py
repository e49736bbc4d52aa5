"""The engine's offload part (the rl-cycle suite): what leaves the device while the rollout engine has it, in the
order a colocated framework runs it, and what comes back.

McoreEngine holds one (`offloading()`, of its `offload_part` class); a framework's engine gives its own subclass:

    class MyOffload(Offloading):
        def optimizer(self, store):
            offload_megatron_optimizer(self.engine.optimizer)

    class MyRLEngine(McoreEngine):
        offload_part = MyOffload

The harness's moves are harness/engines/offload.py's: DDP's buffers through megatron's own offload, the rest storage
by storage into `store` (a HostStore), every view left in place and refilled on reload.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from harness.engines.offload import (
    HostStore,
    buffers,
    loose_params,
    offload_buffers,
    optimizer_state,
    optimizer_tensors,
    reload_buffers,
)

if TYPE_CHECKING:
    import torch


class Offloading:
    """The offload part of an engine with megatron model chunks (`engine.models`) and a megatron optimizer
    (`engine.optimizer`), read at each call (a rebuilt model is the one moved)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def optimizer(self, store: HostStore) -> None:
        """The optimizer's own state off the device (Adam's moments, fp32 master copies and their gradients), the
        model's parameters left for the export: what a colocated framework offloads first."""
        store.move(optimizer_state(self.engine.optimizer, self.engine.models))

    def params(self, store: HostStore) -> None:
        """The parameters and gradients off the device, after the export."""
        offload_buffers(self.engine.models, store)
        store.move(loose_params(self.engine.models))
        store.move(optimizer_tensors(self.engine.optimizer))  # what is left of it: views of the model's storages

    def reload(self, store: HostStore) -> None:
        """Everything offloaded back on the device with its bytes."""
        store.restore()
        reload_buffers(self.engine.models)

    def offloaded(self) -> list[str]:
        """What should be off the device and is not: each tensor still holding bytes, named."""
        return [name for name, t in self.moved_tensors() if t.untyped_storage().nbytes()]

    def not_resident(self) -> list[str]:
        """What should be back on the device after a reload and is not: each tensor without its bytes, named."""
        return [name for name, t in self.moved_tensors() if not t.untyped_storage().nbytes()]

    def moved_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every non-empty tensor an offload moves and a reload brings back, named."""
        models, optimizer = self.engine.models, self.engine.optimizer
        for b in buffers(models):
            yield f"gradient buffer of {len(b.params)} parameters", b.grad_data
            if b.param_data is not None:
                yield f"parameter buffer of {len(b.params)} parameters", b.param_data
        for name, t in [*loose_params(models), *optimizer_tensors(optimizer)]:
            if t.numel():
                yield name, t
