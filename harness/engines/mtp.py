"""Multi-token prediction as RL frameworks train it (megatron-core's MTP layers, `ModelSpec.mtp_num_layers`): the
model called without labels, the policy loss computed outside from the logits, the MTP layers' heads detached from
the main model (`mtp_detach_heads`), and megatron's MTP loss told which tokens are the response through the loss
mask the engine hands the forward (`RLSteps.mtp_loss_mask`).

`probe` measures what batch-split's --mtp-layers judges, on the first step's micro-batches, before any update: the
gradients of the main model's parts with MTP on and again with it off (detached heads: equal; Megatron-LM #3457,
verl #6432: MTP gradients reached an untied lm_head), and the tokens and loss megatron's MTP loss took against the
harness's own count and cross-entropy over the response tokens (ms-swift #8192: prompt and padding positions
counted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.engines.cp_data import zigzag_positions
from harness.engines.rl_batch import RLBatch, microbatch_tensors
from harness.engines.sp_norm import mark_norms_sequence_parallel

if TYPE_CHECKING:
    import torch

# the main model's parts, by the prefix of their global parameter names (a tied output layer is the embedding's)
MAIN_PARTS = {"embedding.": "embedding", "decoder.": "decoder", "output_layer.": "output layer"}
MTP_PART = "mtp."


def block_spec(config: Any, layer_spec: Any, use_transformer_engine: bool, vp_stage: int | None) -> Any:
    """megatron's MTP block spec for a chunk whose decoder layers take `layer_spec` (None: no MTP, or not on this
    stage); its local norms marked sequence-parallel as the decoder's are where the model runs with it (an MoE model
    at TP > 1)."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_transformer_engine,
                                  vp_stage=vp_stage)
    if spec is not None and config.sequence_parallel and not use_transformer_engine:
        mark_norms_sequence_parallel(spec)
    return spec


def token_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[n, s] the response mask aligned with the input tokens (token i a response token), from the harness's, aligned
    with the labels (label i = token i + 1). Megatron's MTP loss without labels derives them from the input ids and
    rolls this mask with them."""
    import torch

    return torch.cat([torch.zeros_like(loss_mask[:, :1]), loss_mask[:, :-1]], dim=1)


@dataclass(frozen=True)
class MTPProbe:
    """One rank's measurements of the first step's micro-batches, run with MTP on and again off (no update)."""

    # per main-model parameter (global name): (largest |gradient with MTP on - with it off|, largest |gradient with it
    # off|) on this rank
    grads: dict[str, tuple[float, float]]
    mtp_grad: float | None  # the MTP layers' largest |gradient| with MTP on (None: none on this rank)
    # per MTP depth, summed over this rank's micro-batches of each one's mean: (megatron's MTP loss, the harness's
    # cross-entropy of the MTP logits over the response tokens at that depth); empty off the last stage
    losses: list[tuple[float, float]]
    counted: list[int]  # per depth, the tokens megatron's MTP loss counted on this rank
    expected: list[int]  # per depth, the response tokens whose target lies in the window, by the harness's arithmetic


def probe(engine: Any, batch: RLBatch, microbatches: list[list[int]], mode: str) -> MTPProbe:
    """The step's gradients with MTP on and off, megatron's MTP loss and counts against the harness's. The case's
    policy loss is the log-likelihood: a PPO step's old-log-prob pass would run the MTP layers too (the suite refuses
    --policy-loss ppo-clip with --mtp-layers)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(engine.models)
    outputs: list[torch.Tensor] = []
    hooks = [c.output_layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0].detach().clone()))
             for c in chunks if c.post_process]
    MTPLossLoggingHelper.tracker.clear()  # sized by the first depth it saw: a warm rank's earlier case may differ
    try:
        engine.train_rl_batch(batch, microbatches, mode, update=False)
    finally:
        for h in hooks:
            h.remove()
    on = engine.main_grads()
    tracker = MTPLossLoggingHelper.tracker
    depth = engine.config.mtp_num_layers
    megatron_losses = [float(v) for v in tracker["loss_values"]] if "loss_values" in tracker else []
    counted = [int(v) for v in tracker["total_values"]] if "total_values" in tracker else []
    tracker.clear()
    with mtp_off(chunks):
        engine.train_rl_batch(batch, microbatches, mode, update=False)
    off = engine.main_grads()
    for m in engine.models:
        m.zero_grad_buffer()
    grads = {n: (float((on[n] - off[n]).abs().max()), float(off[n].abs().max()))
             for n in off if n.startswith(tuple(MAIN_PARTS))}
    mtp = [float(g.abs().max()) for n, g in on.items() if n.startswith(MTP_PART)]
    reference, expected = ([], []) if not outputs else _reference(engine, batch, microbatches, outputs, depth)
    return MTPProbe(grads, max(mtp) if mtp else None,
                    list(zip(megatron_losses, reference)) if reference else [], counted if reference else [],
                    expected)


class mtp_off:
    """The model's MTP layers switched off for a `with` block: their block hands the decoder's hidden states on
    unchanged and megatron's GPTModel computes no MTP loss from them. Nothing else changes - the config, each chunk's
    `mtp_process` - so the rest of the step runs as with MTP on: on a last pipeline stage that holds the MTP layers the
    output layer takes the embedding's weight, and megatron all-reduces that stage's embedding gradient with the first
    stage's."""

    def __init__(self, chunks: list):
        self.chunks = [c for c in chunks if c.mtp_process]

    def __enter__(self) -> None:
        from megatron.core.models.gpt import gpt_model

        self.upstream = gpt_model.process_mtp_loss
        gpt_model.process_mtp_loss = _hand_on
        for c in self.chunks:
            c.mtp.forward = _hand_on

    def __exit__(self, *exc: object) -> None:
        from megatron.core.models.gpt import gpt_model

        gpt_model.process_mtp_loss = self.upstream
        for c in self.chunks:
            del c.mtp.forward  # the class's again


def _hand_on(*args: Any, hidden_states: Any, **kwargs: Any) -> Any:
    """The decoder's hidden states, as they came (the MTP block's and the MTP loss's stand-in)."""
    return hidden_states


def _reference(engine: Any, batch: RLBatch, microbatches: list[list[int]], outputs: list[torch.Tensor],
               depth: int) -> tuple[list[float], list[int]]:
    """Per depth, the sum over micro-batches of the mean cross-entropy of the captured MTP logits at the response
    tokens whose target lies in the window, and their count - by the harness's own arithmetic: where each local token
    sits (zigzag CP chunks), what it predicts at depth k (the label k positions on, an input token) and whether
    that is a response token."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    seq, cp = engine.case.model.seq_length, ps.get_context_parallel_world_size()
    positions = zigzag_positions(seq, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(seq)
    per_mb = depth + 1  # the output layer runs once per MTP depth, then for the main logits
    if len(outputs) != per_mb * len(microbatches):
        raise RuntimeError(f"captured {len(outputs)} output-layer calls for {len(microbatches)} micro-batches at MTP "
                           f"depth {depth}: expected {per_mb} each")
    losses, counts = [0.0] * depth, [0] * depth
    for i, group in enumerate(microbatches):
        full = microbatch_tensors(batch, group, seq)
        for k in range(depth):
            logits = outputs[i * per_mb + k]  # [s, b, V / TP]
            target = positions + k + 1
            inside = target < seq - 1  # label seq - 1 is the token past the window, no input token
            at = target.clamp(max=seq - 1)
            labels, mask = full["labels"][:, at], full["loss_mask"][:, at].float() * inside
            ce = vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous().to(logits.device))
            n = float(mask.sum())
            losses[k] += float((ce.transpose(0, 1).cpu() * mask).sum()) / n if n else 0.0
            counts[k] += int(n)
    return losses, counts
