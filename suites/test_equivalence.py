"""Equivalence: training steps on every model-parallel layout match pure data parallel."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import report
from harness.driver import run_suite

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def equivalence_run(harness_opts, publish):
    run = run_suite("equivalence", harness_opts["model"], harness_opts["world_size"],
                    engine=harness_opts["engine"], backend=harness_opts["backend"],
                        fresh_ranks=harness_opts["fresh_ranks"])
    publish(report.format_run(run))
    if harness_opts["results_dir"]:
        report.write_results(run, Path(harness_opts["results_dir"]) / "equivalence")
    return run


def test_every_case_ran(equivalence_run):
    errors = equivalence_run.errors
    assert not errors, "\n\n".join(errors)


@pytest.mark.parametrize("check", ["loss", "params", "replicas"])
def test_layouts_match_data_parallel(equivalence_run, check):
    failures = [c for c in equivalence_run.checks if c.check == f"equivalence.{check}" and not c.passed]
    assert equivalence_run.checks, "the suite produced no checks"
    assert not failures, "\n".join(f"{c.case_id}: {c.message}\n" + "\n".join(c.details[:10]) for c in failures)
