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
import math
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.checks import CheckResult
from harness.checks.numeric import beyond, fmt_err, nonfinite_summary, within
from harness.checks.tensors import assemble, rel_error
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.probes.memory import MIB, MeasurementError, artifacts_dir, measure
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


@dataclass(frozen=True)
class CkptCase:
    """A checkpoint case's own parameters (`Case.params` of the ckpt-memory suite)."""

    # the distributed optimizer's format (distrib_optim_sharding_type), with "fully_reshardable_mem_efficient"
    # for fully_reshardable + the mem_efficient flag, "default" for what the engine saves unasked, fsdp2_*
    ckpt_format: str = "dp_reshardable"
    fully_parallel_save: bool = False  # through megatron's fully parallel save wrapper
    async_save: bool = False  # megatron's async save: the write runs in a forked process
    # "" a memory case; "reshard" saves and loads back at other layouts of its world size; "reshard-load"
    # loads what the case it runs after (`Case.after`) saved, at another world size
    ckpt_role: str = ""


def contract_cases(name: str, model: ModelSpec, world_size: int, engine: str, backend: str,
                   options: CaseOptions, formats: tuple[str, ...] = CONTRACT_FORMATS) -> list[Case]:
    """One reshard case per format at world size 4, and one DP-only load case at world size 2."""
    if world_size != Layout.parse(SAVE_LAYOUT).world_size:
        return []
    out = []
    opts = dataclasses.replace(options, steps=2, use_distributed_optimizer=True)
    for fmt in formats:
        saver = Case(name, model, Layout.parse(SAVE_LAYOUT), engine, opts, backend,
                     params=CkptCase(fmt, ckpt_role="reshard"))
        out.append(saver)
        out.append(Case(name, model, Layout.parse(DP_ONLY_TARGET), engine, opts, backend, after=(saver.id,),
                        params=CkptCase(fmt, ckpt_role="reshard-load")))  # loads what `saver` wrote
    return out


def saved_checkpoint(case: Case) -> Path:
    """Where a reshard case writes its checkpoint, and where a reshard-load case finds the one it reads
    (the output directory of the case it runs after, resolved by the driver)."""
    if case.params.ckpt_role == "reshard":
        root = Path(case.out_dir) if case.out_dir else artifacts_dir(case.id)
    elif case.inputs:
        root = Path(case.inputs[0])
    else:  # run outside a driver run: where the saver, also run outside one, wrote it
        root = artifacts_dir(case.after[0])
    return root / "ckpt"


def _try_load(case: Case, ctx: RankContext, layout: Layout, ckpt: Path) -> dict[str, Any]:
    """Fresh engine at `layout`, load (measured), parameters, one more step, parameters. A failure is
    recorded with the phase it happened in (build, load, after the load) and, for the load, whether it
    is the kind of refusal a format gives for a layout it does not promise."""
    import torch.distributed as dist

    from harness.platform.parallel import teardown_parallel_state

    target = dataclasses.replace(case, layout=layout)
    engine = make_engine(target, ctx)
    out: dict[str, Any] = {"layout": layout.id}
    phase = "build"
    try:
        engine.build()
        dist.barrier()
        phase = "load"
        with ctx.phase("load"), measure("load", artifacts_dir(case.id), ctx.rank, device=not ctx.on_cpu) as peak:
            engine.load_checkpoint(str(ckpt), case.params.ckpt_format)
        out["load"] = peak
        phase = "after the load"
        out["loaded"] = engine.param_shards()
        out["loaded_optim"] = _optimizer_state(engine)
        engine.train_step(1)
        out["stepped"] = engine.param_shards()
    except MeasurementError:
        raise  # the case errors: a load that was not measured is not judged
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        out["error"], out["phase"] = describe_exception(exc), phase
        out["refusal"] = refusal_kind(exc) if phase == "load" else ""
        out["traceback"] = traceback.format_exc()[-2000:]
    finally:
        del engine
        teardown_parallel_state()
    return out


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside torch's CheckpointException (failures: rank -> (exc, traceback)),
    or the exception itself."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [exc]
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]


def _one_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [""])[0].strip("'\"")
    text = text.split(" from model not in state dict")[0] + (" from model not in state dict"
                                                            if "from model not in state dict" in text else "")
    return f"{type(exc).__name__}: {text[:300]}"


def describe_exception(exc: BaseException) -> str:
    """One line; for a CheckpointException, the first rank's own failure (its str() lists every rank)."""
    inner = _failures(exc)
    if inner == [exc]:
        return _one_line(exc)
    return f"{type(exc).__name__} on {len(inner)} rank(s), first: {_one_line(inner[0])}"


def refusal_kind(exc: BaseException) -> str:
    """What the load rejected when it refused the checkpoint for this layout, or '' when the exception
    is not that kind of refusal.

    Measured (megatron-core 0.16.1, torch_dist): a dp_reshardable checkpoint saved at tp1-pp1-dp4 and
    loaded at tp2-dp2 or pp2-dp2 raises torch's CheckpointException from the load, every rank's failure
    being megatron's shape validation of the flat optimizer buffers: KeyError '<optimizer.distributed...>
    from model not in state dict' (this DP group's buffer is not in the checkpoint) or
    CheckpointingException 'Global shape mismatch' (its bucket has another size). Only that is a refusal;
    anything else (an error in build, another exception) is a failure."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    inner = _failures(exc)
    for e in inner:
        text = str(e)
        if not (isinstance(e, (KeyError, CheckpointingException)) and "optimizer.distributed." in text
                and ("from model not in state dict" in text or "Global shape mismatch" in text)):
            return ""
    return f"the checkpoint's flat optimizer buffers do not fit this layout ({_one_line(inner[0])})"


def reshard_work(case: Case, ctx: RankContext) -> dict[str, Any]:
    import torch.distributed as dist

    from harness.platform.parallel import teardown_parallel_state

    data: dict[str, Any] = {"targets": []}
    if case.params.ckpt_role == "reshard":
        ckpt = saved_checkpoint(case)
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
            engine.save_checkpoint(str(ckpt), case.params.ckpt_format)
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
        ckpt = saved_checkpoint(case)
        targets = [case.layout]
    for layout in targets:
        data["targets"].append(_try_load(case, ctx, layout, ckpt))
    return data


def check_reshard(results: list[CaseResult]) -> list[CheckResult]:
    """Per format and target layout: loads where promised, with the saved values."""
    out: list[CheckResult] = []
    ran = {r.case.id: r for r in results}
    for res in results:
        role, fmt = res.case.params.ckpt_role, res.case.params.ckpt_format
        if not role:
            continue
        if not res.ok:
            lines = (res.error or "failed").splitlines()
            out.append(CheckResult("ckpt-memory.reshard", res.case.id, False, lines[0], lines[1:]))
            continue
        src_id = res.case.id if role == "reshard" else res.case.after[0]
        src = ran.get(src_id)
        if src is None or not src.ok:
            out.append(CheckResult("ckpt-memory.reshard", res.case.id, False,
                                   f"{fmt}: the case that saves ({src_id}) did not run, nothing to load"))
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
            out.append(_judge(res, fmt, src.case.layout, per_rank, saved, reference, saved_optim))
    return out


def _optimizer_state(engine) -> list | None:
    """The engine's optimizer state shards by global name, or None if it has no optimizer_state_shards()."""
    shards = getattr(engine, "optimizer_state_shards", None)
    return shards() if callable(shards) else None


def _assemble_optional(per_rank: list) -> dict | None:
    """Full optimizer-state tensors by `<name>#<key>`, or None when an engine did not report them."""
    if any(p is None for p in per_rank):
        return None
    return assemble(per_rank).tensors


def _worst(err: dict[str, float]) -> tuple[str, float]:
    """The name with the largest error; a NaN error counts as the largest."""
    name = next((n for n, e in err.items() if math.isnan(e)), None) or max(err, key=err.get)
    return name, err[name]


def _nonfinite(name: str, tensors: dict) -> str:
    """' (n/total elements non-finite ...)' when the named tensor holds NaN / Inf, else ''."""
    count, text = nonfinite_summary({name: tensors[name]}) if name in tensors else (0, "")
    return f" ({text})" if count else ""


def _optimizer_diff(loaded: dict, saved: dict) -> tuple[str, str]:
    """(row, failure message or ''): loaded Adam state against the saved, bit for bit."""
    if set(loaded) != set(saved):
        diff = sorted(set(loaded) ^ set(saved))[:5]
        return f"  optimizer state names differ: {diff}", f"optimizer state names differ from the saved ones: {diff}"
    err = {n: rel_error(loaded[n], saved[n]) for n in saved}
    worst, worst_err = _worst(err)
    row = f"  loaded optimizer state == saved: worst {worst} rel {fmt_err(worst_err)} (must be 0)"
    if within(worst_err, 0):
        return row, ""
    steps = sorted(n for n in err if n.endswith("#step") and beyond(err[n], 0))
    if steps and math.isfinite(worst_err):  # the step is a scalar: say the values
        n = steps[0]
        return row, (f"optimizer state differs from the saved one: Adam step of {n[:-5]} is "
                     f"{float(loaded[n][0]):g} after the load, {float(saved[n][0]):g} saved ({len(steps)} parameters)")
    return row, (f"optimizer state differs from the saved one: {worst} rel {fmt_err(worst_err)} (must be 0)"
                 + _nonfinite(worst, loaded))


def _judge(res: CaseResult, fmt: str, src: Layout, per_rank: list[dict], saved, reference,
           saved_optim: dict | None = None) -> CheckResult:
    target = Layout.parse(per_rank[0]["layout"])
    promise = promised(fmt, src, target)
    head = f"{fmt} saved at {src.id}, loaded at {target.id} ({'promised' if promise else 'not promised'})"
    errors = [(r.rank, d) for r, d in zip(res.ranks, per_rank) if "error" in d]
    cid = f"{res.case.id}->{target.id}"
    if errors:
        return _judge_error(cid, head, promise, errors)
    loaded = assemble([d["loaded"] for d in per_rank]).tensors
    stepped = assemble([d["stepped"] for d in per_rank]).tensors
    peaks = " ".join(f"{d['load'].heap_peak / MIB:.0f}" for d in per_rank)
    if set(loaded) != set(saved):
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: parameter names differ from the saved ones: {sorted(set(loaded) ^ set(saved))[:5]}")
    worst_load, load_err = _worst({n: rel_error(loaded[n], saved[n]) for n in saved})
    worst_step, step_err = _worst({n: rel_error(stepped[n], reference[n]) for n in reference})
    rows = [f"  load host peak MiB/rank: {peaks}",
            f"  loaded == saved: worst {worst_load} rel {fmt_err(load_err)} (must be 0)",
            f"  one step after the load == the uninterrupted run: worst {worst_step} rel "
            f"{fmt_err(step_err)} (<= {STEP_RTOL:.0e})"]
    loaded_optim = _assemble_optional([d.get("loaded_optim") for d in per_rank])
    if loaded_optim is None or saved_optim is None:
        optim_msg = ("Adam state not compared: the engine has no optimizer_state_shards() (exp_avg, exp_avg_sq "
                     "and step after the load cannot be checked)")
        optim_row = "  optimizer state: " + optim_msg
    else:
        optim_row, optim_msg = _optimizer_diff(loaded_optim, saved_optim)
    rows.insert(2, optim_row)
    if beyond(load_err, 0):
        msg = (f"model parameters differ from the saved ones: {worst_load} rel {fmt_err(load_err)} (must be 0)"
               + _nonfinite(worst_load, loaded))
    elif optim_msg:
        msg = optim_msg
    elif beyond(step_err, STEP_RTOL):
        msg = (f"the step after the load differs from the uninterrupted run (optimizer state not restored?): "
               f"{worst_step} rel {fmt_err(step_err)} > {STEP_RTOL:.0e}" + _nonfinite(worst_step, stepped))
    else:
        return CheckResult("ckpt-memory.reshard", cid, True,
                           f"{head}: loads with the saved values; step after load rel {fmt_err(step_err)}",
                           rows, value=step_err, show=True)
    if not promise:
        msg = "loaded without error but wrong (silent corruption): " + msg
    return CheckResult("ckpt-memory.reshard", cid, False, f"{head}: {msg}", rows, value=step_err)


def _judge_error(cid: str, head: str, promise: bool, errors: list[tuple[int, dict]]) -> CheckResult:
    """A target where some rank raised: a pass only where the format does not promise the layout and
    every failing rank's exception came from the load and is the expected refusal."""
    rank, d = errors[0]
    tb = (d.get("traceback") or "").splitlines()[-12:]
    where = d.get("phase", "?")
    if promise:
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: load failed on rank {rank} in the {where}: {d['error']}", tb)
    wrong = [(r, e) for r, e in errors if e.get("phase") != "load" or not e.get("refusal")]
    if not wrong:
        return CheckResult("ckpt-memory.reshard", cid, True, f"{head}: refused as the format allows: {d['refusal']}")
    rank, d = wrong[0]
    tb = (d.get("traceback") or "").splitlines()[-12:]
    if d.get("phase") != "load":
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: failed on rank {rank} in the {d.get('phase', '?')}, before any load: {d['error']} "
                           f"(a refusal must come from the load)", tb)
    return CheckResult("ckpt-memory.reshard", cid, False,
                       f"{head}: the load failed on rank {rank} with an unexpected error: {d['error']} (a refusal is "
                       f"the load rejecting the checkpoint's optimizer buffers for this layout)", tb)


def _judge_side_effects(res: CaseResult, fmt: str, continued, reference) -> CheckResult:
    worst, err = _worst({n: rel_error(continued[n], reference[n]) for n in reference})
    ok = within(err, STEP_RTOL)
    return CheckResult("ckpt-memory.save-side-effects", res.case.id, ok,
                       f"{fmt}: the step after the save {'equals' if ok else 'differs from'} the uninterrupted run: "
                       f"worst {worst} rel {fmt_err(err)} {'<=' if ok else 'not <='} {STEP_RTOL:.0e}"
                       + ("" if ok else _nonfinite(worst, continued) + " - the save changed the training state"),
                       value=err)
