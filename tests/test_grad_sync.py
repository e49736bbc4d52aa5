"""The grad-sync suite: its plan, its recorder, and planted regressions that must fail it."""

from __future__ import annotations

import pytest

from harness.checks.expected_collectives import chunk_buckets, chunk_params, expected_collectives
from harness.layouts import coords_of, dp_cp_ranks
from harness.driver import run_suite
from harness.models import load_model
from harness.probes.collectives import kind_of
from harness.spec import Case, CaseOptions, Layout


@pytest.mark.parametrize("op,kind", [
    ("allreduce_coalesced_", "all_reduce"), ("reduce_scatter_tensor_coalesced_", "reduce_scatter"),
    ("_reduce_scatter_base_", "reduce_scatter"), ("allgather_into_tensor_coalesced_", "all_gather"),
    ("all_gather_into_tensor", "all_gather"), ("recv_", "recv"), ("alltoall_base_", "all_to_all"),
])
def test_op_kinds(op, kind):
    assert kind_of(op) == kind


def test_rank_order_matches_megatron():
    lay = Layout.parse("tp2-pp2-cp1-dp1")
    assert [coords_of(lay, r).pp for r in range(4)] == [0, 0, 1, 1]
    assert dp_cp_ranks(Layout.parse("tp1-pp2-cp1-dp2"), 2) == (2, 3)
    assert dp_cp_ranks(Layout.parse("tp2-pp1-cp2-dp1"), 1) == (1, 3)  # CP ranks are in the DP x CP group


def test_padding_follows_megatron_rules():
    tiny = load_model("tiny")
    params = chunk_params(tiny, Layout(dp=2), 0, 0)
    assert sum(n for _, n, _ in params) == tiny.num_params() == 82240
    assert chunk_buckets(params, distopt=False, dp_cp=2, bucket_size=None) == [82240]
    assert chunk_buckets(params, distopt=True, dp_cp=2, bucket_size=None) == [82304]  # lcm(2, 128)
    first = chunk_params(tiny, Layout(pp=2, dp=2), 0, 0)
    assert chunk_buckets(first, distopt=True, dp_cp=2, bucket_size=None) == [36992, 8192]  # shared embedding


def test_plan_follows_configuration_not_engine():
    tiny = load_model("tiny")
    off = expected_collectives(Case("grad-sync", tiny, Layout(dp=2), options=CaseOptions(steps=3)), 0)
    on = expected_collectives(Case("grad-sync", tiny, Layout(dp=2), options=CaseOptions(steps=3, use_distributed_optimizer=True)), 0)
    assert [(p.kind, p.calls) for p in off] == [("all_reduce", 3)]
    assert [(p.kind, p.calls) for p in on] == [("reduce_scatter", 3), ("all_gather", 3)]


@pytest.mark.slow
def test_world_size_2_passes_and_prints_plan_tables():
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo")
    assert len(run.results) == 4  # distributed optimizer x overlap_grad_reduce
    assert run.passed, [c.message for c in run.checks if c.failed]
    tables = [c for c in run.checks if c.check == "grad-sync.plan"]
    assert all(c.show and any("DP gradient reduction" in d for d in c.details) for c in tables)


@pytest.mark.slow
def test_bf16_issues_one_gradient_reduction_as_megatron_does_and_norms_left_in_fp32_fail():
    """In bf16 every parameter is bf16, as megatron's Float16Module makes it (its local spec builds the norms in fp32):
    one buffer, one all-reduce. A model whose norms stay fp32 reduces two buffers, coalesced."""
    bf16 = CaseOptions(dtype="bf16")
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", options=bf16)
    assert run.passed, [c.message for c in run.checks if c.failed]
    planted = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", options=bf16,
                        engine="tests.plants.faulty_engines:NormsKeptInFp32")
    failed = [c for c in planted.checks if c.check == "grad-sync.plan" and c.failed]
    assert len(failed) == 4 and all(" x fp32 x3 " in "\n".join(c.details) for c in failed), \
        [c.message for c in failed]  # the norms' own buffer
    plain = next(c for c in failed if "use_distributed_optimizer=False, overlap_grad_reduce=False" in c.message)
    assert "but observed allreduce_coalesced_ on dp-cp group (0, 1), 81920 x bf16, 3 calls" in plain.message
    assert "allreduce_coalesced_ on dp-cp (0, 1), 320 x fp32 x3" in "\n".join(plain.details)  # 5 norms of 64


def _failures(run):
    return {c.check: c.message for c in run.checks if c.failed}


@pytest.mark.slow
def test_reduce_scatter_with_plain_optimizer_is_caught():
    """R2's outcome: DDP reduce-scatters while the user configured use_distributed_optimizer=False."""
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo",
                    engine="tests.plants.faulty_engines:DistDdpPlainOptimizer")
    configured_off = [r for r in run.results if not r.case.options.use_distributed_optimizer]
    failed = {c.case_id: c.message for c in run.checks if c.failed and c.check == "grad-sync.plan"}
    for res in configured_off:
        msg = failed[res.case.id]
        assert msg.startswith("grad-sync: rank 0: configured all-reduce (use_distributed_optimizer=False")
        assert "but observed reduce_scatter_tensor_coalesced_ on dp-cp group (0, 1), 82304 x fp32, 3 calls" in msg
    drift = [c for c in run.checks if c.check == "grad-sync.replicas" and c.failed]
    assert drift and all("DP replicas drifted after 3 steps" in c.message for c in drift)


@pytest.mark.slow
def test_missing_parameter_all_gather_is_caught():
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo",
                    engine="tests.plants.faulty_engines:SkipParamAllGather")
    on = [r.case.id for r in run.results if r.case.options.use_distributed_optimizer]
    plan_fail = {c.case_id: c.message for c in run.checks if c.check == "grad-sync.plan" and c.failed}
    for cid in on:
        assert "the DP parameter all-gather (all_gather on dp-cp group (0, 1), 82304 x fp32, 3 calls) was not observed" \
            in plan_fail[cid]
    assert not run.passed


@pytest.mark.slow
def test_gradient_reduction_on_the_wrong_group_is_caught():
    run = run_suite("grad-sync", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo",
                    engine="tests.plants.faulty_engines:GradReduceOnWorld")
    off = next(r for r in run.results if not r.case.options.use_distributed_optimizer
               and not r.case.options.overlap_grad_reduce)
    msg = next(c.message for c in run.checks if c.case_id == off.case.id and c.check == "grad-sync.plan")
    assert "configured all-reduce" in msg and "but observed allreduce_coalesced_ on world group (0, 1)" in msg


def _recorded(*records: tuple[str, str]):
    """A world-size-2 grad-sync case whose rank 0 recorded (kind, source) DP collectives, rank 1 the same as both."""
    from harness.launch.results import CaseResult, RankResult
    from harness.probes.collectives import Collective
    from harness.suite_defs.grad_sync import GradSyncRankData

    def coll(kind: str, source: str) -> Collective:
        return Collective(f"{kind}_", kind, (0, 1), "dp-cp", "float32", 4096, 16384, 1, "backward", source)

    both = [coll("reduce_scatter", "dispatch"), coll("reduce_scatter", "alias")]
    ranks = [RankResult(r, data=GradSyncRankData({"dp": r}, [coll(*x) for x in records] if r == 0 else both, [])) for r in (0, 1)]
    return CaseResult(Case("grad-sync", load_model("tiny"), Layout(1, 1, 1, 2)), ranks, "ok")


def test_recorders_that_disagree_fail_naming_the_rank_and_what_only_one_saw():
    from harness.suite_defs.grad_sync import GradSyncSuite

    # the plant: megatron's alias no longer sees the all-gather the dispatcher saw
    check = GradSyncSuite._check_recorders(_recorded(("reduce_scatter", "dispatch"), ("reduce_scatter", "alias"),
                                                     ("all_gather", "dispatch")))
    assert check.failed
    assert check.message == ("rank 0: recorders disagree on DP collectives; only at the dispatcher: "
                             "{('all_gather', (0, 1), 4096): 1}; only at megatron's aliases: {}")
    assert GradSyncSuite._check_recorders(_recorded(("reduce_scatter", "dispatch"),
                                                    ("reduce_scatter", "alias"))).passed


def test_recorders_that_saw_nothing_cannot_tell():
    from harness.launch.results import CaseResult
    from harness.suite_defs.grad_sync import GradSyncSuite

    nothing = _recorded()
    check = GradSyncSuite._check_recorders(CaseResult(nothing.case, [nothing.ranks[0]] * 2, "ok"))
    assert check.inconclusive and "neither recorder saw a DP gradient collective" in check.message
    # one recorder blind while the other saw the step's collectives is a disagreement, not "nothing to compare"
    blind = _recorded(("reduce_scatter", "dispatch"))
    assert GradSyncSuite._check_recorders(CaseResult(blind.case, [blind.ranks[0]] * 2, "ok")).failed
