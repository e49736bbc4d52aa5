"""Hand rank-measured step times to pytest-benchmark, so its statistics, --benchmark-autosave,
--benchmark-compare(-fail) and histograms work on the harness's numbers.

Why feed measured times instead of letting pytest-benchmark time a callable: a step of a multi-rank
case runs in N rank processes; timing it from the parent would add the round trip to the ranks and
the parent's own scheduling to every sample, on a 2-core machine more than the effects we look for.
The ranks time each step between barrier-aligned boundaries (harness/probes/timers.py); a replay clock
gives pytest-benchmark exactly those durations, one round per step.
"""

from __future__ import annotations


class ReplayClock:
    """A timer for pytest-benchmark: each start/end pair of calls advances by the next duration."""

    def __init__(self, durations_s: list[float]):
        self._durations = iter(durations_s)
        self._now = 0.0
        self._started = False

    def __call__(self) -> float:
        if self._started:
            self._now += next(self._durations)
        self._started = not self._started
        return self._now


def record(benchmark, durations_s: list[float], extra_info: dict) -> None:
    """One pytest-benchmark round per measured step, with extra_info (JSON-able) attached."""
    if not hasattr(benchmark, "_timer"):
        raise RuntimeError("this pytest-benchmark has no BenchmarkFixture._timer to replay step times into "
                           "(tested with pytest-benchmark 5.x); install pytest-benchmark>=4,<6")
    benchmark.extra_info.update(extra_info)
    benchmark._timer = ReplayClock(durations_s)
    benchmark.pedantic(lambda: None, rounds=len(durations_s), iterations=1, warmup_rounds=0)
