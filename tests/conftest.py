"""Rank processes in the tests: warm pools are shared across tests, and none outlives its pool.

Suites run through run_suite use the process-wide warm pools (harness/launch/pool.py), one per
(world size, backend); the tests share them, as a long `harness run` would: a case that fails,
hangs or leaks still retires its pool (the poison-pill rule), and step-perf still gets ranks that
ran no other suite. What is checked:
- after every test, every live rank process below this one is a rank of a warm pool in use
  (`ranks_belong_to_warm_pools`, autouse): a rank a test started outside a pool is gone;
- at the end of the session, closing the pools leaves no rank process behind (`pools_close_cleanly`);
- tests about rank lifetime (pool retirement, fresh ranks, orphans) request `no_leftover_ranks`:
  every pool is closed before and after them and nothing they started may survive.

Under pytest-xdist (`nox -s tests` runs two workers) each worker has its own pools, and a test marked
`exclusive` (it judges the step time of real ranks, or feeds pytest-benchmark) runs while no other test runs
(`pytest_runtest_protocol` below), once what the other worker's tests left running has settled, so a worker
beside it cannot move its figures; a module's exclusive tests run first in it and back to back, holding the
other worker off once.
"""

import fcntl
import os
import shutil
import tempfile
import time

import pytest

# Rank processes started by the tests inherit this; keep the machine responsive on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def live_worker_pids() -> list[int]:
    """Rank processes started by this test process (directly or below) that are still alive."""
    import psutil

    def zygote(p) -> bool:
        return "harness.launch.zygote" in " ".join(p.cmdline())

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            # exec'd: harness.launch.worker; forked: a child of the fork server, whose command line it keeps (as
            # do the processes a rank forks itself, e.g. megatron's checkpoint writer and its results server)
            parent = p.parent()
            forked = zygote(p) and zygote(parent) and not zygote(parent.parent())
            if ("harness.launch.worker" in " ".join(p.cmdline()) or forked) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            pass
    return out


def warm_pool_pids() -> set[int]:
    """Live ranks of the process-wide warm pools (kept between tests on purpose)."""
    from harness.launch import pool

    return {p.pid for rp in pool._POOLS.values() for p in rp.procs if p.poll() is None}


@pytest.fixture(scope="session", autouse=True)
def pools_close_cleanly():
    yield
    from harness.launch.pool import close_all

    close_all()
    leftover = live_worker_pids()
    assert not leftover, f"rank processes left behind after closing the warm pools: {leftover}"


@pytest.fixture(autouse=True)
def ranks_belong_to_warm_pools():
    yield
    stray = set(live_worker_pids()) - warm_pool_pids()
    assert not stray, f"rank processes outside any warm pool left behind: {sorted(stray)}"


@pytest.fixture
def no_leftover_ranks():
    """For tests about rank lifetime: no warm pool before or after, nothing the test started survives."""
    from harness.launch.pool import close_all

    close_all()
    before = set(live_worker_pids())
    yield
    close_all()
    leftover = set(live_worker_pids()) - before
    assert not leftover, f"rank processes left behind: {sorted(leftover)}"


# -- exclusive tests under pytest-xdist -------------------------------------------------------------------
# Every test holds a shared lock on `run` for its setup, call and teardown; an exclusive one holds it alone.
# A waiting exclusive test holds `queue`, which every test passes through before taking `run`, so tests
# that arrive after it wait (no starving it between the other worker's tests).
_LOCK_DIR = "harness_test_lock_dir"
_LOCK_DIR_KEY = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """On the xdist controller: one lock directory, handed to every worker."""
    stash = node.config.stash
    if _LOCK_DIR_KEY not in stash:
        stash[_LOCK_DIR_KEY] = tempfile.mkdtemp(prefix="harness-test-locks-")
    node.workerinput[_LOCK_DIR] = stash[_LOCK_DIR_KEY]


def pytest_unconfigure(config):
    if _LOCK_DIR_KEY in config.stash:
        shutil.rmtree(config.stash[_LOCK_DIR_KEY], ignore_errors=True)


def _take(lock_dir: str, exclusive: bool) -> tuple:
    """Open and lock `queue` and `run`; the locks are released when the files close."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    queue, run = open(os.path.join(lock_dir, "queue"), "a"), open(os.path.join(lock_dir, "run"), "a")
    fcntl.flock(queue, mode)
    fcntl.flock(run, mode)
    if not exclusive:
        fcntl.flock(queue, fcntl.LOCK_UN)
    return queue, run


def _release(locks: tuple) -> None:
    for f in locks:
        f.close()


QUIET_CORES = 0.5  # less than a busy process: what an idle worker, its idle ranks and fork server use


def wait_for_quiet(max_s: float | None = None, window_s: float = 0.25) -> tuple[float, float]:
    """Wait until the machine's processes use less than QUIET_CORES cores for two windows in a row; (seconds
    waited, cores busy in the last window). The lock holds off the other worker's tests, not what they left
    running: its ranks finishing a case, a fork server a refused run started still importing torch (suspected
    when a planted 50% slowdown read x1.085 against a step-perf baseline recorded at the start of a run, while
    the other worker's first test had started a fork server)."""
    import psutil

    if max_s is None:  # 15 s; a generated session of sleeping tests (tests/test_exclusive.py) sets 0
        max_s = float(os.environ.get("HARNESS_TEST_QUIET_MAX_S", "15"))
    t0, quiet, busy = time.monotonic(), 0, 0.0
    psutil.cpu_percent()  # starts the first window
    while quiet < 2 and time.monotonic() - t0 < max_s:
        time.sleep(window_s)
        busy = psutil.cpu_percent() / 100 * (psutil.cpu_count() or 1)
        quiet = quiet + 1 if busy < QUIET_CORES else 0
    return time.monotonic() - t0, busy


def _exclusive(item) -> bool:
    return item is not None and item.get_closest_marker("exclusive") is not None


# The locks of a run of consecutive exclusive tests on this worker, held from the first to the last: between
# two of them the other worker would otherwise slip in a test, and the next exclusive one wait for it to end.
_held: tuple = ()


def pytest_collection_modifyitems(items):
    """A module's exclusive tests run one after the other, first in the module: the other worker waits once."""
    first: dict = {}  # module path -> its first item's place
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (first[item.path], not _exclusive(item)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _held
    lock_dir = getattr(item.config, "workerinput", {}).get(_LOCK_DIR)
    if lock_dir is None:  # no xdist: one test at a time anyway
        return (yield)
    if not _exclusive(item):
        locks = _take(lock_dir, exclusive=False)
        try:
            return (yield)
        finally:
            _release(locks)
    if not _held:
        _held = _take(lock_dir, exclusive=True)
        waited, busy = wait_for_quiet()
        if busy >= QUIET_CORES:
            item.add_report_section("setup", "machine", f"not quiet after {waited:.0f} s: {busy:.1f} cores busy")
    try:
        return (yield)
    finally:
        if not _exclusive(nextitem):
            _release(_held)
            _held = ()
