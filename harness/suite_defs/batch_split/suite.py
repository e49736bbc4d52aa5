"""The batch-split suite: its cases (per mode, a reference and the cuts x layouts) and the rank work."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult
from harness.engine_names import EngineName
from harness.engines import engine_class_with, is_fsdp2, make_engine
from harness.engines.base import PadsVocabulary, ProbesMTP, StepOutput, TrainsRLBatches
from harness.engines.policy_loss import NLL, PPO_CLIP
from harness.engines.rl_batch import Cut, RLBatch, check_cut, microbatch_samples, rl_batch
from harness.engines.rl_steps import check_rl_engine
from harness.errors import BadInput, DoesNotApply, NotOnThisStack
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.platform.parallel import layout_coords
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.agreement import with_equivalence_eps
from harness.suite_defs.batch_split.judge import BatchSplitRankData, judge, step_figures
from harness.suite_defs.batch_split.mtp import check_mtp
from harness.suite_defs.batch_split.params import (
    DYNAMIC,
    GLOBAL_BATCH,
    MATRIX,
    STEPS,
    SUITE,
    VOCAB_PADDING,
    BatchSplitCaseParams,
    BatchSplitParams,
)
from harness.suite_defs.batch_split.policy import check_ratio
from harness.upstream import mtp_detach_refusal


def microbatches(case: Case, batch: RLBatch, dp_rank: int) -> list[list[int]]:
    """This DP rank's micro-batches of the case's cut; a `like` reference's: every DP rank's of that layout."""
    cut = Cut.parse(case.params.cut)
    if case.params.like:
        like = Layout.parse(case.params.like)
        return [mb for r in range(like.dp) for mb in microbatch_samples(batch, cut, like.dp, like.pp, r)]
    return microbatch_samples(batch, cut, case.layout.dp, case.layout.pp, dp_rank)


class BatchSplitSuite:
    name = SUITE
    default_model = "tiny"
    Params = BatchSplitParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: BatchSplitParams | None = None) -> list[Case]:
        p = params or BatchSplitParams()
        factory = engine_class_with(
            engine, TrainsRLBatches, "is not a class with train_rl_batch / rl_logprobs (harness.engines.base."
            "TrainsRLBatches): batch-split cannot cut its batches; give a subclass of McoreEngine, whose RL steps run "
            "your aggregate_loss (docs/engines.md)")
        check_rl_engine(engine, factory, p.temperature)
        if p.vocab_size:
            if not issubclass(factory, PadsVocabulary):
                raise BadInput(f"--vocab-size: engine {engine} does not build the vocabulary padded as megatron's "
                               "training scripts do (a bridge builds it from its Hugging Face config); give mcore or "
                               "fsdp2, or drop --vocab-size")
            model = dataclasses.replace(model, vocab_size=p.vocab_size, make_vocab_size_divisible_by=VOCAB_PADDING)
        gbs = options.global_batch_size or GLOBAL_BATCH
        steps = options.steps if options.steps != CaseOptions.steps else STEPS
        opts = dataclasses.replace(with_equivalence_eps(options), steps=steps, global_batch_size=gbs,
                                   log_num_zeros_in_grad=True)
        if opts.micro_batch_size is not None:
            raise BadInput("batch-split cuts the batch itself: give --cut mbs<N> instead of --micro-batch-size")
        if p.mtp_layers:
            return self._mtp_cases(model, world_size, layouts, engine, factory, backend, opts, p)
        pairs = self._pairs(model, world_size, layouts, p, fsdp2=is_fsdp2(engine))
        out: list[Case] = []
        reference = Layout(dp=1)
        if world_size == 1:
            why = ("batch-split compares cuts over several ranks with one micro-batch on one rank: needs world size 2 "
                   "or more (e.g. --world-size 4)")
            return [Case(self.name, model, reference, engine, opts, backend, params=BatchSplitCaseParams(mode, "mbs1"))
                    .to_skip(why) for mode in p.modes]
        def judged(mode: str, lay: Layout, cut: str, on: str) -> list[Case]:
            """The case, after an MoE model's reference with the same micro-batches (its load-balancing loss is
            per micro-batch)."""
            same = [Case(self.name, model, reference, engine, opts, backend,
                         params=BatchSplitCaseParams(mode, cut, like=lay.id))] if model.moe else []
            return same + [Case(self.name, model, lay, on, opts, backend, params=BatchSplitCaseParams(mode, cut))]

        for mode in p.modes:
            out.append(Case(self.name, model, reference, engine, opts, backend,
                            params=BatchSplitCaseParams(mode, f"mbs{gbs}")))
            for lay, cut in pairs.get(mode, ()):
                check_cut(Cut.parse(cut), gbs, lay.dp)
                validate(lay, model, world_size, global_batch_size=gbs)
                out += judged(mode, lay, cut, engine)
            if engine == EngineName.MCORE and layouts is None and not p.cuts:
                # the second backend: FSDP2 and torch Adam on the same model, batch and aggregation, against
                # megatron's reference
                out += judged(mode, Layout(dp=world_size), DYNAMIC, EngineName.FSDP2)
        if p.temperature != 1.0 or p.entropy_coef or p.policy_loss != NLL or p.vocab_size:
            out = [dataclasses.replace(c, params=dataclasses.replace(c.params, temperature=p.temperature,
                                                                     entropy_coef=p.entropy_coef,
                                                                     policy_loss=p.policy_loss,
                                                                     vocab_size=p.vocab_size)) for c in out]
        return out

    def _mtp_cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, engine: str, factory: type,
                   backend: Backend, opts: CaseOptions, p: BatchSplitParams) -> list[Case]:
        """--mtp-layers: per mode, layout (default: one rank, pure DP, and TP, CP and PP 2 with the rest as DP) and
        cut (default: dynamic), one case that measures the first step with the model's MTP layers on and off.
        Megatron normalises the MTP loss per micro-batch and per CP rank, so the MTP layers train differently per cut:
        the cut comparisons run without MTP."""
        if not issubclass(factory, ProbesMTP):
            raise BadInput(f"--mtp-layers: engine {engine} does not build megatron's MTP layers and measure them "
                           "(harness.engines.base.ProbesMTP: McoreEngine and its subclasses); give mcore, or drop "
                           "--mtp-layers")
        if p.policy_loss == PPO_CLIP:
            raise BadInput("--mtp-layers with --policy-loss ppo-clip: the MTP measurements take one forward-backward, "
                           "and PPO's old-log-prob pass before it would run the MTP layers too; judge MTP with the "
                           "default --policy-loss nll")
        why = mtp_detach_refusal()
        if why:
            raise NotOnThisStack(f"--mtp-layers: {why}")
        model = dataclasses.replace(model, mtp_num_layers=p.mtp_layers)
        if layouts is None:
            layouts = [Layout(dp=1)] + ([Layout(dp=world_size)] if world_size > 1 else [])
            if world_size % 2 == 0:
                half = world_size // 2
                layouts += [Layout(tp=2, dp=half), Layout(cp=2, dp=half), Layout(pp=2, dp=half)]
        gbs = opts.global_batch_size or GLOBAL_BATCH
        out = []
        for lay in layouts:
            if lay.world_size > 1:  # one rank: the cut comparisons' reference layout, on any world size
                validate(lay, model, world_size, global_batch_size=gbs)
            for cut in p.cuts or (DYNAMIC,):
                check_cut(Cut.parse(cut), gbs, lay.dp)
                out += [Case(self.name, model, lay, engine, opts, backend, params=BatchSplitCaseParams(
                    mode, cut, temperature=p.temperature, entropy_coef=p.entropy_coef, policy_loss=p.policy_loss,
                    vocab_size=p.vocab_size, mtp_layers=p.mtp_layers)) for mode in p.modes]
        return out

    @staticmethod
    def _pairs(model: ModelSpec, world_size: int, layouts: list[Layout] | None, p: BatchSplitParams,
               fsdp2: bool) -> dict[str, list[tuple[Layout, str]]]:
        """Per mode, the (layout, cut) pairs: the matrix's (the fsdp2 engine's: pure DP, static and dynamic), or
        every given layout x every given cut."""
        if layouts is None and not p.cuts and fsdp2:
            return {mode: [(Layout(dp=world_size), "mbs2"), (Layout(dp=world_size), DYNAMIC)] for mode in p.modes}
        if layouts is None and not p.cuts:
            # an MoE model's experts over EP 2 on the pure-DP layout, where its expert grid admits it
            ep = 2 if model.moe and world_size % 2 == 0 and model.num_experts % 2 == 0 else 1
            shapes = {"dp": Layout(dp=world_size, ep=ep)}
            if world_size % 2 == 0:
                shapes.update(cp2=Layout(cp=2, dp=world_size // 2), pp2=Layout(pp=2, dp=world_size // 2))
            return {mode: [(shapes[s], cut) for s, cut in MATRIX[mode] if s in shapes] for mode in p.modes}
        lays = layouts if layouts is not None else [Layout(dp=world_size)]
        cuts = p.cuts or ("mbs1",)
        return {mode: [(lay, cut) for lay in lays for cut in cuts] for mode in p.modes}

    def rank_work(self, case: Case, ctx: RankContext) -> BatchSplitRankData:
        from megatron.core import parallel_state as ps

        engine = make_engine(case, ctx)
        if not isinstance(engine, TrainsRLBatches):  # the plan refuses such a factory; here for the type checker
            raise DoesNotApply(f"engine {case.engine} has no train_rl_batch / rl_logprobs (TrainsRLBatches)")
        with ctx.phase("build"):
            engine.build()
        o = case.options
        batch = rl_batch(case.model, case.global_batch_size, o.seed, 0)
        first = microbatches(case, batch, ps.get_data_parallel_rank())
        if case.params.mtp_layers:
            if not isinstance(engine, ProbesMTP):  # the plan refuses such a factory
                raise DoesNotApply(f"engine {case.engine} has no mtp_probe (ProbesMTP)")
            with ctx.phase("mtp"):
                probe = engine.mtp_probe(batch, first, case.params.mode)
            return BatchSplitRankData(layout_coords(), [], [], microbatches=first, mtp=probe)
        with ctx.phase("logprobs"):
            logprobs = engine.rl_logprobs(batch, first)
        steps = []
        for step in range(o.steps):
            batch = rl_batch(case.model, case.global_batch_size, o.seed, step)
            with ctx.phase("steps"):
                steps.append(engine.train_rl_batch(batch, microbatches(case, batch, ps.get_data_parallel_rank()),
                                                   case.params.mode))
        with ctx.phase("collect"):
            shards = engine.param_shards()
        return BatchSplitRankData(layout_coords(), steps, shards, [StepOutput(None, None, logprobs)], first)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        return {"losses": step_figures(result)["loss"]} if result.ok else {}

    def check(self, results: list[CaseResult], params: BatchSplitParams | None = None) -> list[CheckResult]:
        mtp = [r for r in results if r.case.params.mtp_layers]
        rest = [r for r in results if not r.case.params.mtp_layers]
        return judge(rest) + [check_ratio(r) for r in rest if r.ok and r.case.params.policy_loss == PPO_CLIP] + \
            [c for r in mtp for c in check_mtp(r)]
