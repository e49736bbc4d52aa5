"""`train-memory`: what a training rank holds, per phase, against the training-memory model and baselines.

Per case: build (model chunks, DDP grad buffers, optimizer) and each training step measured on every rank -
the heap high-water of the phase (memray, as ckpt-memory measures) and, on GPU ranks, the device's allocated
peak above what was allocated at the phase's start. Judged in the parent against the analytic model of
harness/checks/training_memory.py (build: weights + gradient buffers + master copies; first step: the
optimizer state it creates + the step's activations; later steps: the activations alone) and against the
stored baselines. The first step of a rank process pays one-time costs (lazy imports, allocator pools):
the case runs a priming step on a throwaway engine first, as ckpt-memory primes its saves.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any

from harness.checks import CheckResult
from harness.errors import BadInput
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import reference_layouts, validate
from harness.probes.memory import MIB, artifacts_dir, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec

STEPS = 2  # the first creates the optimizer state; the second holds activations only
# Two samples per micro-batch (the model specs say one): on CPU ranks the activations of `small` at one sample
# (~12 MiB at pure DP) are below the flat copy a gloo collective makes of the gradient buffer (23 MiB), so a
# step's peak would say nothing about activations; at two they lead wherever TP or PP splits the weights.
MICRO_BATCH = 2
RECOMPUTE = ("full", "selective")


@dataclass(frozen=True)
class TrainMemoryParams:
    """The train-memory suite's parameters."""

    distributed_optimizer: tuple[bool, ...] = (False, True)  # per layout of the default matrix
    recompute: tuple[str, ...] = RECOMPUTE  # also run at the first layout with the distributed optimizer
    baselines_dir: str | None = None  # None: the repository's baselines/

    def __post_init__(self):
        object.__setattr__(self, "recompute", tuple(self.recompute))
        bad = sorted(set(self.recompute) - set(RECOMPUTE))
        if bad:
            raise BadInput(f"--recompute {bad}: expected {' or '.join(RECOMPUTE)}")


class TrainMemorySuite:
    name = "train-memory"
    default_model = "small"
    Params = TrainMemoryParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel", "memray")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: TrainMemoryParams | None = None) -> list[Case]:
        """Per layout (default: pure DP, TP 2, PP 2) with and without the distributed optimizer; then the
        recompute settings at the first layout."""
        p = params or TrainMemoryParams()
        chosen = layouts or reference_layouts(model, world_size)
        for lay in chosen:
            validate(lay, model, world_size)
        opts = dataclasses.replace(options, steps=STEPS, micro_batch_size=options.micro_batch_size or MICRO_BATCH)
        distopt = (True,) if options.use_distributed_optimizer else p.distributed_optimizer  # --distributed-optimizer
        out = [Case(self.name, model, lay, engine, dataclasses.replace(opts, use_distributed_optimizer=d), backend)
               for lay in chosen for d in distopt]
        out += [Case(self.name, model, chosen[0], engine,
                     dataclasses.replace(opts, use_distributed_optimizer=True, recompute=r), backend)
                for r in p.recompute if not options.recompute]
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        from harness.engines import make_engine
        from harness.platform.parallel import teardown_parallel_state
        from harness.suites import layout_coords

        with ctx.phase("prime"):  # a throwaway engine's build and step: one-time costs of the process land here
            engine = make_engine(case, ctx)
            engine.build()
            engine.train_step(0)
            del engine
            teardown_parallel_state()
        captures, device = artifacts_dir(case.id), not ctx.on_cpu
        engine = make_engine(case, ctx)
        gc.collect()  # what a reference cycle of an earlier phase holds must not be freed inside a measured one
        with ctx.phase("build"), measure("build", captures, ctx.rank, device=device) as build:
            engine.build()
        steps = []
        for step in range(case.options.steps):
            gc.collect()
            with ctx.phase("steps"), measure(f"step{step}", captures, ctx.rank, device=device) as peak:
                engine.train_step(step)
            steps.append(peak)
        for peak in (build, *steps):  # the figures are kept; the captures are not needed past the rank
            _drop_capture(peak.capture)
        return {"coords": layout_coords(), "build": build, "steps": steps}

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        figures = [phase_figures(r.data, result.case.backend) for r in result.ranks]
        return {f"{name} MiB/rank": " ".join(f"{f[name] / MIB:.1f}" for f in figures) for name in figures[0]}

    @staticmethod
    def key(case: Case) -> str:
        o = case.options
        return (f"{case.model.name}/{case.layout.id}/{o.dtype}/mbs{case.micro_batch_size}/"
                f"distopt={int(o.use_distributed_optimizer)}" + (f",recompute={o.recompute}" if o.recompute else ""))

    @staticmethod
    def record_command(case: Case) -> str:
        from harness import baselines

        return baselines.record_command(case.suite, case.model.name, case.layout.world_size, case.backend) + \
            f" --layout {case.layout.id}"

    @staticmethod
    def samples(result: CaseResult) -> dict[str, float]:
        """Per rank and phase, MiB: the heap high-water on CPU ranks, the device's allocated peak on GPUs."""
        return {f"rank{r.rank}.{phase}_mib": value / MIB for r in result.ranks
                for phase, value in phase_figures(r.data, result.case.backend).items()}

    def check(self, results: list[CaseResult], params: TrainMemoryParams | None = None) -> list[CheckResult]:
        from harness.checks import train_memory as judges

        return judges.check(self, results, params or TrainMemoryParams())


def phase_figures(data: dict, backend: str) -> dict[str, int]:
    """The measured bytes of each phase of one rank: heap (CPU) or device allocated (GPU) above its start."""
    pick = (lambda p: p.device_peak) if backend == "nccl" else (lambda p: p.heap_peak)
    return {"build": pick(data["build"]), **{f"step{i}": pick(p) for i, p in enumerate(data["steps"])}}


def _drop_capture(capture: str) -> None:
    import glob
    import os

    for f in ([] if os.environ.get("HARNESS_KEEP") else glob.glob(capture + "*") if capture else []):
        os.unlink(f)
