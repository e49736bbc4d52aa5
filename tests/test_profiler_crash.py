"""A rank killed by memray's tracker as it stops runs its case once more, saying so; any other crash is the case's."""

from __future__ import annotations

from harness import driver
from harness.launch.profiler_crash import profiler_crash
from harness.launch.results import CaseResult, RankResult
from harness.outcomes import CaseStatus
from harness.planning import plan
from harness.probes import memory, retention


def _line(path: str, needle: str) -> int:
    return next(n for n, line in enumerate(open(path), 1) if needle in line)


TRACKER_LINE = _line(memory.__file__, "with tracker:")


def _crash(file: str, line: int, func: str, kind: str = "Segmentation fault") -> str:
    """A rank error as the runner writes it, around the log faulthandler left (as seen from refit's export on
    megatron-core 0.19.2, tiny-moe at tp1-pp2-cp1-dp2-ep2)."""
    return (f"rank 0 died (killed by SIGSEGV) in phase 'refit'; last lines of /tmp/harness-case-x/rank0.log:\n"
            f"[harness] rank 0 phase refit\nFatal Python error: {kind}\n\n"
            f"Current thread 0x00007f6ab2301b80 (most recent call first):\n"
            f'  File "{file}", line {line} in {func}\n'
            f'  File "/usr/lib/python3.12/contextlib.py", line 144 in __exit__\n'
            f'  File "/work/harness/suite_defs/refit/suite.py", line 176 in _exports\n\n'
            f"Extension modules: numpy._core._multiarray_umath, torch._C, memray._memray (total: 3)")


def _result(error: str) -> CaseResult:
    case = plan("refit", "tiny", 1).cases[0]
    if not error:
        return CaseResult(case, [RankResult(0)], CaseStatus.OK)
    return CaseResult(case, [RankResult(0, ok=False, phase="refit", error=error)], CaseStatus.ERROR, error)


def test_a_crash_in_the_trackers_stop_is_the_profilers():
    assert profiler_crash(_result(_crash(memory.__file__, TRACKER_LINE, "measure"))) == (
        f"rank 0 was killed by memray's tracker as it stopped (segmentation fault in measure, memory.py:"
        f"{TRACKER_LINE})")
    line = _line(retention.__file__, "with memray.Tracker(")
    assert "bus error in measure_retention" in profiler_crash(_result(_crash(retention.__file__, line,
                                                                             "measure_retention", "Bus error")))


def test_any_other_crash_is_the_cases():
    """A crash inside the measured phase (megatron's op, the engine), on another line of the probe, or with no
    traceback is not the profiler's."""
    assert profiler_crash(_result(_crash("/site-packages/torch/distributed/distributed_c10d.py", 4000,
                                         "all_gather"))) == ""
    assert profiler_crash(_result(_crash(memory.__file__, TRACKER_LINE + 3, "measure"))) == ""
    assert profiler_crash(_result("rank 0 died (killed by SIGSEGV) in phase 'refit'; last lines of x:\n")) == ""
    assert profiler_crash(_result("")) == ""


def test_the_case_runs_once_more_and_says_why(monkeypatch):
    planned = plan("refit", "tiny", 1)
    crashed, ok = _result(_crash(memory.__file__, TRACKER_LINE, "measure")), _result("")
    runs = iter([crashed, ok])
    monkeypatch.setattr(driver.LocalRanks, "_once", lambda self, case: next(runs))
    result = driver.LocalRanks(planned).run(planned.cases[0])
    assert result is ok and result.notes == [
        f"ran twice: the first time rank 0 was killed by memray's tracker as it stopped (segmentation fault in "
        f"measure, memory.py:{TRACKER_LINE}), a memray defect, not a verdict on the code"]


def test_a_second_crash_or_another_error_stays_the_cases_error(monkeypatch):
    planned = plan("refit", "tiny", 1)
    first, second = (_result(_crash(memory.__file__, TRACKER_LINE, "measure")) for _ in range(2))
    runs = iter([first, second])
    monkeypatch.setattr(driver.LocalRanks, "_once", lambda self, case: next(runs))
    assert driver.LocalRanks(planned).run(planned.cases[0]) is second  # twice: reported, never a third time
    other = _result(_crash("/site-packages/megatron/core/foo.py", 10, "bar"))
    runs = iter([other])
    assert driver.LocalRanks(planned).run(planned.cases[0]) is other


def test_a_crashed_ranks_error_keeps_the_fatal_report_whatever_its_threads(tmp_path):
    """The runner's error for a rank that died keeps faulthandler's report from its first line: a rank with many
    threads (gloo's, OpenMP's; 7 here, as in a refit case that crashed so on fsdp2) pushed the report's head and the
    crashing thread's frames out of the log's last 30 lines, so the crash was not recognised as the profiler's."""
    from harness.launch.runner import collect

    line = _line(retention.__file__, "with memray.Tracker(")
    others = "".join(f"Thread 0x00007f9d457fa6{k}c0 (most recent call first):\n  <no Python frame>\n\n"
                     for k in range(7))
    frames = "".join(f'  File "/work/harness/launch/zygote.py", line {300 + k} in body\n' for k in range(14))
    log = tmp_path / "rank0.log"
    log.write_text(f"[harness] rank 0 phase refit\nFatal Python error: Segmentation fault\n\n{others}"
                   f"Current thread 0x00007f9e67b83b80 (most recent call first):\n"
                   f'  File "{retention.__file__}", line {line} in measure_retention\n{frames}\n'
                   f"Extension modules: {', '.join(f'mod{k}' for k in range(84))} (total: 84)\n")
    case = plan("refit", "tiny", 1).cases[0]
    result = collect(case, tmp_path, [log], [-11], False, 1.0)
    assert "Thread 0x00007f9d457fa6" not in result.ranks[0].error
    assert profiler_crash(result) == (f"rank 0 was killed by memray's tracker as it stopped (segmentation fault in "
                                      f"measure_retention, retention.py:{line})")
