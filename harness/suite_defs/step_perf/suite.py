"""The step-perf suite: its cases, and the figures and judges it hands the driver, baselines and reports."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict
from typing import Any

from harness import baselines
from harness import platform as harness_platform
from harness.backends import Backend, Tier, tier_of
from harness.checks import CheckResult
from harness.checks.flops_model import matmul_dtype, peak_tflops
from harness.checks.timing import MIN_EFFECT, Comparison, paired_ratio
from harness.engine_names import EngineName
from harness.engines import is_fsdp2
from harness.errors import DoesNotApply
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import expert_matrix, validate
from harness.platform import backend as platform_backend
from harness.probes.cpu_share import FOREIGN_LIMIT
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.step_perf import figures, judge, rank, sizing
from harness.suite_defs.step_perf.figures import FOREIGN, NOT_COUNTERS, TIMED
from harness.suite_defs.step_perf.params import (
    CPU_BUCKET_ELEMS,
    DEFAULT_LAYOUTS,
    OPTION_SETS,
    SUITE,
    TIMED_STEPS,
    UNJUDGED_TIMED_STEPS,
    StepPerfParams,
)
from harness.suite_defs.step_perf.payload import StepPerfRankData


class StepPerfSuite:
    name = SUITE
    default_model = "small"  # the CPU tier's model when none is given
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")
    Params = StepPerfParams
    digits = 3  # significant digits of a recorded figure
    # Timed on ranks that ran nothing but this suite: warm pool ranks that ran peft-ckpt before (megatron-
    # bridge, transformers and peft imported) stepped 1.10-1.25x slower locally and 1.2-1.6x in CI
    # (cpu-suite) than ranks that had not; on fresh ranks the same run measured 0.99-1.02x its baseline.
    fresh_pool = True
    # ... and timed with no other suite's ranks beside it (a suite next to it in another pytest-xdist worker)
    runs_alone = True

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: StepPerfParams | None = None) -> list[Case]:
        p = params or StepPerfParams()
        explicit = layouts is not None
        if layouts is None and model.moe:  # pure DP, then the experts' layouts (their dispatcher's traffic)
            layouts = [Layout(dp=world_size), *expert_matrix(model, world_size)]
        elif layouts is None:
            layouts = [Layout.parse(i) for i in DEFAULT_LAYOUTS if Layout.parse(i).world_size == world_size] \
                or [Layout(dp=world_size)]
        out = []
        option_sets = p.option_sets
        fsdp2 = is_fsdp2(engine)
        if fsdp2:  # megatron DDP's options (distributed optimizer, overlap, buckets) mean nothing to FSDP2
            if options.use_distributed_optimizer or options.overlap_grad_reduce or p.option_sets:
                raise DoesNotApply(f"--engine {engine} shards with torch's fully_shard, which has no distributed "
                                   "optimizer, grad-reduce overlap or buckets of megatron DDP's: drop "
                                   "--distributed-optimizer / --overlap-grad-reduce / the option sets")
            option_sets = ((False, False),)
        if option_sets is None and (options.use_distributed_optimizer or options.overlap_grad_reduce):
            # --distributed-optimizer / --overlap-grad-reduce given: that option set only
            option_sets = ((options.use_distributed_optimizer, options.overlap_grad_reduce),)
        for lay in layouts:
            validate(lay, model, world_size)
            pure_dp = (lay.tp, lay.pp, lay.cp, lay.ep) == (1, 1, 1, 1)
            for distopt, overlap in option_sets or OPTION_SETS:
                if not explicit and option_sets is None and not pure_dp and not (distopt and overlap):
                    continue
                bucket = options.bucket_size or (CPU_BUCKET_ELEMS if backend == Backend.GLOO and not fsdp2 else None)
                opts = dataclasses.replace(options, steps=p.timed_steps or TIMED_STEPS, warmup_steps=p.warmup_steps,
                                           use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
                                           bucket_size=bucket)
                out.append(Case(self.name, model, lay, engine, opts, backend, params=p))
        return out if p.timed_steps or p.full_timing else timed_for_a_judge(out, p)

    def rank_work(self, case: Case, ctx: RankContext) -> StepPerfRankData:
        return rank.rank_work(case, ctx)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        case = result.case
        times = figures.step_ms(result)
        med = statistics.median(times)
        tokens = case.global_batch_size * case.model.seq_length
        r0 = figures.phase_medians(result)[0]
        data = [figures.rank_data(r) for r in result.ranks]
        flops = [d.counters.flops for d in data]
        dp_bytes = sum(v["bytes"] for k, v in data[0].counters.collectives.items()
                       if k.startswith("dp-cp/") or k.startswith("dp/"))
        out = {"step ms": f"{med:.0f}", "tokens/s": f"{tokens / med * 1000:.0f}",
               "fwd/bwd/sync/opt ms (rank 0)": "/".join(f"{r0[p]:.0f}" for p in ("forward", "backward", "grad-sync",
                                                                                  "optimizer")),
               "GFLOP/rank": " ".join(f"{f / 1e9:.2f}" for f in flops),
               "dp MB (rank 0)": f"{dp_bytes / 1e6:.1f}"}
        plain = figures.plain_ms(result)
        if len(plain) >= 3:
            cost = paired_ratio(plain, times)
            out["harness overhead"] = f"{cost.ratio - 1:+.1%} [{cost.ci_low - 1:+.1%}, {cost.ci_high - 1:+.1%}]"
        device = data[0].device
        if device:
            used, source = figures.flops_used(result)
            tflops = max(used) / (med / 1000) / 1e12
            dtype = matmul_dtype(case.options.dtype, device.get("tf32", False))
            peak, why = peak_tflops(device["name"], dtype)
            out["TFLOP/s/GPU"] = f"{tflops:.1f}"
            out["MFU"] = f"{tflops / peak:.1%} of {dtype} {peak:g}" if peak else f"- ({why})"
            out["FLOPs"] = source
        return out

    # -- baselines ------------------------------------------------------------------------------
    key = staticmethod(figures.key)
    record_command = staticmethod(figures.record_command)
    TIMED = TIMED

    def samples(self, result: CaseResult) -> dict[str, float]:
        """Baselined figures: the counters, and the medians of the timed figures (their raw samples are
        stored beside them by raw_samples)."""
        load = figures.foreign_load(result)
        return {**figures.counters(result), "step_time_ms": statistics.median(figures.step_ms(result)),
                "exposed_comm_ms": statistics.median(figures.exposed_ms(result)),
                "calibration_ms": figures.calibration_ms(result),
                **({figures.FOREIGN: round(load.share, 3)} if load else {})}

    def recording_notes(self, entries: dict[str, dict], params: StepPerfParams | None, backend: Backend) -> list[str]:
        p = params or StepPerfParams()
        return sizing.recording_notes(entries, p.timed_steps or TIMED_STEPS, p.min_effect, backend)

    def raw_samples(self, result: CaseResult) -> dict[str, list[float]]:
        return {"step_time_ms": figures.step_ms(result), "exposed_comm_ms": figures.exposed_ms(result)}

    def tolerance(self, metric: str, values: list[float]) -> float:
        """Counters are exact (tolerance 0). Timed figures are judged by statistics on their samples, not
        by a band; their stored tolerance is the minimum effect, for people reading the file."""
        return MIN_EFFECT[Tier.CPU] * statistics.median(values) if metric in TIMED else 0.0

    def noisy_metrics(self, samples: dict[str, dict[str, list[float]]]) -> list[str]:
        """A counter that differs between repeats cannot be judged exactly: the work of a step is not
        deterministic (timed figures vary by nature and are judged by statistics); a step time measured
        while other processes used the machine is no baseline of the code."""
        varying = [f"{key} {metric}: a counter that differs between repeats ({', '.join(f'{v:g}' for v in values)})"
                   for key, metrics in sorted(samples.items()) for metric, values in sorted(metrics.items())
                   if metric not in NOT_COUNTERS and len(set(values)) > 1]
        busy = [f"{key}: other processes used {max(m[FOREIGN]):.0%} of the machine's CPUs while its steps were "
                f"timed (at most {FOREIGN_LIMIT:.0%}); stop them or record on a quiet machine"
                for key, m in sorted(samples.items()) if max(m.get(FOREIGN, [0.0])) > FOREIGN_LIMIT]
        return varying + busy

    # -- checks (judge.py) ------------------------------------------------------------------------
    def check(self, results: list[CaseResult], params: StepPerfParams | None = None) -> list[CheckResult]:
        return judge.check(results, params or StepPerfParams())

    def timed_comparison(self, res: CaseResult, metric: str, entry: dict, effect: float | None = None,
                         params: StepPerfParams | None = None) -> Comparison:
        """What `harness bisect` judges a timed figure by: the same comparison as `check`."""
        return judge.timed_comparison(res, metric, entry, effect, params or StepPerfParams())

    def load_explains(self, res: CaseResult, metric: str, entry: dict, cmp: Comparison) -> str:
        """Why other processes on the machine explain a slower timed figure ('' where they do not)."""
        return judge.load_explains(res, entry, cmp, cmp.slower, figures.foreign_load(res), metric)

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        """Per-step times and per-rank phase medians, for plots and pytest-benchmark."""
        return {"step_ms": figures.step_ms(result), "exposed_comm_ms": figures.exposed_ms(result),
                "plain_step_ms": figures.plain_ms(result), "calibration_ms": figures.calibration_ms(result),
                "phases_ms": {str(r): m for r, m in figures.phase_medians(result).items()},
                "counters": {str(r.rank): asdict(figures.rank_data(r).counters) for r in result.ranks}}


def timed_for_a_judge(cases: list[Case], params: StepPerfParams) -> list[Case]:
    """Each case with UNJUDGED_TIMED_STEPS timed steps where no baseline of this machine can judge its time (on CPU
    ranks: recorded on another machine or too long ago; judge.time_unjudged), else as planned. GPU cases keep theirs:
    this machine's fingerprint there needs torch, which the planning process does not import."""
    out = []
    books: dict[str, baselines.Book] = {}
    machine = None
    now = judge.now()
    for case in cases:
        if tier_of(case.backend) != Tier.CPU:
            out.append(case)
            continue
        platform = harness_platform.detect_platform(case.backend).key
        if platform not in books:  # each stack's baseline file read once per plan
            books[platform] = baselines.Book(params.baselines_dir, platform, SUITE)
        machine = machine or platform_backend.machine_fingerprint(case.backend)
        key = figures.key(case)
        provenance = books[platform].source(key).data.get("provenance", {}).get(key, {})
        if judge.time_unjudged(case, provenance, machine, now):
            case = dataclasses.replace(case, options=dataclasses.replace(case.options, steps=UNJUDGED_TIMED_STEPS))
        out.append(case)
    return out
