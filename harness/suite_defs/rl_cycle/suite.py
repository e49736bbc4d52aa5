"""The rl-cycle suite: its cases (layouts, model variants, each with its twin) and the rank work."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult
from harness.engine_names import EngineName
from harness.engines import engine_class_with, is_fsdp2, make_engine
from harness.engines.base import PeftExporting, RunsRLCycles
from harness.engines.hf_policy import hf_model_modules
from harness.engines.rl_steps import check_rl_engine
from harness.errors import BadInput, DoesNotApply
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate, violations
from harness.platform.parallel import layout_coords
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.rl_cycle.cycle import export_refusal, residue_bound, run_cycle
from harness.suite_defs.rl_cycle.judge import judge, residue_data, table_figures
from harness.suite_defs.rl_cycle.params import (
    EXPERT_BIAS_VARIANTS,
    GLOBAL_BATCH,
    LORA_ALPHA,
    LORA_DIM,
    LR,
    SUITE,
    Kind,
    ModelVariant,
    RLCycleCaseParams,
    RLCycleParams,
    Weights,
)
from harness.suite_defs.rl_cycle.payload import RLCycleRankData

VARIANTS: dict[ModelVariant, dict[str, Any]] = {
    ModelVariant.FOUR_LAYERS: dict(num_layers=4), **{v: dict(moe_expert_bias=True) for v in EXPERT_BIAS_VARIANTS}}


def variant(model: ModelSpec, what: ModelVariant) -> ModelSpec:
    return dataclasses.replace(model, **VARIANTS[what]) if what else model


def kind(model: ModelSpec, what: Kind) -> tuple[RLCycleCaseParams, dict[str, Any]]:
    """A case of one kind before its twin: its parameters and options (--rl-variant; `Kind`)."""
    replay: dict[str, Any] = dict(routing_replay=True) if model.moe else {}
    p = RLCycleCaseParams
    if what == Kind.BUILT_TWICE:
        return p(builds=2), dict(replay, use_distributed_optimizer=True)
    if what == Kind.FOUR_LAYERS:
        return p(variant=ModelVariant.FOUR_LAYERS if model.num_layers < 4 else ModelVariant.AS_IS), replay
    # the expert bias is judged without offload (no twin): the bias is a buffer, what an offload moves is judged
    # by the other kinds
    if what == Kind.EXPERT_BIAS:
        return p(variant=ModelVariant.EXPERT_BIAS, offload=False), {}
    if what == Kind.REPLAYED_BIAS:
        return p(variant=ModelVariant.REPLAYED_BIAS, offload=False), dict(routing_replay=True)
    if what == Kind.FROZEN_ROUTER:
        return p(variant=ModelVariant.FROZEN_ROUTER, offload=False), dict(routing_replay=True, freeze_router=True)
    if what == Kind.LORA:  # in bf16, as frameworks refit: the merge cast once to the base weights' grid
        return p(), dict(replay, lora_dim=LORA_DIM, lora_alpha=LORA_ALPHA, dtype="bf16")
    if what == Kind.EXPORT_FIRST:
        return p(export_first=True), replay
    if what == Kind.WEIGHTS_ONLY_LOAD:
        return p(weights=Weights.LOADED), dict(replay, use_distributed_optimizer=True, dtype="bf16")
    return p(), replay


def matrix(model: ModelSpec, world_size: int, lora: bool = False) -> list[tuple[Layout, Kind]]:
    """The default cases before their twins: (layout, kind). A dense model at pure DP with and without the
    distributed optimizer, TP 2, PP 2, PP 2 with two virtual stages each, and a weights-only load (bf16 with the
    distributed optimizer: master copies to refresh), and with an engine that has LoRA adapters LoRA in the loop at
    pure DP and TP 2 (bf16); an MoE model with routing replayed at EP 2 (also built twice,
    with the distributed optimizer), at EP 2 with PP 2, and with aux-loss-free balancing - its router training
    unreplayed, and frozen and replayed. What the world size or the model cannot lay out is left out."""
    w, half = world_size, world_size // 2
    if not model.moe:
        out = [(Layout(dp=w), Kind.AS_IS), (Layout(dp=w), Kind.DISTOPT)]
        if w % 2 == 0:
            out += [(Layout(tp=2, dp=half), Kind.AS_IS), (Layout(pp=2, dp=half), Kind.AS_IS),
                    (Layout(pp=2, dp=half, vpp=2), Kind.FOUR_LAYERS)]
        out.append((Layout(dp=w), Kind.WEIGHTS_ONLY_LOAD))
        if lora:  # an engine with LoRA adapters (megatron-bridge): LoRA in the loop at pure DP and TP 2
            out += [(Layout(dp=w), Kind.LORA)] + ([(Layout(tp=2, dp=half), Kind.LORA)] if w % 2 == 0 else [])
    else:
        ep = 2 if w % 2 == 0 and model.num_experts % 2 == 0 else 1
        out = [(Layout(dp=w, ep=ep), Kind.AS_IS), (Layout(dp=w, ep=ep), Kind.BUILT_TWICE)]
        if w % 2 == 0:
            out += [(Layout(pp=2, dp=half, ep=ep), Kind.AS_IS), (Layout(pp=2, dp=half, ep=ep, vpp=2), Kind.FOUR_LAYERS)]
        out += [(Layout(dp=w, ep=ep), Kind.EXPERT_BIAS), (Layout(dp=w, ep=ep), Kind.REPLAYED_BIAS),
                (Layout(dp=w, ep=ep), Kind.FROZEN_ROUTER)]
    return [(lay, what) for lay, what in out
            if not violations(lay, variant(model, kind(model, what)[0].variant), world_size,
                              global_batch_size=GLOBAL_BATCH)]


class RLCycleSuite:
    name = SUITE
    default_model = "tiny"
    Params = RLCycleParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
               "megatron.core.pipeline_parallel", *hf_model_modules())  # rank 0's rollout policy
    # the census after an offload counts the rank's live tensors: nothing of an earlier case's may be among them
    fresh_ranks_per_case = True

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: RLCycleParams | None = None) -> list[Case]:
        p = params or RLCycleParams()
        factory = engine_class_with(
            engine, RunsRLCycles, "has no record_routing / replay_routing / offload / reload (harness.engines.base."
            "RunsRLCycles): rl-cycle needs an RL framework's iteration; give a subclass of McoreEngine whose "
            "framework parts are yours (docs/engines.md)")
        check_rl_engine(engine, factory, p.temperature)
        if is_fsdp2(engine):
            raise DoesNotApply(f"--engine {engine} has no RL cycle here: rl-cycle builds megatron's model chunks "
                               "(setup_parallel, build_model) and offloads megatron DDP's parameter and gradient "
                               "buffers, while fsdp2 builds torch's fully_shard over DP; run rl-cycle with --engine "
                               "mcore (batch-split and refit take fsdp2)")
        base = dataclasses.replace(options, global_batch_size=options.global_batch_size or GLOBAL_BATCH,
                                   lr=LR if options.lr == CaseOptions.lr else options.lr)
        if options.recompute:
            raise BadInput(f"rl-cycle replays each router's recorded routing once per micro-batch forward: "
                           f"--recompute {options.recompute} runs the routers again in backward; drop it")
        adapters = isinstance(factory, type) and issubclass(factory, PeftExporting)
        if p.rl_variant == Kind.LORA and not adapters:
            raise BadInput(f"--rl-variant lora trains LoRA adapters and refits them: --engine {engine} has none "
                           "(harness.engines.base.PeftExporting); give --engine megatron-bridge")
        if p.rl_variant == Kind.LORA and model.moe:
            raise BadInput(f"--rl-variant lora is judged on a dense model here: the merged refit of LoRA on experts "
                           f"is not mapped yet; give --model tiny, not {model.name}")
        if p.rl_variant in (Kind.EXPERT_BIAS, Kind.REPLAYED_BIAS, Kind.FROZEN_ROUTER) and not model.moe:
            raise BadInput(f"--rl-variant {p.rl_variant} needs an MoE model (its routers' expert bias): give --model "
                           "tiny-moe")
        if layouts is not None:
            todo = [(validate(lay, variant(model, kind(model, p.rl_variant)[0].variant), world_size,
                              global_batch_size=base.global_batch_size), p.rl_variant) for lay in layouts]
        elif p.rl_variant:
            raise BadInput(f"--rl-variant {p.rl_variant} runs that kind of case at the layouts given: add --layout "
                           "(e.g. tp1-pp1-cp1-dp4), or drop it for the matrix's")
        else:
            todo = matrix(model, world_size, lora=adapters)
        out = []
        for lay, what in todo:
            cp, extra = kind(model, Kind.AS_IS if what == Kind.DISTOPT else what)
            if what == Kind.DISTOPT:
                extra = dict(extra, use_distributed_optimizer=True)
            cp = dataclasses.replace(cp, iterations=p.iterations, temperature=p.temperature)
            opts = dataclasses.replace(base, **extra)
            for q in (cp, cp.twin()) if cp.offload else (cp,):
                out.append(Case(self.name, variant(model, q.variant), lay, engine, opts, backend, params=q))
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> RLCycleRankData:
        engine = make_engine(case, ctx)
        if not isinstance(engine, RunsRLCycles):  # the plan refuses such a factory; here for the type checker
            raise DoesNotApply(f"engine {case.engine} has no RL cycle (RunsRLCycles)")
        p = case.params if isinstance(case.params, RLCycleCaseParams) else RLCycleCaseParams()
        seed = case.options.seed
        with ctx.phase("build"):
            if p.weights == Weights.AS_LOADED:
                engine.init_seed = seed + 1  # type: ignore[attr-defined]
            engine.setup_parallel()  # type: ignore[attr-defined]
            for _ in range(p.builds - 1):
                engine.build_chunks()  # type: ignore[attr-defined]  # a bridge's first build, a reference copy
            engine.build_model()
            instances = [engine.replay_instances()]  # type: ignore[attr-defined]
            if p.weights == Weights.LOADED:
                engine.load_weights(seed + 1)
        refused = export_refusal(engine, case)
        steps, iterations, probe = run_cycle(engine, case, p, ctx, refused)
        instances.append(engine.replay_instances())  # type: ignore[attr-defined]
        with ctx.phase("collect"):
            shards = engine.param_shards()
        return RLCycleRankData(layout_coords(), steps, shards, iterations=iterations, instances=instances,
                               residue_bound=residue_bound(engine, case), probe=probe,
                               bias_marked_frozen=engine.bias_marked_frozen(),  # type: ignore[attr-defined]
                               export_refused=refused)

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        return residue_data(result)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        return table_figures(result) if result.ok else {}

    def check(self, results: list[CaseResult], params: RLCycleParams | None = None) -> list[CheckResult]:
        return judge(results)

