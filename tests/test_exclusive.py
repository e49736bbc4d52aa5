"""Tests marked `exclusive` run alone under pytest-xdist (tests/conftest.py), and the others still run side by
side: a generated session of sleeping tests on two workers, each test logging when it ran."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist (the `test` extra) runs `nox -s tests` on two workers")

TESTS = '''
import json, os, time
import pytest

def _ran(name, exclusive, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(json.dumps([name, exclusive, start, time.monotonic()]) + "\\n")

{tests}
'''


def _module(names: list[tuple[str, bool]]) -> str:
    return TESTS.format(tests="\n".join(
        (("@pytest.mark.exclusive\n" if exclusive else "") + f"def test_{name}():\n    _ran({name!r}, {exclusive}, 0.4)\n")
        for name, exclusive in names))


def test_an_exclusive_test_runs_while_no_other_test_runs(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_a.py").write_text(_module([(f"a{i}", False) for i in range(5)]))
    (tmp_path / "test_b.py").write_text(_module([("b0", False), ("b1", True), ("b2", False), ("b3", True),
                                                 ("b4", False)]))
    log = tmp_path / "ran.jsonl"
    quiet = [f"no:{p}" for p in ("cacheprovider", "hypothesispytest", "hydra_pytest", "benchmark")]  # start-up
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *(a for p in quiet for a in ("-p", p)), "-n", "2",
                           "--dist", "loadscope", "-o", "markers=exclusive: alone", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "RAN_LOG": str(log), "HARNESS_TEST_QUIET_MAX_S": "0"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(ran) == 10

    def overlap(x, y):
        return x[2] < y[3] and y[2] < x[3]

    alone = [r for r in ran if r[1]]
    beside = [(x[0], y[0]) for x in alone for y in ran if y is not x and overlap(x, y)]
    assert not beside, f"exclusive tests ran beside others: {beside}"
    # without this the lock could pass by running everything one at a time
    assert any(overlap(x, y) for x in ran for y in ran if x[0] < y[0] and not x[1] and not y[1]), ran
    # a module's exclusive tests run first and back to back: the other worker waits for its test once, not
    # before each of them
    b1, b3 = (next(r for r in ran if r[0] == name) for name in ("b1", "b3"))
    between = [r[0] for r in ran if r[0] not in ("b1", "b3") and b1[2] < r[3] and r[2] < b3[3]]
    assert not between, f"tests ran between two exclusive ones of a module: {between}"


@pytest.mark.exclusive
def test_an_exclusive_test_waits_until_the_machine_is_quiet():
    """A process still busy when the lock is taken (the other worker's ranks finishing a case, a fork server
    importing) is waited for: the test would otherwise time steps beside it."""
    from tests.conftest import wait_for_quiet

    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 2\n"
                                                   "while time.monotonic() < end: pass"])
    try:
        waited, cores = wait_for_quiet(max_s=20)
        assert busy.poll() is not None, f"quiet after {waited:.1f} s ({cores:.2f} cores) beside a busy process"
    finally:
        busy.kill()
        busy.wait()
