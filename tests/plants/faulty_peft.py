"""PEFT adapter exports with planted regressions (--engine tests.plants.faulty_peft:...), for the peft-ckpt suite."""

from __future__ import annotations

import contextlib
from pathlib import Path

from harness.engines.megatron_bridge import MegatronBridgeEngine


@contextlib.contextmanager
def _patched(name: str, replacement):
    """Replace a method of megatron-bridge's PEFT conversion mixin for one export (warm ranks run later
    cases with the original)."""
    from megatron.bridge.models.conversion.peft_bridge import MegatronPeftBridge

    original = getattr(MegatronPeftBridge, name)
    setattr(MegatronPeftBridge, name, replacement)
    try:
        yield
    finally:
        setattr(MegatronPeftBridge, name, original)


class QkvSplitIgnoresGroups(MegatronBridgeEngine):
    """The fused qkv adapter's B is split as contiguous [q; k; v] rows, ignoring megatron's per-query-group
    interleave (GQA)."""

    def export_peft_adapter(self, path: str) -> None:
        import torch

        def split(bridge, megatron_model, linear_out_weight):
            cfg = (megatron_model[0] if isinstance(megatron_model, list) else megatron_model).config
            q = cfg.num_attention_heads * cfg.kv_channels
            kv = cfg.num_query_groups * cfg.kv_channels
            q_out, k_out, v_out = torch.split(linear_out_weight, [q, kv, kv], dim=0)
            return {"q_proj": q_out, "k_proj": k_out, "v_proj": v_out}

        with _patched("_split_qkv_linear_out_weight", split):
            super().export_peft_adapter(path)


class Fc1NoDeinterleave(MegatronBridgeEngine):
    """The fused fc1 adapter's B is cut in two halves as at TP1, so at TP2 each 'gate' holds a TP rank's
    [gate; up] block."""

    def export_peft_adapter(self, path: str) -> None:
        import torch

        def split(bridge, linear_out_weight, *, is_expert):
            return torch.chunk(linear_out_weight, 2, dim=0)

        with _patched("_split_fused_fc1_linear_out_weight", split):
            super().export_peft_adapter(path)


@contextlib.contextmanager
def _bridge_config_patched(edit):
    """megatron-bridge's own adapter_config.json (build_adapter_config_dict, which save_hf_adapter imports when it
    writes: releases after 0.3.1) edited for one export."""
    import importlib

    module = importlib.import_module("megatron.bridge.models.conversion.peft_bridge")
    original = getattr(module, "build_adapter_config_dict", None)
    if original is None:  # a bridge that writes no adapter_config.json: the harness writes it (adapter_config)
        yield
        return
    module.build_adapter_config_dict = lambda *a, **k: edit(original(*a, **k))
    try:
        yield
    finally:
        module.build_adapter_config_dict = original


class AlphaWrittenAsRank(MegatronBridgeEngine):
    """adapter_config.json says lora_alpha = r: PEFT scales the adapter by 1 instead of alpha / r - in the bridge's
    own config where it writes one, else in the one the harness writes for it."""

    def _edit(self, cfg: dict) -> dict:
        return {**cfg, "lora_alpha": cfg["r"]}

    def adapter_config(self, tensors):
        return self._edit(super().adapter_config(tensors))

    def export_peft_adapter(self, path: str):
        with _bridge_config_patched(self._edit):
            return super().export_peft_adapter(path)


class TargetModuleDropped(AlphaWrittenAsRank):
    """v_proj is left out of target_modules while its tensors are written."""

    def _edit(self, cfg: dict) -> dict:
        return {**cfg, "target_modules": [m for m in cfg["target_modules"] if m != "v_proj"]}


class MergedExport(MegatronBridgeEngine):
    """Exports the adapters merged into the base weights: the whole model gathered on every rank and
    written as the adapter file next to the adapter tensors."""

    def export_peft_adapter(self, path: str) -> None:
        import torch.distributed as dist

        from harness.engines.lora import PEFT_PREFIX, write_adapter_dir

        tasks = self.hf_conversion_tasks(self.ctx.workdir)
        merged = {PEFT_PREFIX + name: t.clone() for name, t in self.bridge.export_hf_weights(
            self.models, cpu=True, show_progress=False, conversion_tasks=tasks, merge_adapter_weights=True)}
        adapters = self.adapter_tensors()
        if dist.get_rank() == 0:
            write_adapter_dir(Path(path), {**adapters, **merged}, self.adapter_config(adapters))


class LegacyKeysRenamed(MegatronBridgeEngine):
    """A release renamed the adapter modules: its loads ask the adapter-only distributed checkpoint for
    `...lora_adapter...` keys, which checkpoints saved before the rename do not hold."""

    def load_adapter_checkpoint(self, ckpt_dir: str) -> None:
        original = self._adapter_sharded_state_dict

        def renamed():
            sd = original()
            for section in sd.values():
                for value in section.values():
                    if hasattr(value, "key"):
                        value.key = value.key.replace(".adapter.", ".lora_adapter.")
            return sd

        self._adapter_sharded_state_dict = renamed
        super().load_adapter_checkpoint(ckpt_dir)


class ImportDropsFc1(MegatronBridgeEngine):
    """The HF adapter import leaves fc1's adapter at its initial value (B zero): the reloaded model lacks
    part of what was trained."""

    def load_peft_adapter(self, path: str) -> None:
        import torch

        super().load_peft_adapter(path)
        with torch.no_grad():
            for m in self.models:
                for name, p in self.global_names(m.module).items():
                    if name.endswith("mlp.linear_fc1.adapter.linear_out.weight"):
                        p.zero_()


class AdapterGradsNotReduced(MegatronBridgeEngine):
    """The adapters' gradients skip the data-parallel reduction (a LoRA wrapper that reduces them over another
    group, or none): each DP rank steps its adapter copy with its own micro-batches' gradient."""

    def _wire_config(self) -> None:
        super()._wire_config()
        reduce = self.config.finalize_model_grads_func

        def finalize_without_adapters(*args, **kwargs):
            adapters = [p for m in self.models for n, p in m.module.named_parameters() if ".adapter." in n]
            local = [p.main_grad.clone() for p in adapters]
            out = reduce(*args, **kwargs)
            for p, g in zip(adapters, local):
                p.main_grad.copy_(g)
            return out

        self.config.finalize_model_grads_func = finalize_without_adapters


class ExpertAdaptersSwapped(MegatronBridgeEngine):
    """The export writes expert 0's adapters under expert 1's HF names and the other way round (an exporter that
    numbers experts by another order than the router's)."""

    def export_peft_adapter(self, path: str):
        """The bridge's adapter export renamed on its way out, whoever writes the directory (the bridge's
        save_hf_adapter and the harness both read it)."""
        export = self.bridge.export_adapter_weights
        swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}

        def swapped(*args, **kwargs):
            for weight in export(*args, **kwargs):  # the bridge's HFWeightTuple (param_name, weight)
                name = weight[0]
                for old, new in swap.items():
                    if old in name:
                        name = name.replace(old, new)
                        break
                yield weight._replace(param_name=name) if hasattr(weight, "_replace") else (name, weight[1])

        self.bridge.export_adapter_weights = swapped
        try:
            return super().export_peft_adapter(path)
        finally:
            del self.bridge.export_adapter_weights


class AdapterNeverTrained(MegatronBridgeEngine):
    """The adapters take no part in training (a wrapper that leaves them out of the optimizer, or re-initialises
    them after the step): every B stays zero, so the exported adapter is faithful and does nothing."""

    def train_step(self, step: int):
        import torch

        out = super().train_step(step)
        with torch.no_grad():
            for m in self.models:
                for name, p in self.global_names(m.module).items():
                    if name.endswith("adapter.linear_out.weight"):
                        p.zero_()
        return out


class JudgedAtEveryLayout(MegatronBridgeEngine):
    """The pinned bridge judged at every expert layout, as a megatron-bridge newer than the last known wrong one
    is (its `adapter_refusal` asked of nothing)."""

    @staticmethod
    def adapter_refusal(model, layout, backend) -> None:
        return None
