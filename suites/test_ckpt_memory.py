"""Checkpoint memory: per-rank host peaks of a save, per format, against the model and the baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import report
from harness.driver import run_suite

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def ckpt_run(request, harness_opts, publish):
    if request.config.getoption("--update-baselines"):
        from harness.baselines import record_suite

        path, diff = record_suite("ckpt-memory", harness_opts["model"], harness_opts["world_size"],
                                  backend=harness_opts["backend"],
                                  baselines_dir=request.config.getoption("--baselines-dir"))
        publish(f"recorded {path}:\n{diff}")
    run = run_suite("ckpt-memory", harness_opts["model"], harness_opts["world_size"],
                    engine=harness_opts["engine"], backend=harness_opts["backend"],
                    fresh_ranks=harness_opts["fresh_ranks"],
                    baselines_dir=request.config.getoption("--baselines-dir"))
    publish(report.format_run(run))
    if harness_opts["results_dir"]:
        report.write_results(run, Path(harness_opts["results_dir"]) / "ckpt-memory")
    return run


def test_every_case_ran(ckpt_run):
    errors = ckpt_run.errors
    assert not errors, "\n\n".join(errors)


@pytest.mark.parametrize("check", ["contract", "model", "baseline"])
def test_save_memory(ckpt_run, check):
    assert ckpt_run.checks, "the suite produced no checks"
    failures = [c for c in ckpt_run.checks if c.check == f"ckpt-memory.{check}" and not c.passed]
    assert not failures, "\n".join(f"{c.case_id}: {c.message}\n" + "\n".join(c.details[:8]) for c in failures)
