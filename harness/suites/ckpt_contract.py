"""The checkpoint contract of the ckpt-memory suite: a checkpoint saved at one layout loads at another
wherever its format promises it, with the values it saved.

dp_reshardable promises DP changes only; fully_reshardable (mem_efficient or not) promises TP, PP and
DP changes. A "reshard" case saves after one training step at its layout and takes a second step
there, which must equal an uninterrupted run of both steps (a save has no side effects). Then, for
every target layout of its world size (itself included), it builds a fresh engine, loads (host
peak measured), compares the loaded parameters and takes the same second step. A "reshard-load"
case does the same at another world size from the reshard case's checkpoint (the DP-only change).
The parent compares full parameters and Adam state (exp_avg, exp_avg_sq, step) by global name:
loaded == saved bit for bit, and after the second step == the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import shutil
import traceback
from pathlib import Path
from typing import Any

from harness.checks import CheckResult
from harness.checks.tensors import assemble, rel_error
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.probes.memory import MIB, artifacts_dir, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec

CONTRACT_FORMATS = ("dp_reshardable", "fully_reshardable")
SAVE_LAYOUT = "tp1-pp1-cp1-dp4"
TARGETS = ("tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp2")  # same world size as the save
DP_ONLY_TARGET = "tp1-pp1-cp1-dp2"  # another world size: DP 4 -> 2, nothing else changes
# loaded values are copies (bit-identical); the step after the load differs only by reduction order
STEP_RTOL = 1e-5


def promised(fmt: str, saved: Layout, target: Layout) -> bool:
    """Whether the format promises loading a checkpoint saved at `saved` at `target`."""
    if fmt.startswith("fully_reshardable"):
        return True
    return (saved.tp, saved.pp, saved.vpp) == (target.tp, target.pp, target.vpp)  # dp_reshardable: DP only


def contract_cases(name: str, model: ModelSpec, world_size: int, engine: str, backend: str,
                   options: CaseOptions, formats: tuple[str, ...] = CONTRACT_FORMATS) -> list[Case]:
    """One reshard case per format at world size 4, and one DP-only load case at world size 2."""
    if world_size != Layout.parse(SAVE_LAYOUT).world_size:
        return []
    out = []
    for fmt in formats:
        base = {**dataclasses.asdict(options), "steps": 2, "use_distributed_optimizer": True, "ckpt_format": fmt}
        base["seqlens"] = tuple(base["seqlens"])
        saver = Case(name, model, Layout.parse(SAVE_LAYOUT), engine, CaseOptions(**{**base, "ckpt_role": "reshard"}),
                     backend)
        out.append(saver)
        out.append(Case(name, model, Layout.parse(DP_ONLY_TARGET), engine,
                        CaseOptions(**{**base, "ckpt_role": "reshard-load", "ckpt_source": SAVE_LAYOUT}), backend,
                        after=(saver.id,)))  # loads what `saver` wrote
    return out


def shared_dir(case: Case, source: str) -> Path:
    """Where the reshard case's checkpoint lives for the load cases: in the run's own directory
    (outside any case's workdir; a concurrent run has its own)."""
    sub = f"reshard/{case.engine}/{case.model.name}/{case.options.ckpt_format}/{source}".replace(":", "_")
    if case.run_dir:
        path = Path(case.run_dir) / sub
        path.mkdir(parents=True, exist_ok=True)
        return path / "ckpt"
    return artifacts_dir(sub) / "ckpt"


def _try_load(case: Case, ctx: RankContext, layout: Layout, ckpt: Path) -> dict[str, Any]:
    """Fresh engine at `layout`, load (measured), parameters, one more step, parameters."""
    import torch.distributed as dist

    from harness.platform.parallel import teardown_parallel_state

    target = dataclasses.replace(case, layout=layout)
    engine = make_engine(target, ctx)
    out: dict[str, Any] = {"layout": layout.id}
    try:
        engine.build()
        dist.barrier()
        with ctx.phase("load"), measure("load", artifacts_dir(case.id), ctx.rank, device=not ctx.on_cpu) as peak:
            engine.load_checkpoint(str(ckpt), case.options.ckpt_format)
        out["load"] = peak
        out["loaded"] = engine.param_shards()
        out["loaded_optim"] = _optimizer_state(engine)
        engine.train_step(1)
        out["stepped"] = engine.param_shards()
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out["traceback"] = traceback.format_exc()[-2000:]
    finally:
        del engine
        teardown_parallel_state()
    return out


def reshard_work(case: Case, ctx: RankContext) -> dict[str, Any]:
    import torch.distributed as dist

    from harness.platform.parallel import teardown_parallel_state

    data: dict[str, Any] = {"targets": []}
    if case.options.ckpt_role == "reshard":
        ckpt = shared_dir(case, case.layout.id)
        if ctx.rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
            ckpt.mkdir(parents=True)
        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        with ctx.phase("steps"):
            engine.train_step(0)
        dist.barrier()
        with ctx.phase("save"):
            engine.save_checkpoint(str(ckpt), case.options.ckpt_format)
        dist.barrier()
        data["saved"] = engine.param_shards()
        data["saved_optim"] = _optimizer_state(engine)
        engine.train_step(1)
        data["continued"] = engine.param_shards()
        del engine
        teardown_parallel_state()
        # the uninterrupted run: the same two steps without a save
        engine = make_engine(case, ctx)
        engine.build()
        engine.train_step(0)
        engine.train_step(1)
        data["reference"] = engine.param_shards()
        del engine
        teardown_parallel_state()
        targets = [Layout.parse(t) for t in TARGETS if Layout.parse(t).world_size == case.layout.world_size]
    else:
        ckpt = shared_dir(case, case.options.ckpt_source)
        targets = [case.layout]
    for layout in targets:
        data["targets"].append(_try_load(case, ctx, layout, ckpt))
    return data


def check_reshard(results: list[CaseResult]) -> list[CheckResult]:
    """Per format and target layout: loads where promised, with the saved values."""
    out: list[CheckResult] = []
    sources = {(r.case.options.ckpt_format, r.case.layout.id): r for r in results
               if r.case.options.ckpt_role == "reshard" and r.ok}
    for res in results:
        role, fmt = res.case.options.ckpt_role, res.case.options.ckpt_format
        if not role:
            continue
        if not res.ok:
            lines = (res.error or "failed").splitlines()
            out.append(CheckResult("ckpt-memory.reshard", res.case.id, False, lines[0], lines[1:]))
            continue
        src_id = res.case.layout.id if role == "reshard" else res.case.options.ckpt_source
        src = sources.get((fmt, src_id))
        if src is None:
            out.append(CheckResult("ckpt-memory.reshard", res.case.id, False,
                                   f"{fmt}: the case that saves at {src_id} did not run, nothing to load"))
            continue
        saved = assemble([r.data["saved"] for r in src.ranks]).tensors
        saved_optim = _assemble_optional([r.data.get("saved_optim") for r in src.ranks])
        reference = assemble([r.data["reference"] for r in src.ranks]).tensors
        if role == "reshard":
            out.append(_judge_side_effects(res, fmt, assemble([r.data["continued"] for r in src.ranks]).tensors,
                                           reference))
        n_targets = len(res.ranks[0].data["targets"])
        for i in range(n_targets):
            per_rank = [r.data["targets"][i] for r in res.ranks]
            out.append(_judge(res, fmt, Layout.parse(src_id), per_rank, saved, reference, saved_optim))
    return out


def _optimizer_state(engine) -> list | None:
    """The engine's optimizer state shards by global name, or None if it cannot say."""
    return engine.optimizer_state_shards() if hasattr(engine, "optimizer_state_shards") else None


def _assemble_optional(per_rank: list) -> dict | None:
    """Full optimizer-state tensors by `<name>#<key>`, or None when an engine did not report them."""
    if any(p is None for p in per_rank):
        return None
    return assemble(per_rank).tensors


def _optimizer_diff(loaded: dict, saved: dict) -> tuple[str, str]:
    """(row, failure message or ''): loaded Adam state against the saved, bit for bit."""
    if set(loaded) != set(saved):
        diff = sorted(set(loaded) ^ set(saved))[:5]
        return f"  optimizer state names differ: {diff}", f"optimizer state names differ from the saved ones: {diff}"
    err = {n: rel_error(loaded[n], saved[n]) for n in saved}
    worst = max(err, key=err.get)
    row = f"  loaded optimizer state == saved: worst {worst} rel {err[worst]:.2e} (must be 0)"
    if err[worst] == 0:
        return row, ""
    steps = sorted(n for n in err if n.endswith("#step") and err[n] > 0)
    if steps:  # the step is a scalar: say the values
        n = steps[0]
        return row, (f"optimizer state differs from the saved one: Adam step of {n[:-5]} is "
                     f"{float(loaded[n][0]):g} after the load, {float(saved[n][0]):g} saved ({len(steps)} parameters)")
    return row, f"optimizer state differs from the saved one: {worst} rel {err[worst]:.2e}"


def _judge(res: CaseResult, fmt: str, src: Layout, per_rank: list[dict], saved, reference,
           saved_optim: dict | None = None) -> CheckResult:
    target = Layout.parse(per_rank[0]["layout"])
    promise = promised(fmt, src, target)
    head = f"{fmt} saved at {src.id}, loaded at {target.id} ({'promised' if promise else 'not promised'})"
    errors = [(r.rank, d["error"]) for r, d in zip(res.ranks, per_rank) if "error" in d]
    cid = f"{res.case.id}->{target.id}"
    if errors:
        rank, err = errors[0]
        if promise:
            tb = next(d["traceback"] for d in per_rank if "traceback" in d).splitlines()
            return CheckResult("ckpt-memory.reshard", cid, False, f"{head}: load failed on rank {rank}: {err}", tb[-12:])
        return CheckResult("ckpt-memory.reshard", cid, True, f"{head}: refused as the format allows: {err}")
    loaded = assemble([d["loaded"] for d in per_rank]).tensors
    stepped = assemble([d["stepped"] for d in per_rank]).tensors
    peaks = " ".join(f"{d['load'].heap_peak / MIB:.0f}" for d in per_rank)
    if set(loaded) != set(saved):
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: parameter names differ from the saved ones: {sorted(set(loaded) ^ set(saved))[:5]}")
    load_err = {n: rel_error(loaded[n], saved[n]) for n in saved}
    step_err = {n: rel_error(stepped[n], reference[n]) for n in reference}
    worst_load, worst_step = max(load_err, key=load_err.get), max(step_err, key=step_err.get)
    rows = [f"  load host peak MiB/rank: {peaks}",
            f"  loaded == saved: worst {worst_load} rel {load_err[worst_load]:.2e} (must be 0)",
            f"  one step after the load == the uninterrupted run: worst {worst_step} rel "
            f"{step_err[worst_step]:.2e} (<= {STEP_RTOL:.0e})"]
    loaded_optim = _assemble_optional([d.get("loaded_optim") for d in per_rank])
    optim_row, optim_msg = ("  optimizer state: not compared (the engine has no optimizer_state_shards)", "") \
        if loaded_optim is None or saved_optim is None else _optimizer_diff(loaded_optim, saved_optim)
    rows.insert(2, optim_row)
    if load_err[worst_load] > 0:
        msg = f"model parameters differ from the saved ones: {worst_load} rel {load_err[worst_load]:.2e}"
    elif optim_msg:
        msg = optim_msg
    elif step_err[worst_step] > STEP_RTOL:
        msg = (f"the step after the load differs from the uninterrupted run (optimizer state not restored?): "
               f"{worst_step} rel {step_err[worst_step]:.2e} > {STEP_RTOL:.0e}")
    else:
        return CheckResult("ckpt-memory.reshard", cid, True,
                           f"{head}: loads with the saved values; step after load rel {step_err[worst_step]:.2e}",
                           rows, value=step_err[worst_step], show=True)
    if not promise:
        msg = "loaded without error but wrong (silent corruption): " + msg
    return CheckResult("ckpt-memory.reshard", cid, False, f"{head}: {msg}", rows, value=step_err[worst_step])


def _judge_side_effects(res: CaseResult, fmt: str, continued, reference) -> CheckResult:
    err = {n: rel_error(continued[n], reference[n]) for n in reference}
    worst = max(err, key=err.get)
    ok = err[worst] <= STEP_RTOL
    return CheckResult("ckpt-memory.save-side-effects", res.case.id, ok,
                       f"{fmt}: the step after the save {'equals' if ok else 'differs from'} the uninterrupted run: "
                       f"worst {worst} rel {err[worst]:.2e} {'<=' if ok else '>'} {STEP_RTOL:.0e}"
                       + ("" if ok else " - the save changed the training state"), value=err[worst])
