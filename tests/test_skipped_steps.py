"""A step megatron skips (its optimizer applied no update) is reported in every suite that trains and never passes
as trained: planted as a non-finite gradient under fp16's loss scaler (every release) and as megatron-core 0.19's
grad_norm_skip_threshold."""

from __future__ import annotations

import pytest

from harness.checks import skipped_steps
from harness.checks.step_outputs import TrainedRankData
from harness.driver import run_suite
from harness.engines.base import StepOutput
from harness.launch.results import CaseResult, RankResult
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout


def _result(*skips: bool, norm: float | None = 1.5) -> CaseResult:
    case = Case("equivalence", load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(steps=len(skips)))
    steps = [StepOutput(1.0, 8, grad_norm=norm, skipped=s) for s in skips]
    return CaseResult(case, [RankResult(r, data=TrainedRankData({}, steps)) for r in range(2)], "ok")


def test_a_skipped_step_fails_the_case_naming_the_step_and_why():
    assert skipped_steps.check("equivalence", [_result(False, False, False)]) == []
    assert skipped_steps.figures(_result(False, False)) == {}
    (check,) = skipped_steps.check("equivalence", [_result(False, True, False)])
    assert check.check == "equivalence.trained-steps" and check.failed
    assert check.message == ("megatron skipped 1 of 3 steps (steps 1): its optimizer applied no update (gradient norm "
                             "1.5, beyond the optimizer's grad_norm_skip_threshold at step 1), so 2 steps trained and "
                             "the figures of the skipped ones judge nothing")
    assert skipped_steps.figures(_result(False, True, True)) == {"skipped_steps": [1, 2]}
    noted = _result(False, False, False)  # a suite whose payload keeps no steps: the rank's note of it
    noted.ranks[0].skipped_steps.append((2, 7.5))
    (check,) = skipped_steps.check("train-memory", [noted])
    assert "steps 2)" in check.message and "gradient norm 7.5" in check.message
    (nan,) = skipped_steps.check("golden", [_result(True, norm=None)])
    assert "(a non-finite gradient norm at step 0)" in nan.message


@pytest.mark.slow
def test_a_step_skipped_for_a_non_finite_gradient_is_reported_on_every_release():
    """In fp16: megatron's loss scaler finds the inf / NaN and the optimizer skips the step (in fp32 and bf16 it
    checks nothing and applies the NaN: equivalence.finite names that)."""
    run = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo", options=CaseOptions(dtype="fp16"),
                    engine="tests.plants.faulty_engines:NonFiniteGradientAtStep1")
    failed = [c for c in run.checks if c.failed]
    assert failed and all(c.check == "equivalence.trained-steps" for c in failed), [c.message for c in failed]
    assert "(steps 1): its optimizer applied no update (a non-finite gradient norm at step 1)" in failed[0].message
    assert any(r.figures and r.figures["metrics"].get("skipped_steps") == [1] for r in run.results)
    assert not run.passed


@pytest.mark.slow
def test_a_step_skipped_over_the_skip_threshold_is_reported_where_megatron_has_one():
    from harness.upstream import skip_threshold_field

    if skip_threshold_field() is None:
        pytest.skip("megatron-core here has no grad_norm_skip_threshold (0.19 and later): only a non-finite "
                    "gradient norm skips a step on it")
    run = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo",
                    engine="tests.plants.faulty_engines:StepsOverSkipThreshold")
    failed = [c for c in run.checks if c.check == "equivalence.trained-steps"]
    assert failed and failed[0].failed and "beyond the optimizer's grad_norm_skip_threshold" in failed[0].message
    assert not run.passed
