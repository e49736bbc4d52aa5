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
    measured from a timed sleep when calibrated (or at the first wait), and each wait asks for seconds x that rate,
    in whole cycles."""
    from harness.power import DeviceWait

    slept, timed, took = [], [], [0.04]

    def timed_sleep(cycles: int) -> float:  # the device took 0.04 s for them: 1.25e9 cycles/s
        timed.append(cycles)
        return took[0]

    wait = DeviceWait(slept.append, timed_sleep)
    wait(0.0)  # nothing planted: nothing enqueued, nothing measured
    assert timed == [] and slept == []
    wait(0.2)
    assert timed == [DeviceWait.CALIBRATION_CYCLES] and wait.cycles_per_s == pytest.approx(1.25e9)
    assert slept == [250_000_000]
    took[0] = 0.05  # clocks lower under load: 1e9 cycles/s
    wait.calibrate()
    wait(0.2)
    assert slept == [250_000_000, 200_000_000]


def test_the_planted_device_wait_is_calibrated_after_the_warm_up_steps_outside_the_timed_ones(monkeypatch):
    """An idle GPU's clocks are not those of its steps: the rate is measured once the last warm-up step is done,
    before the first timed step and its wait."""
    from types import SimpleNamespace

    from harness.engines.mcore import McoreEngine
    from harness.power import DeviceWait, PlantedSlowdown

    events: list[str] = []
    monkeypatch.setattr(McoreEngine, "train_step", lambda self, step: events.append(f"step {step}"))
    engine = object.__new__(PlantedSlowdown)
    engine.SIZE, engine.WHERE = 0.1, "step"
    engine.case = SimpleNamespace(options=SimpleNamespace(warmup_steps=2))
    engine.config = SimpleNamespace(finalize_model_grads_func=None)
    engine._own, engine._wait_s, engine._wrapped, engine._on_cpu = [], 0.0, False, False
    engine._sync = lambda: None
    engine._wait = DeviceWait(lambda cycles: events.append("wait"), lambda cycles: events.append("calibrate") or 0.04)
    for step in range(4):  # each call is one step as step-perf times it
        events.append(f"call {step}")
        engine.train_step(step)
    assert events == ["call 0", "step 0", "call 1", "step 1", "calibrate", "call 2", "wait", "step 2",
                      "call 3", "wait", "step 3"]
