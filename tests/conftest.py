import os

import pytest

# Rank processes started by the tests inherit this; keep the machine responsive on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def live_worker_pids() -> list[int]:
    """Rank processes of this test session still alive (not zombies)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "harness.launch.worker" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
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
