"""Training memory: each rank's build and steps (heap on CPU ranks, device memory on GPUs) against the
training-memory model and the stored baselines."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def train_memory_run(suite_runner):
    return suite_runner("train-memory")


def test_every_check_passes(train_memory_run, judge):
    judge(train_memory_run)


@pytest.mark.parametrize("check", ["model", "baseline"])
def test_training_memory(train_memory_run, judge, check):
    judge(train_memory_run, f"train-memory.{check}")
