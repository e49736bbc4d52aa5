"""LoRA adapters in Hugging Face PEFT format: what a directory holds, written from HF-named tensors.

An HF PEFT LoRA directory is `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...)
and `adapter_model.safetensors`, whose keys are `base_model.model.<HF module>.lora_{A,B}.weight`.
Megatron's fused linears map to several HF modules: linear_qkv -> q/k/v_proj, linear_fc1 ->
gate/up_proj (SwiGLU), linear_proj -> o_proj, linear_fc2 -> down_proj; an MoE layer's experts each hold their own
fc1 / fc2 adapters (HF `mlp.experts.E.gate_proj`, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from harness.engines.hf_weights import split_fc1, split_qkv
from harness.files import atomic_dir

if TYPE_CHECKING:
    import torch

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def hf_modules(linear: str, swiglu: bool = True) -> tuple[str, ...]:
    """The HF modules one megatron linear maps to (fc1 is up_proj alone without SwiGLU)."""
    return HF_MODULES[linear] if (linear != "linear_fc1" or swiglu) else ("up_proj",)


def hf_target_modules(targets: tuple[str, ...] = MEGATRON_TARGETS, swiglu: bool = True) -> list[str]:
    """The HF module names LoRA on these megatron linears adapts."""
    return sorted(m for t in targets for m in hf_modules(t, swiglu))


def adapter_config(dim: int, alpha: int, target_modules: list[str], dropout: float = 0.0,
                   base_model: str = "") -> dict:
    """adapter_config.json of a plain LoRA adapter (PEFT's LoraConfig fields that decide the math)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": dim, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": sorted(target_modules), "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_adapter_dir(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write the directory whole or not at all: files go to a temporary sibling renamed into place
    (harness.files.atomic_dir)."""
    from safetensors.torch import save_file

    with atomic_dir(path) as tmp:
        seen: set[int] = set()
        own = {}
        for k, v in tensors.items():  # a fused linear's single A is exported once per HF module: one copy each
            v = v.contiguous()
            own[k] = v.clone() if v.data_ptr() in seen else v
            seen.add(v.data_ptr())
        save_file(own, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))


def read_adapter_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of an adapter directory."""
    from safetensors.torch import load_file

    return json.loads((path / CONFIG_FILE).read_text()), load_file(str(path / WEIGHTS_FILE))


def adapter_values(model, dim: int, targets: tuple[str, ...] = MEGATRON_TARGETS) -> int:
    """Values an adapter holds: per layer and target, A [dim, in] + B [out, dim] of the HF modules it maps to
    (the fused qkv / fc1 adapter's single A is written once per HF module, as PEFT needs it); an MoE layer's MLP
    adapters once per expert."""
    h, kv = model.hidden_size, model.kv_channels * model.num_query_groups
    adapted = hf_target_modules(targets, model.swiglu)

    def values(shapes: dict[str, tuple[int, int]]) -> int:
        return sum(dim * (i + o) for name, (i, o) in shapes.items() if name in adapted)

    attention = values({"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)})

    def mlp(f: int) -> int:
        return values({"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)})

    return (model.num_layers * attention + (model.num_layers - model.moe_layers()) * mlp(model.ffn_hidden_size)
            + model.moe_layers() * model.num_experts * mlp(model.expert_ffn))


_ADAPTER = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(?:experts\.local_experts\.(\d+)\.)?"
                      r"(linear_\w+)\.adapter\.linear_(in|out)\.weight$")


def _hf_block(layer: int | str, block: str, expert: int | str | None = None) -> str:
    """The PEFT key prefix of a layer's attention ("self_attention") or MLP ("mlp") block, or of one expert."""
    at = f"{PEFT_PREFIX}model.layers.{layer}.{'self_attn' if block == 'self_attention' else 'mlp'}."
    return at if expert is None else f"{at}experts.{expert}."


def expected_hf_adapter(params: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The PEFT tensors an export of these Megatron adapter parameters must hold, by the harness's own
    arithmetic (not the bridge's): full (TP-assembled) `decoder.layers.N.<linear>.adapter.linear_{in,out}.weight`
    -> `base_model.model.model.layers.N.<module>.lora_{A,B}.weight`, an expert's (`mlp.experts.local_experts.E.`,
    global E) -> `mlp.experts.E.<module>`. A fused linear's A is every split module's A; fused qkv B rows are per
    query group [q heads of the group; k; v]; fc1 B is [gate; up]."""
    out = {}
    for name, t in params.items():
        match = _ADAPTER.match(name)
        if match is None:
            continue
        layer, block, expert, linear, which = match.groups()
        lora = "lora_A" if which == "in" else "lora_B"
        if linear == "linear_qkv" and which == "out":
            parts = split_qkv(t, model)
        elif linear == "linear_fc1" and which == "out":
            parts = split_fc1(t, model)
        else:
            parts = dict.fromkeys(hf_modules(linear, model.swiglu), t)
        hf = _hf_block(layer, block, expert)
        out.update({f"{hf}{module}.{lora}.weight": v for module, v in parts.items()})
    return out


def megatron_adapter_from_hf(tensors: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The inverse of expected_hf_adapter: PEFT tensors -> full Megatron adapter parameters by global name.
    A fused linear has one A, so its HF modules must share it; ValueError names the one that does not."""
    import torch

    d, groups = model.kv_channels, model.num_query_groups
    heads_per_group = model.num_attention_heads // groups
    out = {}

    def get(hf: str, module: str, lora: str) -> torch.Tensor:
        key = f"{hf}{module}.{lora}.weight"
        if key not in tensors:
            raise ValueError(f"the adapter has no {key}")
        return tensors[key]

    def shared_a(hf: str, modules: tuple[str, ...]) -> torch.Tensor:
        a = get(hf, modules[0], "lora_A")
        for m in modules[1:]:
            if not torch.equal(get(hf, m, "lora_A"), a):
                raise ValueError(f"{hf}{m}.lora_A differs from {modules[0]}.lora_A, but Megatron's fused linear has "
                                 "a single A")
        return a

    def mlp(pre: str, hf: str) -> None:
        fc1 = hf_modules("linear_fc1", model.swiglu)
        out[pre + "linear_fc1.adapter.linear_in.weight"] = shared_a(hf, fc1)
        out[pre + "linear_fc1.adapter.linear_out.weight"] = torch.cat([get(hf, m, "lora_B") for m in fc1])
        out[pre + "linear_fc2.adapter.linear_in.weight"] = get(hf, "down_proj", "lora_A")
        out[pre + "linear_fc2.adapter.linear_out.weight"] = get(hf, "down_proj", "lora_B")

    for layer in range(model.num_layers):
        pre, hf = f"decoder.layers.{layer}.self_attention.", _hf_block(layer, "self_attention")
        qkv = HF_MODULES["linear_qkv"]
        out[pre + "linear_qkv.adapter.linear_in.weight"] = shared_a(hf, qkv)
        q, k, v = (get(hf, m, "lora_B") for m in qkv)
        r = q.shape[-1]
        out[pre + "linear_qkv.adapter.linear_out.weight"] = torch.cat(
            [q.reshape(groups, heads_per_group, d, r), k.reshape(groups, 1, d, r), v.reshape(groups, 1, d, r)],
            dim=1).reshape(-1, r)
        out[pre + "linear_proj.adapter.linear_in.weight"] = get(hf, "o_proj", "lora_A")
        out[pre + "linear_proj.adapter.linear_out.weight"] = get(hf, "o_proj", "lora_B")
        if model.moe and layer >= model.moe_first_dense_layers:
            for e in range(model.num_experts):
                mlp(f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.", _hf_block(layer, "mlp", e))
        else:
            mlp(f"decoder.layers.{layer}.mlp.", _hf_block(layer, "mlp"))
    return out


def merged_weights(full: dict[str, torch.Tensor], alpha: int, dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a merged LoRA refit must send: each wrapped linear's weight `W + (alpha / dim) * (B @ A)` computed in fp32
    from the trained tensors (megatron's global names, assembled) and cast to the model's dtype once, under the base
    weight's name; the adapters left out, every other tensor as it is."""
    scale = alpha / dim
    out = {}
    for name, t in full.items():
        if ".adapter." in name:
            continue
        if ".to_wrap." in name:
            linear = name[:name.index(".to_wrap.")]
            a, b = full[f"{linear}.adapter.linear_in.weight"], full[f"{linear}.adapter.linear_out.weight"]
            t = (t.float() + scale * (b.float() @ a.float())).to(dtype).float()
            name = name.replace(".to_wrap.", ".")
        out[name] = t
    return out

