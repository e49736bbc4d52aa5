"""refit's parameters: the bucket sizes of the export and the refits repeated."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import StrEnum

from harness.engines.logprob_head import TEMPERATURE_HELP, check_temperature
from harness.errors import BadInput
from harness.option_flags import flag

SUITE = "refit"
STEPS = 2  # trained before the export: the exported weights are the optimizer's, not the initial ones
REFITS = 10  # repeated exports per bucket size: what each leaves allocated, and whether the streams agree
# verl's default refit bucket (update_weights_bucket_megabytes 512: one bucket for a tiny model), and one that cuts
# tiny's tensors (16-32 KiB each at fp32) and each MoE layer's experts over several buckets.
BUCKETS = ("8KiB", "512MiB")
_SIZE = re.compile(r"^(\d+)(B|KiB|MiB|GiB)$")
_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def bucket_bytes(text: str) -> int:
    """'8KiB' -> 8192; BadInput naming the form otherwise."""
    m = _SIZE.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise BadInput(f"--bucket-size {text!r}: expected a positive size with a unit, e.g. 8KiB, 512MiB, 1GiB")
    return int(m.group(1)) * _UNIT[m.group(2)]


def size_text(n: int) -> str:
    """8192 -> '8 KiB'."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


class RefitVariant(StrEnum):
    """The model a case exports: AS_IS (the empty string: no mark in its id), with untied embeddings, with 4 layers
    (two virtual stages per PP stage), with aux-loss-free balancing (EXPERT_BIAS), or with one token fewer padded as
    megatron pads a vocabulary (PADDED_VOCAB: to a multiple of 128 x TP; the export must cut the padding)."""

    AS_IS = ""
    UNTIED = "untied"
    FOUR_LAYERS = "4-layers"
    EXPERT_BIAS = "expert-bias"
    PADDED_VOCAB = "padded-vocab"


@dataclass(frozen=True)
class RefitParams:
    """The suite's parameters: the bucket sizes every layout exports with, and how many refits are repeated."""

    bucket_sizes: tuple[str, ...] = dataclasses.field(default=BUCKETS, metadata=flag(
        "--bucket-size", f"refit: export in buckets of this size (repeatable; default {', '.join(BUCKETS)})"))
    refits: int = dataclasses.field(default=REFITS, metadata=flag(
        "--refits", f"refit: exports repeated per bucket size to judge what they leave allocated (default {REFITS})"))

    variant: RefitVariant = dataclasses.field(default=RefitVariant.AS_IS, metadata=flag(
        "--refit-variant", "refit: run the model as this variant at every layout given: untied (embeddings), "
                           "4-layers (for virtual stages), expert-bias (aux-loss-free balancing), padded-vocab (one "
                           "token fewer, padded as megatron pads it: to a multiple of 128 x TP; the export must cut "
                           "the padding) (default: the matrix's, the model as it is with --layout)"))
    temperature: float = dataclasses.field(default=1.0, metadata=flag("--temperature", TEMPERATURE_HELP))
    baselines_dir: str | None = dataclasses.field(default=None, metadata={"in_id": False})  # None: baselines/

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_sizes", tuple(self.bucket_sizes))
        if not self.bucket_sizes:
            raise BadInput("--bucket-size: give at least one size, e.g. --bucket-size 8KiB")
        for size in self.bucket_sizes:
            bucket_bytes(size)
        if self.variant not in tuple(RefitVariant):
            raise BadInput(f"refit variant {str(self.variant)!r}: expected untied, 4-layers, expert-bias or "
                           "padded-vocab")
        object.__setattr__(self, "variant", RefitVariant(self.variant))
        check_temperature(self.temperature)
        if self.refits < 2:
            raise BadInput(f"--refits {self.refits}: at least 2 (what repeated exports keep is judged per refit)")
