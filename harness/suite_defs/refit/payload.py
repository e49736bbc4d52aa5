"""What a refit rank returns: what it sent, bucket by bucket, what each export cost, and rank 0's Hugging Face side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.checks.step_outputs import TrainedRankData
from harness.engines.base import StepOutput
from harness.probes.memory import MemoryPeak
from harness.probes.retention import Retention
from harness.probes.weight_stream import Sent

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Export:
    """One bucket size's exports on a rank: the measured one's stream and memory, and the repeated ones'."""

    bucket_bytes: int
    sent: list[Sent]
    peak: MemoryPeak
    largest: int  # the largest single allocation during the measured export, bytes
    largest_at: str  # where it was made
    retention: Retention | None = None  # what the repeated exports left allocated
    differ: list[str] = field(default_factory=list)  # the repeated exports whose stream differs from the first


@dataclass(frozen=True)
class HFSide:
    """Rank 0: the Hugging Face model built from the config and loaded from the exported stream."""

    expected: dict[str, tuple[tuple[int, ...], str]]  # the HF model's own state-dict keys: (shape, dtype)
    tied: list[str]  # keys HF ties to another (not sent)
    missing: list[str] = field(default_factory=list)  # load_state_dict's, less the tied ones
    unexpected: list[str] = field(default_factory=list)
    load_error: str = ""
    logprobs: torch.Tensor | None = None  # [batch, seq] of the held-out batch, float64


@dataclass(frozen=True)
class RefitRankData(TrainedRankData):
    """A rank's trained parameters (TrainedRankData.params, the routers' expert biases among them: the reference),
    the held-out batch's log-probs (`held_out`), its exports per bucket size, and on rank 0 the stream of one
    export kept whole and the Hugging Face side (None: the model has no Hugging Face architecture here)."""

    held_out: list[StepOutput] = field(default_factory=list)
    exports: list[Export] = field(default_factory=list)
    stream: dict[str, Any] | None = None
    hf: HFSide | None = None
    hf_none: str = ""  # why there is no Hugging Face side
