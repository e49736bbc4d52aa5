"""NaN and Inf never pass a check: `err > tol` is False for NaN, so every check judges through
harness/checks/numeric.py. Fabricated results for each check, and one real run with a planted NaN."""

from __future__ import annotations

import math

import pytest
import torch

from harness.checks.numeric import beyond, nonfinite_summary, within, worst
from harness.checks.step_outputs import TrainedRankData
from harness.checks.tensors import assemble
from harness.engines.base import ParamShard, StepOutput
from harness.launch.results import CaseResult, RankResult
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout

NAN, INF = float("nan"), float("inf")


def test_comparisons_treat_non_finite_errors_as_failures():
    assert within(0.0, 0.0) and within(1e-6, 1e-5)
    assert not within(NAN, 1e-5) and not within(INF, 1e-5) and beyond(NAN, 1.0) and beyond(-INF, 1.0)
    assert math.isnan(worst([0.0, NAN, 1.0])) and worst([0.5, 2.0]) == 2.0 and worst([]) == 0.0
    t = torch.zeros(4)
    t[1], t[2] = NAN, INF
    assert nonfinite_summary({"w": t, "ok": torch.ones(3)}) == (1, "w: 2/4 elements non-finite (1 NaN, 1 Inf)")
    assert nonfinite_summary({"ok": torch.ones(3)}) == (0, "")


def test_a_nan_replica_is_not_identical_to_its_copies():
    a, b = torch.zeros(3), torch.tensor([0.0, NAN, 0.0])
    spread = assemble([[ParamShard("n", a, None, 0, 1)], [ParamShard("n", b, None, 0, 1)]]).replica_spread["n"]
    assert math.isnan(spread)
    both = assemble([[ParamShard("n", b, None, 0, 1)], [ParamShard("n", b.clone(), None, 0, 1)]])
    assert math.isnan(both.replica_spread["n"])  # NaN != NaN: two NaN copies are not "identical" either


# -- equivalence ---------------------------------------------------------------------------------

def _equivalence_result(layout: Layout, w: torch.Tensor, losses=(4.0, 3.5), replica: torch.Tensor | None = None):
    case = Case("equivalence", load_model("tiny"), layout)
    ranks = [RankResult(0, data=TrainedRankData({"tp": 0, "pp": 0, "cp": 0, "dp": 0, "last_stage": 1},
                                                [StepOutput(x * 64, 64) for x in losses],
                                                [ParamShard("w", w, None, 0, 1)]))]
    if replica is not None:
        ranks.append(RankResult(1, data=TrainedRankData({"tp": 0, "pp": 0, "cp": 0, "dp": 1, "last_stage": 1}, [],
                                                        [ParamShard("w", replica, None, 0, 1)])))
    return CaseResult(case, ranks, "ok")


def _equivalence_checks(ref, other):
    from harness.suite_defs.equivalence import EquivalenceSuite

    out: dict[str, dict[str, object]] = {}
    for c in EquivalenceSuite().check([ref, other]):
        out.setdefault(c.case_id, {})[c.check] = c
    return out[ref.case.id], out[other.case.id]


def test_nan_in_one_parameter_fails_finite_and_params():
    w = torch.ones(4)
    w[0] = NAN
    _, checks = _equivalence_checks(_equivalence_result(Layout(dp=2), torch.ones(4)), _equivalence_result(Layout(tp=2), w))
    assert not checks["equivalence.finite"].passed
    assert checks["equivalence.finite"].message == (
        "tp2-pp1-cp1-dp1: 1/1 params hold non-finite values after 2 steps: w: 1/4 elements non-finite (1 NaN, 0 Inf)")
    assert not checks["equivalence.params"].passed
    assert checks["equivalence.params"].message == (
        "1/1 params differ from tp1-pp1-cp1-dp2 after 2 steps; worst w: rel nan > 1e-05 "
        "(non-finite: w: 1/4 elements non-finite (1 NaN, 0 Inf))")


def test_nan_in_the_reference_fails_the_reference_itself():
    w = torch.ones(4)
    w[3] = INF
    ref_checks, other = _equivalence_checks(_equivalence_result(Layout(dp=2), w), _equivalence_result(Layout(tp=2), torch.ones(4)))
    assert not ref_checks["equivalence.finite"].passed and "(0 NaN, 1 Inf)" in ref_checks["equivalence.finite"].message
    assert not other["equivalence.params"].passed  # compared with a non-finite reference: never equal


def test_nan_loss_fails_the_loss_check():
    ref, other = _equivalence_checks(_equivalence_result(Layout(dp=2), torch.ones(4)),
                                     _equivalence_result(Layout(tp=2), torch.ones(4), losses=(4.0, NAN)))
    assert not other["equivalence.loss"].passed
    assert other["equivalence.loss"].message.startswith("loss step 1: tp2-pp1-cp1-dp1 nan vs tp1-pp1-cp1-dp2 3.50000000, rel diff nan > 1e-05")
    assert not other["equivalence.finite"].passed and "loss of step 1 is nan" in other["equivalence.finite"].message


def test_nan_replica_fails_the_replica_check():
    bad = torch.ones(4)
    bad[2] = NAN
    _, checks = _equivalence_checks(_equivalence_result(Layout(dp=2), torch.ones(4)),
                                    _equivalence_result(Layout(tp=2), torch.ones(4), replica=bad))
    assert not checks["equivalence.replicas"].passed
    assert checks["equivalence.replicas"].message.endswith("worst w: max abs nan")


def _grad_sync_data(params):
    from harness.suite_defs.grad_sync import GradSyncRankData

    return GradSyncRankData({}, [], params)


def test_grad_sync_nan_replica_fails():
    from harness.suite_defs.grad_sync import GradSyncSuite

    bad = torch.ones(4)
    bad[0] = NAN
    case = Case("grad-sync", load_model("tiny"), Layout(dp=2), options=CaseOptions(steps=3))
    res = CaseResult(case, [RankResult(0, data=_grad_sync_data([ParamShard("w", torch.ones(4), None, 0, 1)])),
                            RankResult(1, data=_grad_sync_data([ParamShard("w", bad, None, 0, 1)]))], "ok")
    check = GradSyncSuite._check_replicas(res)
    assert not check.passed
    assert "DP replicas drifted after 3 steps: 1 params differ, worst w max abs nan" in check.message


# -- dynamic-cp ----------------------------------------------------------------------------------

def _cp_result(mode: str, logprobs: torch.Tensor, grad: torch.Tensor) -> CaseResult:
    from harness.engines.cp_modes import CPCaseParams

    case = Case("dynamic-cp", load_model("tiny"), Layout(dp=1), params=CPCaseParams("m", (4,), mode))
    from harness.suite_defs.dynamic_cp.judge import DynamicCPRankData
    from harness.engines.cp_modes import TokenOutputs

    record = TokenOutputs(0, torch.arange(4), logprobs, 1, 0)
    return CaseResult(case, [RankResult(0, data=DynamicCPRankData([record], float(-logprobs.sum()), 4, [logprobs],
                                                                  {"w": grad}))], "ok")


def test_dynamic_cp_inf_log_prob_and_nan_gradient_fail():
    from harness.suite_defs.dynamic_cp.judge import _check_grads, _check_logprobs, _check_loss

    lp, g = torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.ones(3)
    bad_lp, bad_g = lp.clone(), g.clone()
    bad_lp[2], bad_g[1] = -INF, NAN
    ref, res = _cp_result("none", lp, g), _cp_result("static", bad_lp, bad_g)
    logprobs = _check_logprobs(res, ref, 1e-5)
    assert not logprobs.passed
    assert "log-probs of sample 0 differ from no CP: sample 0: length 4, max abs inf, rel inf, 1 non-finite log-probs" \
        in logprobs.message
    assert not _check_loss(res, ref, 1e-5).passed
    grads = _check_grads(res, ref, 1e-5)
    assert not grads.passed
    assert "1/1 gradients differ from no CP; worst w: rel nan > 1e-05" in grads.message
    assert "(non-finite: w: 1/3 elements non-finite (1 NaN, 0 Inf))" in grads.message


# -- a real run ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_planted_nan_parameter_fails_a_real_equivalence_run(tmp_path, capsys):
    """The finding as measured: a NaN in one parameter element after the last step on the non-reference
    layouts used to pass (`params nan`, verdict pass, exit 0)."""
    from harness import cli

    code = cli.main(["run", "--suite", "equivalence", "--model", "tiny", "--world-size", "2", "--backend", "gloo",
                     "--engine", "tests.plants.faulty_engines:NaNParamAfterLastStep", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    for lay in ("tp1-pp1-cp2-dp1", "tp1-pp2-cp1-dp1", "tp2-pp1-cp1-dp1"):
        assert f"FAIL equivalence.finite equivalence/tests.plants.faulty_engines:NaNParamAfterLastStep/tiny/{lay}" in out
        assert f"FAIL equivalence.params equivalence/tests.plants.faulty_engines:NaNParamAfterLastStep/tiny/{lay}" in out
    assert "elements non-finite (1 NaN, 0 Inf)" in out
    assert "1 pass, 3 regression" in out  # the pure-DP reference is untouched and passes
