"""Mixture-of-experts models and expert parallelism: the models and layouts as data, megatron's MoE layer on CPU
ranks (EP, ETP, the token dispatchers, sequence parallelism under TP), and the regressions the suites must catch."""

from __future__ import annotations

import re

import pytest

from harness.errors import BadInput
from harness.checks.expected_collectives import chunk_buckets, chunk_params, expected_dispatch, expected_collectives
from harness.driver import run_suite
from harness.layouts import default_matrix, enumerate_layouts, expert_dp_ranks, expert_matrix, violations
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout


def test_an_expert_layout_is_spelled_once():
    assert Layout.parse("tp2-pp1-cp1-dp2-ep2-etp2") == Layout.parse("tp2-pp1-cp1-dp2-ep2")  # ETP = TP: the default
    lay = Layout.parse("tp2-pp1-cp1-dp2-ep2-etp1")
    assert (lay.id, lay.ep, lay.expert_tp, lay.edp, lay.world_size) == ("tp2-pp1-cp1-dp2-ep2-etp1", 2, 1, 2, 4)
    assert Layout.parse("tp2-pp1-cp1-dp2").id == "tp2-pp1-cp1-dp2" and Layout.parse("tp1-pp2-cp1-dp2-vpp2-ep2").vpp == 2
    with pytest.raises(BadInput, match=r"tpT-ppP-cpC-dpD\[-vppV\]\[-epE\[-etpT\]\]"):
        Layout.parse("tp2-pp1-cp1-dp2-etp1")


def test_every_violated_expert_constraint_is_named():
    tiny, moe = load_model("tiny"), load_model("tiny-moe")
    assert violations(Layout(dp=4, ep=2), tiny, 4) == ["ep=2, etp=1: model tiny has no experts"]
    assert violations(Layout(dp=4, ep=3, etp=1), moe, 4) == [
        "num_experts=4 not divisible by ep=3",
        "tp*cp*dp = 4 not divisible by etp*ep = 3 (the expert grid of a stage: tp*cp*dp = etp*ep*edp)"]
    assert violations(Layout(tp=2, dp=2, ep=4), moe, 4) == [
        "tp*cp*dp = 4 not divisible by etp*ep = 8 (the expert grid of a stage: tp*cp*dp = etp*ep*edp)"]
    assert violations(Layout(dp=4, ep=1, etp=3), moe, 4)[0] == "moe_ffn_hidden_size=64 not divisible by etp=3"


def test_the_listing_and_the_default_matrix_hold_the_expert_layouts():
    moe = load_model("tiny-moe")
    listed = {lay.id for lay in enumerate_layouts(moe, 4)}
    assert {"tp1-pp1-cp1-dp4-ep2", "tp1-pp1-cp1-dp4-ep4", "tp2-pp1-cp1-dp2-ep2", "tp2-pp1-cp1-dp2-ep2-etp1",
            "tp2-pp1-cp1-dp2-ep1-etp1"} <= listed
    assert [lay.id for lay in expert_matrix(moe, 4)] == [
        "tp1-pp1-cp1-dp4-ep2", "tp1-pp1-cp1-dp4-ep4", "tp2-pp1-cp1-dp2-ep2", "tp2-pp1-cp1-dp2-ep2-etp1",
        "tp1-pp1-cp2-dp2-ep2", "tp1-pp2-cp1-dp2-ep2"]
    assert all(not lay.expert_parallel for lay in default_matrix(moe, 4)[:8])  # the dense grid first
    assert default_matrix(load_model("tiny"), 4) == enumerate_layouts(load_model("tiny"), 4)  # dense models: as before
    # at world size 2 a pipeline stage has one rank: no expert grid to split
    assert [lay.id for lay in expert_matrix(moe, 2)] == ["tp1-pp1-cp1-dp2-ep2", "tp2-pp1-cp1-dp1-ep2-etp1",
                                                         "tp1-pp1-cp2-dp1-ep2"]
    # one rank has no expert grid: EP over the whole world is EP 1, the dense layout the suites run already
    assert expert_matrix(moe, 1) == [] and default_matrix(moe, 1) == [Layout()]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_no_suite_plans_a_case_twice(world_size):
    """At world size 1 the MoE models' "EP over the whole world" was the dense layout again: grad-sync, step-perf
    and golden ran every such case twice (step-perf recorded 6 repeats under one key)."""
    from collections import Counter

    from harness.driver import plan
    from harness.errors import BadInput, DoesNotFit, MissingDependency
    from harness.suite_registry import SUITES

    planned = set()
    for suite in SUITES:
        for model in ("tiny", "small", "tiny-moe", "small-moe", "tiny-qwen3-moe"):
            try:
                cases = plan(suite, model, world_size, backend="gloo").cases
            except (BadInput, DoesNotFit, MissingDependency):  # a dense-only suite, or a model that does not fit
                continue
            planned.add((suite, model))
            twice = {i: n for i, n in Counter(c.id for c in cases).items() if n > 1}
            assert not twice, f"{suite} {model} at world size {world_size} plans cases more than once: {twice}"
    assert {("grad-sync", "tiny-moe"), ("step-perf", "tiny-moe"), ("golden", "tiny-moe")} <= planned, planned


def test_moe_models_count_their_experts():
    moe, small_moe = load_model("tiny-moe"), load_model("small-moe")
    assert moe.num_params() - load_model("tiny").num_params() == 2 * (64 * 4 + 4 * 3 * 64 * 64 - 3 * 64 * 128)
    assert small_moe.moe_layers() == 3 and small_moe.moe_shared_expert_ffn == 256
    assert 29e9 < load_model("moe-gpu").num_params() < 31e9  # Qwen3-30B-A3B-like


def test_the_layouts_command_shows_the_expert_grid(capsys):
    from harness import cli

    assert cli.main(["layouts", "--model", "tiny-moe", "--world-size", "4", "--layout", "tp2-pp1-cp1-dp2-ep2-etp1"]) == 0
    assert capsys.readouterr().out == "tp2-pp1-cp1-dp2-ep2-etp1\ttp=2 pp=1 cp=1 dp=2 | ep=2 etp=1 edp=2  valid\n"


@pytest.mark.slow
@pytest.mark.nightly
def test_expert_layouts_train_like_pure_dp():
    """EP 2 and EP 4 at pure DP and EP 2 with TP 2 (sequence parallel; the dispatcher's uneven gathers over TP)
    train like pure DP: losses, log-probs, every parameter by global expert index, replicas bit-identical."""
    from harness.driver import run_suite

    run = run_suite("equivalence", "tiny-moe", 4, ["tp1-pp1-cp1-dp4-ep4", "tp2-pp1-cp1-dp2-ep2"], backend="gloo")
    assert run.passed, [c.message for c in run.checks if c.failed]
    names = {s.name for r in run.results[1].ranks for s in r.data.params}
    assert {f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(4)} <= names
    assert run.results[2].adjustments().count("norms: torch's RMSNorm / LayerNorm with their weights marked "
                                              "sequence_parallel (megatron's torch norm refuses sequence parallelism, "
                                              "which its MoE layer needs with TP; harness/engines/sp_norm.py)") == 1


@pytest.mark.slow
def test_expert_gradients_reduced_over_the_dense_dp_group_fail_equivalence():
    from harness.driver import run_suite

    run = run_suite("equivalence", "tiny-moe", 2, ["tp1-pp1-cp1-dp2-ep2"], backend="gloo",
                    engine="tests.plants.faulty_engines:ExpertGradsOverDenseDP")
    failed = {c.check: c.message for c in run.checks if c.failed}
    assert re.match(r"\d+/\d+ params differ from tp1-pp1-cp1-dp2 after 2 steps; worst decoder\.layers\.\d\.mlp\.experts"
                    r"\.local_experts\.\d\.linear_fc\d\.weight: rel \S+ > 1e-05$", failed["equivalence.params"]), failed


def test_the_load_balancing_loss_is_judged_per_step_across_layouts():
    """The auxiliary loss of the global batch per step: every rank's share summed, over the micro-batches."""
    from harness.checks.step_outputs import TrainedRankData, step_aux_losses
    from harness.engines.base import StepOutput
    from harness.launch.results import CaseResult, RankResult
    from harness.spec import Case

    def result(layout: Layout, shares: list[list[float]]) -> CaseResult:
        ranks = [RankResult(r, data=TrainedRankData({"tp": 0, "last_stage": 1}, [StepOutput(None, None, aux_loss=x)
                                                                                 for x in steps]))
                 for r, steps in enumerate(shares)]
        return CaseResult(Case("equivalence", load_model("tiny-moe"), layout), ranks, "ok")

    assert step_aux_losses(result(Layout(dp=2), [[8.0, 16.0], [8.0, 0.0]])) == [2.0, 2.0]  # 8 micro-batches
    from harness.suite_defs.equivalence import EquivalenceSuite

    ref, ep = result(Layout(dp=2), [[8.0, 8.0], [8.0, 8.0]]), result(Layout(dp=2, ep=2), [[16.0, 8.0], [16.0, 8.0]])
    check = EquivalenceSuite._check_losses(ep, ref, step_aux_losses(ep), step_aux_losses(ref), 1e-5,
                                           "equivalence.aux_loss", "load-balancing loss")
    assert not check.passed and check.message == (
        "load-balancing loss step 0: tp1-pp1-cp1-dp2-ep2 4.00000000 vs tp1-pp1-cp1-dp2 2.00000000, rel diff 1.00e+00 "
        "> 1e-05")
    assert step_aux_losses(result(Layout(dp=2), [[None], [None]])) is None  # a dense model: nothing to judge


@pytest.mark.slow
@pytest.mark.parametrize("engine,failing,message", [
    ("tests.plants.faulty_engines:AuxLossScaledByEP", "equivalence.aux_loss",
     r"load-balancing loss step 0: tp1-pp1-cp1-dp2-ep2 \S+ vs tp1-pp1-cp1-dp2 \S+, rel diff 1\.00e\+00 > 1e-05"),
    ("tests.plants.faulty_engines:ExpertTokensOutOfOrder", "equivalence.logprobs",
     r"tp1-pp1-cp1-dp2-ep2: step-0 log-probs differ from tp1-pp1-cp1-dp2 at \d+/512 tokens"),
])
def test_planted_moe_faults_fail_equivalence_naming_the_layout(engine, failing, message):
    from harness.driver import run_suite

    run = run_suite("equivalence", "tiny-moe", 2, ["tp1-pp1-cp1-dp2-ep2"], backend="gloo", engine=engine)
    failed = {c.check: c.message for c in run.checks if c.failed}
    assert set(failed) >= {failing, "equivalence.params"}, failed
    assert re.match(message, failed[failing]), failed[failing]
    assert re.search(r"worst decoder\.layers\.\d\.mlp\.(router|experts\.local_experts\.\d\.linear_fc\d)\.weight",
                     failed["equivalence.params"]), failed["equivalence.params"]


@pytest.fixture(scope="module")
def moe_golden(tmp_path_factory):
    """tiny-moe's golden trajectory recorded at world size 2 over pure DP and PP 2 (the unbroken run only)."""
    from harness.recording import record_suite
    from tests.fakes.replayed_repeats import repeats_replayed

    directory = tmp_path_factory.mktemp("moe-golden")
    with repeats_replayed():
        record_suite("golden", "tiny-moe", 2, ["tp1-pp1-cp1-dp2", "tp1-pp2-cp1-dp1"], baselines_dir=str(directory),
                     backend="gloo", suite_params={"formats": ()})
    return directory


def _golden(baselines, layout: str, engine: str = "mcore"):
    from harness.driver import run_suite

    run = run_suite("golden", "tiny-moe", 2, [layout], backend="gloo", baselines_dir=str(baselines), engine=engine,
                    suite_params={"formats": ()})
    return run, {c.check: c for c in run.checks}


@pytest.mark.slow
@pytest.mark.nightly
def test_the_moe_trajectory_holds_at_ep_2_and_records_the_load_balancing_loss(moe_golden):
    import json

    run, _ = _golden(moe_golden, "tp1-pp1-cp1-dp2-ep2")
    assert run.passed, [c.message for c in run.checks if c.failed]
    entries = json.loads((moe_golden / "cpu-gloo" / "golden.json").read_text())["entries"]
    entry = entries["tiny-moe/fp32/steps=12/lr=warmup3-cosine12-min0.0001"]
    assert {f"step{s:02d}.{f}" for s in (1, 12) for f in ("aux_loss", "grad_norm", "num_zeros", "loss", "lr")} <= set(entry)
    assert "param.decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in entry


@pytest.mark.slow
def test_a_gradient_norm_without_the_other_ep_ranks_experts_fails_golden(moe_golden):
    """Megatron-LM #5916's shape: the norm leaves out experts held by other EP ranks, so it depends on the layout
    (and clipping is too weak). Equivalence cannot see it while the clip does not bind; golden's norm does."""
    _, checks = _golden(moe_golden, "tp1-pp1-cp1-dp2-ep2", "tests.plants.faulty_engines:GradNormMissesOtherEPExperts")
    trajectory = checks["golden.trajectory"]
    assert trajectory.failed
    assert re.match(r"step 1: grad_norm \S+ vs golden \S+ \(rel \S+ > 1e-05\)", trajectory.message), trajectory.message


@pytest.mark.slow
def test_megatron_cores_aux_loss_scaling_under_per_token_loss_and_tp_is_judged_by_the_release(moe_golden):
    """Not planted: megatron-core up to 0.18 scales the auxiliary loss's gradient under the per-token loss by each
    TP x CP rank's own token count (Megatron-LM PR #5047, in 0.19.0), so at TP 2 the router trains differently from
    pure DP - the gradient norm of step 1 already differs; a release with the fix holds the trajectory there."""
    from harness.upstream import MOE_AUX_LOSS_SCALING

    run, checks = _golden(moe_golden, "tp2-pp1-cp1-dp1")
    if not MOE_AUX_LOSS_SCALING.present():
        assert run.passed, [c.message for c in run.checks if c.failed]
        return
    trajectory, params = checks["golden.trajectory"], checks["golden.params"]
    assert re.match(r"step 1: grad_norm \S+ vs golden \S+ \(rel \S+ > 1e-05\)", trajectory.message), trajectory.message
    assert params.failed and "mlp.router.weight" in params.message, params.message


# -- grad-sync -----------------------------------------------------------------------------------------------

def test_expert_data_parallel_groups_follow_megatrons_expert_rank_order():
    assert [expert_dp_ranks(Layout.parse("tp1-pp1-cp1-dp4-ep2"), r) for r in range(4)] == [(0, 2), (1, 3)] * 2
    assert expert_dp_ranks(Layout.parse("tp2-pp1-cp1-dp2-ep2-etp1"), 3) == (1, 3)
    assert expert_dp_ranks(Layout.parse("tp2-pp1-cp1-dp2-ep2"), 1) == (1,)  # ETP 2 x EP 2 fill the stage
    assert expert_dp_ranks(Layout.parse("tp1-pp2-cp1-dp2-ep2"), 3) == (3,)


def test_experts_have_their_own_buffer_at_ep_above_1_only():
    m = load_model("tiny-moe")
    dense = sum(n for _, n, _ in chunk_params(m, Layout(dp=4, ep=2), 0, 0))
    experts = sum(n for _, n, _ in chunk_params(m, Layout(dp=4, ep=2), 0, 0, expert_buffer=True))
    assert (dense, experts) == (33600, 49152)  # 2 layers x 2 local experts x (fc1 2*64*64 + fc2 64*64)
    assert sum(n for _, n, _ in chunk_params(m, Layout(dp=4), 0, 0)) == 33600 + 2 * 49152 == m.num_params()
    assert chunk_params(m, Layout(dp=4), 0, 0, expert_buffer=True) == []
    small = load_model("small-moe")  # a dense first layer: stage 0 of PP 2 holds one MoE layer
    assert len(chunk_params(small, Layout(pp=2, dp=2, ep=2), 0, 0, expert_buffer=True)) == 2 * 4
    assert chunk_buckets(chunk_params(m, Layout(dp=4, ep=2), 0, 0, expert_buffer=True), distopt=True, dp_cp=2,
                         bucket_size=None) == [49152]


def test_the_plan_reduces_experts_over_the_expert_data_parallel_group():
    m = load_model("tiny-moe")
    case = Case("grad-sync", m, Layout(dp=4, ep=2), options=CaseOptions(steps=3, use_distributed_optimizer=True))
    assert [(p.kind, p.role, p.ranks, p.numel, p.calls) for p in expected_collectives(case, 0)] == [
        ("reduce_scatter", "dp-cp", (0, 1, 2, 3), 33664, 3), ("all_gather", "dp-cp", (0, 1, 2, 3), 33664, 6),
        ("reduce_scatter", "edp", (0, 2), 49152, 3), ("all_gather", "edp", (0, 2), 49152, 6)]
    ep1 = Case("grad-sync", m, Layout(dp=4), options=CaseOptions(steps=3, use_distributed_optimizer=True))
    assert [(p.role, p.calls) for p in expected_collectives(ep1, 0)] == [("dp-cp", 3), ("dp-cp", 3)]  # one optimizer, one buffer


def test_a_stage_without_experts_has_one_buffer_and_one_optimizer():
    """small-moe's first layer is dense: at PP 4 stage 0 holds no expert, so megatron builds no expert buffer or
    optimizer there, and its parameters are gathered once per step."""
    m, lay = load_model("small-moe"), Layout(pp=4, dp=2, ep=2)
    opts = CaseOptions(steps=3, use_distributed_optimizer=True)
    assert [(p.role, p.calls) for p in expected_collectives(Case("grad-sync", m, lay, options=opts), 0)] == [("dp-cp", 3)] * 2
    assert [(p.role, p.calls) for p in expected_collectives(Case("grad-sync", m, lay, options=opts), 2)] == [
        ("dp-cp", 3), ("dp-cp", 6), ("edp", 3), ("edp", 6)]


def test_the_dispatcher_plan_counts_calls_per_moe_layer_and_micro_batch():
    m = load_model("tiny-moe")

    def calls(layout: str, **opts):
        planned = expected_dispatch(Case("grad-sync", m, Layout.parse(layout), options=CaseOptions(steps=3, **opts)), 0)
        return None if planned is None else {(p.kind, p.role, next(iter(p.phases))): p.calls for p in planned}

    # 2 MoE layers x 2 micro-batches x 3 steps = 12 per rank at DP 4
    assert calls("tp1-pp1-cp1-dp4-ep2") == {("all_to_all", "ep", "forward"): 36, ("all_to_all", "ep", "backward"): 36,
                                            ("all_gather", "etp-ep", "forward"): 12}
    assert calls("tp1-pp1-cp1-dp4") == {}
    etp = calls("tp2-pp1-cp1-dp2-ep2")  # 4 micro-batches at DP 2
    assert etp[("all_gather", "etp", "forward")] == 48 and etp[("reduce_scatter", "etp", "backward")] == 48
    assert calls("tp1-pp1-cp1-dp4-ep2", moe_dispatcher="allgather") is None


def _grad_sync_at_ep2(engine: str = "mcore"):
    """grad-sync of tiny-moe at tp1-pp1-cp1-dp4-ep2 (its 4 option sets) with the engine given."""
    return run_suite("grad-sync", "tiny-moe", 4, ["tp1-pp1-cp1-dp4-ep2"], backend="gloo", engine=engine)


@pytest.mark.slow
def test_grad_sync_judges_an_moe_model_and_its_dispatcher():
    run = _grad_sync_at_ep2()
    assert run.passed, [c.message for c in run.checks if c.failed]
    judged = {c.check for c in run.checks}
    assert judged == {"grad-sync.plan", "grad-sync.recorders", "grad-sync.replicas", "grad-sync.dispatch"}


@pytest.mark.slow
def test_expert_gradients_reduced_over_the_dense_dp_group_fail_grad_sync():
    run = _grad_sync_at_ep2("tests.plants.faulty_engines:ExpertGradsOverDenseDP")
    failed = [c for c in run.checks if c.failed]
    assert {c.check for c in failed} == {"grad-sync.plan"} and len(failed) == 4, [c.message for c in failed]
    plain = next(c.message for c in failed if "use_distributed_optimizer" not in c.case_id
                 and "overlap" not in c.case_id)
    assert plain.startswith("grad-sync: rank 0: the experts' gradients were not reduced over the expert-data-parallel "
                            "group (0, 2) (planned all_reduce on edp group (0, 2), 49152 x fp32, 3 calls); observed "
                            "instead allreduce_coalesced_ on dp-cp group (0, 1, 2, 3), 82752 x fp32"), plain


@pytest.mark.slow
def test_a_redundant_token_all_to_all_fails_the_dispatch_check():
    run = _grad_sync_at_ep2("tests.plants.faulty_engines:TokenAllToAllTwice")
    failed = [c for c in run.checks if c.failed]
    assert {c.check for c in failed} == {"grad-sync.dispatch"} and len(failed) == 4, [c.message for c in failed]
    assert failed[0].message == ("grad-sync: alltoall dispatcher: rank 0: all_to_all on ep group (0, 1) in forward: "
                                 "72 calls, planned 36 (token all-to-all (tokens, probabilities, combine))")


# -- step-perf ------------------------------------------------------------------------------------------------

def test_an_moe_models_counters_are_summed_over_each_group_a_tokens_copies_stay_within():
    """Which rank computes and sends a token's routed copies follows the routing: an MoE model's counters are
    judged per ETP x EP group of a stage, where their sums do not move as the weights train."""
    from harness.checks.flops_model import exact_groups, step_flops
    from harness.launch.results import CaseResult, RankResult
    from harness.suite_defs.step_perf.figures import counters, flops_used
    from harness.suite_defs.step_perf.payload import Counters, StepPerfRankData

    moe = load_model("tiny-moe")
    assert exact_groups(moe, Layout(dp=4, ep=2)) == [(0, 1), (2, 3)]
    assert exact_groups(moe, Layout(tp=2, dp=2, ep=2)) == [(0, 1, 2, 3)]  # ETP 2 x EP 2
    assert exact_groups(moe, Layout(tp=2, dp=2, ep=2, etp=1)) == [(0, 1), (2, 3)]
    assert exact_groups(moe, Layout(pp=2, dp=2, ep=2)) == [(0, 1), (2, 3)]
    assert exact_groups(load_model("tiny"), Layout(dp=2)) == [(0,), (1,)]

    lay = Layout(dp=4, ep=2)
    balanced = step_flops(moe, lay, 0, global_batch_size=8, micro_batch_size=1)
    routed = [balanced + 1000, balanced - 1000, balanced - 7, balanced + 7]  # the routing's split, summing right
    sent = [5, 9, 6, 8]
    ranks = [RankResult(r, data=StepPerfRankData([], [], Counters(routed[r], {"ep/all_to_all": {
        "calls": 24, "bytes": sent[r]}}))) for r in range(4)]
    res = CaseResult(Case("step-perf", moe, lay, "mcore", CaseOptions()), ranks, "ok")
    assert counters(res) == {"ranks0+1.flops": 2.0 * balanced, "ranks0+1.dp_reductions_in_backward": 0.0,
                             "ranks0+1.ep/all_to_all.calls": 48.0, "ranks0+1.ep/all_to_all.bytes": 14.0,
                             "ranks2+3.flops": 2.0 * balanced, "ranks2+3.dp_reductions_in_backward": 0.0,
                             "ranks2+3.ep/all_to_all.calls": 48.0, "ranks2+3.ep/all_to_all.bytes": 14.0}
    assert flops_used(res) == (routed, "counted")


def test_an_uneven_all_gather_is_recorded_at_its_size_not_its_padding():
    """The CPU layer pads an uneven all-gather (gloo gathers equal lengths); while the padded call runs, a recorder
    reads the size of the gather it stands in for."""
    import torch

    from harness.platform.cpu_collectives import unpadded_numel, uneven_all_gather

    seen = []

    def padded_gather(outputs, tensor, group=None, async_op=False):
        seen.append((unpadded_numel(), tensor.shape[0]))
        for out in outputs:
            out.copy_(tensor)

    outputs = [torch.empty(n, 3) for n in (2, 5, 1)]
    uneven_all_gather(padded_gather)(outputs, torch.ones(2, 3))
    assert seen == [((2 + 5 + 1) * 3, 5)] and unpadded_numel() is None


def _step_perf_at_ep2(engine: str = "mcore"):
    """step-perf of tiny-moe at tp1-pp1-cp1-dp4-ep2 (distributed optimizer, overlap), 3 timed steps, against the
    committed baseline (20 timed steps: the counted step is another one)."""
    return run_suite("step-perf", "tiny-moe", 4, ["tp1-pp1-cp1-dp4-ep2"], backend="gloo", engine=engine,
                     suite_params=dict(timed_steps=3, option_sets=((True, True),)))


@pytest.mark.slow
def test_step_perf_counts_an_moe_models_work_exactly_at_another_step():
    run = _step_perf_at_ep2()
    counted = next(c for c in run.checks if c.check == "step-perf.counters")
    assert counted.passed, counted.message + "\n" + "\n".join(counted.details)


@pytest.mark.slow
def test_a_redundant_token_all_to_all_fails_step_perfs_counters():
    run = _step_perf_at_ep2("tests.plants.faulty_engines:TokenAllToAllTwice")
    counted = next(c for c in run.checks if c.check == "step-perf.counters")
    assert counted.failed
    assert counted.message.startswith("tp1-pp1-cp1-dp4-ep2: 4 counters differ from the baseline; "
                                      "ranks0+1.ep/all_to_all.bytes "), counted.message
    assert "  ranks0+1.ep/all_to_all.calls 72 vs baseline 48 (+50.0%)" in counted.details, counted.details


def model_outlives_its_case(rank: int, world_size: int, engine_name: str = "mcore") -> dict[str, tuple[bool, int]]:
    """On each rank (tests.support.rank_call): after a training step of tiny-moe (mcore: at EP 2; fsdp2: pure DP) and the
    case's teardown, whether its model is still alive and how many threads more the rank has than before the
    build - with the engine as it is, then with megatron's dispatchers keeping the last batch's routing graph (the
    plant)."""
    import gc
    import os
    import tempfile
    import weakref
    from pathlib import Path

    from harness.engines import fsdp2, mcore, mcore_steps
    from harness.launch.context import RankContext
    from harness.platform.parallel import teardown_parallel_state

    def threads() -> int:  # torch's process-lifetime threads left out (a CUDA build starts autograd's at FSDP2's hooks)
        from harness.probes.proc import thread_names

        return len(thread_names(lifetime=False))

    module = {"mcore": mcore_steps, "fsdp2": fsdp2}[engine_name]  # where the engine's steps call it
    layout = "tp1-pp1-cp1-dp2-ep2" if engine_name == "mcore" else "tp1-pp1-cp1-dp2"
    out = {}
    for planted in (False, True):
        if planted:
            module.drop_routing_graphs = lambda models: None
        case = Case("equivalence", load_model("tiny-moe"), Layout.parse(layout), engine_name, CaseOptions(steps=1),
                    "gloo", 120.0)
        before = threads()
        ctx = RankContext(rank, world_size, rank, "gloo", Path(tempfile.mkdtemp()))
        engine = mcore.McoreEngine(case, ctx) if engine_name == "mcore" else fsdp2.FSDP2Engine(case, ctx)
        engine.build()
        engine.train_step(0)
        model = weakref.ref(engine.models[0] if engine_name == "mcore" else engine.model)
        del engine
        teardown_parallel_state()
        gc.collect()
        out["planted" if planted else "engine"] = (model() is not None, threads() - before)
    return out


def fsdp2_model_outlives_its_case(rank: int, world_size: int) -> dict[str, tuple[bool, int]]:
    return model_outlives_its_case(rank, world_size, "fsdp2")


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["mcore", "fsdp2"])
def test_a_finished_moe_case_leaves_nothing_alive_in_a_warm_rank(engine_name):
    """megatron's token dispatcher keeps the last batch's routing probabilities with their autograd graph, whose
    gradient-accumulator nodes hold DDP's hooks: a cycle through C++ that kept every MoE case's model and its
    gloo groups' threads alive in a warm rank (which the pool then retired); FSDP2's post-backward hooks close the
    same cycle. Both engines drop them after a step."""
    from tests.support.rank_call import on_ranks

    target = "tests.test_moe:" + ("fsdp2_" if engine_name == "fsdp2" else "") + "model_outlives_its_case"
    for rank, got in enumerate(on_ranks(target, 2)):
        assert got["engine"] == (False, 0), f"rank {rank}: model alive, threads left: {got['engine']}"
        alive, threads = got["planted"]
        assert alive and threads > 0, f"rank {rank}: the plant left nothing alive: {got['planted']}"
