"""`ckpt-memory`: per-rank host (and device) memory peaks of a checkpoint save, per optimizer format."""

from __future__ import annotations

from typing import Any

from harness.checks import CheckResult
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.probes.memory import MIB, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec

# fully_sharded_model_space (deprecated) fails in megatron-core 0.16.1 with "ShardedTensor.flattened_range
# is not supported"; it can still be asked for with --ckpt-format.
FORMATS = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")
DEFAULT_LAYOUTS = ("tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp2")


class CkptMemorySuite:
    name = "ckpt-memory"
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
               "memray")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions()) -> list[Case]:
        if layouts is None:
            layouts = [Layout.parse(i) for i in DEFAULT_LAYOUTS if Layout.parse(i).world_size == world_size] \
                or [Layout(dp=world_size)]
        for lay in layouts:
            validate(lay, model, world_size)
        return [Case(self.name, model, lay, engine,
                     CaseOptions(**{**options.__dict__, "steps": 1, "use_distributed_optimizer": True,
                                    "ckpt_format": fmt}), backend)
                for lay in layouts for fmt in FORMATS]

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        import torch.distributed as dist

        from harness.suites import layout_coords

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        with ctx.phase("steps"):
            engine.train_step(0)  # creates the optimizer state the checkpoint holds
        ckpt_dir = ctx.workdir / "ckpt"
        if ctx.rank == 0:
            ckpt_dir.mkdir(exist_ok=True)
        dist.barrier()
        with ctx.phase("save"), measure("save", ctx.workdir, ctx.rank, device=not ctx.on_cpu) as peak:
            engine.save_checkpoint(str(ckpt_dir), case.options.ckpt_format, case.options.fully_parallel_save)
        dist.barrier()
        return {"coords": layout_coords(), "save": peak}

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        peaks = [r.data["save"] for r in result.ranks]
        return {"host peak MiB/rank": " ".join(f"{p.host_peak / MIB:.0f}" for p in peaks),
                "rss peak MiB/rank": " ".join(f"{(p.rss_peak - p.rss_before) / MIB:.0f}" for p in peaks)}

    def check(self, results: list[CaseResult]) -> list[CheckResult]:
        return [CheckResult("ckpt-memory.run", r.case.id, r.ok, r.error.splitlines()[0] if r.error else "ran")
                for r in results]
