"""What the memory probes read from /proc: a process's descendants and their RSS, as psutil reads them."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from harness.probes.proc import descendants, status_field


def test_descendants_are_psutils_recursive_children_and_rss_is_its_rss():
    trees = [subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"]) for _ in range(2)]
    try:
        me = psutil.Process()

        def ours() -> set[int]:
            return {p.pid for t in trees for p in [psutil.Process(t.pid), *psutil.Process(t.pid).children()]}

        deadline = time.monotonic() + 10
        while len(ours()) < 6 and time.monotonic() < deadline:  # two shells, each with two sleeps
            time.sleep(0.02)
        want = sorted(p.pid for p in me.children(recursive=True))  # with this worker's warm ranks, if any
        assert len(ours()) == 6 and ours() <= set(want)
        assert sorted(descendants()) == want
        assert sorted(descendants(trees[0].pid)) == sorted(p.pid for p in psutil.Process(trees[0].pid).children())
        child = psutil.Process(trees[0].pid)
        assert status_field(trees[0].pid, "VmRSS") == child.memory_info().rss
    finally:
        for t in trees:
            for p in psutil.Process(t.pid).children(recursive=True):
                p.kill()
            t.kill()
            t.wait()


def test_a_process_that_forked_nothing_has_no_descendants():
    code = "from harness.probes.proc import descendants; print(descendants())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
