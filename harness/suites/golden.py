"""`golden`: the training trajectory of a reference config, judged against the stored one of its model and dtype.

Every other numerics check compares layouts with each other, so a change that moves every layout alike (a
changed default, initialisation, constant, optimizer or clipping behaviour) passes them all. This suite
trains each case from a fixed seed on fixed data for STEPS steps (enough that Adam's second moment matters:
it has no effect on the first update) and records per step the loss, the gradient norm before clipping,
the number of zero gradient elements and the learning rate; after the last step the L2 norm of every
parameter (full, TP-unsharded, by global name), of its Adam moments and Adam's step counter. Layouts are
equivalent, so one stored trajectory per model and dtype (baselines/<platform>/golden.json) judges every
layout, world size 1 included.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.checks import CheckResult, case_failed
from harness.engines.base import HasOptimizerState, checkpointing
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import enumerate_layouts, validate
from harness.spec import Case, CaseOptions, Layout, ModelSpec

STEPS = 12
# A clip that binds: `tiny`'s gradient norm is 0.54-0.70 over its 12 steps, below megatron's default of 1.0,
# where clipping switched off would change nothing the trajectory can show.
CLIP_GRAD = 0.5


RESUME_FORMATS = ("dp_reshardable", "fully_reshardable")  # the distributed optimizer's checkpoint formats
# the fsdp2 engine's (torch fully_shard, torch Adam): its own trajectory, on the pure-DP layout
FSDP2_FORMATS = ("fsdp2_sharded", "fsdp2_full")


@dataclass(frozen=True)
class GoldenParams:
    """The golden suite's parameters; `role` and `ckpt_format` are a case's own (resume cases)."""

    baselines_dir: str | None = dataclasses.field(default=None, metadata={"in_id": False})
    # formats whose resume is judged (--ckpt-format); () none
    formats: tuple[str, ...] = dataclasses.field(default=RESUME_FORMATS + FSDP2_FORMATS, metadata={"in_id": False})
    # "" the unbroken trajectory; "first-half" trains the first half and saves; "resume" loads what the case it
    # runs after saved (at its own layout, which may differ) and trains the second half
    role: str = ""
    ckpt_format: str = ""


def checkpoint_dir(case: Case) -> Path:
    """Where a first-half case saves (its output directory), and where the resume case after it loads from."""
    from harness.probes.memory import artifacts_dir

    if case.params.role == "first-half":
        return Path(case.out_dir or artifacts_dir(case.id)) / "ckpt"
    return Path(case.inputs[0] if case.inputs else artifacts_dir(case.after[0])) / "ckpt"


def step_metric(step: int, figure: str) -> str:
    """The baseline metric of a figure at a step (1-based, as people count steps)."""
    return f"step{step:02d}.{figure}"


def trajectory(result: CaseResult, first_step: int = 1) -> dict[str, float]:
    """The case's figures as baseline metrics: per step loss, grad_norm, num_zeros, lr; after the last step
    param.<name> (L2 norm of the full parameter), exp_avg.<name> / exp_avg_sq.<name> (of its Adam moments, where
    the engine hands out its optimizer state) and optimizer.step (Adam's step counter)."""
    from harness.checks.tensors import assemble
    from harness.suites.equivalence import step_losses

    out: dict[str, float] = {}
    for i, loss in enumerate(step_losses(result), start=first_step):
        out[step_metric(i, "loss")] = loss
    for i, s in enumerate(result.ranks[0].data["steps"], start=first_step):
        for figure in ("grad_norm", "num_zeros", "lr"):
            value = getattr(s, figure)
            if value is not None:
                out[step_metric(i, figure)] = float(value)
    if "params" not in result.ranks[0].data:  # the first half of a resumed run: steps only
        return out
    for name, tensor in sorted(assemble([r.data["params"] for r in result.ranks]).tensors.items()):
        out[f"param.{name}"] = float(tensor.double().norm())
    state = [r.data.get("optimizer") for r in result.ranks]
    handed_out = [s for s in state if s is not None]
    if len(handed_out) == len(state):  # the engine hands out its Adam state
        steps = []
        for key, tensor in sorted(assemble(handed_out).tensors.items()):
            name, _, moment = key.rpartition("#")
            if moment == "step":
                steps.append(float(tensor.max()))
            else:
                out[f"{moment}.{name}"] = float(tensor.double().norm())
        if steps:
            out["optimizer.step"] = max(steps)  # Adam's step counter (bias correction)
    return out


class GoldenSuite:
    name = "golden"
    default_model = "tiny"  # the CPU tier's model when none is given
    Params = GoldenParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: GoldenParams | None = None) -> list[Case]:
        """Every valid layout of the world size (default), STEPS steps each, zero gradients counted."""
        from harness.engines import is_fsdp2
        from harness.suites.equivalence import with_equivalence_eps

        # the fsdp2 engine shards over data parallel only
        chosen = layouts or ([Layout(dp=world_size)] if is_fsdp2(engine) else enumerate_layouts(model, world_size))
        for lay in chosen:
            validate(lay, model, world_size)
        # the equivalence suite's Adam eps: with megatron's 1e-8 the layouts' rounding differences grow
        # through Adam's division into differences no single trajectory could hold for every layout
        given = CaseOptions()
        opts = dataclasses.replace(
            with_equivalence_eps(options), steps=STEPS if options.steps == given.steps else options.steps,
            log_num_zeros_in_grad=True, loss_mask=True,
            clip_grad=CLIP_GRAD if options.clip_grad == given.clip_grad else options.clip_grad)
        p = params or GoldenParams()
        out = [Case(self.name, model, lay, engine, opts, backend, params=p) for lay in chosen]
        return out + self.resume_cases(model, world_size, chosen[0], engine, backend, opts, p)

    def resume_cases(self, model: ModelSpec, world_size: int, layout: Layout, engine: str, backend: str,
                     options: CaseOptions, params: GoldenParams) -> list[Case]:
        """Per format: the first half of the steps and a save at `layout` with the distributed optimizer, then
        a resume there; for a fully reshardable format also a resume at another layout of the world size.
        fsdp2's formats: the same on the pure-DP layout with the fsdp2 engine, whose own unbroken trajectory
        (another optimizer, not megatron's) runs beside them."""
        from harness.engines import is_fsdp2
        from harness.layouts import reference_layouts

        own_fsdp2 = is_fsdp2(engine)
        dp = Layout(dp=world_size)
        out: list[Case] = []
        for fmt in params.formats:
            if fmt in FSDP2_FORMATS:
                eng = engine if own_fsdp2 else "fsdp2"
                if not own_fsdp2 and not any(c.engine == eng and not c.params.role for c in out):
                    out.append(Case(self.name, model, dp, eng, options, backend, params=params))
                lay, opts, loads = dp, options, [dp]
            elif own_fsdp2:
                continue  # the distributed optimizer's formats: not the fsdp2 engine's
            else:
                lay, eng, opts = layout, engine, dataclasses.replace(options, use_distributed_optimizer=True)
                loads = [layout]
                if fmt.startswith("fully_reshardable"):  # promises TP / PP / DP changes
                    loads += [x for x in reference_layouts(model, world_size) if x != layout][:1]
            first = Case(self.name, model, lay, eng, opts, backend,
                         params=dataclasses.replace(params, role="first-half", ckpt_format=fmt))
            out.append(first)
            out += [Case(self.name, model, x, eng, opts, backend, after=(first.id,),
                         params=dataclasses.replace(params, role="resume", ckpt_format=fmt)) for x in loads]
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        import torch.distributed as dist

        from harness.engines import make_engine
        from harness.suites import layout_coords

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        role, half = case.params.role, case.options.steps // 2
        if role == "resume":
            with ctx.phase("load"):
                checkpointing(engine, case.engine).load_checkpoint(str(checkpoint_dir(case)), case.params.ckpt_format)
        todo = {"": range(case.options.steps), "first-half": range(half),
                "resume": range(half, case.options.steps)}[role]
        steps = []
        for step in todo:
            with ctx.phase("steps"):
                steps.append(engine.train_step(step))
        if role == "first-half":
            ckpt = checkpoint_dir(case)
            if ctx.rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
                ckpt.mkdir(parents=True)
            dist.barrier()
            with ctx.phase("save"):
                checkpointing(engine, case.engine).save_checkpoint(str(ckpt), case.params.ckpt_format)
            dist.barrier()
            return {"coords": layout_coords(), "steps": steps}
        with ctx.phase("collect"):
            shards = engine.param_shards()
            state = engine.optimizer_state_shards() if isinstance(engine, HasOptimizerState) else None
        return {"coords": layout_coords(), "steps": steps, "params": shards, "optimizer": state}

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
    @staticmethod
    def key(case: Case) -> str:
        """One trajectory per model, dtype and step count: every layout is judged against it. The fsdp2 engine
        (torch Adam, no loss mask) trains another one, stored beside it."""
        from harness.engines import is_fsdp2

        engine = "/fsdp2" if is_fsdp2(case.engine) else ""
        return f"{case.model.name}/{case.options.dtype}/steps={case.options.steps}{engine}"

    @staticmethod
    def record_command(case: Case) -> str:
        from harness import baselines

        return baselines.record_command(case.suite, case.model.name, case.layout.world_size, case.backend)

    @staticmethod
    def samples(result: CaseResult) -> dict[str, float]:
        """The unbroken trajectory (resume cases are judged against it, not recorded)."""
        return trajectory(result) if not result.case.params.role else {}

    # Stored to full precision: the figures differ in their 6th-8th significant digit between layouts
    digits = None

    def tolerance(self, metric: str, values: list[float]) -> float:
        from harness.checks.golden import tolerance

        return tolerance(metric, values)

    def noisy_metrics(self, samples: dict[str, dict[str, list[float]]]) -> list[str]:
        from harness.checks.golden import noisy_metrics

        return noisy_metrics(samples)

    def check(self, results: list[CaseResult], params: GoldenParams | None = None) -> list[CheckResult]:
        from harness.checks import golden as judges

        out = []
        for res in results:
            if not res.ok:
                out.append(case_failed("golden.run", res))
        return out + judges.check(self, [r for r in results if r.ok], params or GoldenParams())
