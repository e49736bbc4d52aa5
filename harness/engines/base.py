"""The Engine protocol: what the suites need from any training engine."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harness.backends import Backend
from harness.engines.policy_loss import PolicyStats

if TYPE_CHECKING:  # planning and judging import no torch; ranks do
    import torch

    from harness.engines.rl_batch import RLBatch
    from harness.spec import Layout, ModelSpec


@dataclass
class ParamShard:
    """One rank's piece of a parameter, with what is needed to rebuild the full tensor."""

    name: str  # global name, layer index made global (decoder.layers.3.mlp...)
    tensor: torch.Tensor  # CPU copy
    partition_dim: int | None  # None: replicated across TP
    tp_rank: int
    tp_size: int
    tp_parts: int = 1  # >1: the full tensor is that many blocks along partition_dim, each sharded (SwiGLU fc1)


def partition_dim(param: Any) -> int | None:
    """The dim megatron shards a tensor-parallel parameter along (its own attributes); None: not TP-sharded."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def tp_shard(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, parts: int = 1) -> torch.Tensor:
    """This TP rank's shard of a full tensor; with parts > 1 each block is sharded separately."""
    import torch

    return torch.cat([block.chunk(tp_size, dim=dim)[tp_rank] for block in full.chunk(parts, dim=dim)], dim=dim)


def tp_unshard(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Inverse of tp_shard over the shards of TP ranks 0..tp_size-1."""
    import torch

    split = [s.chunk(parts, dim=dim) for s in shards]
    return torch.cat([torch.cat([sp[i] for sp in split], dim=dim) for i in range(parts)], dim=dim)


@dataclass
class TokenLogprobs:
    """Per-token log-probs of one micro-batch as one rank computed them (the label token's log-prob)."""

    samples: torch.Tensor  # [mbs] indices into the global batch
    positions: torch.Tensor  # [s_local] positions within the sequence (after the CP split)
    logprobs: torch.Tensor  # [mbs, s_local]
    entropy: torch.Tensor | None = None  # [mbs, s_local] where the engine's log-prob head computed it (RL steps)


@dataclass
class StepOutput:
    """Sums over this rank's micro-batches; only last-pipeline-stage ranks report losses. Engines that
    capture per-token log-probs for a step put them in token_logprobs (None: not captured)."""

    loss_sum: float | None
    num_tokens: int | None
    token_logprobs: list[TokenLogprobs] | None = None
    # what the optimizer's step reported (every rank the same): the global gradient norm before clipping, the
    # zero gradient elements (None unless CaseOptions.log_num_zeros_in_grad) and the learning rate it applied
    grad_norm: float | None = None
    num_zeros: int | None = None
    lr: float | None = None
    # an MoE model's load-balancing auxiliary loss (before its coefficient), this rank's share: summed over its
    # micro-batches and MoE layers, its part of the sequence (TP under sequence parallelism, CP); None: dense
    aux_loss: float | None = None
    # megatron's optimizer applied no update (update_successful False: a non-finite gradient norm, or one beyond
    # grad_norm_skip_threshold): the step trained nothing (harness/checks/skipped_steps.py)
    skipped: bool = False
    # the RL steps' PPO figures over this rank's tokens (a `--policy-loss ppo-clip` step; None otherwise)
    policy: PolicyStats | None = None


class Engine(Protocol):
    def build(self) -> None: ...

    def train_step(self, step: int) -> StepOutput: ...

    def param_shards(self) -> list[ParamShard]: ...


@runtime_checkable
class HasOptimizerState(Protocol):
    """An engine that hands out its Adam state (exp_avg, exp_avg_sq, step) as `<global name>#<key>` shards of the
    parameter's layout, whole over DP, from DP rank 0 (other ranks: []) - McoreCheckpoints does."""

    def optimizer_state_shards(self) -> list[ParamShard]: ...


@runtime_checkable
class HasGradBuffers(Protocol):
    """An engine built on megatron's DDP that lists, per model chunk in registration order, the parameters that
    train, as (name, local numel): its gradient buffers must hold them, and grad-sync plans the buffers from them."""

    def grad_buffer_params(self) -> list[list[tuple[str, int]]]: ...


@runtime_checkable
class TrainsRLBatches(Protocol):
    """Steps on RL batches cut the way a framework cuts them (batch-split): McoreEngine and its subclasses
    (harness/engines/rl_steps.py has the parts a framework's own aggregation overrides)."""

    def train_rl_batch(self, batch: RLBatch, microbatches: list[list[int]], mode: str,
                       capture: bool = False) -> StepOutput: ...

    def rl_logprobs(self, batch: RLBatch, microbatches: list[list[int]]) -> list[TokenLogprobs]: ...


@runtime_checkable
class PadsVocabulary(Protocol):
    """An engine that builds the embedding and output layer with megatron's padded vocabulary rows
    (`ModelSpec.padded_vocab_size`), as batch-split's --vocab-size and refit's padded-vocab variant need: McoreEngine
    and fsdp2. A bridge builds its Hugging Face config's vocabulary: it sets `padded_vocab_rows = None`."""

    def padded_vocab_rows(self) -> int: ...


@runtime_checkable
class ProbesMTP(Protocol):
    """An engine that builds megatron's MTP layers (`ModelSpec.mtp_num_layers`) and measures the first step with them
    on and off (batch-split's --mtp-layers; harness/engines/mtp.py): McoreEngine. A bridge builds its Hugging Face
    config's model: it sets `mtp_probe = None`."""

    def mtp_probe(self, batch: RLBatch, microbatches: list[list[int]], mode: str) -> Any: ...


@runtime_checkable
class HasLogprobHead(Protocol):
    """An engine whose RL steps take log-probs and entropy from the logits through a part (McoreEngine's
    `logprob_head()`, harness/engines/logprob_head.py), made at the case's sampling temperature."""

    def logprob_head(self) -> Any: ...

    def head_eval_step(self, step: int) -> StepOutput:
        """Forward only on the batch of `step`, every token's log-prob through the head (the model called without
        labels, as the RL steps call it): refit's policy check."""
        ...


@runtime_checkable
class RunsRLCycles(TrainsRLBatches, Protocol):
    """An engine that runs an RL framework's iteration (the rl-cycle suite): the log-prob pass with the routing
    recorded, training steps with it replayed, offload and reload, a weights-only load. McoreEngine and its
    subclasses (harness/engines/rl_cycle.py has the parts a framework overrides)."""

    def build_model(self) -> None: ...

    def record_routing(self, batch: RLBatch, microbatches: list[list[int]]) -> tuple[list[TokenLogprobs], Any]: ...

    def replay_routing(self, batch: RLBatch, microbatches: list[list[int]], recorded: Any, mode: str,
                       capture: bool = False) -> tuple[StepOutput, Any]: ...

    def offloading(self) -> Any: ...  # the offload part (harness.engines.offloading.Offloading)

    def load_weights(self, seed: int) -> None: ...


@runtime_checkable
class ExportsWeights(Protocol):
    """An engine that streams its weights to a rollout engine as an RL framework's refit does (the refit suite):
    buckets of (Hugging Face name, full tensor) of at most bucket_bytes each (a larger tensor alone), collective
    (every rank iterates to the end). McoreEngine's is the harness's per-tensor exporter
    (harness/engines/weight_export.py), the bridges' their bridge's own export; a framework's engine overrides it
    with its own. eval_step gives the held-out batch's per-token log-probs the exported policy must reproduce."""

    def export_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def eval_step(self, step: int) -> StepOutput: ...


@runtime_checkable
class RefusesExports(Protocol):
    """An engine factory whose weight export cannot run at every backend: export_refusal(model, backend) says why
    not (None: it can). Asked in the parent by the refit suite, like RefusesCases."""

    def export_refusal(self, model: ModelSpec, backend: Backend) -> str | None: ...


@runtime_checkable
class Checkpointing(Engine, Protocol):
    """An engine that saves and loads distributed checkpoints in named formats (ckpt-memory, golden's resumes)."""

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False,
                        async_save: bool = False) -> None: ...

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None: ...


@runtime_checkable
class PeftExporting(Engine, Protocol):
    """An engine that trains LoRA adapters and exports them as a HF PEFT adapter (the peft-ckpt suite)."""

    def eval_step(self, step: int) -> StepOutput: ...

    def export_peft_adapter(self, path: str) -> str | None: ...

    def hf_base_state_dict(self, workdir: Path) -> dict[str, torch.Tensor]: ...

    def save_adapter_checkpoint(self, ckpt_dir: str) -> None: ...


@runtime_checkable
class LabelsCheckpoints(Protocol):
    """An engine that labels its checkpoints itself (fsdp2); megatron's are labelled by dist_checkpointing's
    content metadata."""

    def saved_metadata(self, ckpt_dir: str) -> dict: ...


@runtime_checkable
class RefusesCases(Protocol):
    """An engine factory that cannot build every model or layout: refusal(model, layout) says why it cannot build
    that one (None: it can). Asked in the parent: a default matrix drops what the path cannot build, a layout the
    user named is refused as bad input, before any rank starts."""

    def refusal(self, model: ModelSpec, layout: Layout) -> str | None: ...


@runtime_checkable
class RefusesAdapterLayouts(Protocol):
    """An engine factory whose LoRA adapters cannot be exported or loaded correctly at every layout:
    adapter_refusal(model, layout, backend) says why not at that one (None: it can). Asked in the parent by the
    peft-ckpt suite, like RefusesCases."""

    def adapter_refusal(self, model: ModelSpec, layout: Layout, backend: Backend) -> str | None: ...


@runtime_checkable
class ImportsInRanks(Protocol):
    """An engine factory whose ranks import packages of their own (megatron-bridge's): the fork server its ranks start
    from imports them first (rank_imports.import_modules entries: `module`, or `module:function` to call), so that
    each rank of a case does not import them again."""

    rank_imports: tuple[str, ...]


@runtime_checkable
class ChecksAvailability(Protocol):
    """An engine factory, or its module, whose packages may be missing (the bridges): check_available() raises
    MissingDependency with the install command, in the parent before any rank starts."""

    def check_available(self) -> None: ...


def _lacks(engine: object, capability: type, name: str) -> TypeError:
    return TypeError(f"engine {name!r} ({type(engine).__name__}) is not {capability.__name__}: {capability.__doc__}")


def checkpointing(engine: Engine, name: str) -> Checkpointing:
    """The engine as a Checkpointing one, or a TypeError naming what it lacks."""
    if not isinstance(engine, Checkpointing):
        raise _lacks(engine, Checkpointing, name)
    return engine


def peft_exporting(engine: Engine, name: str) -> PeftExporting:
    """The engine as a PeftExporting one, or a TypeError naming what it lacks."""
    if not isinstance(engine, PeftExporting):
        raise _lacks(engine, PeftExporting, name)
    return engine
