"""LoRA adapters in Hugging Face PEFT format: what a directory holds, written from HF-named tensors.

An HF PEFT LoRA directory is `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...)
and `adapter_model.safetensors`, whose keys are `base_model.model.<HF module>.lora_{A,B}.weight`.
Megatron's fused linears map to several HF modules: linear_qkv -> q/k/v_proj, linear_fc1 ->
gate/up_proj (SwiGLU), linear_proj -> o_proj, linear_fc2 -> down_proj.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

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
    (the fused qkv / fc1 adapter's single A is written once per HF module, as PEFT needs it)."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, model.kv_channels * model.num_query_groups
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    adapted = hf_target_modules(targets, model.swiglu)
    per_layer = sum(dim * (i + o) for name, (i, o) in shapes.items() if name in adapted)
    return model.num_layers * per_layer


def expected_hf_adapter(params: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The PEFT tensors an export of these Megatron adapter parameters must hold, by the harness's own
    arithmetic (not the bridge's): full (TP-assembled) `decoder.layers.N.<linear>.adapter.linear_{in,out}.weight`
    -> `base_model.model.model.layers.N.<module>.lora_{A,B}.weight`. A fused linear's A is every split
    module's A; fused qkv B rows are per query group [q heads of the group; k; v]; fc1 B is [gate; up]."""
    out = {}
    d, groups = model.kv_channels, model.num_query_groups
    heads_per_group = model.num_attention_heads // groups
    for name, t in params.items():
        parts = name.split(".")
        if ".adapter." not in name or parts[0] != "decoder":
            continue
        layer, linear, which = int(parts[2]), parts[4], parts[-2]
        hf = f"{PEFT_PREFIX}model.layers.{layer}.{'self_attn' if linear in ('linear_qkv', 'linear_proj') else 'mlp'}."
        lora = "lora_A" if which == "linear_in" else "lora_B"
        if linear == "linear_qkv" and which == "linear_out":
            g = t.reshape(groups, heads_per_group + 2, d, t.shape[-1])
            split = {"q_proj": g[:, :heads_per_group], "k_proj": g[:, heads_per_group],
                     "v_proj": g[:, heads_per_group + 1]}
            for module, rows in split.items():
                out[f"{hf}{module}.{lora}.weight"] = rows.reshape(-1, t.shape[-1])
        elif linear == "linear_fc1" and which == "linear_out" and model.swiglu:
            gate, up = t.chunk(2, dim=0)
            out[f"{hf}gate_proj.{lora}.weight"], out[f"{hf}up_proj.{lora}.weight"] = gate, up
        else:
            for module in hf_modules(linear, model.swiglu):
                out[f"{hf}{module}.{lora}.weight"] = t
    return out


def megatron_adapter_from_hf(tensors: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The inverse of expected_hf_adapter: PEFT tensors -> full Megatron adapter parameters by global name.
    A fused linear has one A, so its HF modules must share it; ValueError names the one that does not."""
    import torch

    d, groups = model.kv_channels, model.num_query_groups
    heads_per_group = model.num_attention_heads // groups
    out = {}

    def get(layer: int, module: str, lora: str) -> torch.Tensor:
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"{PEFT_PREFIX}model.layers.{layer}.{block}.{module}.{lora}.weight"
        if key not in tensors:
            raise ValueError(f"the adapter has no {key}")
        return tensors[key]

    def shared_a(layer: int, modules: tuple[str, ...]) -> torch.Tensor:
        a = get(layer, modules[0], "lora_A")
        for m in modules[1:]:
            if not torch.equal(get(layer, m, "lora_A"), a):
                raise ValueError(f"layer {layer}: {m}.lora_A differs from {modules[0]}.lora_A, but Megatron's fused "
                                 "linear has a single A")
        return a

    for layer in range(model.num_layers):
        pre = f"decoder.layers.{layer}."
        qkv = HF_MODULES["linear_qkv"]
        out[pre + "self_attention.linear_qkv.adapter.linear_in.weight"] = shared_a(layer, qkv)
        q, k, v = (get(layer, m, "lora_B") for m in qkv)
        r = q.shape[-1]
        out[pre + "self_attention.linear_qkv.adapter.linear_out.weight"] = torch.cat(
            [q.reshape(groups, heads_per_group, d, r), k.reshape(groups, 1, d, r), v.reshape(groups, 1, d, r)],
            dim=1).reshape(-1, r)
        out[pre + "self_attention.linear_proj.adapter.linear_in.weight"] = get(layer, "o_proj", "lora_A")
        out[pre + "self_attention.linear_proj.adapter.linear_out.weight"] = get(layer, "o_proj", "lora_B")
        fc1 = hf_modules("linear_fc1", model.swiglu)
        out[pre + "mlp.linear_fc1.adapter.linear_in.weight"] = shared_a(layer, fc1)
        out[pre + "mlp.linear_fc1.adapter.linear_out.weight"] = torch.cat([get(layer, m, "lora_B") for m in fc1])
        out[pre + "mlp.linear_fc2.adapter.linear_in.weight"] = get(layer, "down_proj", "lora_A")
        out[pre + "mlp.linear_fc2.adapter.linear_out.weight"] = get(layer, "down_proj", "lora_B")
    return out
