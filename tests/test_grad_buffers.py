"""grad-sync plans each rank's gradient buffers from the parameters of its built model chunks (HasGradBuffers);
the model spec's arithmetic (chunk_params, which project-memory and the training-memory model use) must give the
same parameters, element for element: on real ranks for every shipped CPU model at every layout of world sizes 2
and 4, and built a rank at a time on a fake process group for every shipped model at every layout up to 8."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.checks.expected_collectives import chunk_params, expected_collectives
from harness.launch.pool import pool_for
from harness.layouts import default_matrix
from harness.models import known_models, load_model
from harness.spec import Case, CaseOptions, Layout
from tests.fakes.fake_world import MAX_WORLD, arithmetic_sizes, fake_process_group_missing

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


# one dense and one MoE model in the fast tier; every CPU model at both world sizes nightly
SPEC_CASES = [pytest.param(m, w, marks=[] if (m, w) in (("tiny", 2), ("tiny-moe", 4)) else [pytest.mark.nightly])
              for m in CPU_MODELS for w in (2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("model, world", SPEC_CASES)
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
            want = arithmetic_sizes(case, r.rank)
            if got != want:
                names = [name for chunk in built for name, _ in chunk]
                mismatches.append(f"{lay} rank {r.rank}: built {sum(map(sum, got))} elements in "
                                  f"{sum(map(len, got))} parameters, the arithmetic {sum(map(sum, want))}"
                                  f" in {sum(map(len, want))} ({names[:6]} ...)")
            # and the plans from either agree
            assert expected_collectives(case, r.rank, built) == expected_collectives(case, r.rank), f"{lay} rank {r.rank}"
    assert not mismatches, "\n".join(mismatches)


def test_a_plan_from_the_built_model_counts_a_weight_the_arithmetic_lacks():
    """The plant: a chunk holding one more trained weight (as qk_layernorm was before the arithmetic listed it)
    moves the planned buffer; the plan follows the built model, not the formula."""
    case = Case("grad-sync", load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(steps=1), "gloo")
    chunk = [(name, n) for name, n, _ in chunk_params(case.model, case.layout, 0, 0)]
    extra = [*chunk, ("decoder.layers.0.self_attention.q_layernorm.weight", 16)]
    assert expected_collectives(case, 0, [chunk]) == expected_collectives(case, 0)
    [reduction] = expected_collectives(case, 0, [extra])
    assert reduction.numel == expected_collectives(case, 0)[0].numel + 16


def _fake_world(names: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.fakes.fake_world", *names], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.nightly
@pytest.mark.skipif(bool(fake_process_group_missing()), reason=fake_process_group_missing())
@pytest.mark.parametrize("tier", ["cpu", "gpu"])
def test_the_plan_counts_what_megatron_builds_for_every_shipped_model_up_to_world_size_8(tier):
    names = [n for n in known_models() if load_model(n).tier == tier]
    judged = _fake_world(names)
    assert set(judged) == set(names) and MAX_WORLD == 8
    for name, got in judged.items():
        assert got["layouts"] >= 20 and got["builds"] >= 5, (name, got)  # every world size's matrix was built
        assert not got["differ"], f"{name}: " + "\n".join(got["differ"][:10])


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
@pytest.mark.skipif(bool(fake_process_group_missing()), reason=fake_process_group_missing())
def test_the_plan_counts_what_megatron_builds_for_tiny_up_to_world_size_8():
    """The fast tier's representative of the sweep above (every shipped model: nightly)."""
    got = _fake_world(["tiny"])["tiny"]
    assert got["layouts"] >= 20 and got["builds"] >= 5, got
    assert not got["differ"], "\n".join(got["differ"][:10])


_PLANT = """
import json, sys
import harness.checks.expected_collectives as sp
import tests.fakes.fake_world as fw
from harness.platform import cpu_layer

spec_arithmetic = sp.chunk_params
sp.chunk_params = lambda *a, **k: [p for p in spec_arithmetic(*a, **k) if "final_layernorm" not in p[0]]
cpu_layer.activate()
print(json.dumps(fw.judge("tiny")))
"""


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
@pytest.mark.skipif(bool(fake_process_group_missing()), reason=fake_process_group_missing())
def test_an_arithmetic_that_forgets_a_weight_differs_from_the_fake_world_build():
    """The plant: the spec's arithmetic without the final layernorm (as it was without qk_layernorm once)."""
    done = subprocess.run([sys.executable, "-c", _PLANT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    differ = json.loads(done.stdout.splitlines()[-1])["differ"]
    assert differ, "a missing final layernorm went unnoticed"
    assert any(d.startswith("tp1-pp1-cp1-dp2 rank 0: built [") and "elements per chunk, the arithmetic [" in d
               for d in differ), differ[:3]
