"""What an rl-cycle rank returns: its steps and parameters, and per iteration what the suite judges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.checks.step_outputs import TrainedRankData
from harness.engines.base import ParamShard, TokenLogprobs
from harness.launch.results import CaseResult
from harness.probes.weight_stream import Sent


@dataclass(frozen=True)
class Offloaded:
    """One offload and reload of a rank: what stayed on the device that should have left, the census of the device
    after the offload, and what the reload did not bring back."""

    left: list[str]
    bytes: int
    storages: int
    largest: list[tuple[str, int]]
    not_back: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)  # storages new since the previous offload, with their holders
    allocated: int = 0  # GPU ranks: torch's allocated bytes after the offload (0 on CPU ranks)


@dataclass(frozen=True)
class Refit:
    """One iteration's export on a rank, after its training and before its parameters' offload: what the rank sent, its
    parameters as the iteration trained them (what the export must equal), on rank 0 the stream kept whole, and what
    the rank sent when exporting again after the offload and reload."""

    sent: list[Sent]
    params: list[ParamShard]
    stream: dict[str, Any] | None = None
    after_reload: list[Sent] | None = None  # the export again after the offload and reload (None: no offload)
    # rank 0: the next iteration's batch through the Hugging Face model loaded from the stream ([G, seq], float64),
    # the rollout's policy; None, saying why, where no Hugging Face class holds the model
    policy: Any = None
    policy_entropy: Any = None  # rank 0: the same model's entropy per position ([G, seq], float64)
    policy_none: str = ""
    policy_error: str = ""  # the stream did not load into the Hugging Face model
    # this rank's parameters off the device when the export was due (on any rank: no rank exported)
    read_offloaded: list[str] = field(default_factory=list)
    # bytes the export left allocated once it ended, beyond rank 0's copy of the stream: torch's allocated device
    # memory (GPU ranks) or the process's live heap (CPU ranks: tensors, numpy arrays, bytes); None: not measurable
    kept: int | None = None
    # LoRA: the merged export again, LORA_REFITS - 1 times in a row with no training between (the first iteration)
    repeats: list[list[Sent]] = field(default_factory=list)
    # LoRA, rank 0: the next iteration's batch through the Hugging Face model with the adapter-only refit loaded by
    # peft over the base weights; None saying why, or the error where peft could not load it
    adapter_policy: Any = None
    adapter_none: str = ""
    adapter_error: str = ""
    adapter_tensors: dict[str, Any] | None = None  # rank 0: the adapter-only refit's tensors as peft reads them
    adapter_config: dict[str, Any] | None = None


@dataclass(frozen=True)
class Iteration:
    """One RL iteration of a rank: the log-prob pass (the first mini-batch's micro-batches' log-probs, the routing
    recorded), the two steps (the first one's forward log-probs, the routing each used), the expert biases before and
    after each step, and the offload."""

    logprobs: list[TokenLogprobs]
    train_logprobs: list[TokenLogprobs]
    recorded: Any  # harness.engines.rl_cycle.Routing
    used: list[Any]  # per mini-batch
    biases: list[dict[str, Any]]  # name -> expert bias tensor: before the first step, after each step
    offload: Offloaded | None = None
    refit: Refit | None = None  # None: the engine exports nothing (not ExportsWeights)


@dataclass(frozen=True)
class RLCycleRankData(TrainedRankData):
    """A rank's steps (two per iteration, then the probe's) and parameters (TrainedRankData), its iterations,
    RouterReplay's list after the build and after the cycle, the residue an offload may leave, and the probe of
    megatron's own expert-bias update (biases before and after a step with the router frozen and nothing held)."""

    iterations: list[Iteration] = field(default_factory=list)
    instances: list[tuple[int, int, int]] = field(default_factory=list)  # (listed, live, live listed)
    residue_bound: int = 0
    probe: list[dict[str, Any]] = field(default_factory=list)
    bias_marked_frozen: bool = False  # the routers carry megatron's frozen_expert_bias mark
    export_refused: str = ""  # why the engine's export cannot run for the case (RefusesExports): nothing exported


def data(result: CaseResult) -> list[RLCycleRankData]:
    """The case's ranks' payloads."""
    return [r.payload_as(RLCycleRankData) for r in result.ranks]


def at_iteration(i: int, k: int | None = None) -> str:
    """How a message names iteration i (and mini-batch k), counted from 1."""
    return f"iteration {i + 1}" + (f", mini-batch {k + 1}" if k is not None else "")
