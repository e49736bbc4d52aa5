"""Count the floating-point operations a rank executes, exactly, from the aten ops that run.

A TorchDispatchMode that prices each op with torch's own FLOP formulas
(`torch.utils.flop_counter.flop_registry`: mm, addmm, bmm, baddbmm, convolutions, attention kernels).
It installs no module hooks (torch's FlopCounterMode tracks modules with hooks, and torch's
CommDebugMode's module hooks break the local attention's in-place masked_fill_), and it sees the
backward pass because CPU autograd runs on the calling thread. Ops not in the registry are
elementwise or reductions and are not counted (as in FlopCounterMode).
Also the analytic training FLOPs per token and the GPUs' peak TFLOP/s, for MFU.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

if TYPE_CHECKING:
    from harness.spec import ModelSpec

# bf16 dense peak TFLOP/s per GPU (vendor datasheets, no sparsity), for MFU.
PEAK_BF16_TFLOPS = {"H100 SXM": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}


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


def flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token as torchtitan counts them: 6 N + 12 L H S, N the parameters without the
    input embedding, L layers, H hidden size, S sequence length (full attention: the causal mask's
    saving, which Megatron's formula halves, is not taken)."""
    n = model.num_params() - model.vocab_size * model.hidden_size
    return 6 * n + 12 * model.num_layers * model.hidden_size * model.seq_length


def peak_tflops(device_name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.replace(" ", "").lower() in device_name.replace(" ", "").lower():
            return PEAK_BF16_TFLOPS[key]
    return None
