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


@pytest.fixture(scope="module")
def moe_golden_run(suite_runner, skip_off_cpu):
    """tiny-moe's trajectory (with its load-balancing loss) on pure DP, PP 2, EP 2, EP 4 and PP 2 with EP 2."""
    skip_off_cpu("golden", "tiny-moe", "tiny-moe's golden trajectory")
    return suite_runner("golden", model="tiny-moe", label="golden-moe")


def test_every_moe_check_passes(moe_golden_run, judge):
    judge(moe_golden_run)


@pytest.mark.parametrize("check", ["trajectory", "params", "resume"])
def test_the_moe_trajectory_matches_its_golden_values(moe_golden_run, judge, check):
    judge(moe_golden_run, f"golden.{check}")
