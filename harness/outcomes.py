"""A case's outcomes and a run's exit codes: shared by the driver and the reports (no torch, no suites)."""

from enum import StrEnum


class CaseStatus(StrEnum):
    """How a case's ranks ended (`CaseResult.status`)."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"


class Outcome(StrEnum):
    """A case's single verdict (`CaseOutcome.outcome`). UNJUDGED: the case ran but no check judged it - never a
    pass (a check that did not run cannot fail). INCONCLUSIVE: every check of the case ran but none could tell
    right from wrong here (e.g. fsdp2's sharded and full saves write the same files at one rank) - neither a pass
    nor a failure. PENDING marks a measured case in a results file written before the run's checks ran."""

    PASS = "pass"
    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    ERROR = "error"
    SKIPPED = "skipped"
    INCONCLUSIVE = "inconclusive"
    UNJUDGED = "unjudged"
    PENDING = "pending"


class RunVerdict(StrEnum):
    """A run's verdict (`SuiteRun.verdict`), which sets its exit code."""

    PASS = "pass"
    FAIL = "fail"
    ERRORED = "errored"
    NOTHING_JUDGED = "nothing judged"
    INTERRUPTED = "interrupted"


# bisect's --metric / --max that takes a case's verdict as the metric (a failed check is bad), no threshold
PASS_FAIL = "fail"
# bisect's metric `check:<suite>.<check>`: bad where that check does not pass (fails, or cannot tell: a known upstream
# defect reported as inconclusive turns good in the release that fixes it)
CHECK_METRIC = "check:"

# the outcomes that are not a pass, nor a neutral skip or cannot-tell: a report lists these cases as not passing
NOT_PASSING = (Outcome.REGRESSION, Outcome.IMPROVEMENT, Outcome.UNJUDGED, Outcome.ERROR)
# the outcomes a summary counts, in its order
OUTCOMES = tuple(o.value for o in Outcome if o is not Outcome.PENDING)
# Exit codes of `harness run` / `baselines check` / `nightly`. 3 = could not measure: cases errored (a
# rank died, a module missing in the engine's environment) and no check failed - the environment's owner is
# paged, not the code's. 5 = nothing judged: every case skipped or no check ran, the analogue of pytest's
# "no tests collected".
EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_ERRORED, EXIT_NOTHING_JUDGED = 0, 1, 2, 3, 5


def check_failed(check: dict) -> bool:
    """Whether a check of a results.json failed (an inconclusive one did not, nor did it pass)."""
    return not check["passed"] and not check.get("inconclusive", False)
