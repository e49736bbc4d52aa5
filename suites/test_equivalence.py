"""Equivalence: training steps on every model-parallel layout match pure data parallel."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def equivalence_run(suite_runner):
    return suite_runner("equivalence")


def test_every_check_passes(equivalence_run, judge):
    judge(equivalence_run)


@pytest.mark.parametrize("check", ["finite", "loss", "params", "replicas"])
def test_layouts_match_data_parallel(equivalence_run, judge, check):
    judge(equivalence_run, f"equivalence.{check}")
