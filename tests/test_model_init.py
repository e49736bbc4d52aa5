"""The engine's initial weights come from the parameters' global names alone (McoreEngine.reinit), so megatron
is asked to draw none (its init methods are model_config.undrawn): every parameter a model has must still start
as it would after megatron's own draw and the engine's overwrite - nothing left as uninitialised memory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

# (model, layout) at world size 2: TP-sharded matrices and fc1's [gate; up] blocks, pipeline stages, experts
# sharded over EP, a shared expert and a dense first layer, QK norms
BUILDS = (("tiny", "tp2-pp1-cp1-dp1"), ("small", "tp1-pp2-cp1-dp1"), ("tiny-moe", "tp1-pp1-cp1-dp2-ep2"),
          ("small-moe", "tp2-pp1-cp1-dp1"), ("tiny-qwen3-moe", "tp1-pp1-cp1-dp2-ep2"))


def _build(rank: int, world_size: int, model: str, layout: str, drawn: bool,
           unset: str = "") -> dict[str, torch.Tensor]:
    from harness.engines import mcore, model_config
    from harness.launch.context import RankContext
    from harness.models import load_model
    from harness.platform.parallel import teardown_parallel_state
    from harness.spec import Case, CaseOptions, Layout

    case = Case("equivalence", load_model(model), Layout.parse(layout), "mcore", CaseOptions(), "gloo", 60.0)
    engine = mcore.McoreEngine(case, RankContext(rank, world_size, rank, "gloo", Path(tempfile.mkdtemp())))
    engine.setup_parallel()

    def config(*args, **kwargs):
        cfg = model_config.transformer_config(*args, **kwargs)
        if drawn:  # megatron's own draws, as TransformerConfig makes them when given none
            from megatron.core.utils import init_method_normal, scaled_init_method_normal

            cfg.init_method = cfg.embedding_init_method = init_method_normal(cfg.init_method_std)
            cfg.output_layer_init_method = scaled_init_method_normal(cfg.init_method_std, cfg.num_layers)
        return cfg

    if unset:  # the plant: the engine's overwrite leaves this parameter as megatron made it
        engine.set_full = lambda chunk, value: mcore.McoreEngine.set_full(
            engine, chunk, lambda name, shape: None if name == unset else value(name, shape))
    saved, mcore.transformer_config = mcore.transformer_config, config
    try:
        return {f"{i}.{name}": p.detach().clone() for i, chunk in enumerate(engine.build_chunks())
                for name, p in engine.global_names(chunk).items()}
    finally:
        mcore.transformer_config = saved
        # every rank done connecting the build's groups (no collective used them) before any closes one: a peer
        # descheduled by load could still be in gloo's connect ("Connection closed by peer")
        torch.distributed.barrier()
        teardown_parallel_state()


def _differ(rank: int, world_size: int, builds, unset: str = "") -> dict[str, list[str]]:
    """Per build, the parameters whose values differ between megatron drawing initial weights and not
    (uninitialised memory filled with NaN, so a parameter nobody set shows)."""
    out = {}
    for model, layout in builds:
        drawn = _build(rank, world_size, model, layout, drawn=True, unset=unset)
        torch.use_deterministic_algorithms(True)  # with fill_uninitialized_memory: torch.empty is NaN
        try:
            assert torch.utils.deterministic.fill_uninitialized_memory
            undrawn = _build(rank, world_size, model, layout, drawn=False, unset=unset)
        finally:
            torch.use_deterministic_algorithms(False)
        assert drawn.keys() == undrawn.keys()
        out[f"{model} {layout}"] = [name for name, value in undrawn.items()
                                    if not torch.equal(value, drawn[name])]
    return out


def compare_builds(rank: int, world_size: int) -> dict[str, list[str]]:
    """On each rank (tests.support.rank_call): _differ over BUILDS."""
    return _differ(rank, world_size, BUILDS)


UNSET = "decoder.layers.0.mlp.linear_fc1.weight"


def compare_with_one_unset(rank: int, world_size: int) -> dict[str, list[str]]:
    """On each rank: _differ of tiny where the engine's overwrite skips UNSET."""
    return _differ(rank, world_size, [("tiny", "tp1-pp1-cp1-dp1")], unset=UNSET)


@pytest.mark.slow
def test_every_parameter_starts_the_same_without_megatrons_draw():
    from tests.support.rank_call import on_ranks

    for rank, differ in enumerate(on_ranks("tests.test_model_init:compare_builds", 2)):
        assert differ.keys() == {f"{m} {lay}" for m, lay in BUILDS}
        bad = {build: names for build, names in differ.items() if names}
        assert not bad, f"rank {rank}: parameters megatron's draw set and the engine did not: {bad}"


@pytest.mark.slow
def test_a_parameter_the_engine_leaves_unset_is_found():
    """The plant: the engine's overwrite skips one weight, which megatron no longer draws either."""
    from tests.support.rank_call import on_ranks

    (differ,) = on_ranks("tests.test_model_init:compare_with_one_unset", 1)
    assert differ == {"tiny tp1-pp1-cp1-dp1": ["0." + UNSET]}

