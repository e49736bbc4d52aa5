"""step-perf's parameters and the default matrix it times."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.errors import BadInput
from harness.option_flags import flag

SUITE = "step-perf"
# 3 warm-up steps take the first-step costs (allocator growth, lazy inits) out; 20 timed steps per case
# give the Mann-Whitney test and the bootstrap enough samples on 2 cores (measured: a 15% shift is
# detected at p < 0.01 with 20 vs 60 samples at the spread of `small` on 4 CPU ranks).
WARMUP_STEPS = 3
TIMED_STEPS = 20
# Timed where no baseline of this machine can judge the time (recorded on another machine, or on CPU ranks longer
# ago than CPU_TIME_BASELINE_HOURS: every CI run on a fresh VM): the counters come from one untimed step after
# them and the report's step figures need a median, so the other 17 steps would buy a verdict nobody gives.
UNJUDGED_TIMED_STEPS = 3
# The default matrix, trimmed for the CPU tier (a `small` step takes ~0.7 s on 4 ranks of 2 cores, and
# a case ~25 s): every option set on pure DP, and each model-parallel kind with the distributed
# optimizer and overlap on. `--layout` runs the given layouts with every option set.
DEFAULT_LAYOUTS = ("tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp2", "tp1-pp1-cp2-dp2")
OPTION_SETS = ((False, False), (False, True), (True, False), (True, True))  # (distributed optimizer, overlap)
# DDP gradient bucket on CPU ranks: megatron's default (max(40M, 1M x dp) elements) puts all of `small`'s
# 6M parameters in one bucket, whose reduction starts when backward ends - overlap_grad_reduce would have
# nothing to overlap. 1M elements gives `small` 6-7 buckets, as a real model has at 40M. GPU cases keep
# megatron's default.
CPU_BUCKET_ELEMS = 1_000_000
NORMALISE = False
# On CPU ranks a time baseline judges only for this long after it was recorded: a 2-core VM read x0.65-0.93 of
# its own 11-hour-old baseline (same boot, same code), and a snapshot of that VM, restored elsewhere as a CI
# machine (same boot id, so the same machine by its fingerprint), x0.64-0.66; reruns minutes apart read
# x0.92-1.17. GPU baselines stay valid: a GPU model's speed does not drift so.
CPU_TIME_BASELINE_HOURS = 2.0
_RUN_LEVEL = {"in_id": False}  # how the run times and judges, not what a case is: not part of case ids


@dataclass(frozen=True)
class StepPerfParams:
    """The step-perf suite's parameters: how many steps it times, its option sets, how it judges; every case
    carries them (`Case.params`), and `overhead` is part of its id."""

    warmup_steps: int = field(default=WARMUP_STEPS, metadata=_RUN_LEVEL)
    # None: TIMED_STEPS where a baseline of this machine judges the case's time (or with full_timing), else
    # UNJUDGED_TIMED_STEPS
    timed_steps: int | None = field(default=None, metadata=flag(
        "--timed-steps", f"step-perf: timed steps per case (default {TIMED_STEPS} where a baseline of this machine "
                         f"judges the time, else {UNJUDGED_TIMED_STEPS})", in_id=False))
    # (distopt, overlap); None: the default matrix's
    option_sets: tuple[tuple[bool, bool], ...] | None = field(default=None, metadata=_RUN_LEVEL)
    # None: MIN_EFFECT of the tier
    min_effect: float | None = field(default=None, metadata=flag(
        "--min-effect", "step-perf: smallest slowdown that fails, as a fraction (default against baselines 0.5 "
                        "on CPU, 0.05 on GPU; compare, interleaved: 0.05 / 0.03)", in_id=False))
    # judge times scaled by the calibration workload's (baseline / now)
    normalise: bool = field(default=NORMALISE, metadata=_RUN_LEVEL)
    baselines_dir: str | None = field(default=None, metadata=_RUN_LEVEL)  # None: the repository's baselines/
    # every step timed whatever this machine's baselines can judge: a recording, a bisect step, the nightly
    full_timing: bool = field(default=False, metadata=_RUN_LEVEL)
    # --overhead: each timed step paired with an uninstrumented step of the same engine (no seam wrapped, no
    # counter), in random order per pair; judged: the harness's own cost of a step (judge.py)
    overhead: bool = field(default=False, metadata=flag(
        "--overhead", "step-perf: pair every timed step with an uninstrumented one of the same engine and judge "
                      "the harness's own cost of a step (goal: within 2%%)"))

    def __post_init__(self):
        if self.timed_steps is not None and self.timed_steps < 3:
            raise BadInput(f"--timed-steps must be >= 3 (the statistics need samples), got {self.timed_steps}")
        if self.min_effect is not None and not 0 < self.min_effect < 10:
            raise BadInput(f"--min-effect is a fraction of the baseline median (e.g. 0.1 for 10%), "
                           f"got {self.min_effect}")
