"""What every engine's GPTModel is built from: TransformerConfig, layer spec, initial weights."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

from harness.adjustments import note
from harness.dtypes import dtype as dtype_of
from harness.engines.sp_norm import mark_norms_sequence_parallel
from harness.errors import BadInput, DoesNotApply
from harness.platform.backend import COMPILE_OFF
from harness.spec import Case, Recompute

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer import TransformerConfig


def transformer_config(case: Case, on_cpu: bool, params_dtype: str | None = None) -> TransformerConfig:
    """TransformerConfig for the model spec and layout (no dropout: the CPU RNG tracker cannot fork); parameters
    in `params_dtype` where given, else the case's."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    m, lay, params = case.model, case.layout, dtype_of(params_dtype or case.options.dtype).torch
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels, normalization=m.normalization, gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu, add_bias_linear=False, qk_layernorm=m.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
        context_parallel_size=lay.cp,
        sequence_parallel=sequence_parallel(case),
        params_dtype=params, pipeline_dtype=params, bf16=params is torch.bfloat16, fp16=params is torch.float16,
        # megatron draws no initial values: the engine overwrites every weight matrix from its global name
        # (McoreEngine.reinit). perform_initialization stays on: megatron 0.16 marks a weight TP-sharded
        # (partition_dim) inside its initialisation, so without it a sharded weight looks replicated.
        use_cpu_initialization=True, perform_initialization=True,
        init_method=undrawn, output_layer_init_method=undrawn, embedding_init_method=undrawn,
        **fusions(on_cpu),
        # Interleaved PP with batched p2p swaps messages on gloo (docs/architecture.md).
        batch_p2p_comm=not (lay.vpp > 1), deallocate_pipeline_outputs=True,
        **training_fields(case),
        **moe_config(case, on_cpu),
        **mtp_config(case),
    )


def mtp_config(case: Case) -> dict:
    """The model's multi-token prediction layers, their heads detached from the main model (RL frameworks' MTP:
    the MTP loss trains the MTP layers only); nothing for a model without."""
    n = case.model.mtp_num_layers
    return dict(mtp_num_layers=n, mtp_detach_heads=True) if n else {}


def training_fields(case: Case) -> dict:
    """TransformerConfig fields the case's training options set, on every construction path: per-token loss
    normalisation with a loss mask, activation recompute."""
    return dict(calculate_per_token_loss=case.options.loss_mask, **recompute_config(case.options.recompute))


def sequence_parallel(case: Case) -> bool:
    """Every path's sequence_parallel: megatron's MoE layer refuses TP without it; dense models run without it."""
    return case.model.moe and case.layout.tp > 1


def in_params_dtype(chunk: Any) -> None:
    """Cast a chunk built for fp16 / bf16 wholly to that dtype, as megatron's Float16Module does to the module it
    wraps (`module.bfloat16()`), which the engines do not use (`model.module` is the GPTModel chunk). Megatron's
    local spec builds its norms with torch's RMSNorm / LayerNorm, in fp32 whatever the config's dtype: left so,
    their gradients took a DDP buffer of their own (two coalesced all-reduces where megatron issues one) and torch
    cannot dispatch its fused norm to a bf16 input with an fp32 weight."""
    import torch

    if chunk.config.params_dtype != torch.float32:
        chunk.to(chunk.config.params_dtype)


def undrawn(weight: torch.Tensor) -> None:
    """megatron's init method for weights the engine sets itself (McoreEngine.reinit): draws nothing."""


def moe_config(case: Case, on_cpu: bool) -> dict:
    """TransformerConfig fields of an MoE model ({} for a dense one): top-k routing with the load-balancing
    auxiliary loss, the case's token dispatcher, EP and ETP; megatron's SequentialMLP experts (one GEMM per
    expert), grouped GEMM where Transformer Engine provides it on GPUs."""
    m, lay, o = case.model, case.layout, case.options
    if not m.moe:
        return {}
    if o.moe_dispatcher not in ("alltoall", "allgather"):
        raise BadInput(f"MoE dispatcher {o.moe_dispatcher!r}: expected alltoall or allgather (flex needs DeepEP)")
    grouped = grouped_experts(on_cpu)
    return dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.expert_ffn,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_token_dispatcher_type=o.moe_dispatcher, moe_grouped_gemm=grouped,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_ffn or None,
        moe_layer_freq=[0] * m.moe_first_dense_layers + [1] * m.moe_layers(),
        expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.expert_tp,
        **(dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True) if m.moe_expert_bias
           else {}),
        **(routing_replay_config() if o.routing_replay else {}),
    )


def routing_replay_config() -> dict:
    """TransformerConfig's routing replay switch, probed: megatron-core 0.16 added it."""
    import dataclasses
    from importlib.metadata import version

    from megatron.core.transformer import TransformerConfig

    if "moe_enable_routing_replay" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        raise DoesNotApply(f"megatron-core {version('megatron-core')} has no routing replay "
                           "(TransformerConfig.moe_enable_routing_replay): it needs megatron-core 0.16 or later")
    return {"moe_enable_routing_replay": True}


FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion", "persist_layer_norm")


def grouped_experts(on_cpu: bool) -> bool:
    """Whether megatron's engines build grouped-GEMM experts (Transformer Engine's, on GPU ranks where it is
    installed); megatron's SequentialMLP (one GEMM per expert) otherwise."""
    return not on_cpu and _importable("transformer_engine")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fusions(on_cpu: bool) -> dict[str, bool]:
    """Megatron's fusions as a user's GPU config has them (Megatron-LM turns these on by default), each on where
    its kernel exists here; every one left off is listed among the harness's adjustments with the reason.
    CPU ranks: all off (CUDA kernels)."""

    if on_cpu:
        note("fusions off on CPU ranks (CUDA kernels): " + ", ".join(FUSIONS))
        note(COMPILE_OFF)
        return dict.fromkeys(FUSIONS, False)
    te = _importable("transformer_engine")
    rope = False
    if te:
        from megatron.core.models.common.embeddings import rope_utils

        rope = rope_utils.fused_apply_rotary_pos_emb is not None
    kernels = {
        "bias_activation_fusion": (True, ""),  # torch-jitted bias + SwiGLU / GeLU
        "bias_dropout_fusion": (True, ""),  # torch-jitted
        "masked_softmax_fusion": (_importable("scaled_upper_triang_masked_softmax_cuda"),
                                  "apex's fused softmax kernels are not installed"),
        "apply_rope_fusion": (rope, "Transformer Engine's fused RoPE is not available"),
        # apex's kernel even under TE's spec: the GPT output layer is megatron's own ColumnParallelLinear, which
        # raises at construction with this fusion on and the kernel missing (megatron-core 0.16)
        "gradient_accumulation_fusion": (_importable("fused_weight_gradient_mlp_cuda"),
                                         "apex's fused_weight_gradient_mlp_cuda is not installed (megatron's output "
                                         "layer needs it, with Transformer Engine too)"),
        "persist_layer_norm": (_importable("fast_layer_norm"), "apex's persistent layer norm is not installed"),
    }
    for name, (ok, why) in kernels.items():
        if not ok:
            note(f"fusion {name} off: {why}")
    return {name: ok for name, (ok, _) in kernels.items()}


def recompute_config(recompute: str) -> dict:
    """TransformerConfig fields of the case's activation-recompute option."""
    if recompute == Recompute.FULL:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == Recompute.SELECTIVE:
        return dict(recompute_granularity="selective")
    if recompute:
        raise BadInput(f"recompute {recompute!r}: expected full or selective")
    return {}


def layer_spec(on_cpu: bool, normalization: str, cp: int = 1, config: TransformerConfig | None = None,
               vp_stage: int | None = None, qk_layernorm: bool = False) -> Any:
    """Local spec on CPU ranks; the Transformer Engine spec on GPU when transformer_engine imports. An MoE model
    (config.num_moe_experts) gets megatron's decoder block spec of its stage: dense and MoE layers.

    Without TE and with CP > 1, the local spec's core attention (which asserts CP == 1) is replaced
    by the reference context-parallel attention; with sequence parallelism (MoE with TP) its torch norms by
    ones whose weights megatron reduces over TP (harness/engines/sp_norm.py).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = uses_transformer_engine(on_cpu)
    moe = config is not None and bool(config.num_moe_experts)
    qk_layernorm = qk_layernorm or bool(config is not None and config.qk_layernorm)
    if te:
        return (specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage) if moe
                else specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm))

    note("layer spec: megatron's local spec (Transformer Engine's needs CUDA)")
    if moe:
        assert config is not None
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization,
                                                vp_stage=vp_stage)
        layers = spec.layer_specs
    else:
        spec = specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
        layers = [spec]
    if cp > 1:
        from harness.engines.cp_attention import ReferenceCPAttention

        note("core attention: the harness's reference CP attention (megatron's local attention asserts CP == 1)")
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = ReferenceCPAttention
    if config is not None and config.sequence_parallel:
        mark_norms_sequence_parallel(spec)
    return spec


def uses_transformer_engine(on_cpu: bool) -> bool:
    """Whether the layer specs are Transformer Engine's: on GPU where transformer_engine imports."""
    return not on_cpu and _importable("transformer_engine")


def _full_init(name: str, full_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Layout-independent initial value of a parameter: a function of its global name only."""
    import torch

    gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    return torch.randn(full_shape, generator=gen) * 0.02
