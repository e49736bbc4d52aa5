"""`step-perf`: how fast a training step is, per layout, and how much work it does.

Per case, on warm ranks: WARMUP_STEPS untimed steps; a calibration workload (a fixed GEMM and a fixed
all-reduce, timed right before the case's steps); TIMED_STEPS steps timed between barrier-aligned
boundaries with a phase breakdown (harness/probes/timers.py); then one more step, untimed, with the
counters installed: FLOPs (harness/probes/flops.py) and every collective (harness/probes/collectives.py).
The counters never run during a timed step.

Judged in the parent (harness/checks/step_perf.py) against baselines/<platform>/step-perf.json:
- counters, exactly: FLOPs per rank, collective calls and bytes per group role and kind per rank, and the
  DP gradient reductions issued during backward (overlap) - no noise, no tolerance;
- step time and exposed communication, statistically: the steady-state samples against the baseline's
  stored samples (ratio of medians, bootstrap CI, Mann-Whitney U; harness/checks/timing.py), failing
  only when a slowdown is significant and beyond the minimum effect.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from harness.checks import CheckResult
from harness.checks import step_perf as judges
from harness.checks.timing import MIN_EFFECT, TIMED_METRICS, Comparison
from harness.engines import make_engine
from harness.errors import BadInput
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.spec import Case, CaseOptions, Layout, ModelSpec

# 3 warm-up steps take the first-step costs (allocator growth, lazy inits) out; 20 timed steps per case
# give the Mann-Whitney test and the bootstrap enough samples on 2 cores (measured: a 15% shift is
# detected at p < 0.01 with 20 vs 60 samples at the spread of `small` on 4 CPU ranks).
WARMUP_STEPS = 3
TIMED_STEPS = 20
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


def count_work(engine, step: int) -> dict[str, Any]:
    """One untimed step with the counters installed: FLOPs, collectives by role/kind, overlap."""
    from harness.checks.grad_sync import dp_records
    from harness.probes.collectives import CollectiveRecorder, GroupRoles
    from harness.probes.flops import FlopCounter
    from harness.suites.grad_sync import instrument

    recorder = CollectiveRecorder(GroupRoles())
    with instrument(engine, recorder), recorder, FlopCounter() as flops, recorder.phase("forward-backward"):
        engine.train_step(step)
    collectives: dict[str, dict[str, int]] = {}
    for c in recorder.by_source("dispatch"):
        entry = collectives.setdefault(f"{c.role}/{c.kind}", {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += c.bytes
    in_backward = sum(1 for c in dp_records(recorder.by_source("dispatch"))
                      if c.kind in ("all_reduce", "reduce_scatter") and c.phase == "backward")
    return {"flops": flops.total, "collectives": collectives, "dp_reductions_in_backward": in_backward}


def flops_used(result: CaseResult) -> tuple[list[int], str]:
    """Per rank the FLOPs of one step that TFLOP/s and MFU divide by, and where they come from: the counter's
    when it saw every matmul the config implies (megatron's local spec), else the analytic count
    (harness/checks/flops_model.py) - Transformer Engine's GEMMs and fused attention are invisible to it."""
    from harness.checks.flops_model import step_flops

    case = result.case
    counted = [r.data["counters"]["flops"] for r in result.ranks]
    analytic = [step_flops(case.model, case.layout, r.rank, global_batch_size=case.global_batch_size,
                           micro_batch_size=case.micro_batch_size, recompute=case.options.recompute)
                for r in result.ranks]
    if counted == analytic:
        return counted, "counted"
    seen = sum(counted) / sum(analytic) if sum(analytic) else 0.0
    return analytic, f"analytic (the counter saw {seen:.0%}: kernels it cannot see)"


_RUN_LEVEL = {"in_id": False}  # how the run times and judges, not what a case is: not part of case ids


@dataclass(frozen=True)
class StepPerfParams:
    """The step-perf suite's parameters: how many steps it times, its option sets, how it judges; every case
    carries them (`Case.params`), and `overhead` is part of its id."""

    warmup_steps: int = field(default=WARMUP_STEPS, metadata=_RUN_LEVEL)
    timed_steps: int = field(default=TIMED_STEPS, metadata=_RUN_LEVEL)  # --timed-steps
    # (distopt, overlap); None: the default matrix's
    option_sets: tuple[tuple[bool, bool], ...] | None = field(default=None, metadata=_RUN_LEVEL)
    min_effect: float | None = field(default=None, metadata=_RUN_LEVEL)  # --min-effect; None: MIN_EFFECT of the tier
    # judge times scaled by the calibration workload's (baseline / now)
    normalise: bool = field(default=NORMALISE, metadata=_RUN_LEVEL)
    baselines_dir: str | None = field(default=None, metadata=_RUN_LEVEL)  # None: the repository's baselines/
    # --overhead: each timed step paired with an uninstrumented step of the same engine (no seam wrapped, no
    # counter), in random order per pair; judged: the harness's own cost of a step (checks/step_perf.py)
    overhead: bool = False

    def __post_init__(self):
        if self.timed_steps < 3:
            raise BadInput(f"--timed-steps must be >= 3 (the statistics need samples), got {self.timed_steps}")
        if self.min_effect is not None and not 0 < self.min_effect < 10:
            raise BadInput(f"--min-effect is a fraction of the baseline median (e.g. 0.1 for 10%), "
                           f"got {self.min_effect}")


class StepPerfSuite:
    name = "step-perf"
    default_model = "small"  # the CPU tier's model when none is given
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")
    Params = StepPerfParams
    digits = 3  # significant digits of a recorded figure
    # Timed on ranks that ran nothing but this suite: warm pool ranks that ran peft-ckpt before (megatron-
    # bridge, transformers and peft imported) stepped 1.10-1.25x slower locally and 1.2-1.6x in CI
    # (cpu-suite) than ranks that had not; on fresh ranks the same run measured 0.99-1.02x its baseline.
    fresh_pool = True

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: StepPerfParams | None = None) -> list[Case]:
        import dataclasses

        p = params or StepPerfParams()
        explicit = layouts is not None
        if layouts is None:
            layouts = [Layout.parse(i) for i in DEFAULT_LAYOUTS if Layout.parse(i).world_size == world_size] \
                or [Layout(dp=world_size)]
        out = []
        option_sets = p.option_sets
        if option_sets is None and (options.use_distributed_optimizer or options.overlap_grad_reduce):
            # --distributed-optimizer / --overlap-grad-reduce given: that option set only
            option_sets = ((options.use_distributed_optimizer, options.overlap_grad_reduce),)
        for lay in layouts:
            validate(lay, model, world_size)
            pure_dp = (lay.tp, lay.pp, lay.cp) == (1, 1, 1)
            for distopt, overlap in option_sets or OPTION_SETS:
                if not explicit and option_sets is None and not pure_dp and not (distopt and overlap):
                    continue
                bucket = options.bucket_size or (CPU_BUCKET_ELEMS if backend == "gloo" else None)
                opts = dataclasses.replace(options, steps=p.timed_steps, warmup_steps=p.warmup_steps,
                                           use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
                                           bucket_size=bucket)
                out.append(Case(self.name, model, lay, engine, opts, backend, params=p))
        return out

    # -- in the ranks ---------------------------------------------------------------------------
    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        import functools
        import random

        import torch.distributed as dist

        from harness.probes.timers import PhaseTimer, calibrate
        from harness.suites import layout_coords

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        warmup, timed = case.options.warmup_steps, case.options.steps
        with ctx.phase("steps"):
            for step in range(warmup):
                engine.train_step(step)
        with ctx.phase("calibrate"):
            calibration = calibrate(ctx)
        timer = PhaseTimer(engine, ctx.on_cpu)
        steps, plain = [], []
        overhead = isinstance(case.params, StepPerfParams) and case.params.overhead
        order = random.Random(case.options.seed)  # the same draws on every rank: their barriers pair up
        step = warmup
        with ctx.phase("steps"):
            for _ in range(timed):
                kinds = ["timed", "plain"] if overhead else ["timed"]
                order.shuffle(kinds)
                for kind in kinds:
                    run = functools.partial(engine.train_step, step)
                    if kind == "plain":
                        plain.append(timer.plain_step(run, dist.barrier))
                    else:
                        with timer.installed():
                            timing, _ = timer.step(run, dist.barrier)
                        steps.append(timing)
                    step += 1
        with ctx.phase("counters"):
            counters = count_work(engine, step)
        device = {}
        if not ctx.on_cpu:
            import torch

            device = {"name": torch.cuda.get_device_name(), "max_allocated": torch.cuda.max_memory_allocated(),
                      "tf32": torch.backends.cuda.matmul.allow_tf32}  # fp32 matmuls on tensor cores
        return {"coords": layout_coords(), "steps": steps, "plain_s": plain, "calibration": calibration,
                "counters": counters, "device": device}

    # -- figures ----------------------------------------------------------------------------------
    @staticmethod
    def step_ms(result: CaseResult) -> list[float]:
        """Per timed step: the slowest rank's barrier-to-barrier time, ms."""
        per_rank = [[s.wall_s for s in r.data["steps"]] for r in result.ranks]
        return [1000 * max(col) for col in zip(*per_rank)]

    @staticmethod
    def plain_ms(result: CaseResult) -> list[float]:
        """Per uninstrumented step (--overhead; paired with the timed step of the same index): the slowest
        rank's barrier-to-barrier time, ms; [] without --overhead."""
        per_rank = [r.data.get("plain_s") or [] for r in result.ranks]
        return [1000 * max(col) for col in zip(*per_rank)]

    @staticmethod
    def exposed_ms(result: CaseResult) -> list[float]:
        """Per timed step: the largest exposed DP communication (grad-sync + param-gather) over ranks, ms."""
        per_rank = [[s.exposed_comm_s for s in r.data["steps"]] for r in result.ranks]
        return [1000 * max(col) for col in zip(*per_rank)]

    @staticmethod
    def calibration_ms(result: CaseResult) -> float:
        return 1000 * statistics.median(x for r in result.ranks for x in r.data["calibration"])

    @staticmethod
    def phase_medians(result: CaseResult) -> dict[int, dict[str, float]]:
        """rank -> phase -> median ms over the timed steps (plus 'compute': busy time minus exposed comm)."""
        out = {}
        for r in result.ranks:
            steps = r.data["steps"]
            med = {p: 1000 * statistics.median(s.phases.get(p, 0.0) for s in steps) for p in steps[0].phases}
            med["compute"] = 1000 * statistics.median(s.busy_s - s.exposed_comm_s for s in steps)
            out[r.rank] = med
        return out

    @staticmethod
    def slowest_rank(result: CaseResult) -> tuple[int, float, float]:
        """(rank, its compute ms, the median compute ms of the others): who the others wait for."""
        med = StepPerfSuite.phase_medians(result)
        rank = max(med, key=lambda r: med[r]["compute"])
        others = [m["compute"] for r, m in med.items() if r != rank] or [med[rank]["compute"]]
        return rank, med[rank]["compute"], statistics.median(others)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        case = result.case
        times = self.step_ms(result)
        med = statistics.median(times)
        tokens = case.global_batch_size * case.model.seq_length
        r0 = self.phase_medians(result)[0]
        flops = [r.data["counters"]["flops"] for r in result.ranks]
        dp_bytes = sum(v["bytes"] for k, v in result.ranks[0].data["counters"]["collectives"].items()
                       if k.startswith("dp-cp/") or k.startswith("dp/"))
        out = {"step ms": f"{med:.0f}", "tokens/s": f"{tokens / med * 1000:.0f}",
               "fwd/bwd/sync/opt ms (rank 0)": "/".join(f"{r0[p]:.0f}" for p in ("forward", "backward", "grad-sync",
                                                                                  "optimizer")),
               "GFLOP/rank": " ".join(f"{f / 1e9:.2f}" for f in flops),
               "dp MB (rank 0)": f"{dp_bytes / 1e6:.1f}"}
        plain = self.plain_ms(result)
        if len(plain) >= 3:
            from harness.checks.timing import paired_ratio

            cost = paired_ratio(plain, times)
            out["harness overhead"] = f"{cost.ratio - 1:+.1%} [{cost.ci_low - 1:+.1%}, {cost.ci_high - 1:+.1%}]"
        device = result.ranks[0].data.get("device") or {}
        if device:
            from harness.checks.flops_model import matmul_dtype, peak_tflops

            used, source = flops_used(result)
            tflops = max(used) / (med / 1000) / 1e12
            dtype = matmul_dtype(case.options.dtype, device.get("tf32", False))
            peak, why = peak_tflops(device["name"], dtype)
            out["TFLOP/s/GPU"] = f"{tflops:.1f}"
            out["MFU"] = f"{tflops / peak:.1%} of {dtype} {peak:g}" if peak else f"- ({why})"
            out["FLOPs"] = source
        return out

    # -- baselines ------------------------------------------------------------------------------
    @staticmethod
    def key(case: Case) -> str:
        o = case.options
        return (f"{case.model.name}/{case.layout.id}/distopt={int(o.use_distributed_optimizer)}"
                f",overlap={int(o.overlap_grad_reduce)}")

    @staticmethod
    def record_command(case: Case) -> str:
        from harness import baselines

        return (baselines.record_command(case.suite, case.model.name, case.layout.world_size, case.backend)
                + f" --layout {case.layout.id}" + (f" --engine {case.engine}" if case.engine != "mcore" else ""))

    @staticmethod
    def counters(result: CaseResult) -> dict[str, float]:
        """The exact counters of a case as flat metrics."""
        out: dict[str, float] = {}
        for r in result.ranks:
            c = r.data["counters"]
            out[f"rank{r.rank}.flops"] = float(c["flops"])
            out[f"rank{r.rank}.dp_reductions_in_backward"] = float(c["dp_reductions_in_backward"])
            for what, v in c["collectives"].items():
                out[f"rank{r.rank}.{what}.calls"] = float(v["calls"])
                out[f"rank{r.rank}.{what}.bytes"] = float(v["bytes"])
        return out

    def samples(self, result: CaseResult) -> dict[str, float]:
        """Baselined figures: the counters, and the medians of the timed figures (their raw samples are
        stored beside them by raw_samples)."""
        return {**self.counters(result), "step_time_ms": statistics.median(self.step_ms(result)),
                "exposed_comm_ms": statistics.median(self.exposed_ms(result)),
                "calibration_ms": self.calibration_ms(result)}

    def raw_samples(self, result: CaseResult) -> dict[str, list[float]]:
        return {"step_time_ms": self.step_ms(result), "exposed_comm_ms": self.exposed_ms(result)}

    TIMED = (*TIMED_METRICS, "calibration_ms")

    def tolerance(self, metric: str, values: list[float]) -> float:
        """Counters are exact (tolerance 0). Timed figures are judged by statistics on their samples, not
        by a band; their stored tolerance is the minimum effect, for people reading the file."""
        return MIN_EFFECT["cpu"] * statistics.median(values) if metric in self.TIMED else 0.0

    def noisy_metrics(self, samples: dict[str, dict[str, list[float]]]) -> list[str]:
        """A counter that differs between repeats cannot be judged exactly: the work of a step is not
        deterministic (timed figures vary by nature and are judged by statistics)."""
        return [f"{key} {metric}: a counter that differs between repeats ({', '.join(f'{v:g}' for v in values)})"
                for key, metrics in sorted(samples.items()) for metric, values in sorted(metrics.items())
                if metric not in self.TIMED and len(set(values)) > 1]

    # -- checks (harness/checks/step_perf.py) ------------------------------------------------------
    def check(self, results: list[CaseResult], params: StepPerfParams | None = None) -> list[CheckResult]:
        return judges.check(self, results, params or StepPerfParams())

    def timed_comparison(self, res: CaseResult, metric: str, entry: dict, effect: float | None = None,
                         params: StepPerfParams | None = None) -> Comparison:
        """What `harness bisect` judges a timed figure by: the same comparison as `check`."""
        return judges.timed_comparison(self, res, metric, entry, effect, params or StepPerfParams())

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        """Per-step times and per-rank phase medians, for plots and pytest-benchmark."""
        return {"step_ms": StepPerfSuite.step_ms(result), "exposed_comm_ms": StepPerfSuite.exposed_ms(result),
                "plain_step_ms": StepPerfSuite.plain_ms(result),
                "calibration_ms": StepPerfSuite.calibration_ms(result),
                "phases_ms": {str(r): m for r, m in StepPerfSuite.phase_medians(result).items()},
                "counters": {str(r.rank): r.data["counters"] for r in result.ranks}}
