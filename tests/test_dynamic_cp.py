"""dynamic-cp: unmodified runs pass; each planted dynamic-CP bug (tests/plants/faulty_dynamic_cp.py) fails the
suite with a message naming the output, the sample and the error."""

from __future__ import annotations

import pytest

from harness.driver import plan, run_suite
from harness.errors import BadInput
from harness.suite_defs.dynamic_cp.judge import expected_local_cp
from harness.suite_defs.dynamic_cp.suite import NAMED_MIXES

pytestmark = pytest.mark.slow

MIX = {"mix": (20, 100, 60, 12)}  # local CP 1, 4, 2, 1; scheduled order differs from the original
CP2 = ["tp1-pp1-cp2-dp2"]


def _run(engine: str = "mcore", mixes=MIX, layouts=CP2):
    return run_suite("dynamic-cp", "tiny", 4, layouts, engine=engine, backend="gloo", suite_params={"mixes": mixes})


def _failed(run, mode: str) -> dict[str, str]:
    """check name -> message of the failed checks of the cases in one CP mode."""
    return {c.check: c.message for c in run.checks
            if c.failed and f"cp_mode={mode}" in c.case_id}


def test_unmodified_mixes_pass_with_local_cp_1_2_4_and_fewer_samples_than_dp():
    mixes = {k: NAMED_MIXES[k] for k in ("cp-1-2-4", "fewer-samples-than-dp")}
    run = _run(mixes=mixes, layouts=None)
    assert run.passed, [c.message for c in run.checks if c.failed] + [r.error for r in run.results if r.error]
    # 2 mixes x (no CP, static cp2, static cp4, dynamic)
    assert len(run.results) == 8
    rows = [row for c in run.checks if c.check == "dynamic-cp.coverage" and "cp_mode=dynamic" in c.case_id
            for row in c.details]
    sizes = {int(r.split("local CP ")[1].split(" ")[0]) for r in rows}
    assert sizes == {1, 2, 4}, rows
    for check in ("logprobs", "loss", "grads"):
        judged = [c for c in run.checks if c.check == f"dynamic-cp.{check}"]
        assert len(judged) == 6 and all(c.value is not None and c.value <= 1e-5 for c in judged)


def test_wrong_zigzag_chunk_order_on_one_rank_is_caught():
    failed = _failed(_run("tests.plants.faulty_dynamic_cp:WrongZigzagOnOneRank"), "dynamic")
    assert failed["dynamic-cp.logprobs"].startswith("tp1-pp1-cp1-dp4 dynamic: log-probs of sample 1 differ from no CP: "
                                                    "sample 1: length 100, max abs")
    assert "dynamic-cp.loss" in failed and "dynamic-cp.grads" in failed


def test_merge_dropping_a_sample_is_caught():
    run = _run("tests.plants.faulty_dynamic_cp:MergeDropsSample")
    for mode in ("static", "dynamic"):
        assert "the merged output has 3 samples, the batch has 4 (lengths merged [20, 100, 60], batch [20, 100, 60, 12])" \
            in _failed(run, mode)["dynamic-cp.logprobs"]


def test_merge_duplicating_a_sample_is_caught():
    msg = _failed(_run("tests.plants.faulty_dynamic_cp:MergeDuplicatesSample"), "dynamic")["dynamic-cp.logprobs"]
    assert "log-probs of sample 1 differ from no CP: sample 1: 20 log-probs merged, length 100 expected" in msg


def test_merge_keeping_the_scheduled_order_is_caught():
    msg = _failed(_run("tests.plants.faulty_dynamic_cp:MergeKeepsScheduledOrder"), "dynamic")["dynamic-cp.logprobs"]
    # the scheduler runs the longest sample first
    assert msg.startswith("tp1-pp1-cp1-dp4 dynamic: log-probs of sample 0 differ from no CP: "
                          "sample 0: 100 log-probs merged, length 20 expected")


def test_r3_token_count_over_dp_scales_the_loss_and_is_caught():
    run = _run("tests.plants.faulty_dynamic_cp:TokenCountOverDP")
    failed = _failed(run, "dynamic")
    assert "(tokens 768 vs 192)" in failed["dynamic-cp.loss"]
    assert "norm ratio 0.2500" in failed["dynamic-cp.grads"]
    assert not _failed(run, "static")  # the bug is in the dynamic path only
    # what the report draws (tensors-vs-reference): every gradient of the dynamic case 3/4 off, beyond the tolerance
    (grads,) = [c for c in run.checks if c.check == "dynamic-cp.grads" and c.failed]
    assert grads.data.rtol == 1e-5 and all(abs(e - 0.75) < 1e-3 for e in grads.data.errors.values()), grads.data


def test_fewer_samples_early_return_without_local_cp_size_is_caught():
    run = _run("tests.plants.faulty_dynamic_cp:FewerSamplesEarlyReturn", mixes={"few": NAMED_MIXES["fewer-samples-than-dp"]})
    failed = _failed(run, "dynamic")
    assert failed["dynamic-cp.coverage"].startswith(
        "tp1-pp1-cp1-dp4 dynamic: sample 0 (length 100): 0 tokens never computed, 100 computed more than once")
    details = next(c.details for c in run.checks if c.check == "dynamic-cp.coverage" and c.failed)
    assert "  sample 0 (length 100): ran at local CP size [1], needs one power of two >= 4 " \
           "(ceil(104 / max_seqlen_per_dp_cp_rank=32) rounded up)" in details
    assert failed["dynamic-cp.logprobs"].startswith(
        "tp1-pp1-cp1-dp4 dynamic: log-probs of sample 0 differ from no CP: sample 0: 400 log-probs merged, length 100 expected")


@pytest.mark.parametrize("lengths, cp", [(32, 1), (33, 2), (64, 2), (65, 4), (128, 4)])
def test_expected_local_cp(lengths, cp):
    assert expected_local_cp(lengths, 32) == cp


def test_bad_mixes_and_layouts_are_refused_before_anything_runs():
    with pytest.raises(BadInput, match=r"every length must be in 1..120"):
        plan("dynamic-cp", "tiny", 4, suite_params={"mixes": {"bad": (500,)}})
    with pytest.raises(BadInput, match="must have tp1 and pp1"):
        plan("dynamic-cp", "tiny", 4, ["tp2-pp1-cp2-dp1"], suite_params={"mixes": MIX})
    (odd,) = plan("dynamic-cp", "tiny", 3, suite_params={"mixes": MIX}).cases  # not bad input: a skip naming the need
    assert "needs world size 2 or more, even" in odd.skip_reason


def test_missing_dynamic_cp_api_names_what_is_missing(monkeypatch):
    from megatron.core.pipeline_parallel import hybrid_cp_schedule

    from harness.upstream import dynamic_cp_api
    from harness.errors import MissingDependency

    assert dynamic_cp_api().flag == "hybrid_context_parallel"  # megatron-core 0.16 - 0.19 here
    monkeypatch.delattr(hybrid_cp_schedule, "BalancedCPScheduler")
    with pytest.raises(MissingDependency, match=r"hybrid_context_parallel API \(releases 0.16-0.19\).*lacks: "
                                                r"megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler; "
                                                r"megatron.core.pipeline_parallel.dynamic_cp_schedule"):
        dynamic_cp_api()


def test_the_dynamic_cp_split_is_megatrons_where_the_release_has_it(monkeypatch):
    """0.16 has get_batch_on_this_hybrid_cp_rank; 0.19 removed it and the split is made from the parts that stayed."""
    from megatron.core import utils

    from harness.upstream import dynamic_cp_api
    from harness.upstream import _hybrid_cp_split_from_parts

    own = getattr(utils, "get_batch_on_this_hybrid_cp_rank", None)
    assert dynamic_cp_api().split is (own or _hybrid_cp_split_from_parts)
    if own is not None:
        monkeypatch.delattr(utils, "get_batch_on_this_hybrid_cp_rank")
        assert dynamic_cp_api().split is _hybrid_cp_split_from_parts
