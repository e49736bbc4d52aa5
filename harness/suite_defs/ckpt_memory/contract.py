"""The checkpoint contract of the ckpt-memory suite: a checkpoint saved at one layout loads at another
wherever its format promises it, with the values it saved.

dp_reshardable promises DP changes only; fully_reshardable (mem_efficient or not) promises TP, PP and
DP changes. A "reshard" case saves after one training step at its layout and takes a second step
there, which must equal an uninterrupted run of both steps (a save has no side effects). Then, for
every target layout of its world size (itself included), it builds a fresh engine, loads (host
peak measured), compares the loaded parameters and takes the same second step. A "reshard-load"
case does the same at another world size from the reshard case's checkpoint (the DP-only change).
The parent (contract_judge.py) compares full parameters and Adam state (exp_avg,
exp_avg_sq, step) by global name: loaded == saved bit for bit, and after the second step == the
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import shutil
import traceback
from pathlib import Path

from harness.backends import Backend
from harness.engines import make_engine
from harness.engines.base import HasOptimizerState, checkpointing
from harness.launch.context import RankContext
from harness.layouts import reference_layouts, violations
from harness.platform.parallel import teardown_parallel_state
from harness.probes.memory import MeasurementError, artifacts_dir, captures_dir, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.ckpt_errors import describe_exception, refusal_kind
from harness.suite_defs.ckpt_memory.params import CONTRACT_FORMATS, CkptCaseParams, CkptRole
from harness.suite_defs.ckpt_memory.payload import ContractRankData, LoadTarget


def save_layout(world_size: int, model: ModelSpec | None = None) -> Layout:
    """Where a reshard case saves: pure DP over the world (tp1-pp1-cp1-dp4 at world size 4); an MoE model's
    experts at EP 2 there where they divide (tp1-pp1-cp1-dp4-ep2)."""
    expert = Layout(dp=world_size, ep=2)
    if model is not None and model.moe and not violations(expert, model, world_size):
        return expert
    return Layout(dp=world_size)


def targets(model: ModelSpec, world_size: int) -> list[Layout]:
    """The layouts a reshard case loads at, all of its world size: the save layout itself, then TP 2 and
    PP 2 over half the DP where the model allows them (tp2-dp2 and pp2-dp2 at world size 4). An MoE model saved
    at EP 2 loads at EP 1 (which no format promises: contract_judge.promised) and EP 4 too, and at TP 2 and PP 2
    with EP 2."""

    saved = save_layout(world_size, model)
    if not saved.expert_parallel:
        return reference_layouts(model, world_size)
    wanted = [saved, Layout(dp=world_size), Layout(dp=world_size, ep=4),
              *reference_layouts(model, world_size, saved.ep)]
    return [lay for lay in dict.fromkeys(wanted) if not violations(lay, model, world_size)]


def dp_only_target(world_size: int, model: ModelSpec | None = None) -> Layout | None:
    """Another world size where only DP changes (DP 4 -> 2; EP kept), or None where DP cannot be halved."""
    if world_size % 2:
        return None
    saved = save_layout(world_size, model)
    half = Layout(dp=world_size // 2, ep=saved.ep, etp=saved.etp)
    return half if model is None or not violations(half, model, world_size // 2) else None


def contract_cases(name: str, model: ModelSpec, world_size: int, engine: str, backend: Backend,
                   options: CaseOptions, formats: tuple[str, ...] = CONTRACT_FORMATS) -> list[Case]:
    """One reshard case per format at the world size, and one DP-only load case at half of it (skipped,
    saying so, where the world size is odd: 1 on a one-GPU node)."""
    out = []
    opts = dataclasses.replace(options, steps=2, use_distributed_optimizer=True)
    for fmt in formats:
        saver = Case(name, model, save_layout(world_size, model), engine, opts, backend,
                     params=CkptCaseParams(fmt, ckpt_role=CkptRole.RESHARD))
        out.append(saver)
        target = dp_only_target(world_size, model)
        loader = Case(name, model, target or save_layout(world_size, model), engine, opts, backend, after=(saver.id,),
                      params=CkptCaseParams(fmt, ckpt_role=CkptRole.RESHARD_LOAD))  # loads what `saver` wrote
        halves = world_size % 2 == 0
        out.append(loader if target else loader.to_skip(
            f"the DP-only reshard load halves DP at another world size; world size {world_size} cannot be halved: "
            f"needs world size 2 or more, even" if not halves else
            f"the DP-only reshard load halves DP at another world size; DP {world_size // 2} cannot hold the save "
            f"layout's expert grid (EP {save_layout(world_size, model).ep}): needs world size "
            f"{2 * world_size} or more"))
    return out


def saved_checkpoint(case: Case) -> Path:
    """Where a reshard case writes its checkpoint, and where a reshard-load case finds the one it reads
    (the output directory of the case it runs after, resolved by the driver)."""
    if case.params.ckpt_role == CkptRole.RESHARD:
        root = Path(case.out_dir) if case.out_dir else artifacts_dir(case.id)
    elif case.inputs:
        root = Path(case.inputs[0])
    else:  # run outside a driver run: where the saver, also run outside one, wrote it
        root = artifacts_dir(case.after[0])
    return root / "ckpt"


def _try_load(case: Case, ctx: RankContext, layout: Layout, ckpt: Path) -> LoadTarget:
    """Fresh engine at `layout`, load (measured), parameters, one more step, parameters. A failure is
    recorded with the phase it happened in (build, load, after the load) and, for the load, whether it
    is the kind of refusal a format gives for a layout it does not promise."""
    import torch.distributed as dist

    target = dataclasses.replace(case, layout=layout)
    engine = checkpointing(make_engine(target, ctx), target.engine)
    phase = "build"
    try:
        engine.build()
        dist.barrier()
        phase = "load"
        with ctx.phase("load"), measure("load", captures_dir(case), ctx.rank, device=not ctx.on_cpu) as peak:
            engine.load_checkpoint(str(ckpt), case.params.ckpt_format)
        phase = "after the load"
        loaded, loaded_optim = engine.param_shards(), _optimizer_state(engine)
        engine.train_step(1)
        return LoadTarget(layout.id, peak, loaded, loaded_optim, engine.param_shards())
    except MeasurementError:
        raise  # the case errors: a load that was not measured is not judged
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return LoadTarget(layout.id, error=describe_exception(exc), phase=phase,
                          refusal=refusal_kind(exc) if phase == "load" else "",
                          traceback=traceback.format_exc()[-2000:])
    finally:
        del engine
        teardown_parallel_state()


def reshard_work(case: Case, ctx: RankContext) -> ContractRankData:
    import torch.distributed as dist

    ckpt = saved_checkpoint(case)
    if case.params.ckpt_role != CkptRole.RESHARD:
        return ContractRankData([_try_load(case, ctx, case.layout, ckpt)])
    if ctx.rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
    engine = checkpointing(make_engine(case, ctx), case.engine)
    with ctx.phase("build"):
        engine.build()
    with ctx.phase("steps"):
        engine.train_step(0)
    dist.barrier()
    with ctx.phase("save"):
        engine.save_checkpoint(str(ckpt), case.params.ckpt_format)
    dist.barrier()
    saved, saved_optim = engine.param_shards(), _optimizer_state(engine)
    engine.train_step(1)
    continued = engine.param_shards()
    del engine
    teardown_parallel_state()
    # the uninterrupted run: the same two steps without a save
    reference = make_engine(case, ctx)
    reference.build()
    reference.train_step(0)
    reference.train_step(1)
    uninterrupted = reference.param_shards()
    del reference
    teardown_parallel_state()
    loads = [_try_load(case, ctx, layout, ckpt) for layout in targets(case.model, case.layout.world_size)]
    return ContractRankData(loads, saved, saved_optim, continued, uninterrupted)


def _optimizer_state(engine) -> list | None:
    """The engine's optimizer state shards by global name, or None if it has no optimizer_state_shards()."""

    return engine.optimizer_state_shards() if isinstance(engine, HasOptimizerState) else None

