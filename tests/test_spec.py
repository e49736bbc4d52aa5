"""Model specs, layout ids, layout validation and enumeration."""

from __future__ import annotations

import pytest

from harness.errors import BadInput
from harness.layouts import enumerate_layouts, validate, violations
from harness.models import known_models, load_model
from harness.spec import Layout


def test_known_models_include_cpu_and_real_scale_shapes():
    assert {"tiny", "small", "1b", "8b", "70b"} <= set(known_models())
    tiny = load_model("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.num_query_groups,
            tiny.vocab_size, tiny.seq_length) == (2, 64, 4, 2, 128, 64)
    small = load_model("small")
    assert (small.num_layers, small.hidden_size) == (4, 256)


@pytest.mark.parametrize("name,billions", [("1b", 1.24), ("8b", 8.03), ("70b", 70.55)])
def test_real_scale_param_counts(name, billions):
    assert load_model(name).num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_unknown_model_lists_known_ones():
    with pytest.raises(BadInput, match=r"unknown model 'gpt5'; known models: tiny, tiny-moe, tiny-qwen3-moe, small, small-moe, "):
        load_model("gpt5")


@pytest.mark.parametrize("text", ["tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp1-vpp2"])
def test_layout_id_roundtrip(text):
    assert Layout.parse(text).id == text


@pytest.mark.parametrize("text", ["tp2-pp1-dp2", "tp0-pp1-cp1-dp1", "2x2", "tp2-pp1-cp1-dp2-"])
def test_malformed_layout(text):
    with pytest.raises(BadInput):
        Layout.parse(text)


def test_invalid_layout_names_each_violated_constraint():
    tiny = load_model("tiny")
    with pytest.raises(BadInput) as exc:
        validate(Layout.parse("tp3-pp1-cp1-dp1"), tiny, 8)
    msg = str(exc.value)
    assert "tp*pp*cp*dp = 3 != world size 8" in msg
    assert "num_attention_heads=4 not divisible by tp=3" in msg
    assert "num_query_groups=2 not divisible by tp=3" in msg
    assert violations(Layout(pp=4, dp=1), tiny) == ["num_layers=2 not divisible by pp*vpp=4"]
    assert "seq_length=64 not divisible by 2*cp=128" in violations(Layout(cp=64), tiny)[0]
    assert any("needs pp > 1" in v for v in violations(Layout(vpp=2, dp=2), load_model("small")))


# Written out by hand from tiny's shape (2 layers, 4 heads, 2 query groups, vocab 128, ffn 128, seq 64,
# global batch 8): TP <= 2 (query groups), PP <= 2 (layers), CP up to 4 (2 x 4 divides 64).
TINY_WS4 = ["tp1-pp1-cp1-dp4", "tp1-pp1-cp2-dp2", "tp1-pp1-cp4-dp1", "tp1-pp2-cp1-dp2", "tp1-pp2-cp2-dp1",
            "tp2-pp1-cp1-dp2", "tp2-pp1-cp2-dp1", "tp2-pp2-cp1-dp1"]
TINY_WS8 = ["tp1-pp1-cp1-dp8", "tp1-pp1-cp2-dp4", "tp1-pp1-cp4-dp2", "tp1-pp1-cp8-dp1", "tp1-pp2-cp1-dp4",
            "tp1-pp2-cp2-dp2", "tp1-pp2-cp4-dp1", "tp2-pp1-cp1-dp4", "tp2-pp1-cp2-dp2", "tp2-pp1-cp4-dp1",
            "tp2-pp2-cp1-dp2", "tp2-pp2-cp2-dp1"]


@pytest.mark.parametrize("world_size,expected", [(4, TINY_WS4), (8, TINY_WS8), (1, ["tp1-pp1-cp1-dp1"])])
def test_enumerate_lists_exactly_the_valid_layouts(world_size, expected):
    assert [lay.id for lay in enumerate_layouts(load_model("tiny"), world_size)] == expected


@pytest.mark.parametrize("lid,reason", [
    ("tp4-pp1-cp1-dp1", "num_query_groups=2 not divisible by tp=4"),
    ("tp1-pp4-cp1-dp1", "num_layers=2 not divisible by pp*vpp=4"),
    ("tp1-pp1-cp1-dp16", "global_batch_size=8 not divisible by micro_batch_size*dp=16"),
    ("tp1-pp1-cp64-dp1", "seq_length=64 not divisible by 2*cp=128 (zigzag CP split)"),
])
def test_each_refused_layout_says_why(lid, reason):
    lay = Layout.parse(lid)
    assert reason in violations(lay, load_model("tiny"), lay.world_size)
    assert lay not in enumerate_layouts(load_model("tiny"), lay.world_size)


def test_every_dtype_has_its_bytes_torch_dtype_and_tolerances():
    import torch

    from harness.dtypes import DTYPES, dtype

    assert {n: (d.bytes, d.torch) for n, d in DTYPES.items()} == {
        "fp32": (4, torch.float32), "bf16": (2, torch.bfloat16), "fp16": (2, torch.float16)}
    assert all(0 < d.rtol and 0 < d.golden_rtol < d.golden_max_spread for d in DTYPES.values())
    with pytest.raises(BadInput, match="unknown dtype 'fp8'; known: fp32, bf16, fp16"):
        dtype("fp8")
