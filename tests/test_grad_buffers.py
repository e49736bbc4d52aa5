"""grad-sync plans each rank's gradient buffers from the parameters of its built model chunks (HasGradBuffers);
the model spec's arithmetic (chunk_params, which project-memory and the training-memory model use) must give the
same parameters, element for element, for every shipped CPU model at every layout of world sizes 2 and 4."""

from __future__ import annotations

import pytest

from harness.checks.sync_plan import chunk_params, plan
from harness.launch.pool import pool_for
from harness.layouts import coords_of, default_matrix
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout

pytestmark = pytest.mark.slow

CPU_MODELS = ("tiny", "small", "tiny-moe", "small-moe", "tiny-qwen3-moe")


class BuildOnly:
    """Builds the case's model and reports what its gradient buffers hold."""

    name = "build-only"
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer")

    def rank_work(self, case, ctx):
        from harness.engines import make_engine

        engine = make_engine(case, ctx)
        engine.build()
        return {"chunks": engine.grad_buffer_params()}


def _arithmetic(case: Case, rank: int) -> list[list[tuple[int, bool, bool]]]:
    c, lay = coords_of(case.layout, rank), case.layout
    out = []
    for vp in range(lay.vpp):
        dense = [(n, s, False) for _, n, s in chunk_params(case.model, lay, c.pp, vp)]
        experts = [(n, s, True) for _, n, s in chunk_params(case.model, lay, c.pp, vp, expert_buffer=True)]
        out.append(dense + experts)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", CPU_MODELS)
def test_the_spec_arithmetic_counts_what_megatron_builds(model, world):
    spec = load_model(model)
    mismatches = []
    for lay in default_matrix(spec, world):
        case = Case("tests.test_grad_buffers:BuildOnly", spec, lay, "mcore", CaseOptions(), "gloo", 300.0)
        res = pool_for(world, "gloo").run(case)
        assert res.status == "ok", res.error
        for r in res.ranks:
            built = r.data["chunks"]
            got = [sorted(n for _, n in chunk) for chunk in built]
            want = [sorted(n for n, _, _ in chunk) for chunk in _arithmetic(case, r.rank)]
            if got != want:
                names = [name for chunk in built for name, _ in chunk]
                mismatches.append(f"{lay} rank {r.rank}: built {sum(map(sum, got))} elements in "
                                  f"{sum(map(len, got))} parameters, the arithmetic {sum(map(sum, want))}"
                                  f" in {sum(map(len, want))} ({names[:6]} ...)")
            # and the plans from either agree
            assert plan(case, r.rank, built) == plan(case, r.rank), f"{lay} rank {r.rank}"
    assert not mismatches, "\n".join(mismatches)


def test_a_plan_from_the_built_model_counts_a_weight_the_arithmetic_lacks():
    """The plant: a chunk holding one more trained weight (as qk_layernorm was before the arithmetic listed it)
    moves the planned buffer; the plan follows the built model, not the formula."""
    case = Case("grad-sync", load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(steps=1), "gloo")
    chunk = [(name, n) for name, n, _ in chunk_params(case.model, case.layout, 0, 0)]
    extra = [*chunk, ("decoder.layers.0.self_attention.q_layernorm.weight", 16)]
    assert plan(case, 0, [chunk]) == plan(case, 0)
    [reduction] = plan(case, 0, [extra])
    assert reduction.numel == plan(case, 0)[0].numel + 16
