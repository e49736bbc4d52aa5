"""The ckpt-memory suite: its cases (memory and reshard contract) and the rank work of a measured save."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.backends import Backend
from harness.baselines import noisy_metrics, tolerance_for
from harness.checks import CheckResult
from harness.engine_names import EngineName
from harness.engines import is_fsdp2, make_engine
from harness.engines.base import LabelsCheckpoints
from harness.errors import DoesNotApply
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.platform.parallel import layout_coords
from harness.probes.ckpt_format import inspect
from harness.probes.memory import MIB, captures_dir, measure
from harness.probes.retention import measure_retention
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.ckpt_memory import figures, judge
from harness.suite_defs.ckpt_memory.contract import contract_cases, reshard_work, save_layout
from harness.suite_defs.ckpt_memory.contract_judge import check_reshard
from harness.suite_defs.ckpt_memory.params import (
    ASYNC_FORMATS,
    DEFAULT_LAYOUTS,
    FORMATS,
    FULLY_PARALLEL_FORMATS,
    RESAVES,
    SUITE,
    CkptCaseParams,
    CkptMemoryParams,
)
from harness.suite_defs.ckpt_memory.payload import ContractRankData, SaveRankData


class CkptMemorySuite:
    name = SUITE
    default_model = "small"  # the CPU tier's model when none is given
    Params = CkptMemoryParams
    # Measured on ranks that ran nothing but this suite, as its baselines were recorded (train-memory's suite.py
    # has what another suite's warm ranks did to a memory figure).
    fresh_pool = True
    # ... and each case on ranks of its own: on warm ranks a save's heap peak moved with the cases the ranks had run
    # before (tiny-moe at EP 2, fully_reshardable through the fully parallel wrapper: 3.49 MiB on rank 0 in the first
    # of three repeats of the suite in one process, 2.50 and 2.51 in the next two, its save primed alike in each;
    # a warm rank's reshard load 2.42, 2.91, 2.41). On ranks forked per case, two runs agreed within 0.18 MiB on
    # every figure (most within 0.05) and with the baselines.
    fresh_ranks_per_case = True
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
               "memray")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: CkptMemoryParams | None = None) -> list[Case]:
        p = params or CkptMemoryParams()
        # the contract cases come with the default matrix (not with hand-picked layouts or formats)
        contract = p.contract and layouts is None and p.formats == FORMATS
        if layouts is None and model.moe:  # its experts at EP 2 over pure DP, where the contract saves
            layouts = [save_layout(world_size, model)]
        elif layouts is None:
            layouts = [Layout.parse(i) for i in DEFAULT_LAYOUTS if Layout.parse(i).world_size == world_size] \
                or [Layout(dp=world_size)]
        for lay in layouts:
            validate(lay, model, world_size)
        fsdp2 = is_fsdp2(engine)
        if fsdp2 and model.moe:
            raise DoesNotApply(f"--engine {engine} saves FSDP2 checkpoints of dense models only (torch's fully_shard "
                               f"over DP), so ckpt-memory has no case of it for mixture-of-experts model {model.name}: "
                               "run the model with --engine mcore, or a dense model here")
        mcore_engine, fsdp2_engine = (EngineName.MCORE, engine) if fsdp2 else (engine, EngineName.FSDP2)
        memory = []
        for lay in layouts:
            for fmt in p.formats:
                is_fsdp2_format = fmt.startswith("fsdp2")
                megatron_only = p.fully_parallel_save or p.async_save
                if is_fsdp2_format and ((lay.tp, lay.pp, lay.cp, lay.vpp) != (1, 1, 1, 1) or megatron_only
                                        or model.moe):
                    continue  # FSDP2 shards over DP only (a dense model); the fully parallel wrapper and async
                    # save are megatron's
                opts = dataclasses.replace(options, steps=1, use_distributed_optimizer=not is_fsdp2_format)
                memory.append(Case(self.name, model, lay, fsdp2_engine if is_fsdp2_format else mcore_engine, opts,
                                   backend, params=CkptCaseParams(fmt, p.fully_parallel_save, p.async_save)))
        if contract:  # the default matrix: async and fully parallel saves of both main formats at the first layout
            opts = dataclasses.replace(options, steps=1, use_distributed_optimizer=True)
            for variant, formats in (("async_save", ASYNC_FORMATS), ("fully_parallel_save", FULLY_PARALLEL_FORMATS)):
                for fmt in formats:
                    memory.append(Case(self.name, model, layouts[0], mcore_engine, opts, backend,
                                       params=CkptCaseParams(fmt, async_save=variant == "async_save",
                                                       fully_parallel_save=variant == "fully_parallel_save")))
        return memory + (contract_cases(self.name, model, world_size, mcore_engine, backend, options)
                         if contract else [])

    def rank_work(self, case: Case, ctx: RankContext) -> SaveRankData | ContractRankData:
        import torch.distributed as dist

        if case.params.ckpt_role:
            return reshard_work(case, ctx)

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        with ctx.phase("steps"):
            engine.train_step(0)  # creates the optimizer state the checkpoint holds
        with ctx.phase("prime"):
            prime_save(engine, case, ctx)
        ckpt_dir = ctx.workdir / "ckpt"
        if ctx.rank == 0:
            ckpt_dir.mkdir(exist_ok=True)
        dist.barrier()
        captures = captures_dir(case)
        with ctx.phase("save"), measure("save", captures, ctx.rank, device=not ctx.on_cpu) as peak:
            save(engine, case, ckpt_dir)
        dist.barrier()
        on_disk = label = None
        if ctx.rank == 0:
            # what the files are, and what the engine says they are
            on_disk, label = inspect(ckpt_dir), _label(engine, ckpt_dir)
        with ctx.phase("resaves"):
            kept = measure_retention(lambda i: save_scratch(engine, case, ctx, f"resave-{i}"), RESAVES,
                                     captures / f"memray-resaves-rank{ctx.rank}.bin")
        return SaveRankData(peak, layout_coords(), on_disk, label, kept)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok or result.case.params.ckpt_role:
            return {}
        peaks = [figures.save_data(r).save for r in result.ranks]
        return {"host peak MiB/rank": " ".join(f"{p.host_peak / MIB:.0f}" for p in peaks),
                "rss peak MiB/rank": " ".join(f"{(p.rss_peak - p.rss_before) / MIB:.0f}" for p in peaks)}

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        """Per-rank peaks of the save (bytes) and the rank's RSS timeline during it, for plots."""
        if result.case.params.ckpt_role:
            return {}
        from dataclasses import asdict

        return {"save": {str(r.rank): asdict(figures.save_data(r).save) for r in result.ranks}}

    key = staticmethod(figures.key)
    record_command = staticmethod(figures.record_command)
    samples = staticmethod(figures.samples)
    digits = 3

    @staticmethod
    def tolerance(metric: str, values: list[float]) -> float:
        return tolerance_for(values, figures.floor(metric))

    @staticmethod
    def noisy_metrics(samples: dict[str, dict[str, list[float]]]) -> list[str]:
        return noisy_metrics(samples, figures.floor)

    def check(self, results: list[CaseResult], params: CkptMemoryParams | None = None) -> list[CheckResult]:
        return check_reshard(results) + judge.check(results, params or CkptMemoryParams())


def _label(engine, ckpt_dir) -> dict:
    """The engine's own label of the checkpoint (kept as a secondary row of the contract)."""
    if isinstance(engine, LabelsCheckpoints):
        return engine.saved_metadata(str(ckpt_dir))
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_content_metadata(str(ckpt_dir)) or {}


def save(engine, case: Case, ckpt_dir) -> None:
    """The case's save: its format, through the fully parallel wrapper or async where it asks for them."""
    p = case.params
    if p.async_save:
        engine.save_checkpoint(str(ckpt_dir), p.ckpt_format, p.fully_parallel_save, async_save=True)
    else:
        engine.save_checkpoint(str(ckpt_dir), p.ckpt_format, p.fully_parallel_save)


def prime_save(engine, case: Case, ctx: RankContext) -> None:
    """The case's own save once, unmeasured and deleted, before the measured one.

    What a process pays only at its first save (or first save of a new size) lands here and in no
    measured peak, whichever case runs first: the pinned host blocks the device-to-host copies of a GPU
    save are cut from (torch's caching host allocator keeps them; measured on an H100: `default` 200.9 MiB
    on the first save of a rank process, 1.0 after), the checkpoint writer's result-queue manager, lazy
    imports, fsdp2's first get_state_dict. The measured save reuses those; what it holds of the pinned pool
    is measured as such (probes/memory.py: MemoryPeak.pinned_peak), so a GPU figure keeps its staging."""
    save_scratch(engine, case, ctx, "prime-ckpt")


def save_scratch(engine, case: Case, ctx: RankContext, name: str) -> None:
    """The case's save into a scratch directory of the rank's workdir, deleted after it."""
    import shutil

    import torch.distributed as dist

    scratch = ctx.workdir / name
    if ctx.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
    dist.barrier()
    save(engine, case, scratch)
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
