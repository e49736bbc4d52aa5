"""train-memory's parameters: steps, micro-batch, the recompute modes it runs."""

from __future__ import annotations

from dataclasses import dataclass

from harness.engine_names import EngineName
from harness.errors import BadInput
from harness.spec import Recompute

SUITE = "train-memory"
STEPS = 2  # the first creates the optimizer state; the second holds activations only
# Two samples per micro-batch (the model specs say one): on CPU ranks the activations of `small` at one sample
# (~12 MiB at pure DP) are below the flat copy a gloo collective makes of the gradient buffer (23 MiB), so a
# step's peak would say nothing about activations; at two they lead wherever TP or PP splits the weights.
MICRO_BATCH = 2
RECOMPUTE = (Recompute.FULL, Recompute.SELECTIVE)
# Paths whose memory the model (harness/checks/training_memory.py: megatron DDP's buffers, its optimizers,
# recompute) does not describe, and why; they run plain data parallel and are judged against their baselines only.
UNMODELLED: dict[str, str] = {
    EngineName.FSDP2: "FSDP2 shards parameters, gradients and optimizer state over DP and gathers each layer's weights "
                      "for its forward and backward; the model describes megatron DDP's buffers and optimizers, and "
                      "this path has no distributed optimizer or recompute of megatron's"}


@dataclass(frozen=True)
class TrainMemoryParams:
    """The train-memory suite's parameters."""

    distributed_optimizer: tuple[bool, ...] = (False, True)  # per layout of the default matrix
    recompute: tuple[str, ...] = RECOMPUTE  # also run at the first layout with the distributed optimizer
    baselines_dir: str | None = None  # None: the repository's baselines/

    def __post_init__(self):
        object.__setattr__(self, "recompute", tuple(self.recompute))
        bad = sorted(set(self.recompute) - set(RECOMPUTE))
        if bad:
            raise BadInput(f"--recompute {bad}: expected {' or '.join(RECOMPUTE)}")
