"""A Megatron GPT model's full parameters under Hugging Face names (Llama, Qwen3-MoE), by the harness's own arithmetic.

Megatron's fused linears hold several HF modules: linear_qkv's rows are per query group [the group's q heads; k;
v], SwiGLU linear_fc1's rows are [gate; up]. The names are megatron's local spec's (input_layernorm,
pre_mlp_layernorm, local_experts.E) and the Transformer Engine spec's (layer_norm_weight fused into the next
linear, grouped experts weightE); a LoRA-wrapped linear's `.to_wrap.` is its base weight.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from harness.spec import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
_ONE_TO_ONE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    # aux-loss-free balancing's per-expert bias (a buffer): DeepSeek-V3's and GLM-4.5's name for it
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def split_qkv(t: torch.Tensor, model: ModelSpec) -> dict[str, torch.Tensor]:
    """q_proj, k_proj, v_proj rows of a fused linear_qkv tensor (weight, or a LoRA B) of rows per query group."""
    d, groups = model.kv_channels, model.num_query_groups
    per_group = model.num_attention_heads // groups
    g = t.reshape(groups, per_group + 2, d, t.shape[-1])
    return {"q_proj": g[:, :per_group].reshape(-1, t.shape[-1]), "k_proj": g[:, per_group].reshape(-1, t.shape[-1]),
            "v_proj": g[:, per_group + 1].reshape(-1, t.shape[-1])}


def split_fc1(t: torch.Tensor, model: ModelSpec) -> dict[str, torch.Tensor]:
    """gate_proj and up_proj rows of a linear_fc1 tensor (up_proj alone without SwiGLU)."""
    if not model.swiglu:
        return {"up_proj": t}
    gate, up = t.chunk(2, dim=0)
    return {"gate_proj": gate, "up_proj": up}


def hf_state_dict(full: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """HF-named tensors of full (TP-assembled, global-named) Megatron base parameters; adapters are left out.
    KeyError names a parameter this mapping does not know."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        name = name.replace(".to_wrap.", ".")
        if ".adapter." in name:
            continue
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif (layer := _LAYER.match(name)) is None:
            raise KeyError(f"no Hugging Face name for {name}")
        else:
            pre, rest = f"model.layers.{layer.group(1)}.", layer.group(2)
            expert = _EXPERT.match(rest)
            if rest in _ONE_TO_ONE:
                out[pre + _ONE_TO_ONE[rest]] = t
            elif rest == "self_attention.linear_qkv.weight":
                out.update({f"{pre}self_attn.{m}.weight": v for m, v in split_qkv(t, model).items()})
            elif rest == "mlp.linear_fc1.weight":
                out.update({f"{pre}mlp.{m}.weight": v for m, v in split_fc1(t, model).items()})
            elif expert is not None:
                index, linear = (expert.group(1), expert.group(2)) if expert.group(1) else expert.group(4, 3)
                at = f"{pre}mlp.experts.{index}."
                parts = split_fc1(t, model) if linear == "linear_fc1" else {"down_proj": t}
                out.update({f"{at}{m}.weight": v for m, v in parts.items()})
            else:
                raise KeyError(f"no Hugging Face name for {name}")
    return out
