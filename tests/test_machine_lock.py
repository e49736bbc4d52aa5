"""Suite runs share the machine between pytest-xdist workers; a timed suite's run has it alone."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from harness.launch import machine_lock
from harness.suite_defs import get_suite, runs_alone


def _hold(alone: bool, uid: str, log, release, barrier=None, entered=None) -> None:
    import os

    os.environ[machine_lock.SESSION_ENV] = uid
    with machine_lock.share_machine(alone):
        log.put(("in", alone, time.monotonic()))
        if entered is not None:
            entered.set()
        if barrier is not None:
            barrier.wait(30)  # raises unless the other shared run holds the machine at the same time
        release.wait(30)
        log.put(("out", alone, time.monotonic()))


def _gate_taken(uid: str) -> bool:
    """Whether a run holds the gate: an alone run waiting for the runs in flight."""
    import fcntl
    import os

    os.environ[machine_lock.SESSION_ENV] = uid
    where = machine_lock.lock_dir()
    assert where is not None
    if not (where / "gate").exists():
        return False
    with open(where / "gate", "a+") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(gate, fcntl.LOCK_UN)
        return False


def _spans(log) -> dict[bool, list[tuple[float, float]]]:
    events = []
    while not log.empty():
        events.append(log.get())
    spans: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    opened: dict[bool, list[float]] = {True: [], False: []}
    for kind, alone, t in sorted(events, key=lambda e: e[2]):
        if kind == "in":
            opened[alone].append(t)
        else:
            spans[alone].append((opened[alone].pop(0), t))
    return spans


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.fixture
def uid(tmp_path, monkeypatch) -> str:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return f"test-{time.monotonic_ns()}"


def test_shared_runs_overlap_and_an_alone_run_overlaps_none(uid, monkeypatch):
    ctx = multiprocessing.get_context("fork")
    log, barrier = ctx.Queue(), ctx.Barrier(2)
    release_first, release_rest = ctx.Event(), ctx.Event()
    # two shared runs in flight together (a barrier inside the lock), then an alone run asked for, then a shared
    # run asked for while the alone one waits
    entered = [ctx.Event(), ctx.Event()]
    first = [ctx.Process(target=_hold, args=(False, uid, log, release_first, barrier, e)) for e in entered]
    for p in first:
        p.start()
    assert all(e.wait(30) for e in entered), "two shared runs did not hold the machine together"
    alone = ctx.Process(target=_hold, args=(True, uid, log, release_rest))
    alone.start()
    deadline = time.monotonic() + 30
    while not _gate_taken(uid):
        assert time.monotonic() < deadline, "the alone run never waited at the gate"
        time.sleep(0.01)
    late = ctx.Process(target=_hold, args=(False, uid, log, release_rest))
    late.start()
    release_first.set()
    release_rest.set()
    for p in [*first, alone, late]:
        p.join(60)
        assert p.exitcode == 0
    spans = _spans(log)
    assert len(spans[True]) == 1 and len(spans[False]) == 3
    [solo] = spans[True]
    assert not any(_overlap(solo, s) for s in spans[False]), spans
    # the shared run asked for while the alone one waited ran after it (a waiting alone run is not starved)
    assert max(s[0] for s in spans[False]) >= solo[1]


def test_outside_an_xdist_session_no_lock_is_taken(monkeypatch):
    monkeypatch.delenv(machine_lock.SESSION_ENV, raising=False)
    assert machine_lock.lock_dir() is None
    with machine_lock.share_machine(True), machine_lock.share_machine(True):
        pass  # an alone run inside another would wait forever if a lock were taken


def test_step_perf_runs_alone_and_the_other_suites_share():
    assert runs_alone(get_suite("step-perf"))
    assert not any(runs_alone(get_suite(s)) for s in ("ckpt-memory", "grad-sync", "refit", "train-memory"))
