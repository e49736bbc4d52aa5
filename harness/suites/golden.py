"""`golden`: the training trajectory of a reference config, judged against the stored one of its model and dtype.

Every other numerics check compares layouts with each other, so a change that moves every layout alike (a
changed default, initialisation, constant, optimizer or clipping behaviour) passes them all. This suite
trains each case from a fixed seed on fixed data for STEPS steps (enough that Adam's second moment matters:
it has no effect on the first update) and records per step the loss, the gradient norm before clipping,
the number of zero gradient elements and the learning rate; after the last step the L2 norm of every
parameter (full, TP-unsharded, by global name) and of its Adam moments. Layouts are equivalent, so one
stored trajectory per model and dtype (baselines/<platform>/golden.json) judges every layout, world size 1
included.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from harness.checks import CheckResult, case_failed
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import enumerate_layouts, validate
from harness.spec import Case, CaseOptions, Layout, ModelSpec

STEPS = 12
STEP_FIGURES = ("loss", "grad_norm", "num_zeros", "lr")
# A clip that binds: `tiny`'s gradient norm is 0.54-0.62 over its 12 steps, below megatron's default of 1.0,
# where clipping switched off would change nothing the trajectory can show.
CLIP_GRAD = 0.5


@dataclass(frozen=True)
class GoldenParams:
    """The golden suite's parameters."""

    baselines_dir: str | None = dataclasses.field(default=None, metadata={"in_id": False})


def step_metric(step: int, figure: str) -> str:
    """The baseline metric of a figure at a step (1-based, as people count steps)."""
    return f"step{step:02d}.{figure}"


def trajectory(result: CaseResult) -> dict[str, float]:
    """The case's figures as baseline metrics: per step loss, grad_norm, num_zeros, lr; after the last step
    param.<name> (L2 norm of the full parameter) and exp_avg.<name> / exp_avg_sq.<name> (of its moments)."""
    from harness.checks.tensors import assemble
    from harness.suites.equivalence import step_losses

    out: dict[str, float] = {}
    for i, loss in enumerate(step_losses(result), start=1):
        out[step_metric(i, "loss")] = loss
    first = result.ranks[0].data["steps"]
    for i, s in enumerate(first, start=1):
        for figure in ("grad_norm", "num_zeros", "lr"):
            value = getattr(s, figure)
            if value is not None:
                out[step_metric(i, figure)] = float(value)
    for prefix, key in (("param", "params"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        shards = [r.data.get(key) for r in result.ranks]
        if any(s is None for s in shards):
            continue
        for name, tensor in sorted(assemble(shards).tensors.items()):
            out[f"{prefix}.{name}"] = float(tensor.double().norm())
    return out


@runtime_checkable
class AdamMoments(Protocol):
    """An engine that can hand out its Adam moments per parameter (McoreEngine; None where it cannot)."""

    def moment_shards(self) -> dict[str, list] | None: ...


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
        from harness.suites.equivalence import with_equivalence_eps

        chosen = layouts or enumerate_layouts(model, world_size)
        for lay in chosen:
            validate(lay, model, world_size)
        # the equivalence suite's Adam eps: with megatron's 1e-8 the layouts' rounding differences grow
        # through Adam's division into differences no single trajectory could hold for every layout
        opts = dataclasses.replace(with_equivalence_eps(options), steps=STEPS if options.steps == CaseOptions.steps
                                   else options.steps, log_num_zeros_in_grad=True, loss_mask=True,
                                   clip_grad=CLIP_GRAD if options.clip_grad == CaseOptions.clip_grad else options.clip_grad)
        return [Case(self.name, model, lay, engine, opts, backend, params=params or GoldenParams()) for lay in chosen]

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        from harness.engines import make_engine
        from harness.suites import layout_coords

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        steps = []
        for step in range(case.options.steps):
            with ctx.phase("steps"):
                steps.append(engine.train_step(step))
        with ctx.phase("collect"):
            shards = engine.param_shards()
            moments = engine.moment_shards() if isinstance(engine, AdamMoments) else None
        return {"coords": layout_coords(), "steps": steps, "params": shards,
                "exp_avg": moments and moments["exp_avg"], "exp_avg_sq": moments and moments["exp_avg_sq"]}

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        t = trajectory(result)
        last = max((int(k[4:6]) for k in t if k.startswith("step")), default=0)
        return {"loss first/last": f"{t.get(step_metric(1, 'loss'), math.nan):.6f} / "
                                   f"{t.get(step_metric(last, 'loss'), math.nan):.6f}",
                "grad norm first/last": f"{t.get(step_metric(1, 'grad_norm'), math.nan):.4f} / "
                                        f"{t.get(step_metric(last, 'grad_norm'), math.nan):.4f}"}

    # -- baselines ------------------------------------------------------------------------------
    @staticmethod
    def key(case: Case) -> str:
        """One trajectory per model, dtype and step count: every layout is judged against it."""
        return f"{case.model.name}/{case.options.dtype}/steps={case.options.steps}"

    @staticmethod
    def record_command(case: Case) -> str:
        from harness import baselines

        return baselines.record_command(case.suite, case.model.name, case.layout.world_size, case.backend)

    @staticmethod
    def samples(result: CaseResult) -> dict[str, float]:
        return trajectory(result)

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
