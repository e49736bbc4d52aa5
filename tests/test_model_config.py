"""The engine as users run it: megatron's fusions on GPU ranks wherever their kernels exist, each one left off
listed among the harness's adjustments with the reason; all off on CPU ranks."""

from __future__ import annotations

import pytest

from harness import adjustments
from harness.engines import model_config


class _Notes(list):
    """The adjustments noted inside the block (adjustments.take() before and after)."""

    def __enter__(self):
        adjustments.take()
        return self

    def __exit__(self, *exc):
        self.extend(n for n in adjustments.take() if not n.startswith("CPU layer"))


def test_fusions_on_a_gpu_without_te_or_apex_are_the_jitted_ones(monkeypatch):
    monkeypatch.setattr(model_config, "_importable", lambda module: False)
    with _Notes() as notes:
        flags = model_config.fusions(on_cpu=False)
    assert flags == {"bias_activation_fusion": True, "bias_dropout_fusion": True, "masked_softmax_fusion": False,
                     "apply_rope_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False}
    assert "fusion masked_softmax_fusion off: apex's fused softmax kernels are not installed" in notes
    assert ("fusion gradient_accumulation_fusion off: apex's fused_weight_gradient_mlp_cuda is not installed "
            "(megatron's output layer needs it, with Transformer Engine too)") in notes


def test_gradient_accumulation_fusion_needs_apex_with_transformer_engine_too(monkeypatch):
    """megatron's ColumnParallelLinear (the GPT output layer, in TE's spec too) refuses the fusion without apex's
    kernel: with TE and no apex the fusion stays off, and the flags build that layer here (no apex either)."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(model_config, "_importable", lambda module: module == "transformer_engine")
    with _Notes() as notes:
        flags = model_config.fusions(on_cpu=False)
    assert any(n.startswith("fusion gradient_accumulation_fusion off: apex's") for n in notes)

    def output_layer(fusion: bool) -> None:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                                   perform_initialization=False, gradient_accumulation_fusion=fusion)
        ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.zeros_, bias=False)

    output_layer(flags["gradient_accumulation_fusion"])
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:  # no apex here: the plant, the fusion on under TE, is refused
        with pytest.raises(RuntimeError, match="gradient_accumulation_fusion"):
            output_layer(True)


def test_fusions_with_apex_kernels_are_on(monkeypatch):
    monkeypatch.setattr(model_config, "_importable", lambda module: module != "transformer_engine")
    with _Notes() as notes:
        flags = model_config.fusions(on_cpu=False)
    assert all(flags[k] for k in ("masked_softmax_fusion", "gradient_accumulation_fusion", "persist_layer_norm"))
    assert flags["apply_rope_fusion"] is False and notes == ["fusion apply_rope_fusion off: Transformer Engine's fused "
                                                             "RoPE is not available"]


def test_every_fusion_is_off_on_cpu_ranks_and_said_so():
    with _Notes() as notes:
        flags = model_config.fusions(on_cpu=True)
    assert not any(flags.values()) and set(flags) == set(model_config.FUSIONS)
    from harness.platform.backend import COMPILE_OFF, CPU_RANK_ENV

    assert notes == ["fusions off on CPU ranks (CUDA kernels): " + ", ".join(model_config.FUSIONS), COMPILE_OFF]
    assert CPU_RANK_ENV["TORCHDYNAMO_DISABLE"] == "1"  # what the note says: the ranks' environment has it
