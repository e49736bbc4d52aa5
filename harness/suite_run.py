"""A suite run as data: its cases' results, the checks over them, each case's outcome, the verdict and
the exit code. The driver fills one (harness/driver.py); reports render it (harness/report/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.backends import Backend
from harness.broken_env import exception_line
from harness.checks import CheckResult, skipped_steps
from harness.errors import Interrupted
from harness.launch.results import CaseResult
from harness.outcomes import EXIT_ERRORED, EXIT_FAIL, EXIT_NOTHING_JUDGED, EXIT_PASS, Outcome, RunVerdict
from harness.suite_defs import Baselined, ReportsData, Suite


@dataclass
class CaseOutcome:
    """A case's single verdict for summaries: one of OUTCOMES and, unless it passed, why."""

    result: CaseResult
    outcome: Outcome
    reason: str = ""
    checks: list[CheckResult] = field(default_factory=list)


def error_summary(error: str) -> str:
    """The head line of a case error plus the exception its first traceback ends with, e.g.
    "case ...: rank 0 failed in phase 'save' - AssertionError: ..."."""
    head = (error.splitlines() or ["failed"])[0]
    exception = exception_line(error)
    return f"{head} - {exception}" if exception else head


def _outcome(result: CaseResult, checks: list[CheckResult], judged: bool = True) -> CaseOutcome:
    if result.skipped:
        return CaseOutcome(result, Outcome.SKIPPED, (result.error.splitlines() or ["skipped"])[0], checks)
    if not result.ok:
        return CaseOutcome(result, Outcome.ERROR,
                           error_summary(result.error).removeprefix(f"case {result.case.id}: "), checks)
    if not judged:  # written while the run goes on: measured, judged at the end
        return CaseOutcome(result, Outcome.PENDING, "measured; judged when the run ends", checks)
    if not checks:
        return CaseOutcome(result, Outcome.UNJUDGED, "the case ran but no check judged it", checks)
    failed = [c for c in checks if c.failed]
    if not failed:
        if all(c.inconclusive for c in checks):
            return CaseOutcome(result, Outcome.INCONCLUSIVE, f"{checks[0].check}: {checks[0].message}", checks)
        return CaseOutcome(result, Outcome.PASS, "", checks)
    worse = [c for c in failed if not c.improvement]
    c = (worse or failed)[0]
    return CaseOutcome(result, Outcome.REGRESSION if worse else Outcome.IMPROVEMENT, f"{c.check}: {c.message}",
                       checks)


@dataclass
class SuiteRun:
    suite: Suite
    model: str
    world_size: int
    backend: Backend
    engine: str
    results: list[CaseResult] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    wall_s: float = 0.0
    planned: int = 0  # cases in the plan (results may hold fewer: an interrupted run)
    judged: bool = False  # the suite's checks ran over the results
    interrupted: Interrupted | None = None  # the signal that ended the run early
    label: str | None = None  # the user's name for this run (reports, history)
    stopped: str = ""  # why the run stopped before its last case: its first cases all errored alike (broken_env.py)
    params: Any = None  # the suite's parameters (suite.Params) the cases were planned and are judged with
    judge_s: float = 0.0  # the parent's time judging the results (the suite's checks)

    @property
    def passed(self) -> bool:
        """Something was judged, every case ran (or was skipped for a missing dependency), every case
        that ran was judged by at least one check, and every check passed."""
        return self.verdict == RunVerdict.PASS

    @property
    def verdict(self) -> RunVerdict:
        """'pass', 'fail' (a check failed or a case went unjudged), 'errored' (cases could not run - a rank
        died, a module is missing - and nothing that ran failed), 'nothing judged' (no check could judge
        anything: every case skipped or inconclusive, or none planned) or 'interrupted' (stopped early by a
        signal)."""
        if self.interrupted is not None:
            return RunVerdict.INTERRUPTED
        if not self.conclusive and not self.errors:
            return RunVerdict.NOTHING_JUDGED
        outcomes = self.outcomes()
        errored = {o.result.case.id for o in outcomes if o.outcome == Outcome.ERROR}
        # a case that errored fails its `<suite>.run` check; only the other failures are the code's
        failed = [c for c in self.checks if c.failed and c.case_id not in errored]
        if failed or any(o.outcome in (Outcome.REGRESSION, Outcome.IMPROVEMENT, Outcome.UNJUDGED) for o in outcomes):
            return RunVerdict.FAIL
        return RunVerdict.ERRORED if errored else RunVerdict.PASS

    @property
    def conclusive(self) -> list[CheckResult]:
        """The checks that told right from wrong (passed or failed), not the ones that could not tell."""
        return [c for c in self.checks if not c.inconclusive]

    def judge(self) -> SuiteRun:
        """Run the suite's checks over the cases that ran (a skipped case has nothing to judge). Checks are
        pure functions of the results and the parameters: what a report does with files (flamegraphs of
        failures, captures of passes deleted) happens in the report stage (harness/report/artifacts.py)."""
        import time

        start = time.perf_counter()
        for r in self.results:
            self.describe(r)
        ran = [r for r in self.results if not r.skipped]
        self.checks = self.suite.check(ran, self.params) + skipped_steps.check(self.suite.name, ran)
        self.judged = True
        self.judge_s = time.perf_counter() - start
        return self

    def describe(self, result: CaseResult) -> CaseResult:
        """The suite's figures of a case, taken once when it arrives (`result.figures`): reports are
        rendered from them (and from results.json) without the suite's code."""
        if result.figures is None:
            result.figures = case_figures(self.suite, result)
        return result

    def stop_if_interrupted(self) -> SuiteRun:
        """Re-raise the interrupt this run was stopped by: for callers that run more than one suite run
        (repeats, rounds, bisect steps), which must stop too."""
        if self.interrupted is not None:
            raise self.interrupted
        return self

    @property
    def exit_code(self) -> int:
        if self.interrupted is not None:
            return self.interrupted.exit_code
        return {RunVerdict.PASS: EXIT_PASS, RunVerdict.FAIL: EXIT_FAIL, RunVerdict.ERRORED: EXIT_ERRORED,
                RunVerdict.NOTHING_JUDGED: EXIT_NOTHING_JUDGED}[self.verdict]

    @property
    def errors(self) -> list[str]:
        """The error text of every case that failed to run (skipped cases are not errors)."""
        return [r.error for r in self.results if not r.ok and not r.skipped]

    def outcomes(self) -> list[CaseOutcome]:
        """One outcome per case, in plan order, with the checks of its id."""
        by_case: dict[str, list[CheckResult]] = {r.case.id: [] for r in self.results}
        for c in self.checks:
            by_case.setdefault(c.case_id, []).append(c)
        return [_outcome(r, by_case[r.case.id], self.judged) for r in self.results]


def case_figures(suite: Suite, result: CaseResult) -> dict[str, Any]:
    """What a report shows of a case beyond the harness's own fields: the suite's metrics, its report data
    (plots) and, for a baselined suite, the baseline key and samples."""
    out: dict[str, Any] = {"metrics": {**(suite.metrics(result) or {}), **skipped_steps.figures(result)}}
    if result.ok and isinstance(suite, ReportsData):
        out["data"] = suite.report_data(result)
    if result.ok and isinstance(suite, Baselined):
        out["baseline_key"], out["samples"] = suite.key(result.case), suite.samples(result)
    return out
