"""harness power: its planted engines and its interval (the benchmark itself is minutes of CPU: not run here)."""

from __future__ import annotations

import pytest

from harness import cli


def test_wilson_interval_is_sound_at_the_edges():
    from harness.power import wilson

    low, high = wilson(0, 5)
    assert low == 0.0 and 0.4 < high < 0.45  # 0 of 5 still allows ~43%
    low, high = wilson(5, 5)
    assert high == 1.0 and 0.55 < low < 0.6
    assert wilson(0, 0) == (0.0, 1.0)


def test_every_planted_size_is_an_engine_ranks_can_import():
    from harness import power

    for where in power.WHERE:
        for size in power.SIZES:
            cls = getattr(power, power.engine_name(where, size))
            assert issubclass(cls, power.PlantedSlowdown) and (cls.SIZE, cls.WHERE) == (size, where)
    assert power.engine_name("step", 0.03) == "Step03"


@pytest.mark.parametrize("argv", [["--trials", "0"], ["--rounds", "1"], ["--layout", "tp4-pp1-cp1-dp1"]])
def test_bad_input_is_refused_before_anything_runs(argv, capsys):
    assert cli.main(["power", *argv]) == 2
    assert capsys.readouterr().err.strip()


def test_power_on_nccl_ranks_without_gpus_is_refused_naming_them(capsys):
    assert cli.main(["power", "--backend", "nccl", "--world-size", "1"]) == 2
    assert "backend nccl needs one GPU per rank: world size 1 but 0 GPU(s) visible" in capsys.readouterr().err


def test_a_device_wait_asks_the_device_for_the_cycles_of_the_planted_seconds():
    """The GPU ranks' planted wait, with stand-ins for torch.cuda._sleep and its CUDA-event timing: the rate is
    measured once from a timed sleep, and each wait asks for seconds x that rate, in whole cycles."""
    from harness.power import DeviceWait

    slept, timed = [], []

    def timed_sleep(cycles: int) -> float:  # the device took 0.04 s for them: 1.25e9 cycles/s
        timed.append(cycles)
        return 0.04

    wait = DeviceWait(slept.append, timed_sleep)
    assert timed == [DeviceWait.CALIBRATION_CYCLES] and wait.cycles_per_s == pytest.approx(1.25e9)
    wait(0.2)
    wait(0.0)  # nothing planted: nothing enqueued
    assert slept == [250_000_000]

