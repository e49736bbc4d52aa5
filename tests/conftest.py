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

Under pytest-xdist (`nox -s tests` runs two workers) each worker has its own pools. No verdict a test asserts
depends on how busy the machine is: a test that shows a timing verdict on real ranks plants an effect far beyond
any load (tests/plants/faulty_engines.py, BEYOND), or judges exact counters, or statistics on recorded or synthetic
samples; time limits (a case's, a subprocess's) are several times what a loaded 2-core machine took
(tests/plants/fake_suites.py, CASE_TIMEOUT_S); memray captures are private to a run (harness/probes/memory.py).
"""

import os

import pytest

pytest_plugins = ["tests.support.phase_table"]  # --phase-table FILE: where the time goes, per module

# Rank processes started by the tests inherit this; keep the machine responsive on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def live_worker_pids() -> list[int]:
    """Rank processes started by this test process (directly or below) that are still alive."""
    import psutil

    from harness.launch.zygote import _ZYGOTES

    # this process's fork servers (a server of more modules is forked from the first one and keeps its command line)
    servers = {server.proc.pid for server in _ZYGOTES.values()}
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            # exec'd: harness.launch.worker; forked: a child of a fork server that is not one itself (a rank's own
            # children, e.g. megatron's checkpoint writer and its results server, keep its command line too)
            forked = p.ppid() in servers and p.pid not in servers
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


@pytest.fixture(autouse=True)
def unit_tests_start_no_ranks(request, monkeypatch):
    """The tiers: a test that runs cases on ranks is marked `slow` (as is one that starts an interpreter importing
    torch and megatron); the rest - the unit tier, `nox -s unit` (pytest -m "not slow") - starts no rank, which this
    holds them to at the one place ranks start or run."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} runs ranks: mark it @pytest.mark.slow (the unit tier starts none)",
                    pytrace=False)

    monkeypatch.setattr("harness.launch.runner.spawn_rank", refuse)
    monkeypatch.setattr("harness.launch.pool.RankPool.run", refuse)
