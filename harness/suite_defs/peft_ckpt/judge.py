"""The peft-ckpt judges: the exported adapter against PEFT, the Megatron model, the pure-DP export, export memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.checks import Agreement, CheckResult, HostPeaks, ParamErrors, cannot_tell, case_failed
from harness.checks.numeric import beyond, fmt_err, severity, within
from harness.checks.step_outputs import HF_LOGPROB_RTOL as LOGPROB_RTOL
from harness.checks.step_outputs import (
    LogprobDiff,
    TrainedRankData,
    assemble_logprobs,
    coverage_problem,
    first_step_logprobs,
)
from harness.checks.tensors import assemble, rel_error
from harness.dtypes import DType, dtype
from harness.engines.base import ParamShard, StepOutput
from harness.engines.lora import CONFIG_FILE, adapter_values, expected_hf_adapter, hf_target_modules
from harness.launch.results import CaseResult, RankResult
from harness.probes.memory import MIB, MemoryPeak
from harness.spec import ModelSpec


@dataclass(frozen=True)
class Reload:
    """An adapter loaded into a fresh Megatron model at another layout: the held-out batch's outputs, or where
    and why it failed (refusal: the kind of refusal a format gives for a layout it does not promise)."""

    layout: str
    coords: dict[str, int] = field(default_factory=dict)
    eval: list[StepOutput] = field(default_factory=list)
    error: str = ""
    phase: str = ""  # build | load | after the load
    refusal: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class PeftRankData(TrainedRankData):
    """What a peft-ckpt rank returns: its training steps (TrainedRankData) and the held-out batch's outputs, the
    export's host peak, rank 0's HF + PEFT side (hf_side: tensors, config, log-probs; None elsewhere), the
    model's adapter shards, and the two reloads (the HF PEFT export; the adapter-only distributed checkpoint)."""

    eval: list[StepOutput] = field(default_factory=list)
    export: MemoryPeak | None = None
    hf: dict[str, Any] | None = None
    adapters: list[ParamShard] = field(default_factory=list)
    roundtrip: Reload | None = None
    legacy: Reload | None = None


def peft_data(rank: RankResult) -> PeftRankData:
    return rank.payload_as(PeftRankData)


def _held_out(data: TrainedRankData) -> list[StepOutput]:
    return data.eval if isinstance(data, PeftRankData) else []

# B starts at zero, so after two steps it is all update: on `small` the row-parallel o_proj's B at TP2
# (its adapter input summed over TP in another order) differed from pure DP by 1.4e-5 (measured); a
# wrong split or de-interleave moves whole rows, rel ~1
EXPORT_RTOL = 1e-4
EXPORT_COPY_RTOL = 0.0  # the export copies the model's adapter values: bit for bit
# after STEPS steps of Adam at lr 1e-3 the adapter moves log-probs by ~1e-3 (measured); a no-op adapter
# (B still zero, scaling 0, adapters dropped) moves them by 0
NOOP_MIN = 1e-4
# export host peak per rank: every adapter tensor once on every rank (the bridge gathers them), once
# more in rank 0's serialised safetensors buffer, plus the conversion's fixed cost (first export of a
# fresh rank: 2.0 MiB on `tiny`, whose adapter is 0.06 MiB - lazy imports, conversion tasks, PP broadcasts)
EXPORT_COPIES = 3
EXPORT_FIXED = 4 * MIB


def export_bound(model: ModelSpec, dim: int) -> int:
    return EXPORT_COPIES * 4 * adapter_values(model, dim) + EXPORT_FIXED


def check(results: list[CaseResult]) -> list[CheckResult]:
    if not results:
        return []
    ref = results[0]
    ref_hf = _hf(ref) if ref.ok else None
    out: list[CheckResult] = []
    for res in results:
        if not res.ok:
            out.append(case_failed("peft-ckpt.run", res))
            continue
        hf = _hf(res)
        out.append(_check_valid(res, hf))
        out.append(_check_tensors(res, hf))
        out.append(_check_replicas(res))
        out.append(_check_logprobs(res, hf))
        out.append(_check_memory(res))
        out.append(_check_reload(res, "roundtrip"))
        out.append(_check_reload(res, "legacy"))
        if res is not ref:
            out.append(_check_export(res, hf, ref, ref_hf))
        elif len(results) == 1:  # one layout (world size 1): no other export to hold this one against
            out.append(export_alone(res))
    return out


def export_alone(res: CaseResult) -> CheckResult:
    """The export check of a run with one layout: there is nothing to compare the export with."""
    return cannot_tell("peft-ckpt.export", res.case.id,
                       f"{res.case.layout.id} is the only layout of the run, and the export is judged against the "
                       f"pure-DP export of other layouts: needs world size 2 or more")


def _check_valid(res: CaseResult, hf: dict) -> CheckResult:
    cid, lay, o = res.case.id, res.case.layout.id, res.case.options
    name = "peft-ckpt.valid"
    if "load_error" in hf:
        return CheckResult(name, cid, False, f"{lay}: PEFT refused the exported adapter: {hf['load_error']}")
    cfg = hf["config"]
    want: dict[str, Any] = {"peft_type": "LORA", "r": o.lora_dim, "lora_alpha": o.lora_alpha, "lora_dropout": 0.0,
            "target_modules": hf_target_modules(swiglu=res.case.model.swiglu)}
    got = {k: sorted(cfg.get(k)) if k == "target_modules" and isinstance(cfg.get(k), list) else cfg.get(k)
           for k in want}
    # a check judges what the engine under test produced: fields the harness wrote itself are not a pass
    harness_config = hf.get("config_by") == "harness"
    problems = [] if harness_config else \
        [f"{CONFIG_FILE} {k} = {got[k]!r}, configured {want[k]!r}" for k in want if got[k] != want[k]]
    if hf["missing"]:
        problems.append(f"{len(hf['missing'])} adapter keys PEFT expects are missing, first {hf['missing'][0]}")
    if hf["unexpected"]:
        problems.append(f"{len(hf['unexpected'])} keys PEFT does not expect, first {hf['unexpected'][0]}")
    if hf["base_missing"] or hf["base_unexpected"]:
        problems.append(f"base weights do not fit the Hugging Face model (missing {hf['base_missing'][:3]}, "
                        f"unexpected {hf['base_unexpected'][:3]})")
    if problems:
        return CheckResult(name, cid, False, f"{lay}: " + "; ".join(problems[:2]),
                           [f"  {p}" for p in problems])
    if harness_config:
        return CheckResult(name, cid, True, f"{lay}: PEFT {hf['peft_version']} loads the {len(hf['tensors'])} adapter "
                                            f"tensors the engine exported, no missing or unexpected key; "
                                            f"{CONFIG_FILE} was written by the harness (the engine exports tensors "
                                            f"only), so its fields are not judged")
    return CheckResult(name, cid, True, f"{lay}: PEFT {hf['peft_version']} loads {len(hf['tensors'])} adapter "
                                        f"tensors, no missing or unexpected key; r={o.lora_dim}, "
                                        f"lora_alpha={o.lora_alpha}, {len(want['target_modules'])} target modules")


def _check_tensors(res: CaseResult, hf: dict) -> CheckResult:
    """Every exported tensor against the Megatron model's own adapter parameters, mapped to HF names by
    the harness's arithmetic: names the tensor a wrong split, de-interleave or gather produced."""

    cid, lay, name = res.case.id, res.case.layout.id, "peft-ckpt.tensors"
    want = expected_hf_adapter(assemble([peft_data(r).adapters for r in res.ranks]).tensors, res.case.model)
    got = hf["tensors"]
    if not want:
        return CheckResult(name, cid, False, f"{lay}: the engine reported no adapter parameters (.adapter. names)")
    diff = TensorDiff.of(got, want, EXPORT_COPY_RTOL)
    if diff.extra or diff.lost:
        return CheckResult(name, cid, False, f"{lay}: the export holds {len(diff.extra)} tensors that are no adapter "
                                             f"of the model (first {diff.extra[:1]}) and lacks {len(diff.lost)} "
                                             f"(first {diff.lost[:1]})",
                           [f"  extra {k}" for k in diff.extra[:20]] + [f"  absent {k}" for k in diff.lost[:20]])
    if diff.shapes:
        k = diff.shapes[0]
        return CheckResult(name, cid, False, f"{lay}: {k} has shape {tuple(got[k].shape)}, the model's adapter "
                                             f"{tuple(want[k].shape)} ({len(diff.shapes)} tensors differ in shape)")
    errs, bad, worst = diff.errs, diff.bad, diff.worst or ""
    if bad:
        return CheckResult(name, cid, False,
                           f"{lay}: {len(bad)}/{len(errs)} exported tensors are not the model's adapter; worst "
                           f"{bad[0]}: rel {fmt_err(errs[bad[0]])} (the export must copy them bit for bit)",
                           [f"  {k}: rel {fmt_err(errs[k])}" for k in bad], value=errs[bad[0]])
    return CheckResult(name, cid, True, f"{lay}: {len(errs)} exported tensors are the model's adapter "
                                        f"parameters, worst rel {errs[worst]:.1e}", value=errs[worst])


def _check_replicas(res: CaseResult) -> CheckResult:
    """Every copy of an adapter shard (the ranks of its data-parallel group: DP for attention's and dense MLPs'
    adapters, expert-DP for an expert's) bit-identical after training: an adapter gradient reduced over another
    group, or not at all, leaves the copies apart."""
    cid, lay, name = res.case.id, res.case.layout.id, "peft-ckpt.replicas"
    held: dict[tuple[str, int], list[tuple[int, ParamShard]]] = {}
    for r in res.ranks:
        for s in peft_data(r).adapters:
            held.setdefault((s.name, s.tp_rank if s.partition_dim is not None else 0), []).append((r.rank, s))
    copied = {key: copies for key, copies in held.items() if len(copies) > 1}
    apart = {}
    for key, copies in copied.items():
        first = copies[0][1].tensor
        if any(c.tensor.shape != first.shape or not torch_equal(c.tensor, first) for _, c in copies[1:]):
            apart[key] = copies
    if not copied:
        return cannot_tell(name, cid, f"{lay}: no adapter tensor is held by more than one rank (no DP replicas)")
    if not apart:
        return CheckResult(name, cid, True, f"{lay}: the copies of all {len(copied)} adapter shards held by more than "
                                            f"one rank are bit-identical after {res.case.options.steps} steps")
    rows = []
    for (tensor, tp_rank), copies in sorted(apart.items())[:20]:
        groups: list[tuple[Any, list[int]]] = []
        for rank, c in copies:
            same = next((g for g in groups if g[0].shape == c.tensor.shape and torch_equal(g[0], c.tensor)), None)
            if same is None:
                groups.append((c.tensor, [rank]))
            else:
                same[1].append(rank)
        rows.append(f"  {tensor} (TP shard {tp_rank}): ranks " + " / ".join(str(g[1]) for g in groups)
                    + " hold different values")
    (tensor, _), copies = min(apart.items())
    return CheckResult(name, cid, False,
                       f"{lay}: {len(apart)}/{len(copied)} adapter shards differ between the ranks that hold copies "
                       f"of them after {res.case.options.steps} steps, first {tensor} on ranks "
                       f"{[rank for rank, _ in copies]}: their gradients were not reduced over the group that "
                       f"holds them", rows)


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _check_logprobs(res: CaseResult, hf: dict) -> CheckResult:
    cid, lay, name = res.case.id, res.case.layout.id, "peft-ckpt.logprobs"
    if "load_error" in hf:
        return CheckResult(name, cid, False, f"{lay}: not computed: PEFT refused the adapter")
    got = first_step_logprobs(res, _held_out)
    if got is None:
        return CheckResult(name, cid, False, f"{lay}: the engine captured no log-probs of the held-out batch")
    megatron, counts = got
    coverage = coverage_problem(counts)
    if coverage:
        return CheckResult(name, cid, False, f"{lay}: held-out log-probs: {coverage}")
    peft_lp, off = hf["logprobs"], hf["logprobs_disabled"]
    diff = LogprobDiff.of(peft_lp, megatron, LOGPROB_RTOL)
    worst, drawn = diff.worst, _agreement(diff, megatron.numel())
    effect = float(((peft_lp - off).abs() / (float(megatron.abs().max()) or 1.0)).max())
    if diff.bad.any():
        unjudged = _beyond_fp32(name, cid, f"{lay}: HF + PEFT against the Megatron model", worst,
                                res.case.options.dtype, effect, drawn)
        if unjudged:
            return unjudged
        sample = diff.first_sample
        return CheckResult(name, cid, False,
                           f"{lay}: HF + PEFT log-probs differ from the Megatron model at {int(diff.bad.sum())}/"
                           f"{megatron.numel()} held-out tokens (worst rel {fmt_err(worst)} > {LOGPROB_RTOL:.0e}); "
                           f"first: sample {sample}, positions {diff.positions(sample)}", value=worst, data=drawn)
    if not effect > NOOP_MIN:
        return CheckResult(name, cid, False,
                           f"{lay}: the adapter is a no-op in PEFT: disabling it moves the log-probs by "
                           f"{fmt_err(effect)} (<= {NOOP_MIN:.0e}) after {res.case.options.steps} steps",
                           value=effect, data=drawn)
    return CheckResult(name, cid, True,
                       f"{lay}: HF + PEFT log-probs of {megatron.numel()} held-out tokens equal the Megatron model's, "
                       f"worst rel {worst:.2e} <= {LOGPROB_RTOL:.0e}; the adapter moves them by {effect:.2e}",
                       value=worst, data=drawn)


def _beyond_fp32(name: str, cid: str, head: str, worst: float, dtype_name: str, effect: float | None = None,
                 drawn: Agreement | None = None) -> CheckResult | None:
    """In fp16 / bf16 a log-prob difference beyond fp32's tolerance and within the dtype's is rounding as much as a
    wrong adapter: what the adapter itself moves (~1e-3 after two steps) hides in it, so the comparison cannot tell
    (None: fp32, or beyond the dtype's tolerance: the caller judges)."""
    rtol = dtype(dtype_name).rtol
    if dtype_name == DType.fp32 or beyond(worst, rtol):
        return None
    moved = f", and the adapter moves them by {effect:.2e}" if effect is not None else ""
    rounding = f"{dtype_name}'s rounding ({rtol:.0e})"
    return cannot_tell(name, cid, f"{head}: log-probs differ by {worst:.2e} in {dtype_name}, beyond fp32's "
                                  f"{LOGPROB_RTOL:.0e} and within {rounding}{moved}: a wrong adapter can hide there; "
                                  f"judge with --dtype fp32", value=worst, data=drawn)


def _check_reload(res: CaseResult, which: str) -> CheckResult:
    """roundtrip: the exported PEFT adapter loaded into a fresh Megatron model at another layout gives the
    held-out log-probs of the model that exported it. legacy: the adapter-only distributed checkpoint
    (the layout before HF PEFT export) must load there too (megatron's sharded tensors promise TP / PP
    changes), giving the same log-probs; a refusal fails with the load's own reason."""

    cid, lay, name = res.case.id, res.case.layout.id, f"peft-ckpt.{which}"
    what = {"roundtrip": "the exported HF PEFT adapter", "legacy": "the adapter-only distributed checkpoint"}[which]
    parts = [_reload_of(r, which) for r in res.ranks]
    target = parts[0].layout
    errors = [(r.rank, p) for r, p in zip(res.ranks, parts) if p.error]
    if errors:
        rank, p = errors[0]
        kind = f" ({p.refusal})" if p.refusal else ""
        verb = "was refused" if p.phase == "load" else f"failed in {p.phase}"
        return CheckResult(name, cid, False, f"{lay} -> {target}: {what} {verb} on rank {rank}{kind}: {p.error}",
                           p.traceback.splitlines()[-8:])
    reloaded = assemble_logprobs(res.case, [(p.coords, p.eval) for p in parts])
    source = first_step_logprobs(res, _held_out)
    if reloaded is None or source is None:
        return CheckResult(name, cid, False, f"{lay} -> {target}: no held-out log-probs captured")
    (got, counts), (want, _) = reloaded, source
    coverage = coverage_problem(counts)
    if coverage:
        return CheckResult(name, cid, False, f"{lay} -> {target}: held-out log-probs: {coverage}")
    diff = LogprobDiff.of(got, want, LOGPROB_RTOL)
    worst, drawn = diff.worst, _agreement(diff, got.numel())
    if diff.bad.any():
        unjudged = _beyond_fp32(name, cid, f"{lay} -> {target}: {what}", worst, res.case.options.dtype, None, drawn)
        if unjudged:
            return unjudged
        sample = diff.first_sample
        return CheckResult(name, cid, False,
                           f"{lay} -> {target}: {what} loaded, but the held-out log-probs differ from the model "
                           f"that saved it at {int(diff.bad.sum())}/{got.numel()} tokens (worst rel "
                           f"{fmt_err(worst)} > {LOGPROB_RTOL:.0e}); first: sample {sample}, positions "
                           f"{diff.positions(sample)}", value=worst, data=drawn)
    return CheckResult(name, cid, True, f"{lay} -> {target}: {what} loads and gives the saving model's held-out "
                                        f"log-probs, worst rel {worst:.2e} <= {LOGPROB_RTOL:.0e}", value=worst,
                       data=drawn)


def _check_export(res: CaseResult, hf: dict, ref: CaseResult, ref_hf: dict | None) -> CheckResult:
    cid, lay, rlay, name = res.case.id, res.case.layout.id, ref.case.layout.id, "peft-ckpt.export"
    if ref_hf is None:
        return CheckResult(name, cid, False, f"reference {rlay} did not run")
    got, want = hf["tensors"], ref_hf["tensors"]
    diff = TensorDiff.of(got, want, EXPORT_RTOL)
    if diff.extra or diff.lost:
        return CheckResult(name, cid, False, f"{lay}: the export names other tensors than {rlay}'s: "
                                             f"{len(diff.extra)} extra (first {diff.extra[:1]}), {len(diff.lost)} "
                                             f"absent (first {diff.lost[:1]})")
    if diff.shapes:
        k = diff.shapes[0]
        return CheckResult(name, cid, False, f"{lay}: {len(diff.shapes)} tensors have other shapes than {rlay}'s; "
                                             f"{k}: {tuple(got[k].shape)} vs {tuple(want[k].shape)}")
    errs, bad, worst = diff.errs, diff.bad, diff.worst or ""
    drawn = ParamErrors(ref.case.id, EXPORT_RTOL, dict(errs))
    if bad:
        return CheckResult(name, cid, False,
                           f"{lay}: {len(bad)}/{len(errs)} exported adapter tensors differ from {rlay}'s; worst "
                           f"{bad[0]}: rel {fmt_err(errs[bad[0]])} > {EXPORT_RTOL:.0e}",
                           [f"  {k}: rel {fmt_err(errs[k])}" for k in bad], value=errs[bad[0]], data=drawn)
    return CheckResult(name, cid, True, f"{lay}: {len(errs)} exported adapter tensors equal {rlay}'s; worst "
                                        f"{worst} rel {errs[worst]:.2e} <= {EXPORT_RTOL:.0e}", value=errs[worst],
                       data=drawn)


def _check_memory(res: CaseResult) -> CheckResult:
    cid, lay, m, o = res.case.id, res.case.layout.id, res.case.model, res.case.options
    name = "peft-ckpt.memory"
    bound = export_bound(m, o.lora_dim)
    adapter = 4 * adapter_values(m, o.lora_dim)
    peaks = {r.rank: _export_peak(r).host_peak for r in res.ranks}
    worst = max(peaks, key=lambda r: peaks[r])
    rows = [f"  rank {r}: {p / MIB:.2f} MiB" for r, p in sorted(peaks.items())]
    whole = 4 * m.num_params()
    why = (f"adapter {adapter / MIB:.2f} MiB x {EXPORT_COPIES} + {EXPORT_FIXED / MIB:.0f} MiB fixed; "
           f"the whole model is {whole / MIB:.1f} MiB")
    drawn = HostPeaks({r: int(p) for r, p in peaks.items()}, int(bound), whole)
    if within(peaks[worst], bound):
        if whole <= bound:  # a whole-model export would fit in the bound too
            return cannot_tell(name, cid, f"{lay}: export host peak {peaks[worst] / MIB:.2f} MiB <= "
                                          f"{bound / MIB:.2f} MiB, but a whole-model export would fit that bound too "
                                          f"({why}): judge on `small`", rows, value=peaks[worst] / MIB, data=drawn)
        return CheckResult(name, cid, True, f"{lay}: export host peak {peaks[worst] / MIB:.2f} MiB (rank {worst}) "
                                            f"<= {bound / MIB:.2f} MiB ({why})", rows, value=peaks[worst] / MIB,
                           data=drawn)
    return CheckResult(name, cid, False,
                       f"{lay}: the adapter export peaked at {peaks[worst] / MIB:.2f} MiB of host memory on rank "
                       f"{worst} > {bound / MIB:.2f} MiB ({why}): it gathers or merges more than the adapters",
                       rows, value=peaks[worst] / MIB, data=drawn)


def _agreement(diff: LogprobDiff, tokens: int) -> Agreement:
    return Agreement(float(diff.worst), LOGPROB_RTOL, int(diff.bad.sum()), int(tokens))


@dataclass
class TensorDiff:
    """Two name -> tensor maps compared: names only one side has, shape mismatches, relative errors."""

    extra: list[str]
    lost: list[str]
    shapes: list[str]
    errs: dict[str, float]
    bad: list[str]  # beyond the tolerance, worst first
    worst: str | None

    @classmethod
    def of(cls, got: dict, want: dict, rtol: float) -> TensorDiff:
        extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        shapes = [k for k in want if k in got and got[k].shape != want[k].shape]
        if extra or lost or shapes:
            return cls(extra, lost, shapes, {}, [], None)
        errs = {k: rel_error(got[k], want[k]) for k in want}
        bad = sorted((k for k in errs if beyond(errs[k], rtol)), key=lambda k: -severity(errs[k]))
        return cls([], [], [], errs, bad, max(errs, key=lambda k: severity(errs[k])) if errs else None)


def _reload_of(rank: RankResult, which: str) -> Reload:
    data = peft_data(rank)
    reload = data.roundtrip if which == "roundtrip" else data.legacy
    if reload is None:
        raise TypeError(f"rank {rank.rank} returned no {which} reload")
    return reload


def _export_peak(rank: RankResult) -> MemoryPeak:
    peak = peft_data(rank).export
    if peak is None:
        raise TypeError(f"rank {rank.rank} returned no export peak")
    return peak


def _hf(result: CaseResult) -> dict:
    hf = next(peft_data(r).hf for r in result.ranks if r.rank == 0)
    if hf is None:
        raise TypeError("rank 0 returned no HF + PEFT side of the export")
    return hf
