"""`step-perf`: how fast a training step is, per layout, and how much work it does.

Per case, on warm ranks: WARMUP_STEPS untimed steps; a calibration workload (a fixed GEMM and a fixed
all-reduce, timed right before the case's steps); TIMED_STEPS steps timed between barrier-aligned
boundaries with a phase breakdown (harness/probes/timers.py); then one more step, untimed, with the
counters installed: FLOPs (harness/probes/flops.py) and every collective (harness/probes/collectives.py).
The counters never run during a timed step.

Judged in the parent (judge.py) against baselines/<platform>/step-perf.json:
- counters, exactly: FLOPs per rank, collective calls and bytes per group role and kind per rank, and the
  DP gradient reductions issued during backward (overlap) - no noise, no tolerance;
- step time and exposed communication, statistically: the steady-state samples against the baseline's
  stored samples (ratio of medians, bootstrap CI, Mann-Whitney U; harness/checks/timing.py), failing
  only when a slowdown is significant and beyond the minimum effect, and beyond what other processes using
  the machine meanwhile explain (harness/probes/cpu_share.py).

The package: params.py (the matrix and StepPerfParams), rank.py (what a rank runs), figures.py (what is read
from the ranks' results), judge.py (the checks), suite.py (the Suite the registry names).
"""

from harness.suite_defs.step_perf.params import StepPerfParams

__all__ = ["StepPerfParams", "StepPerfSuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "StepPerfSuite":
        from harness.suite_defs.step_perf.suite import StepPerfSuite

        return StepPerfSuite
    raise AttributeError(name)
