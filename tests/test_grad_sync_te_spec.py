"""The grad-sync plan for Transformer Engine's layer spec, without TE: megatron's own TE spec tree is built
with stand-ins that register parameters as TE's modules do, and megatron's DDP lays out the buffers.

TE does not install on CPU machines. What the plan needs from it is only each module's parameters in
registration order - TE's LayerNormLinear registers `layer_norm_weight` (and `layer_norm_bias` for
LayerNorm) before `weight`; Linear registers `weight` and no bias parameter when bias=False; TENorm
registers `weight` (and `bias`); DotProductAttention has none. The stand-ins do exactly that; which module
sits where (norms fused into the following linear, identity norms in the layer) is megatron's spec itself.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import torch
from torch import nn

from harness.checks.expected_collectives import chunk_buckets, chunk_params
from harness.models import load_model
from harness.spec import Layout

BUCKETS = (None, 4_000, 10_000)  # bucket sizes (elements) at which TE's order and the local one differ


def _stand_ins():
    from megatron.core.models.backends import BackendSpecProvider

    def tp_size(config) -> int:
        return config.tensor_model_parallel_size

    class Linear(nn.Module):
        def __init__(self, input_size, output_size, *, config, parallel_mode="column", **kwargs):
            super().__init__()
            rows, cols = output_size, input_size
            if parallel_mode == "column":
                rows //= tp_size(config)
            else:
                cols //= tp_size(config)
            self.weight = nn.Parameter(torch.zeros(rows, cols))

    class Column(Linear):
        def __init__(self, input_size, output_size, **kwargs):
            super().__init__(input_size, output_size, parallel_mode="column", **kwargs)

    class Row(Linear):
        def __init__(self, input_size, output_size, **kwargs):
            super().__init__(input_size, output_size, parallel_mode="row", **kwargs)

    class LayerNormColumn(nn.Module):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__()
            self.layer_norm_weight = nn.Parameter(torch.ones(input_size))
            if config.normalization != "RMSNorm":
                self.layer_norm_bias = nn.Parameter(torch.zeros(input_size))
            self.weight = nn.Parameter(torch.zeros(output_size // tp_size(config), input_size))

    class Norm(nn.Module):
        def __new__(cls, config, hidden_size, eps=1e-5):
            module = nn.Module()
            module.weight = nn.Parameter(torch.ones(hidden_size))
            if config.normalization != "RMSNorm":
                module.bias = nn.Parameter(torch.zeros(hidden_size))
            return module

    class Attention(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    class Provider(BackendSpecProvider):
        def linear(self):
            return Linear

        def column_parallel_linear(self):
            return Column

        def row_parallel_linear(self):
            return Row

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return LayerNormColumn

        def layer_norm(self, rms_norm=False, for_qk=False):
            return Norm

        def core_attention(self):
            return Attention

        def grouped_mlp_modules(self, *args, **kwargs):
            raise NotImplementedError("no MoE here")

        def activation_func(self):
            return None

    return Provider


def _layout_of_megatron(model, te: bool, bucket_sizes) -> dict:
    """Parameter names in registration order and DDP's padded bucket sizes, for the TE or the local spec."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig

    from harness.platform.parallel import init_parallel_state, teardown_parallel_state

    init_parallel_state(Layout(), on_cpu=True, seed=1)
    try:
        if te:
            specs.TESpecProvider = _stand_ins()  # the name megatron's TE spec builder looks up
            spec = specs.get_gpt_layer_with_transformer_engine_spec()
        else:
            spec = specs.get_gpt_layer_local_spec(normalization=model.normalization)
        config = TransformerConfig(
            num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
            num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
            normalization=model.normalization, gated_linear_unit=model.swiglu, add_bias_linear=False,
            use_cpu_initialization=True)
        gpt = GPTModel(config, spec, vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
                       share_embeddings_and_output_weights=model.tie_embeddings, position_embedding_type="rope")
        names = [re.sub(r"^decoder\.layers\.\d+\.", "", n) for n, _ in gpt.named_parameters()]
        buckets = {}
        for size in bucket_sizes:
            ddp = DistributedDataParallel(
                config, DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                      bucket_size=size), gpt)
            buckets[size] = [b.grad_data.numel() for buf in ddp.buffers for b in buf.buckets]
            del ddp
        return {"names": names, "buckets": buckets}
    finally:
        teardown_parallel_state()


def megatron_layout(rank: int, world_size: int) -> dict[tuple[str, bool], object]:
    """On one rank (tests.support.rank_call): megatron's buffers of both specs, for tiny and a LayerNorm tiny."""
    tiny = load_model("tiny")
    results = {}
    for model in (tiny, dataclasses.replace(tiny, name="tiny-layernorm", normalization="LayerNorm")):
        for te in (False, True):
            results[(model.name, te)] = _layout_of_megatron(model, te, BUCKETS)
    return results


@pytest.fixture(scope="module")
def megatron_layouts():
    from tests.support.rank_call import on_ranks

    return on_ranks("tests.test_grad_sync_te_spec:megatron_layout", 1)[0]


def _model(name: str):
    tiny = load_model("tiny")
    return tiny if name == "tiny" else dataclasses.replace(tiny, name=name, normalization="LayerNorm")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-layernorm"])
@pytest.mark.parametrize("te", [False, True], ids=["local-spec", "te-spec"])
def test_plan_params_are_megatrons_in_registration_order(megatron_layouts, name, te):
    got = megatron_layouts[(name, te)]
    planned = [n for n, _, _ in chunk_params(_model(name), Layout(), 0, 0, te=te)]
    assert planned == got["names"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-layernorm"])
@pytest.mark.parametrize("te", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("bucket_size", BUCKETS)
def test_planned_buckets_are_the_ones_megatron_builds(megatron_layouts, name, te, bucket_size):
    params = chunk_params(_model(name), Layout(), 0, 0, te=te)
    planned = chunk_buckets(params, distopt=True, dp_cp=1, bucket_size=bucket_size)
    assert planned == megatron_layouts[(name, te)]["buckets"][bucket_size]


def test_the_two_specs_bucket_differently():
    """The buckets above tell the specs apart: a plan that assumed the local order would fail for TE."""
    tiny = load_model("tiny")
    local, te = (chunk_buckets(chunk_params(tiny, Layout(), 0, 0, te=t), distopt=True, dp_cp=1, bucket_size=10_000)
                 for t in (False, True))
    assert local != te


def test_plan_uses_te_order_where_the_case_builds_te(monkeypatch):
    """A case on NCCL ranks with transformer_engine installed plans with TE's parameters; gloo ranks never."""
    import importlib.util

    from harness.checks.expected_collectives import expected_collectives
    from harness.spec import Case, CaseOptions

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    opts = CaseOptions(steps=1, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=10_000)
    tiny = load_model("tiny")
    nccl = Case("grad-sync", tiny, Layout(), options=opts, backend="nccl")
    gloo = Case("grad-sync", tiny, Layout(), options=opts, backend="gloo")
    assert nccl.te_spec and not gloo.te_spec
    # the plan counts calls per bucket size: one step, one call per bucket
    sizes = {c.backend: {p.numel: p.calls for p in expected_collectives(c, 0) if p.kind == "reduce_scatter"} for c in (nccl, gloo)}
    te_buckets = chunk_buckets(chunk_params(tiny, Layout(), 0, 0, te=True), distopt=True, dp_cp=1, bucket_size=10_000)
    assert sizes["nccl"] == Counter(te_buckets)
    assert sizes["nccl"] != sizes["gloo"]
