"""Checkpoint-contract judges of ckpt-memory: loads where the format promises, saved values, no save side effects."""

from __future__ import annotations

import dataclasses
import math

from harness.backends import Backend
from harness.checks import CheckResult, cannot_tell, case_failed
from harness.checks.memory_model import device_load_band, device_load_blind_spot, load_band, load_blind_spot
from harness.checks.numeric import beyond, fmt_err, nonfinite_summary, within
from harness.checks.tensors import assemble, rel_error
from harness.dtypes import DType, dtype
from harness.launch.results import CaseResult
from harness.probes.memory import MIB
from harness.spec import Layout
from harness.suite_defs.ckpt_memory.params import CkptRole
from harness.suite_defs.ckpt_memory.payload import ContractRankData, LoadTarget

# Loaded values are copies (bit-identical). The step after a load at another layout differs by that layout's
# reduction order, as any two layouts do: compared at the case dtype's tolerance across layouts (DType.rtol; bf16's
# measured against a planted lost update in docs/suites.md). The step after a save runs at the layout that saved,
# with the uninterrupted run's reductions: compared at fp32's 1e-5 in every dtype.
SAME_LAYOUT_RTOL = 1e-5


def promised(fmt: str, saved: Layout, target: Layout) -> bool:
    """Whether the format promises loading a checkpoint saved at `saved` at `target`."""
    if fmt.startswith("fully_reshardable"):
        # any layout, but not across EP 1 <-> EP > 1: megatron (0.16.1, main of 2026-08) steps an MoE model at
        # EP > 1 with a ChainedOptimizer of a dense and an expert optimizer and saves and loads one state per
        # sub-optimizer, while at EP 1 a single optimizer holds the experts
        return (saved.ep > 1) == (target.ep > 1)
    # dp_reshardable: DP only (the expert grid's EP and ETP kept: they decide the expert optimizer's buffers)
    return ((saved.tp, saved.pp, saved.vpp, saved.ep, saved.expert_tp)
            == (target.tp, target.pp, target.vpp, target.ep, target.expert_tp))


def check_reshard(results: list[CaseResult]) -> list[CheckResult]:
    """Per format and target layout: loads where promised, with the saved values."""
    out: list[CheckResult] = []
    ran = {r.case.id: r for r in results}
    for res in results:
        role, fmt = res.case.params.ckpt_role, res.case.params.ckpt_format
        if not role:
            continue
        if not res.ok:
            out.append(case_failed("ckpt-memory.reshard", res))
            continue
        src_id = res.case.id if role == CkptRole.RESHARD else res.case.after[0]
        src = ran.get(src_id)
        if src is None or not src.ok:
            out.append(CheckResult("ckpt-memory.reshard", res.case.id, False,
                                   f"{fmt}: the case that saves ({src_id}) did not run, nothing to load"))
            continue
        source = [r.payload_as(ContractRankData) for r in src.ranks]
        saved = assemble([d.saved for d in source]).tensors
        saved_optim = _assemble_optional([d.saved_optim for d in source])
        reference = assemble([d.reference for d in source]).tensors
        if role == CkptRole.RESHARD:
            out.append(_judge_side_effects(res, fmt, assemble([d.continued for d in source]).tensors, reference))
        loads = [r.payload_as(ContractRankData).targets for r in res.ranks]
        for i in range(len(loads[0])):
            per_rank = [rank_loads[i] for rank_loads in loads]
            at = Layout.parse(per_rank[0].layout).id  # the checks of this load name the layout it loaded at
            out.append(dataclasses.replace(_judge(res, fmt, src.case.layout, per_rank, saved, reference, saved_optim),
                                           target=at))
            if not any(d.error for d in per_rank):
                out.append(dataclasses.replace(judge_load_peak(res, fmt, per_rank), target=at))
    return out


def judge_load_peak(res: CaseResult, fmt: str, per_rank: list[LoadTarget]) -> CheckResult:
    """Every rank's load peak against the memory model's band: on CPU ranks the host peak (the state lives on the
    host), on GPU ranks the device peak above the load's start (the host peak shown beside it, not judged)."""

    target = Layout.parse(per_rank[0].layout)
    cid = res.case.id
    head = f"{fmt} loaded at {target.id}"
    rows, outside, blind = [], [], []
    device = res.case.backend == Backend.NCCL
    what = "device peak above its start" if device else "host peak"
    if device and res.case.options.dtype != DType.fp32:
        peaks = [f"  rank {r.rank}: load device peak above its start {d.load.device_peak / MIB:.1f} MiB (host peak "
                 f"{d.load.host_peak / MIB:.1f} MiB)" for r, d in zip(res.ranks, per_rank) if d.load is not None]
        return cannot_tell("ckpt-memory.load", cid, f"{head}: the device load model is of fp32 state, this case "
                                                    f"trains in {res.case.options.dtype}", peaks)
    for r, d in zip(res.ranks, per_rank):
        assert d.load is not None  # a load without error was measured (MeasurementError fails the case)
        model, rank = res.case.model, r.rank
        if device:
            band = device_load_band(fmt, model, target, rank)
            peak = d.load.device_peak
            why = device_load_blind_spot(fmt, model, target, rank)
            beside = f" (host peak {d.load.host_peak / MIB:.1f} MiB)"
        else:
            band, peak, why = load_band(fmt, model, target, rank), d.load.host_peak, load_blind_spot(fmt, model,
                                                                                                  target, rank)
            beside = ""
        ok = band.contains(peak)
        rows.append(f"  rank {rank}: load {what} {peak / MIB:.1f} MiB{beside}, model {band.describe()} "
                    f"{'ok' if ok else 'OUTSIDE'}")
        if not ok:
            outside.append((rank, peak, band))
        if why:
            blind.append(why)
    if outside:
        rank, peak, band = outside[0]
        return CheckResult("ckpt-memory.load", cid, False,
                           f"{head}: rank {rank} load {what} {peak / MIB:.1f} MiB outside the load band "
                           f"{band.describe()} ({len(outside)} of {len(per_rank)} ranks)", rows)
    if len(blind) == len(per_rank):
        return cannot_tell("ckpt-memory.load", cid, f"{head}: every rank inside its load band, but {blind[0]}", rows)
    return CheckResult("ckpt-memory.load", cid, True, f"{head}: every rank's load {what} inside its load band",
                       rows, show=True)


def _assemble_optional(per_rank: list) -> dict | None:
    """Full optimizer-state tensors by `<name>#<key>`, or None when an engine did not report them."""
    if any(p is None for p in per_rank):
        return None
    return assemble(per_rank).tensors


def _worst(err: dict[str, float]) -> tuple[str, float]:
    """The name with the largest error; a NaN error counts as the largest."""
    name = next((n for n, e in err.items() if math.isnan(e)), None) or max(err, key=err.__getitem__)
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


def _judge(res: CaseResult, fmt: str, src: Layout, per_rank: list[LoadTarget], saved, reference,
           saved_optim: dict | None = None) -> CheckResult:
    target = Layout.parse(per_rank[0].layout)
    promise = promised(fmt, src, target)
    head = f"{fmt} saved at {src.id}, loaded at {target.id} ({'promised' if promise else 'not promised'})"
    errors = [(r.rank, d) for r, d in zip(res.ranks, per_rank) if d.error]
    cid = res.case.id
    if errors:
        return _judge_error(cid, head, promise, errors)
    loaded = assemble([d.loaded for d in per_rank]).tensors
    stepped = assemble([d.stepped for d in per_rank]).tensors
    peaks = " ".join(f"{d.load.host_peak / MIB:.1f}" if d.load else "?" for d in per_rank)
    if set(loaded) != set(saved):
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: parameter names differ from the saved ones: "
                           f"{sorted(set(loaded) ^ set(saved))[:5]}")
    worst_load, load_err = _worst({n: rel_error(loaded[n], saved[n]) for n in saved})
    worst_step, step_err = _worst({n: rel_error(stepped[n], reference[n]) for n in reference})
    rtol = dtype(res.case.options.dtype).rtol
    rows = [f"  load host peak MiB/rank: {peaks}",
            f"  loaded == saved: worst {worst_load} rel {fmt_err(load_err)} (must be 0)",
            f"  one step after the load == the uninterrupted run: worst {worst_step} rel "
            f"{fmt_err(step_err)} (<= {rtol:.0e}, {res.case.options.dtype})"]
    loaded_optim = _assemble_optional([d.loaded_optim for d in per_rank])
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
    elif beyond(step_err, rtol):
        msg = (f"the step after the load differs from the uninterrupted run (optimizer state not restored?): "
               f"{worst_step} rel {fmt_err(step_err)} > {rtol:.0e}" + _nonfinite(worst_step, stepped))
    else:
        return CheckResult("ckpt-memory.reshard", cid, True,
                           f"{head}: loads with the saved values; step after load rel {fmt_err(step_err)}",
                           rows, value=step_err, show=True)
    if not promise:
        msg = "loaded without error but wrong (silent corruption): " + msg
    return CheckResult("ckpt-memory.reshard", cid, False, f"{head}: {msg}", rows, value=step_err)


def _judge_error(cid: str, head: str, promise: bool, errors: list[tuple[int, LoadTarget]]) -> CheckResult:
    """A target where some rank raised: a pass only where the format does not promise the layout and
    every failing rank's exception came from the load and is the expected refusal."""
    rank, d = errors[0]
    tb = d.traceback.splitlines()[-12:]
    if promise:
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: load failed on rank {rank} in the {d.phase or '?'}: {d.error}", tb)
    wrong = [(r, e) for r, e in errors if e.phase != "load" or not e.refusal]
    if not wrong:
        return CheckResult("ckpt-memory.reshard", cid, True, f"{head}: refused as the format allows: {d.refusal}")
    rank, d = wrong[0]
    tb = d.traceback.splitlines()[-12:]
    if d.phase != "load":
        return CheckResult("ckpt-memory.reshard", cid, False,
                           f"{head}: failed on rank {rank} in the {d.phase or '?'}, before any load: {d.error} "
                           f"(a refusal must come from the load)", tb)
    return CheckResult("ckpt-memory.reshard", cid, False,
                       f"{head}: the load failed on rank {rank} with an unexpected error: {d.error} (a refusal is "
                       f"the load rejecting the checkpoint's optimizer buffers for this layout)", tb)


def _judge_side_effects(res: CaseResult, fmt: str, continued, reference) -> CheckResult:
    worst, err = _worst({n: rel_error(continued[n], reference[n]) for n in reference})
    ok = within(err, SAME_LAYOUT_RTOL)
    return CheckResult("ckpt-memory.save-side-effects", res.case.id, ok,
                       f"{fmt}: the step after the save {'equals' if ok else 'differs from'} the uninterrupted run: "
                       f"worst {worst} rel {fmt_err(err)} {'<=' if ok else 'not <='} {SAME_LAYOUT_RTOL:.0e}"
                       + ("" if ok else _nonfinite(worst, continued) + " - the save changed the training state"),
                       value=err)
