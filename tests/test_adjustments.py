"""What the harness changed in the engine under test reaches results.json, the report and bisect verdicts."""

from __future__ import annotations

import pytest

from harness import adjustments
from harness.checks.step_outputs import TrainedRankData
from harness.checks import CheckResult
from harness.suite_run import SuiteRun
from harness.launch.results import CaseResult, RankResult
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from harness.suite_defs.equivalence import EquivalenceSuite


def test_notes_are_deduplicated_and_taken_once():
    adjustments.take()
    adjustments.note("a")
    adjustments.note("b")
    adjustments.note("a")
    assert adjustments.take() == ["a", "b"]
    assert adjustments.take() == []


def test_the_cpu_layer_is_listed_while_active():
    from harness.platform import cpu_layer

    cpu_layer.activate()
    try:
        taken = adjustments.take()
    finally:
        cpu_layer.deactivate()
    assert len(taken) == 1 and taken[0].startswith("CPU layer (CUDA stand-ins on gloo ranks): torch.cuda.current_device")
    assert adjustments.take() == []


def _run() -> SuiteRun:
    case = Case("equivalence", load_model("tiny"), Layout(dp=2), options=CaseOptions(adam_eps=1e-6))
    ranks = [RankResult(r, data=TrainedRankData({}, []), adjustments=["Adam eps 1e-06", *(["stub x"] if r else [])])
             for r in range(2)]
    run = SuiteRun(EquivalenceSuite(), "tiny", 2, "gloo", "mcore", results=[CaseResult(case, ranks, "ok")])
    run.checks = [CheckResult("equivalence.replicas", case.id, True, "ok")]
    return run


def test_results_report_and_bisect_step_name_the_adjustments():
    from harness.report.results_file import to_json
    from harness.report.terminal import format_run
    from harness.bisect import Threshold, judge_run

    run = _run()
    assert run.results[0].adjustments() == ["Adam eps 1e-06", "stub x"]
    data = to_json(run)
    assert data["adjustments"] == {"Adam eps 1e-06": 1, "stub x": 1}
    assert data["cases"][0]["adjustments"] == ["Adam eps 1e-06", "stub x"]
    assert "judged with these harness adjustments to the engine under test (cases):\n  - Adam eps 1e-06 (1/1)" \
        in format_run(run)
    step = judge_run(run, "fail", Threshold("fail"))
    assert step.adjustments == ["Adam eps 1e-06", "stub x"]


@pytest.mark.slow
def test_a_real_rank_reports_the_equivalence_eps():
    from harness.driver import run_suite

    run = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo")
    assert run.passed
    for r in run.results:
        assert "Adam eps 1e-06 (megatron-core's default 1e-08), from the case options" in r.adjustments()
        assert any(a.startswith("CPU layer") for a in r.adjustments())
