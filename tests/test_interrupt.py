"""An interrupted run keeps every result it measured: SIGTERM (CI's timeout or cancel) and Ctrl-C to the
parent leave results.json with the finished cases, marked interrupted, no rank process behind, and exit
143 / 130; `harness report` renders the partial file as a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _still_marked(mark: str, timeout_s: float = 15.0) -> list[int]:
    """The marked processes still alive once they had timeout_s to die (the chain parent -> fork server -> ranks
    ends asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _marked(mark)


def _marked(mark: str) -> list[int]:
    """Live processes that carry the test's environment marker (the parent and every rank it spawned)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("HARNESS_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _sigint_as_in_a_terminal() -> None:  # runs in the child between fork and exec
    # A shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: under `pytest ... &` the harness would never see the Ctrl-C this test sends.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(out: Path, mark: str) -> subprocess.Popen:
    env = {**os.environ, "HARNESS_TEST_MARK": mark, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--suite", "tests.plants.fake_suites:Sleepy",
                             "--world-size", "2", "--out", str(out)], cwd=ROOT, env=env, start_new_session=True,
                            preexec_fn=_sigint_as_in_a_terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finished(out: Path) -> int:
    try:
        return len(json.loads((out / "results.json").read_text())["cases"])
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("signum,code,name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_interrupted_run_keeps_finished_cases(tmp_path, signum, code, name):
    mark = uuid.uuid4().hex
    proc = _start(tmp_path, mark)
    deadline = time.monotonic() + 300
    while _finished(tmp_path) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    finished = _finished(tmp_path)
    assert finished >= 3, proc.communicate()[1][-2000:]
    os.kill(proc.pid, signum)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["interrupted"] == name and data["verdict"] == "interrupted" and data["cases_planned"] == 8
    assert finished <= len(data["cases"]) < 8  # every case finished before the signal is kept, judged
    assert {c["outcome"] for c in data["cases"]} == {"pass"}
    assert f"sleepy: INTERRUPTED ({name}) after {len(data['cases'])} of 8 cases" in out
    assert f"(exit {code})" in out
    assert not _still_marked(mark), "rank processes outlived the interrupted run"
    assert not list(tmp_path.glob(".results*"))  # no temporary file left by an interrupted write

    from harness import cli

    assert cli.main(["report", str(tmp_path)]) == 0
    assert f"**partial** (a failure): interrupted ({name}) after {len(data['cases'])} of 8 cases" \
        in (tmp_path / "report.md").read_text()
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite.findall("testcase")[-1].find("failure").get("type") == "partial"


@pytest.mark.slow
def test_results_are_written_as_the_run_goes(tmp_path):
    """Before the end, results.json holds the measured cases (not yet judged), each written atomically."""
    mark = uuid.uuid4().hex
    proc = _start(tmp_path, mark)
    try:
        deadline = time.monotonic() + 300
        while _finished(tmp_path) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        data = json.loads((tmp_path / "results.json").read_text())
        assert data["judged"] is False and {c["outcome"] for c in data["cases"]} == {"pending"}
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # a parent killed outright: the ranks die with it
        proc.communicate(timeout=300)
    assert not _still_marked(mark)
    assert _finished(tmp_path) >= 2  # what was written before the kill is still there, whole


def test_loops_over_runs_stop_when_a_run_was_interrupted(monkeypatch, tmp_path):
    """baselines record (repeats), compare (rounds), bisect-step: an interrupted run stops the loop."""
    import signal as sig

    from harness import recording
    from harness.suite_run import SuiteRun
    from harness.errors import Interrupted
    from harness.suite_defs.equivalence import EquivalenceSuite

    calls = []

    def interrupted_run(planned, **kwargs):
        calls.append(1)
        return SuiteRun(EquivalenceSuite(), "tiny", 2, "gloo", "mcore", interrupted=Interrupted(sig.SIGTERM))

    monkeypatch.setattr("harness.driver.execute", interrupted_run)
    with pytest.raises(Interrupted):
        recording.record_suite("ckpt-memory", "small", 4, baselines_dir=str(tmp_path))
    assert calls == [1] and not list(tmp_path.rglob("*"))  # no second repeat, nothing recorded
