"""The rl-cycle suite: its cases (layouts, model variants, each with its twin) and the rank work."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.checks import CheckResult
from harness.errors import DoesNotApply
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate, violations
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.rl_cycle.params import GLOBAL_BATCH, LR, SUITE, RLCycleCaseParams, RLCycleParams
from harness.suite_defs.rl_cycle.payload import RLCycleRankData

VARIANTS: dict[str, dict[str, Any]] = {"4-layers": dict(num_layers=4), "expert-bias": dict(moe_expert_bias=True),
                                      "frozen-router": dict(moe_expert_bias=True)}


def variant(model: ModelSpec, what: str) -> ModelSpec:
    return dataclasses.replace(model, **VARIANTS[what]) if what else model


def matrix(model: ModelSpec, world_size: int) -> list[tuple[Layout, RLCycleCaseParams, dict[str, Any]]]:
    """The default cases before their twins: (layout, case parameters, case options). A dense model at pure DP with
    and without the distributed optimizer, TP 2, PP 2, PP 2 with two virtual stages each, and a weights-only load
    (bf16, the distributed optimizer: master copies to refresh); an MoE model with routing replayed at EP 2 (built
    twice, with the distributed optimizer), at EP 2 with PP 2, and with aux-loss-free balancing - its router training
    unreplayed, and frozen and replayed. What the world size or the model cannot lay out is left out."""
    w, half = world_size, world_size // 2
    distopt: dict[str, Any] = dict(use_distributed_optimizer=True)
    p = RLCycleCaseParams
    if not model.moe:
        out = [(Layout(dp=w), p(), {}), (Layout(dp=w), p(), distopt)]
        if w % 2 == 0:
            out += [(Layout(tp=2, dp=half), p(), {}), (Layout(pp=2, dp=half), p(), {}),
                    (Layout(pp=2, dp=half, vpp=2), p(variant="4-layers" if model.num_layers < 4 else ""), {})]
        out.append((Layout(dp=w), p(weights="loaded"), dict(distopt, dtype="bf16")))
    else:
        replay: dict[str, Any] = dict(routing_replay=True)
        ep = 2 if w % 2 == 0 and model.num_experts % 2 == 0 else 1
        out = [(Layout(dp=w, ep=ep), p(), replay), (Layout(dp=w, ep=ep), p(builds=2), dict(replay, **distopt))]
        if w % 2 == 0:
            out.append((Layout(pp=2, dp=half, ep=ep), p(), replay))
        out += [(Layout(dp=w, ep=ep), p(variant="expert-bias"), {}),
                (Layout(dp=w, ep=ep), p(variant="frozen-router"), dict(replay, freeze_router=True))]
    return [(lay, cp, o) for lay, cp, o in out if not violations(lay, variant(model, cp.variant), world_size,
                                                                 global_batch_size=GLOBAL_BATCH)]


class RLCycleSuite:
    name = SUITE
    default_model = "tiny"
    Params = RLCycleParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
               "megatron.core.pipeline_parallel")
    # the census after an offload counts the rank's live tensors: nothing of an earlier case's may be among them
    fresh_ranks_per_case = True

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: RLCycleParams | None = None) -> list[Case]:
        from harness.engines import resolve_factory
        from harness.engines.base import RunsRLCycles

        p = params or RLCycleParams()
        factory = resolve_factory(engine)
        if not (isinstance(factory, type) and issubclass(factory, RunsRLCycles)):
            raise DoesNotApply(f"engine {engine!r} has no record_routing / replay_routing / offload / reload "
                               "(harness.engines.base.RunsRLCycles): rl-cycle needs an RL framework's iteration; give "
                               "a subclass of McoreEngine whose framework parts are yours (docs/engines.md)")
        base = dataclasses.replace(options, global_batch_size=options.global_batch_size or GLOBAL_BATCH,
                                   lr=LR if options.lr == CaseOptions.lr else options.lr)
        if layouts is not None:
            replay: dict[str, Any] = dict(routing_replay=True) if model.moe else {}
            todo = [(validate(lay, model, world_size, global_batch_size=base.global_batch_size), RLCycleCaseParams(),
                     replay) for lay in layouts]
        else:
            todo = matrix(model, world_size)
        out = []
        for lay, cp, extra in todo:
            cp = dataclasses.replace(cp, iterations=p.iterations)
            opts = dataclasses.replace(base, **extra)
            for q in (cp, cp.twin()):
                out.append(Case(self.name, variant(model, q.variant), lay, engine, opts, backend, params=q))
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> RLCycleRankData:
        from harness.engines import make_engine
        from harness.engines.base import RunsRLCycles
        from harness.platform.parallel import layout_coords
        from harness.suite_defs.rl_cycle.cycle import residue_bound, run_cycle

        engine = make_engine(case, ctx)
        if not isinstance(engine, RunsRLCycles):  # the plan refuses such a factory; here for the type checker
            raise DoesNotApply(f"engine {case.engine} has no RL cycle (RunsRLCycles)")
        p = case.params if isinstance(case.params, RLCycleCaseParams) else RLCycleCaseParams()
        seed = case.options.seed
        with ctx.phase("build"):
            if p.weights == "as-loaded":
                engine.init_seed = seed + 1  # type: ignore[attr-defined]
            engine.setup_parallel()  # type: ignore[attr-defined]
            for _ in range(p.builds - 1):
                engine.build_chunks()  # type: ignore[attr-defined]  # a bridge's first build, a reference copy
            engine.build_model()
            instances = [engine.replay_instances()]  # type: ignore[attr-defined]
            if p.weights == "loaded":
                engine.load_weights(seed + 1)
        steps, iterations, probe = run_cycle(engine, case, p, ctx)
        instances.append(engine.replay_instances())  # type: ignore[attr-defined]
        with ctx.phase("collect"):
            shards = engine.param_shards()
        return RLCycleRankData(layout_coords(), steps, shards, iterations=iterations, instances=instances,
                               residue_bound=residue_bound(engine, case), probe=probe)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        from harness.suite_defs.rl_cycle.judge import table_figures

        return table_figures(result) if result.ok else {}

    def check(self, results: list[CaseResult], params: RLCycleParams | None = None) -> list[CheckResult]:
        from harness.suite_defs.rl_cycle.judge import judge

        return judge(results)

