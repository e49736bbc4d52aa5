"""A Megatron GPT model's full parameters under Hugging Face names (Llama, Qwen3-MoE; a shared expert as DeepSeek
names it), by the harness's own arithmetic.

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
        if name == "embedding.word_embeddings.weight":  # megatron's padded rows cut: no token is theirs
            out["model.embed_tokens.weight"] = t[:model.vocab_size]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[:model.vocab_size]
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
            elif rest == "mlp.shared_experts.linear_fc1.weight":  # DeepSeek's names for the shared expert
                out.update({f"{pre}mlp.shared_experts.{m}.weight": v for m, v in split_fc1(t, model).items()})
            elif rest == "mlp.shared_experts.linear_fc2.weight":
                out[f"{pre}mlp.shared_experts.down_proj.weight"] = t
            elif expert is not None:
                index, linear = (expert.group(1), expert.group(2)) if expert.group(1) else expert.group(4, 3)
                at = f"{pre}mlp.experts.{index}."
                parts = split_fc1(t, model) if linear == "linear_fc1" else {"down_proj": t}
                out.update({f"{at}{m}.weight": v for m, v in parts.items()})
            else:
                raise KeyError(f"no Hugging Face name for {name}")
    return out


# -- checkpoint format and module format ----------------------------------------------------------------------------
# What a rollout engine loads, and what megatron-bridge and this mapping send, is the Hugging Face checkpoint format:
# one tensor per expert (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight). transformers 5's Qwen3-MoE module
# holds each layer's experts fused (mlp.experts.gate_up_proj [E, 2F, H], gate first; mlp.experts.down_proj
# [E, H, F]); transformers 4's holds them per expert, as the checkpoint does.
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_shapes(module_state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of an HF model's state in the checkpoint format: fused experts listed one by one."""
    out = {}
    for name, t in module_state.items():
        fused = _FUSED.match(name)
        if fused is None:
            out[name] = (tuple(t.shape), t.dtype)
            continue
        experts, kind = fused.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{experts}.{e}.down_proj.weight"] = (tuple(t.shape[1:]), t.dtype)
            else:
                half = (t.shape[1] // 2, t.shape[2])
                out[f"{experts}.{e}.gate_proj.weight"] = (half, t.dtype)
                out[f"{experts}.{e}.up_proj.weight"] = (half, t.dtype)
    return out


def to_module_format(state: dict[str, torch.Tensor], module_keys: set[str]) -> dict[str, torch.Tensor]:
    """A checkpoint-format state for a module whose experts are fused (module_keys: its state_dict's keys): each
    layer's per-expert tensors stacked into its fused ones where every expert of the layer is there; the rest as
    given (a missing expert leaves the fused tensor missing, as a missing key would)."""
    import torch

    fused = {m.group(1) for k in module_keys if (m := _FUSED.match(k))}
    if not fused:
        return dict(state)
    out = dict(state)
    per = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    found: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        m = per.match(name)
        if m is not None and m.group(1) in fused:
            found.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            del out[name]
    for experts, by_index in found.items():
        indices = sorted(by_index)
        if indices != list(range(len(indices))):
            continue  # experts missing: the fused tensors stay missing
        if all({"gate_proj", "up_proj"} <= set(by_index[e]) for e in indices):
            out[f"{experts}.gate_up_proj"] = torch.stack([torch.cat([by_index[e]["gate_proj"], by_index[e]["up_proj"]])
                                                           for e in indices])
        if all("down_proj" in by_index[e] for e in indices):
            out[f"{experts}.down_proj"] = torch.stack([by_index[e]["down_proj"] for e in indices])
    return out
