"""Suite runs that share the machine, and those that must have it alone, among the processes of one test session.

pytest-xdist runs the regression suites on two workers: a suite's ranks leave a 2-core machine idle for part of
every collective, which a second suite's ranks use. A timed suite (step-perf) must not be timed beside another
suite, so its run takes the machine alone: it waits for the runs in flight and no run starts until it is done.
A readers-writer lock on two files (flock): shared runs hold `runs` shared; an alone run takes `gate`, which new
runs pass through, then `runs` exclusively, so a waiting alone run is not starved by runs that keep starting.
Outside a pytest-xdist session (no PYTEST_XDIST_TESTRUNUID) nothing runs beside a run: no lock is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

SESSION_ENV = "PYTEST_XDIST_TESTRUNUID"  # set by pytest-xdist in every worker of one session, the same in each


def lock_dir() -> Path | None:
    """The session's lock files' directory, None outside a pytest-xdist session."""
    uid = os.environ.get(SESSION_ENV)
    return Path(tempfile.gettempdir()) / f"harness-machine-{uid}" if uid else None


@contextlib.contextmanager
def share_machine(alone: bool) -> Iterator[None]:
    """Hold the machine shared with the session's other suite runs, or alone (waiting for theirs to end)."""
    where = lock_dir()
    if where is None:
        yield
        return
    where.mkdir(exist_ok=True)
    with open(where / "gate", "a+") as gate, open(where / "runs", "a+") as runs:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(runs, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(runs, fcntl.LOCK_UN)
