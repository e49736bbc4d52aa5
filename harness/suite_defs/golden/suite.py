"""The golden suite: its cases (unbroken, first half + save, resume), rank work and the judges it hands on."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult, case_failed
from harness.engine_names import EngineName
from harness.engines import is_fsdp2, make_engine
from harness.engines.base import HasOptimizerState, checkpointing
from harness.engines.optimizer_offload import offload_unsupported
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import default_matrix, reference_layouts, validate
from harness.platform.parallel import layout_coords
from harness.probes.memory import artifacts_dir
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.agreement import with_equivalence_eps
from harness.suite_defs.golden import figures, judge
from harness.suite_defs.golden.figures import step_metric, trajectory
from harness.suite_defs.golden.params import (
    CLIP_GRAD,
    FSDP2_FORMATS,
    LR_DECAY_STEPS,
    LR_DECAY_STYLE,
    LR_WARMUP_STEPS,
    MIN_LR_FRACTION,
    STEPS,
    SUITE,
    GoldenParams,
    GoldenRole,
)
from harness.suite_defs.golden.payload import GoldenRankData


def checkpoint_dir(case: Case) -> Path:
    """Where a first-half case saves (its output directory), and where the resume case after it loads from."""

    if case.params.role == GoldenRole.FIRST_HALF:
        return Path(case.out_dir or artifacts_dir(case.id)) / "ckpt"
    return Path(case.inputs[0] if case.inputs else artifacts_dir(case.after[0])) / "ckpt"


def default_layouts(model: ModelSpec, world_size: int) -> list[Layout]:
    """Every valid layout of the world size (layouts.default_matrix) - for an MoE model those without TP or CP.
    golden trains with the per-token loss, and megatron-core 0.16 scales the auxiliary loss's gradient there by
    each TP x CP rank's own token count, so an MoE model's router trains differently at TP or CP > 1 (Megatron-LM
    PR #5047); `harness run --suite golden --model tiny-moe --layout tp2-pp1-cp1-dp2` shows it against the stored
    trajectory."""
    return [lay for lay in default_matrix(model, world_size) if not model.moe or (lay.tp == 1 and lay.cp == 1)]


class GoldenSuite:
    name = SUITE
    default_model = "tiny"  # the CPU tier's model when none is given
    Params = GoldenParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: GoldenParams | None = None) -> list[Case]:
        """Every valid layout of the world size (default; for an MoE model with layouts.expert_matrix's expert
        layouts), STEPS steps each, zero gradients counted."""

        # the fsdp2 engine shards over data parallel only
        chosen = layouts or ([Layout(dp=world_size)] if is_fsdp2(engine) else default_layouts(model, world_size))
        for lay in chosen:
            validate(lay, model, world_size)
        # the equivalence suite's Adam eps: with megatron's 1e-8 the layouts' rounding differences grow
        # through Adam's division into differences no single trajectory could hold for every layout
        given = CaseOptions()
        opts = dataclasses.replace(
            with_equivalence_eps(options), steps=STEPS if options.steps == given.steps else options.steps,
            log_num_zeros_in_grad=True, loss_mask=True,
            clip_grad=CLIP_GRAD if options.clip_grad == given.clip_grad else options.clip_grad)
        if not opts.lr_decay_steps:  # megatron's schedule, as a training job steps and checkpoints it
            opts = dataclasses.replace(opts, lr_warmup_steps=LR_WARMUP_STEPS, lr_decay_steps=LR_DECAY_STEPS,
                                       lr_decay_style=LR_DECAY_STYLE, min_lr=opts.lr * MIN_LR_FRACTION)
        p = params or GoldenParams()
        out = [Case(self.name, model, lay, engine, opts, backend, params=p) for lay in chosen]
        return out + self.resume_cases(model, world_size, chosen[0], engine, backend, opts, p)

    def resume_cases(self, model: ModelSpec, world_size: int, layout: Layout, engine: str, backend: Backend,
                     options: CaseOptions, params: GoldenParams) -> list[Case]:
        """Per format: the first half of the steps and a save at `layout` with the distributed optimizer, then
        a resume there; for a fully reshardable format also a resume at another layout of the world size.
        fsdp2's formats: the same on the pure-DP layout with the fsdp2 engine, whose own unbroken trajectory
        (another optimizer, not megatron's) runs beside them."""

        own_fsdp2 = is_fsdp2(engine)
        dp = Layout(dp=world_size)
        out: list[Case] = []
        for fmt in params.formats:
            if fmt in FSDP2_FORMATS:
                eng = engine if own_fsdp2 else EngineName.FSDP2
                if not own_fsdp2 and not any(c.engine == eng and not c.params.role for c in out):
                    out.append(Case(self.name, model, dp, eng, options, backend, params=params))
                lay, opts, loads = dp, options, [dp]
            elif own_fsdp2:
                continue  # the distributed optimizer's formats: not the fsdp2 engine's
            else:
                lay, eng, opts = layout, engine, dataclasses.replace(options, use_distributed_optimizer=True)
                loads = [layout]
                if fmt.startswith("fully_reshardable"):  # promises TP / PP / DP changes
                    # (an MoE model's golden layouts have no TP or CP: see default_layouts)
                    loads += [x for x in reference_layouts(model, world_size) if x != layout
                              and x in default_layouts(model, world_size)][:1]
            first = Case(self.name, model, lay, eng, opts, backend,
                         params=dataclasses.replace(params, role=GoldenRole.FIRST_HALF, ckpt_format=fmt))
            out.append(first)
            out += [Case(self.name, model, x, eng, opts, backend, after=(first.id,),
                         params=dataclasses.replace(params, role=GoldenRole.RESUME, ckpt_format=fmt)) for x in loads]
        return out + self.offload_cases(model, layout, engine, backend, options, params)

    def offload_cases(self, model: ModelSpec, layout: Layout, engine: str, backend: Backend, options: CaseOptions,
                      params: GoldenParams) -> list[Case]:
        """The first half and the resume at `layout` of the first distributed-optimizer format again with the
        optimizer's CPU offload and the precision-aware optimizer (Megatron-LM #1842: the loss jumped from 0.31 to
        10 after such a resume), judged against the same trajectory; skipped, naming why, where it cannot run."""

        fmt = next((f for f in params.formats if f not in FSDP2_FORMATS), None)
        if fmt is None or is_fsdp2(engine):
            return []
        opts = dataclasses.replace(options, use_distributed_optimizer=True, optimizer_cpu_offload=True)
        first = Case(self.name, model, layout, engine, opts, backend,
                     params=dataclasses.replace(params, role=GoldenRole.FIRST_HALF, ckpt_format=fmt))
        resume = Case(self.name, model, layout, engine, opts, backend, after=(first.id,),
                      params=dataclasses.replace(params, role=GoldenRole.RESUME, ckpt_format=fmt))
        why = offload_unsupported(backend, options.dtype)
        return [first.to_skip(why), resume.to_skip(why)] if why else [first, resume]

    def rank_work(self, case: Case, ctx: RankContext) -> GoldenRankData:
        import torch.distributed as dist

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        role, half = case.params.role, case.options.steps // 2
        if role == GoldenRole.RESUME:
            with ctx.phase("load"):
                checkpointing(engine, case.engine).load_checkpoint(str(checkpoint_dir(case)), case.params.ckpt_format)
        todo = {GoldenRole.WHOLE: range(case.options.steps), GoldenRole.FIRST_HALF: range(half),
                GoldenRole.RESUME: range(half, case.options.steps)}[role]
        steps = []
        for step in todo:
            with ctx.phase("steps"):
                steps.append(engine.train_step(step))
        if role == GoldenRole.FIRST_HALF:
            ckpt = checkpoint_dir(case)
            if ctx.rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
                ckpt.mkdir(parents=True)
            dist.barrier()
            with ctx.phase("save"):
                checkpointing(engine, case.engine).save_checkpoint(str(ckpt), case.params.ckpt_format)
            dist.barrier()
            return GoldenRankData(layout_coords(), steps, finished=False)
        with ctx.phase("collect"):
            shards = engine.param_shards()
            state = engine.optimizer_state_shards() if isinstance(engine, HasOptimizerState) else None
        return GoldenRankData(layout_coords(), steps, shards, optimizer=state)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        t = trajectory(result, 1 + (result.case.options.steps // 2 if result.case.params.role == "resume" else 0))
        last = max((int(k[4:6]) for k in t if k.startswith("step")), default=0)
        first = min((int(k[4:6]) for k in t if k.startswith("step")), default=0)
        return {"steps": f"{first}-{last}",
                "loss first/last": f"{t.get(step_metric(first, 'loss'), math.nan):.6f} / "
                                   f"{t.get(step_metric(last, 'loss'), math.nan):.6f}",
                "grad norm first/last": f"{t.get(step_metric(first, 'grad_norm'), math.nan):.4f} / "
                                        f"{t.get(step_metric(last, 'grad_norm'), math.nan):.4f}"}

    # -- baselines ------------------------------------------------------------------------------
    key = staticmethod(figures.key)
    record_command = staticmethod(figures.record_command)

    @staticmethod
    def samples(result: CaseResult) -> dict[str, float]:
        """The unbroken trajectory (resume cases are judged against it, not recorded)."""
        return trajectory(result) if not result.case.params.role else {}

    # Stored to full precision: the figures differ in their 6th-8th significant digit between layouts
    digits = None

    def tolerance(self, metric: str, values: list[float]) -> float:
        return judge.tolerance(metric, values)

    def noisy_metrics(self, samples: dict[str, dict[str, list[float]]]) -> list[str]:
        return judge.noisy_metrics(samples)

    def check(self, results: list[CaseResult], params: GoldenParams | None = None) -> list[CheckResult]:
        out = []
        for res in results:
            if not res.ok:
                out.append(case_failed("golden.run", res))
        return out + judge.check([r for r in results if r.ok], params or GoldenParams())
