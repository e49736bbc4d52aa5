"""golden's parameters: steps, the clip that binds, the checkpoint formats whose resume is judged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from harness.option_flags import flag

SUITE = "golden"
STEPS = 12
# A clip that binds: `tiny`'s gradient norm is 0.65-0.70 over its 12 steps, below megatron's default of 1.0,
# where clipping switched off would change nothing the trajectory can show.
CLIP_GRAD = 0.5
# The learning-rate schedule golden trains with (megatron's OptimizerParamScheduler): a linear warm-up from 0 over
# the first 3 steps, then a cosine decay towards a tenth of the peak at step 12, so the 12 steps see both and a
# resume after step 6 lands inside the decay, where a schedule that restarts at the load shows at once.
LR_WARMUP_STEPS, LR_DECAY_STEPS, LR_DECAY_STYLE, MIN_LR_FRACTION = 3, 12, "cosine", 0.1
RESUME_FORMATS = ("dp_reshardable", "fully_reshardable")  # the distributed optimizer's checkpoint formats
# the fsdp2 engine's (torch fully_shard, torch Adam): its own trajectory, on the pure-DP layout
FSDP2_FORMATS = ("fsdp2_sharded", "fsdp2_full")


class GoldenRole(StrEnum):
    """What a golden case trains: WHOLE (the empty string: no role in its id) the unbroken trajectory; FIRST_HALF
    trains the first half and saves; RESUME loads what the case it runs after saved (at its own layout, which may
    differ) and trains the second half."""

    WHOLE = ""
    FIRST_HALF = "first-half"
    RESUME = "resume"


@dataclass(frozen=True)
class GoldenParams:
    """The golden suite's parameters; `role` and `ckpt_format` are a case's own (resume cases)."""

    baselines_dir: str | None = dataclasses.field(default=None, metadata={"in_id": False})
    # formats whose resume is judged (--ckpt-format); () none
    formats: tuple[str, ...] = dataclasses.field(default=RESUME_FORMATS + FSDP2_FORMATS, metadata=flag(
        "--ckpt-format", "golden: the formats whose resume is judged", in_id=False))
    role: GoldenRole = GoldenRole.WHOLE
    ckpt_format: str = ""
