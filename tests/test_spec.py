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
    with pytest.raises(BadInput, match=r"unknown model 'gpt5'; known models: tiny, small"):
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


def test_enumerate_world_size_8_tiny():
    ids = [lay.id for lay in enumerate_layouts(load_model("tiny"), 8)]
    assert len(ids) == len(set(ids)) == 12
    assert "tp4-pp1-cp1-dp2" not in ids  # 2 query groups cannot split over 4 TP ranks
    assert "tp1-pp4-cp1-dp2" not in ids  # 2 layers cannot fill 4 stages
    for lid in ids:
        lay = Layout.parse(lid)
        assert lay.world_size == 8 and not violations(lay, load_model("tiny"), 8)


def test_enumerate_is_exhaustive():
    tiny = load_model("tiny")
    found = set(enumerate_layouts(tiny, 4))
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for cp in (1, 2, 4):
                if 4 % (tp * pp * cp) == 0:
                    lay = Layout(tp, pp, cp, 4 // (tp * pp * cp))
                    assert (lay in found) == (not violations(lay, tiny, 4)), lay
