"""Count the floating-point operations a rank executes, exactly, from the aten ops that run.

A TorchDispatchMode that prices each op with torch's own FLOP formulas
(`torch.utils.flop_counter.flop_registry`: mm, addmm, bmm, baddbmm, convolutions, attention kernels).
It installs no module hooks (torch's FlopCounterMode tracks modules with hooks, and torch's
CommDebugMode's module hooks break the local attention's in-place masked_fill_), and it sees the
backward pass because CPU autograd runs on the calling thread. Ops not in the registry are
elementwise or reductions and are not counted (as in FlopCounterMode).
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class FlopCounter(TorchDispatchMode):
    """`with FlopCounter() as f: ...` then f.total and f.by_op (op name -> FLOPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.by_op[packet.__name__] += int(flop_registry[packet](*args, **kwargs, out_val=out))
        return out
