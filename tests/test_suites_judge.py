"""The assertion every test in suites/ makes (suites/conftest.py's `judge` fixture): a failed check, a case that
did not run, a run that judged nothing and a check that ran nowhere each fail it; a check that could not tell
anywhere skips naming why; a passing run passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.checks import CheckResult, cannot_tell
from harness.launch.results import CaseResult
from harness.models import load_model
from harness.outcomes import CaseStatus
from harness.spec import Case, Layout
from harness.suite_run import SuiteRun


def _conftest():
    path = Path(__file__).resolve().parents[1] / "suites" / "conftest.py"
    spec = importlib.util.spec_from_file_location("suites_conftest_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


assert_judged = _conftest().assert_judged
CASE = Case("grad-sync", load_model("tiny"), Layout(1, 1, 1, 2))


def _run(checks: list[CheckResult], status: CaseStatus = CaseStatus.OK, error: str = "") -> SuiteRun:
    from harness.suite_registry import load_suite

    return SuiteRun(load_suite("grad-sync"), "tiny", 2, "gloo", "mcore",
                    results=[CaseResult(CASE, [], status, error=error)], checks=checks, planned=1, judged=True)


def test_a_run_whose_checks_pass_passes():
    run = _run([CheckResult("grad-sync.plan", CASE.id, True, "observed = configured")])
    assert assert_judged(run) is None and assert_judged(run, "grad-sync.plan") is None


def test_a_failed_check_fails_the_run_and_the_check_naming_its_message():
    run = _run([CheckResult("grad-sync.plan", CASE.id, True, "ok"),
                CheckResult("grad-sync.replicas", CASE.id, False, "rank 1: 3 tensors differ from rank 0")])
    with pytest.raises(AssertionError, match="grad-sync: verdict fail\n.*grad-sync.replicas: rank 1: 3 tensors"):
        assert_judged(run)
    with pytest.raises(AssertionError, match="grad-sync.replicas: rank 1: 3 tensors differ"):
        assert_judged(run, "grad-sync.replicas")
    assert_judged(run, "grad-sync.plan")  # one check is judged on its own


def test_a_case_that_did_not_run_fails_the_run_naming_its_error():
    run = _run([CheckResult("grad-sync.run", CASE.id, False, "RuntimeError: planted")], CaseStatus.ERROR,
               "RuntimeError: planted\ntraceback")
    with pytest.raises(AssertionError, match="RuntimeError: planted"):
        assert_judged(run)


def test_a_check_that_ran_nowhere_fails():
    run = _run([CheckResult("grad-sync.plan", CASE.id, True, "ok")])
    with pytest.raises(AssertionError, match=r"grad-sync: no grad-sync.dispatch ran \(1 cases: pass\)"):
        assert_judged(run, "grad-sync.dispatch")
    with pytest.raises(AssertionError, match=r"grad-sync: no check ran \(1 cases: unjudged\)"):
        assert_judged(_run([]))


def test_a_check_that_could_not_tell_anywhere_skips_naming_why():
    run = _run([cannot_tell("grad-sync.replicas", CASE.id, "DP replicas need DP >= 2")])
    with pytest.raises(pytest.skip.Exception, match="cannot tell here: .*grad-sync.replicas: cannot tell: DP"):
        assert_judged(run, "grad-sync.replicas")


@pytest.mark.parametrize("error", ["DoesNotFit", "MissingDependency"])
def test_step_perf_skips_where_its_model_does_not_fit_instead_of_an_error_at_collection(monkeypatch, error):
    """suites/test_step_perf.py plans its cases at collection (one benchmark per case): a GPU too small for the
    GPU reference model, or a dependency not installed, skips them as suite_runner skips the suite's checks."""
    from harness import driver, errors

    def plan(*args, **kwargs):
        raise getattr(errors, error)("predicted 37.5 GiB, 22.0 GiB available")

    monkeypatch.setattr(driver, "plan", plan)
    path = Path(__file__).resolve().parents[1] / "suites" / "test_step_perf.py"
    spec = importlib.util.spec_from_file_location("suites_step_perf_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []

    class Metafunc:
        fixturenames = ["case_id"]
        config = type("Config", (), {"getoption": staticmethod(lambda name: None)})()

        def parametrize(self, *args, **kwargs):
            calls.append((args, kwargs))

    module.pytest_generate_tests(Metafunc())
    (name, params), _ = calls[0]
    assert len(calls) == 1 and name == "case_id" and len(params) == 1
    assert [m.kwargs["reason"] for m in params[0].marks] == ["predicted 37.5 GiB, 22.0 GiB available"]
