"""The dtypes a case trains in (`CaseOptions.dtype` names one): bytes per element, the torch dtype, and the tolerance
each family of checks compares its figures with.

fp32 on CPU ranks: layouts differ only in reduction order, ~1e-7 on losses and log-probs and up to ~2e-6 on
gradients (dynamic-cp), so 1e-5 leaves headroom while a skipped reduction or a wrong shard shows at >= 1e-3; golden's
recordings of one trajectory spread <= 1e-4 (docs/golden.md). bf16 and fp16 keep 8 and 11 bits of mantissa: the
layout checks compare them at 2e-2 and 1e-2. golden's bf16 figures are measured (docs/golden.md): its floor is 1e-2
and a recording spreading beyond 2e-2 is refused; fp16's are
not measured (megatron's fp16 trains with a loss scaler the CPU tier does not run).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from harness.errors import BadInput

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DTypeTraits:
    bytes: int  # per element
    torch_name: str  # the attribute of torch
    rtol: float  # relative tolerance of values compared across layouts (losses, log-probs, parameters, gradients)
    golden_max_spread: float  # the most a golden recording may spread over layouts and repeats (of its median)
    golden_rtol: float  # the least relative tolerance of a golden figure (its recorded spread x 4 where larger)
    # whether the count of zero gradient elements compares across layouts (golden records it, batch-split judges
    # it): in bf16 it moved by up to 72% of itself between layouts of `tiny` (whether an element underflows to
    # exactly 0 depends on the reduction order)
    zero_count_comparable: bool = True


class DType(StrEnum):
    """A dtype by the name the CLI, case ids and baseline keys spell (`CaseOptions.dtype`), with its traits."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"

    @property
    def traits(self) -> DTypeTraits:
        return _TRAITS[self]

    @property
    def bytes(self) -> int:
        return self.traits.bytes

    @property
    def torch_name(self) -> str:
        return self.traits.torch_name

    @property
    def rtol(self) -> float:
        return self.traits.rtol

    @property
    def golden_max_spread(self) -> float:
        return self.traits.golden_max_spread

    @property
    def golden_rtol(self) -> float:
        return self.traits.golden_rtol

    @property
    def zero_count_comparable(self) -> bool:
        return self.traits.zero_count_comparable

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)


_TRAITS = {
    DType.fp32: DTypeTraits(4, "float32", 1e-5, 1e-4, 1e-5),
    DType.bf16: DTypeTraits(2, "bfloat16", 2e-2, 2e-2, 1e-2, zero_count_comparable=False),
    DType.fp16: DTypeTraits(2, "float16", 1e-2, 5e-2, 1e-2, zero_count_comparable=False),
}
FP32, BF16, FP16 = DType.fp32, DType.bf16, DType.fp16
DTYPES = {d.value: d for d in DType}


def dtype(name: str) -> DType:
    """The DType of a name; BadInput listing the known ones otherwise."""
    if name not in DTYPES:
        raise BadInput(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]
