"""Batch split: an RL batch trains the same however it is cut into micro-batches (sizes 1, 2, 4, dynamic by a token
budget) and laid out (DP, CP 2, PP 2), in every loss aggregation mode RL frameworks use."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def batch_split_run(suite_runner):
    return suite_runner("batch-split")


def test_every_check_passes(batch_split_run, judge):
    judge(batch_split_run)


@pytest.mark.parametrize("check", ["aggregation", "loss", "grad_norm", "num_zeros", "params", "logprobs"])
def test_every_cut_trains_as_one_micro_batch(batch_split_run, judge, check):
    judge(batch_split_run, f"batch-split.{check}")
