import os

import pytest

# Rank processes started by the tests inherit this; keep the machine responsive on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def live_worker_pids() -> list[int]:
    """Rank processes started by this test process (directly or below) that are still alive."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "harness.launch.worker" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture
def no_leftover_ranks():
    from harness.launch.pool import close_all

    close_all()
    before = set(live_worker_pids())
    yield
    close_all()  # suites run through run_suite keep process-wide warm pools
    leftover = set(live_worker_pids()) - before
    assert not leftover, f"rank processes left behind: {sorted(leftover)}"
