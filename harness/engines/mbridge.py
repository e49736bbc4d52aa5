"""The `mbridge` engine: the "vanilla bridge" construction path of regression R2.

The model is built by PyPI `mbridge`: `AutoBridge.from_config(LlamaConfig)` then
`bridge.get_model(wrap_with_ddp=True, ddp_config=dict)`. mbridge's get_model starts from its own
defaults (use_distributed_optimizer=True, grad_reduce_in_fp32=True) and updates them with the dict
it is given, so the dict must be the whole wrap config merged with the overrides
(`bridge_ddp_config`; a subclass returning only the overrides plants R2). The optimizer is built
from what the user configured, as the RL frameworks did - a DDP config that lost the user's choice
shows up as the wrong collective (and drifting replicas), never silently.

Weights: a `post_model_creation_callbacks` entry re-initialises each chunk from global parameter
names (`McoreEngine.reinit`) before DDP wraps it, and get_model is asked for no Float16Module
(bf16=False, fp16=False; the TransformerConfig keeps the dtype, as in the mcore engine), so every
engine starts from the same weights and `model.module` is the GPTModel chunk.

TransformerConfig changes go through the bridge's `set_extra_args` (which rebuilds and validates
the config): dropout 0 and sequence parallel off on every rank (the mcore engine builds no sequence
parallelism; mbridge turns it on with TP > 1). CPU ranks only: fused kernels off and initialisation
on CPU; and the bridge's layer spec - it always asks megatron-core for the Transformer Engine spec -
is replaced, on this bridge instance only, by the local spec (the reference CP attention when
CP > 1) through its `_get_transformer_layer_spec` hook, the method mbridge's model classes override
to choose their spec.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from harness.backends import Backend
from harness.dtypes import DType, dtype
from harness.engines.mcore import McoreEngine
from harness.engines.model_config import layer_spec, sequence_parallel, training_fields
from harness.engines.wrap_config import WrapConfig, ddp_config_dict
from harness.errors import BadInput, MissingDependency, NotOnThisStack
from harness.upstream import mbridge_build_refusal

if TYPE_CHECKING:
    from harness.spec import Layout, ModelSpec

INSTALL = "pip install -c constraints-cpu.txt -e .[mbridge]"
# import name -> distribution (mbridge's own "megatron" extra: transformers, safetensors, einops)
_REQUIRED = {"mbridge": "mbridge", "transformers": "transformers", "safetensors": "safetensors", "einops": "einops"}
_CPU_FUSIONS = ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                "persist_layer_norm", "gradient_accumulation_fusion")


def check_available() -> None:
    """MissingDependency naming the install command, NotOnThisStack where the installed mbridge cannot build on the
    installed megatron-core; cheap enough for the parent (imports nothing heavy)."""

    for module, dist in _REQUIRED.items():
        if importlib.util.find_spec(module) is None:
            raise MissingDependency(f"engine 'mbridge' needs {dist} (no module {module!r}): {INSTALL}")
    why = mbridge_build_refusal()
    if why:
        raise NotOnThisStack(f"engine 'mbridge': {why}; R2 (a bridge's own DDP defaults winning over the user's "
                             "config) goes unjudged on the mbridge path, the megatron-bridge path still judges it")


def hf_architecture(m: ModelSpec) -> str:
    """The Hugging Face architecture a model spec converts to (imports nothing): Llama for a dense model, Qwen3-MoE
    for a mixture of experts (the MoE architecture megatron-bridge converts with SwiGLU experts, top-k routing
    renormalised over the chosen experts as megatron's router does, and no shared expert). BadInput names what a
    model has that neither maps."""
    if not m.moe:
        if m.qk_layernorm:
            raise BadInput(f"model {m.name}: a dense model with QK layernorm has no Hugging Face mapping here "
                           "(Llama has none): set qk_layernorm = false")
        return "LlamaForCausalLM"
    missing = [why for bad, why in ((not m.qk_layernorm, "qk_layernorm = true"),
                                    (m.moe_shared_expert_ffn, "no shared expert (moe_shared_expert_ffn = 0)"),
                                    (m.moe_first_dense_layers, "no dense layers first (moe_first_dense_layers = 0)"),
                                    (not m.swiglu, "SwiGLU experts"),
                                    (m.moe_expert_bias, "softmax routing without an expert bias "
                                                        "(moe_expert_bias = false)"),
                                    (m.normalization != "RMSNorm", "RMSNorm")) if bad]
    if missing:
        raise BadInput(f"model {m.name}: megatron-bridge converts a mixture of experts to Hugging Face here as "
                       f"Qwen3-MoE, which needs {', '.join(missing)}: use --model tiny-qwen3-moe or a model with them")
    return "Qwen3MoeForCausalLM"


def hf_config(m: ModelSpec):
    """The Hugging Face config of a model spec (built in code, nothing downloaded), of hf_architecture's class."""
    try:
        from transformers import LlamaConfig, Qwen3MoeConfig
    except ImportError as exc:
        raise MissingDependency(f"bridge engines need transformers (import failed: {exc}); the stacks' releases: "
                                "docs/stacks.md") from None

    arch = hf_architecture(m)
    common: dict[str, Any] = dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, max_position_embeddings=m.seq_length,
        tie_word_embeddings=m.tie_embeddings, rope_theta=10000.0, hidden_act="silu" if m.swiglu else "gelu",
        attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-5, architectures=[arch],
    )
    if not m.moe:
        return LlamaConfig(**common, mlp_bias=False)
    return Qwen3MoeConfig(**common, num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                          moe_intermediate_size=m.expert_ffn, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], router_aux_loss_coef=m.moe_aux_loss_coeff)


def bridge_refusal(model: ModelSpec, layout: Layout) -> str | None:
    """Why a bridge cannot build the model (no Hugging Face architecture maps it here); None where it can."""
    try:
        hf_architecture(model)
    except BadInput as exc:
        return str(exc)
    return None


def export_refusal(model: ModelSpec, backend: Backend) -> str | None:
    """mbridge's export names only Transformer Engine's layer spec (a norm fused into the next linear:
    `linear_qkv.layer_norm_weight`); without it (CPU ranks, GPU ranks without Transformer Engine) the harness builds
    megatron's local spec (`input_layernorm.weight`), which the export refuses by name."""
    import importlib.util

    if backend == Backend.NCCL and importlib.util.find_spec("transformer_engine") is not None:
        return None
    return ("mbridge's export_weights maps Transformer Engine's layer names only (it raises 'Unsupported parameter "
            "name: decoder.layers.0.input_layernorm.weight' on megatron's local spec, which ranks without Transformer "
            "Engine build): run --engine mbridge on GPU ranks with Transformer Engine, or --engine megatron-bridge")


class MbridgeEngine(McoreEngine):
    overrides: dict[str, Any] | None = None  # the framework's optional DDP override dict
    bridge: Any = None
    check_available = staticmethod(check_available)
    padded_vocab_rows = None  # type: ignore[assignment]  # the HF config's vocabulary: no PadsVocabulary
    mtp_probe = None  # type: ignore[assignment]  # the HF config's model: no ProbesMTP
    refusal = staticmethod(bridge_refusal)
    export_refusal = staticmethod(export_refusal)

    def bridge_ddp_config(self) -> dict[str, Any]:
        """What this path hands to bridge.get_model(ddp_config=...): the merged wrap config.

        R2 was this method returning only `self.overrides` (tests/plants/faulty_engines.py:MbridgeOverrideOnly).
        """
        return ddp_config_dict(WrapConfig.from_options(self.case.options), self.overrides)

    def config_overrides(self) -> dict[str, Any]:
        """TransformerConfig fields set through the bridge's set_extra_args."""
        o, lay = self.case.options, self.case.layout
        extra: dict[str, Any] = dict(
            hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sequence_parallel(self.case),
            bf16=o.dtype == DType.bf16, fp16=o.dtype == DType.fp16,
            # Interleaved PP with batched p2p swaps messages on gloo (docs/architecture.md).
            batch_p2p_comm=False if lay.vpp > 1 else None, **training_fields(self.case))
        extra = {k: v for k, v in extra.items() if v is not None}
        if self.case.model.moe:  # the case's dispatcher, not the bridge's default
            extra["moe_token_dispatcher_type"] = o.moe_dispatcher
        if self.ctx.on_cpu:
            extra.update({name: False for name in _CPU_FUSIONS}, use_cpu_initialization=True)
            if self.case.model.moe:  # megatron's SequentialMLP: grouped GEMM needs Transformer Engine
                extra["moe_grouped_gemm"] = False
        return extra

    def hf_weight_stream(self):
        """The bridge's own export as RL frameworks call it at refit (mbridge's export_weights: every rank yields
        every tensor)."""
        return self.bridge.export_weights(self.models)

    def _reinit_new_chunk(self, model, **_: Any) -> None:
        self.reinit(model)
        self.after_build([model])  # the RL iteration's marks (a frozen router), as McoreEngine.build_chunks makes them

    def build_model(self) -> None:
        """The bridge's model (DDP-wrapped) and the optimizer, on the parallel state already set up (the bridge reads
        the parallel sizes from it)."""
        check_available()
        try:
            from mbridge import AutoBridge
        except ImportError as exc:
            raise MissingDependency(f"engine 'mbridge': cannot import {exc.name!r}: {INSTALL}") from exc

        bridge = AutoBridge.from_config(hf_config(self.case.model), dtype=dtype(self.case.options.dtype).torch)
        bridge.set_extra_args(**self.config_overrides())
        if self.ctx.on_cpu:
            m = self.case.model

            def local_spec(vp_stage=None):
                bridge.has_vp_stage = True  # what the bridge's own method records (megatron-core >= 0.13)
                # an MoE model's decoder block spec of the stage: without the config its layers were dense MLPs,
                # and grad-sync's dispatch check found no token all-to-all at EP 2
                return layer_spec(True, m.normalization, self.case.layout.cp, bridge.config if m.moe else None,
                                  vp_stage, qk_layernorm=m.qk_layernorm)

            bridge._get_transformer_layer_spec = local_spec
        self.before_build()  # RouterReplay's list emptied: an earlier build's routers are not this policy's
        self.models = bridge.get_model(
            wrap_with_ddp=True, ddp_config=self.bridge_ddp_config(), fp16=False, bf16=False,
            use_cpu_initialization=self.ctx.on_cpu, post_model_creation_callbacks=[self._reinit_new_chunk],
        )
        self.config = bridge.config
        self.bridge = bridge
        self.optimizer = self.make_optimizer(self.models, self.case.options.use_distributed_optimizer)
        self.after_optimizer()
