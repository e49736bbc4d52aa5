"""What a step-perf recording says of its own timed steps: what they detect against the new baseline, the fewest
that detect the minimum effect, and the repeats' drift - from the recorded samples alone."""

from __future__ import annotations

import random

from harness.checks.timing import fewest_steps_detecting, minimum_detectable_effect
from harness.suite_defs.step_perf.sizing import UP_TO, recording_notes, sizing


def _entry(sd: float, medians: tuple[float, ...] = (100.0, 100.0, 100.0), steps: int = 20, seed: int = 0) -> dict:
    """A recorded entry: `len(medians)` repeats of `steps` step times around each median with spread sd."""
    rng = random.Random(seed)
    samples = [rng.gauss(m, sd) for m in medians for _ in range(steps)]
    return {"step_time_ms": {"samples": samples, "values": list(medians)}}


def test_tight_step_times_need_few_steps_and_spread_ones_many():
    tight, spread = _entry(1.0)["step_time_ms"]["samples"], _entry(6.0)["step_time_ms"]["samples"]
    assert minimum_detectable_effect(tight, 20) < 0.02 < minimum_detectable_effect(spread, 20)
    few, many = fewest_steps_detecting(tight, 0.05, 3), fewest_steps_detecting(spread, 0.05, 3)
    assert few is not None and many is not None and few <= 5 < 20 < many
    assert fewest_steps_detecting(_entry(60.0)["step_time_ms"]["samples"], 0.05, 3) is None  # not within UP_TO


def test_a_recording_reads_its_sizing_at_the_tiers_minimum_effect():
    entries = {"1b-2k/tp1-pp1-cp1-dp1/distopt=1,overlap=1/bf16": _entry(1.0)}
    (gpu,) = recording_notes(entries, 20, None, "nccl")
    assert gpu.startswith("1b-2k/tp1-pp1-cp1-dp1/distopt=1,overlap=1/bf16: 20 timed steps detect >= ")
    assert "(minimum effect 5%); the fewest that detect 5%: " in gpu and "differ by 0.0%" in gpu
    (cpu,) = recording_notes(entries, 20, None, "gloo")
    assert "(minimum effect 50%); the fewest that detect 50%: 3;" in cpu
    (given,) = recording_notes(entries, 20, 0.02, "gloo")
    assert "(minimum effect 2%)" in given
    assert recording_notes({"k": {"step_time_ms": {"value": 1.0}}}, 20, None, "gloo") == []  # no samples: nothing


def test_repeats_drifting_beyond_the_minimum_effect_are_named():
    drifting = sizing("k", _entry(1.0, (100.0, 104.0, 110.0)), 20, 0.05)
    assert drifting is not None and round(drifting.drift, 3) == 0.1
    assert "the repeats' medians differ by 10.0%, more than the minimum effect: a step time within it reads as " \
           "this machine's drift (cannot tell)" in drifting.describe()
    steady = sizing("k", _entry(1.0, (100.0, 101.0, 102.0)), 20, 0.05)
    assert steady is not None and "cannot tell" not in steady.describe()
    wide = sizing("k", _entry(60.0), 20, 0.05)
    assert wide is not None and f"the fewest that detect 5%: more than {UP_TO}" in wide.describe()
