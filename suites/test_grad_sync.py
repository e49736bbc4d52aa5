"""Grad-sync: the DP gradient collectives observed at runtime are the configured ones, on every path."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import report
from harness.driver import run_suite
from harness.errors import MissingDependency

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]

# Construction paths: megatron DDP directly, and the two "wrap config" bridge routes.
PATHS = ["mcore", "megatron-bridge", "mbridge"]


@pytest.fixture(scope="module", params=PATHS)
def grad_sync_run(request, harness_opts, publish):
    from harness.engines import BUILTIN

    engine = request.param if harness_opts["engine"] == "mcore" else harness_opts["engine"]
    if engine not in BUILTIN and ":" not in engine:
        pytest.skip(f"construction path {engine!r} is not implemented in this version of the harness")
    try:
        run = run_suite("grad-sync", harness_opts["model"], harness_opts["world_size"],
                        engine=engine, backend=harness_opts["backend"],
                        fresh_ranks=harness_opts["fresh_ranks"])
    except MissingDependency as exc:
        pytest.skip(str(exc))
    publish(report.format_run(run))
    if harness_opts["results_dir"]:
        report.write_results(run, Path(harness_opts["results_dir"]) / f"grad-sync-{engine.replace(':', '-')}")
    return run


def test_every_case_ran(grad_sync_run):
    errors = grad_sync_run.errors
    assert not errors, "\n\n".join(errors)


@pytest.mark.parametrize("check", ["plan", "recorders", "replicas"])
def test_observed_matches_configured(grad_sync_run, check):
    assert grad_sync_run.checks, "the suite produced no checks"
    failures = [c for c in grad_sync_run.checks if c.check == f"grad-sync.{check}" and not c.passed]
    assert not failures, "\n".join(f"{c.case_id}: {c.message}\n" + "\n".join(c.details[:12]) for c in failures)
