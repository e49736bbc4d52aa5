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


@pytest.fixture(scope="module")
def moe_run(suite_runner, skip_off_cpu):
    """small-moe (whose state outweighs the fixed costs the band allows for) at EP 2 over pure DP, and with TP 2
    and PP 2, with and without the distributed optimizer, and recomputed at the first."""
    skip_off_cpu("train-memory", "small-moe", "small-moe's training memory")
    return suite_runner("train-memory", model="small-moe", label="train-memory-moe")


def test_every_moe_check_passes(moe_run, judge):
    judge(moe_run)


@pytest.mark.parametrize("check", ["model", "baseline"])
def test_moe_training_memory(moe_run, judge, check):
    judge(moe_run, f"train-memory.{check}")
