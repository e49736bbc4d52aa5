"""Every suite turns a case that did not run into a failed check naming the error's first line (`<suite>.run`;
ckpt-memory's contract cases: `ckpt-memory.reshard`), never into a pass or silence."""

from __future__ import annotations

import pytest

from harness.driver import plan
from harness.errors import MissingDependency
from harness.launch.results import CaseResult
from harness.outcomes import CaseStatus
from harness.suite_registry import SUITES

ERROR = "RuntimeError: planted in rank 1 at step 2\nTraceback (most recent call last):\n  File \"x.py\", line 1"


@pytest.mark.parametrize("status", [CaseStatus.ERROR, CaseStatus.TIMEOUT])
@pytest.mark.parametrize("suite_name", sorted(SUITES))
def test_a_case_that_did_not_run_fails_naming_its_error(suite_name, status):
    try:
        planned = plan(suite_name, None, 2, backend="gloo")
    except MissingDependency as e:  # peft-ckpt without megatron-bridge or peft (nox installs both)
        pytest.skip(str(e))
    failed = [CaseResult(case, [], status, error=ERROR) for case in planned.cases]
    checks = planned.suite.check(failed, planned.params)
    for case in planned.cases:
        mine = [c for c in checks if c.case_id == case.id]
        assert mine, f"{suite_name}: no check of {case.id}, which did not run"
        assert not any(c.passed for c in mine), [c for c in mine if c.passed]
        assert any(c.failed and c.message == ERROR.splitlines()[0] for c in mine), mine
