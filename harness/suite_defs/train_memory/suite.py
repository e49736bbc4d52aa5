"""The train-memory suite: its cases and rank work; figures and judges in their own modules."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult
from harness.engine_names import EngineName
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import reference_layouts, validate
from harness.platform.parallel import layout_coords, teardown_parallel_state
from harness.probes.memory import MIB, captures_dir, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.train_memory import figures, judge
from harness.suite_defs.train_memory.params import MICRO_BATCH, STEPS, SUITE, UNMODELLED, TrainMemoryParams
from harness.suite_defs.train_memory.payload import TrainMemoryRankData


class TrainMemorySuite:
    name = SUITE
    default_model = "small"
    Params = TrainMemoryParams
    # Measured on ranks that ran nothing but this suite, as its baselines were recorded. (A rank's intermittent
    # +6 MiB at its second step, once put down to ranks step-perf had used, was a late-freed gloo buffer under the
    # CPU layer's float64 norm copy: docs/internals.md.)
    fresh_pool = True
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel", "memray")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: TrainMemoryParams | None = None) -> list[Case]:
        """Per layout (default: pure DP, TP 2, PP 2; an MoE model's with EP 2) with and without the distributed
        optimizer; then the recompute settings at the first layout."""
        p = params or TrainMemoryParams()
        # an MoE model's experts at EP 2 on them, where its expert grid admits any
        chosen = layouts or (model.moe and reference_layouts(model, world_size, ep=2)) \
            or reference_layouts(model, world_size)
        for lay in chosen:
            validate(lay, model, world_size)
        opts = dataclasses.replace(options, steps=STEPS, micro_batch_size=options.micro_batch_size or MICRO_BATCH)
        distopt = (True,) if options.use_distributed_optimizer else p.distributed_optimizer  # --distributed-optimizer
        if engine in UNMODELLED:  # megatron's optimizer and recompute options mean nothing there
            distopt = (options.use_distributed_optimizer,)
        out = [Case(self.name, model, lay, engine, dataclasses.replace(opts, use_distributed_optimizer=d), backend)
               for lay in chosen for d in distopt]
        out += [Case(self.name, model, chosen[0], engine,
                     dataclasses.replace(opts, use_distributed_optimizer=True, recompute=r), backend)
                for r in p.recompute if not options.recompute and engine not in UNMODELLED]
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> TrainMemoryRankData:

        with ctx.phase("prime"):  # a throwaway engine's build and step: one-time costs of the process land here
            engine = make_engine(case, ctx)
            engine.build()
            engine.train_step(0)
            del engine
            teardown_parallel_state()
        captures, device = captures_dir(case), not ctx.on_cpu
        engine = make_engine(case, ctx)
        with ctx.phase("build"), measure("build", captures, ctx.rank, device=device) as build:
            engine.build()
        steps = []
        for step in range(case.options.steps):
            with ctx.phase("steps"), measure(f"step{step}", captures, ctx.rank, device=device) as peak:
                engine.train_step(step)
            steps.append(peak)
        # the captures stay until the parent has judged: a failed check keeps its rank's and renders the phase's
        # flamegraph (what rank 0 held in an intermittent step-1 excess), the report stage deletes the rest
        return TrainMemoryRankData(build, steps, layout_coords())

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        per_rank = [figures.phase_figures(r, result.case.backend) for r in result.ranks]
        return {f"{name} MiB/rank": " ".join(f"{f[name] / MIB:.1f}" for f in per_rank) for name in per_rank[0]}

    key = staticmethod(figures.key)
    record_command = staticmethod(figures.record_command)
    samples = staticmethod(figures.samples)

    def check(self, results: list[CaseResult], params: TrainMemoryParams | None = None) -> list[CheckResult]:
        return judge.check(results, params or TrainMemoryParams())
