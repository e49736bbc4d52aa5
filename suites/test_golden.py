"""Golden values: each layout's training trajectory (per-step loss, gradient norm, zero gradients, learning rate;
final parameter and Adam-moment norms) against the stored trajectory of its model and dtype."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def golden_run(suite_runner):
    return suite_runner("golden")


def test_every_check_passes(golden_run, judge):
    judge(golden_run)


@pytest.mark.parametrize("check", ["trajectory", "params"])
def test_trajectory_matches_the_golden_values(golden_run, judge, check):
    judge(golden_run, f"golden.{check}")
