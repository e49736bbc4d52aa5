"""A deterministic suite's recording repeats, replayed from its first run: what a test fixture's baseline needs
(the figures of its unplanted run) in a third of the CPU. The committed baselines are recorded with real repeats."""

from __future__ import annotations

import contextlib

import pytest


@contextlib.contextmanager
def repeats_replayed():
    """Within it, `harness.recording.record_suite` executes each plan once and reuses that run for its other
    repeats (golden's trajectories are bit for bit the same from one repeat to the next on CPU ranks)."""
    from harness import driver

    real = driver.execute
    runs: dict[int, object] = {}

    def execute(planned, **kwargs):
        if id(planned) not in runs:
            runs[id(planned)] = (planned, real(planned, **kwargs))  # the plan kept alive: its id stays its own
        return runs[id(planned)][1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "execute", execute)
        yield
