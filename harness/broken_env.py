"""A run whose first cases all error alike stops early: the environment the ranks run in is broken (a module
missing, the engine failing to import), not the cases, and every further case would spend its start-up to say
the same (driver.run_suite)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.launch.results import CaseResult
from harness.outcomes import CaseStatus

# How many cases must error alike, first in the run, before it stops: one case may fail for its own layout,
# and the second and third in the plan are other layouts or option sets.
STOP_AFTER = 3


def exception_line(error: str) -> str:
    """The exception the first traceback of a case error ends with ("ModuleNotFoundError: No module named
    'ray'"), or "" when the error holds no traceback (a rank that died, a timeout)."""
    in_traceback = False
    for line in error.splitlines()[1:]:
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            return line.strip()
    return ""


@dataclass(frozen=True)
class CaseError:
    """Where and with what a case errored: the phase of the rank that failed first and its exception."""

    phase: str
    exception: str

    @staticmethod
    def of(result: CaseResult) -> CaseError | None:
        """None unless the case errored with a traceback (a timeout or a killed rank is the case's own)."""
        if result.status != CaseStatus.ERROR:
            return None
        phase = re.search(r"failed in phase '([^']*)'", result.error.splitlines()[0] if result.error else "")
        exception = exception_line(result.error)
        return CaseError(phase.group(1), exception) if phase and exception else None

    def advice(self) -> str:
        """What to do about it, for the errors whose cause is the environment by nature."""
        missing = re.match(r"ModuleNotFoundError: No module named '([\w.]+)'", self.exception)
        if missing:
            top = missing.group(1).split(".")[0]
            return (f"the ranks cannot import '{missing.group(1)}': install it into the environment the ranks run in "
                    f"(pip install {top}, or the distribution that provides it) and run again")
        if self.exception.startswith("ImportError"):
            return ("an import fails in the ranks: fix the engine's environment (the module or its version) and "
                    "run again")
        return "fix what it names and run again"


def broken_environment(finished: list[CaseResult]) -> str:
    """Why the run should stop ("" to go on): the first STOP_AFTER cases that ran (in run order) all errored in
    the same phase with the same exception. Judged once, when the STOP_AFTER-th case finishes: a later error,
    or an earlier case that passed, never stops a run."""
    ran = [r for r in finished if not r.skipped]
    if len(ran) != STOP_AFTER:
        return ""
    errors = {CaseError.of(r) for r in ran}
    if len(errors) != 1 or None in errors:
        return ""
    error = errors.pop()
    assert error is not None
    return (f"the first {STOP_AFTER} cases all errored in phase '{error.phase}' with {error.exception}: "
            f"{error.advice()}")
