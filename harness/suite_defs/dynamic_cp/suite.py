"""`dynamic-cp`: dynamic (hybrid) CP == static CP == no CP on the same global batch (regression R3).

Per sequence-length mix, four cases: no CP (the reference: every sample whole, DP only), static CP
over THD packs at cp2 and cp4, and megatron's hybrid CP on the pure-DP layout. Judged against the
reference, from tensors: per-token log-probs of every sample (merged by the engine, in the original
order, every sample exactly once), which rank computed each token and at which local CP size, the
per-token loss, and the full gradient of every parameter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult
from harness.engine_names import EngineName
from harness.engines import engine_class_with
from harness.engines.cp_modes import CPCaseParams, CPEngine, CPMode, TokenOutputs
from harness.errors import BadInput
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.dynamic_cp.judge import DynamicCPRankData, judge, loss_per_token
from harness.upstream import check_dynamic_cp_available

# Samples are at most 120 tokens (128 after padding); megatron's max_seqlen_per_dp_cp_rank is
# 128 / world size, so at world size 4 samples up to 32 tokens run without CP, up to 64 at local
# CP 2 and up to 128 at local CP 4.
MAX_SEQLEN = 120


def max_seqlen_per_rank(world_size: int) -> int:
    return 128 // world_size

# Named regression mixes (lengths of the global batch's samples)
NAMED_MIXES = {
    "cp-1-2-4": (120, 60, 30, 24, 17, 9, 50, 12),
    "fewer-samples-than-dp": (100, 20),
    "one-long-among-short": (118, 5, 7, 9, 11, 6, 13),
    "all-short": (9, 14, 20, 31, 7, 16, 25, 11),
}


def length_ranges(world_size: int) -> list[tuple[int, int]]:
    """Per local CP size 1, 2, 4, ... <= world size: the sample lengths that need exactly it."""
    m, out, p = max_seqlen_per_rank(world_size), [], 1
    while p <= world_size:
        out.append((1 if p == 1 else m * p // 2 + 1, min(m * p, MAX_SEQLEN)))
        p *= 2
    return out


def random_mix(rng: random.Random, world_size: int) -> tuple[int, ...]:
    """A mix in which every local CP size occurs, plus random lengths."""
    lengths = [rng.randint(lo, hi) for lo, hi in length_ranges(world_size)]
    lengths += [rng.randint(1, MAX_SEQLEN) for _ in range(rng.randint(0, 2 * world_size))]
    rng.shuffle(lengths)
    return tuple(lengths)


def mix_name(lengths: tuple[int, ...]) -> str:
    return "lens-" + ".".join(map(str, lengths))


def check_mix(lengths: tuple[int, ...]) -> None:
    bad = [n for n in lengths if not 1 <= n <= MAX_SEQLEN]
    if not lengths or bad:
        raise BadInput(f"sequence-length mix {lengths}: every length must be in 1..{MAX_SEQLEN} "
                       f"(128 tokens after padding = the whole DP x CP group at "
                       f"max_seqlen_per_dp_cp_rank = 128 / world size)")


@dataclass(frozen=True)
class DynamicCPParams:
    """The dynamic-cp suite's parameters: the sequence-length mixes of its global batches."""

    mixes: dict[str, tuple[int, ...]] | None = None  # None: the named mixes plus `random_mixes` seeded ones
    random_mixes: int = 2


class DynamicCPSuite:
    name = "dynamic-cp"
    default_model = "tiny"  # the CPU tier's model when none is given
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.pipeline_parallel")
    Params = DynamicCPParams

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        loss = loss_per_token(result)
        return {"cp_mode": result.case.params.cp_mode, "loss": round(loss, 8) if loss is not None else None}

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: DynamicCPParams | None = None) -> list[Case]:
        """Per mix: no CP (reference), static CP at every CP size of the layouts, dynamic CP."""
        p = params or DynamicCPParams()
        check_dynamic_cp_available()
        cp_engine(engine)  # the path is refused before any rank: its ranks could not build the suite's engine
        if world_size < 2 or world_size % 2:
            return [Case(self.name, model, Layout(dp=world_size), engine, options, backend).to_skip(
                f"dynamic CP needs an even DP x CP size of at least 2 (megatron's hybrid CP groups), world size "
                f"{world_size} has none: needs world size 2 or more, even (e.g. --world-size 2 or 4)")]
        if layouts is None:
            layouts = [Layout(cp=cp, dp=world_size // cp) for cp in (2, 4) if world_size % cp == 0]
        static = [lay for lay in layouts if lay.cp > 1]
        for lay in static:
            validate(lay, model, world_size)
            if lay.tp != 1 or lay.pp != 1:
                raise BadInput(f"dynamic-cp compares CP only: layout {lay.id} must have tp1 and pp1")
        mixes = dict(p.mixes) if p.mixes is not None else dict(NAMED_MIXES)
        if p.mixes is None:
            rng = random.Random(options.seed)
            for _ in range(p.random_mixes):
                lengths = random_mix(rng, world_size)
                mixes[mix_name(lengths)] = lengths
        out = []
        for name, lengths in mixes.items():
            check_mix(lengths)
            plan = [(Layout(dp=world_size), CPMode.NONE)] + [(lay, CPMode.STATIC) for lay in static] + \
                   [(Layout(dp=world_size), CPMode.DYNAMIC)]
            for lay, mode in plan:
                out.append(Case(self.name, model, lay, engine, options, backend,
                                params=CPCaseParams(name, tuple(lengths), mode, max_seqlen_per_rank(world_size))))
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> DynamicCPRankData:
        engine = make_cp_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        with ctx.phase("steps"):
            engine.run()
        with ctx.phase("collect"):
            merged = engine.merge(engine.gather_records(), len(case.params.seqlens))
            return DynamicCPRankData([_plain(r) for r in engine.records], engine.loss_sum, engine.num_tokens,
                                     merged if ctx.rank == 0 else [], engine.main_grads() if ctx.rank == 0 else {})

    def check(self, results: list[CaseResult], params: DynamicCPParams | None = None) -> list[CheckResult]:
        return judge(results)


def cp_engine(engine: str) -> type[CPEngine]:
    """The suite's engine class for --engine (mcore: CPEngine); DoesNotApply for one that is no CPEngine (the
    bridges, fsdp2: they build no packed-sequence model with static or dynamic CP)."""
    if engine == EngineName.MCORE:
        return CPEngine
    return engine_class_with(engine, CPEngine, "cannot run the dynamic-cp suite: it compares megatron's no, static and "
                             "dynamic CP on packed sequences through harness.engines.cp_modes:CPEngine or a subclass; "
                             "run it with --engine mcore")


def make_cp_engine(case: Case, ctx: RankContext) -> CPEngine:
    return cp_engine(case.engine)(case, ctx)


def _plain(r: TokenOutputs) -> TokenOutputs:
    """The harness's own TokenOutputs of what an engine (or a subclass's record type) reported."""
    return TokenOutputs(r.sample, r.positions, r.logprobs, r.local_cp, r.rank)
