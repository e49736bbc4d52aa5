"""`peft-ckpt` (regression R4): LoRA adapters exported in Hugging Face PEFT format load in PEFT and
reproduce the Megatron model at every layout.

Each case trains LoRA adapters (megatron-bridge's LoRA on every linear; base weights frozen) for a few
steps at its layout, takes the per-token log-probs of a held-out batch from the Megatron model, and
exports the adapter as an HF PEFT directory (the engine's `export_peft_adapter`, host peak measured per
rank). Rank 0 then loads it the way a user would - `PeftModel.from_pretrained` over a
`LlamaForCausalLM` holding the same base weights (the bridge's HF export of the frozen weights) - and
computes the same log-probs with the adapter on and off. The parent judges:

- valid: PEFT loads it with no missing and no unexpected adapter key, and adapter_config.json holds
  the configured r, lora_alpha, dropout and target modules;
- logprobs: HF + PEFT equals the Megatron model token by token, and the adapter is not a no-op;
- export: the adapter exported at every layout equals the pure-DP export, tensor by tensor;
- memory: the export's host peak per rank stays within adapter-sized memory (an export that gathers or
  merges the whole model needs model-sized memory).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.checks import CheckResult
from harness.checks.numeric import beyond, fmt_err, severity, within
from harness.engines.lora import CONFIG_FILE, hf_target_modules, read_adapter_dir
from harness.errors import BadInput, MissingDependency
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.probes.memory import MIB, artifacts_dir, measure
from harness.platform.parallel import teardown_parallel_state
from harness.spec import Case, CaseOptions, Layout, ModelSpec

INSTALL = "pip install peft (the peft-ckpt suite loads the exported adapter with it)"
LAYOUTS = ("tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp2", "tp2-pp2-cp1-dp1")
LORA_DIM, LORA_ALPHA = 8, 16  # scaling alpha / r = 2: an alpha written as r (scaling 1) changes the output
STEPS = 2
EVAL_STEP = 1_000_003  # the held-out batch: a step index no training step uses
# fp32 on CPU: HF and Megatron differ by reduction order (~1e-7); a wrong slice moves tokens by >= 1e-3
LOGPROB_RTOL = 1e-5
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


def adapter_dir(case: Case) -> Path:
    """Where a case's adapter is exported: its output directory (outside any rank's workdir)."""
    return (Path(case.out_dir) if case.out_dir else artifacts_dir(case.id)) / "adapter"


def export_bound(model: ModelSpec, dim: int) -> int:
    from harness.engines.lora import adapter_values

    return EXPORT_COPIES * 4 * adapter_values(model, dim) + EXPORT_FIXED


def _require_peft() -> None:
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise MissingDependency(f"the peft-ckpt suite needs peft: {INSTALL}")


def label_logprobs(logits, tokens):
    """[batch, seq] log-prob of each next token, in float64."""
    import torch

    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def hf_side(case: Case, path: Path, base: dict) -> dict[str, Any]:
    """Rank 0: the adapter loaded the way a user loads it, and the held-out batch through it."""
    import peft
    import torch
    from peft.utils import set_peft_model_state_dict
    from transformers import LlamaForCausalLM

    from harness.engines import data
    from harness.engines.mbridge import hf_llama_config

    config, tensors = read_adapter_dir(path)
    out: dict[str, Any] = {"config": config, "tensors": {k: v.float().clone() for k, v in tensors.items()},
                           "peft_version": peft.__version__}
    model = LlamaForCausalLM(hf_llama_config(case)).float().eval()
    res = model.load_state_dict(base, strict=False)
    out["base_missing"] = [k for k in res.missing_keys if k != "lm_head.weight" or not case.model.tie_embeddings]
    out["base_unexpected"] = list(res.unexpected_keys)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the missing keys are judged below, from the load result
            pm = peft.PeftModel.from_pretrained(model, str(path)).eval()
        loaded = set_peft_model_state_dict(pm, tensors)
    except Exception as exc:  # a directory PEFT refuses is the finding, not a crash of the case
        out["load_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return out
    out["missing"] = [k for k in loaded.missing_keys if "lora_" in k]
    out["unexpected"] = list(loaded.unexpected_keys)
    tokens = data.global_batch(case, EVAL_STEP)
    with torch.no_grad():
        out["logprobs"] = label_logprobs(pm(input_ids=tokens[:, :-1]).logits, tokens)
        with pm.disable_adapter():
            out["logprobs_disabled"] = label_logprobs(pm(input_ids=tokens[:, :-1]).logits, tokens)
    return out


class PeftCkptSuite:
    name = "peft-ckpt"
    default_model = "small"  # big enough that a whole-model export is far above the adapter's memory
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "transformers", "peft")

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        peaks = [r.data["export"].host_peak / MIB for r in result.ranks]
        return {"export_host_peak_mib": [round(p, 3) for p in peaks]}

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: None = None) -> list[Case]:
        """Pure DP first (the export the others are compared with), then the layouts with TP and PP."""
        if engine == "mcore":  # megatron-core alone has no LoRA / PEFT export: the bridge's path is the default
            engine = "megatron-bridge"
        from harness.engines import resolve_factory

        if not hasattr(resolve_factory(engine), "export_peft_adapter"):
            raise BadInput(f"engine {engine!r} has no export_peft_adapter(path): the peft-ckpt suite needs an engine "
                           "that trains LoRA adapters and exports them (built-in: megatron-bridge)")
        _require_peft()  # in the parent: a missing peft is named before any rank starts
        options = dataclasses.replace(options, steps=STEPS if options.steps == CaseOptions.steps else options.steps,
                                      lora_dim=options.lora_dim or LORA_DIM, lora_alpha=options.lora_alpha or LORA_ALPHA)
        from harness.suites.equivalence import with_equivalence_eps

        options = with_equivalence_eps(options)
        reference = Layout(dp=world_size)
        if layouts is None:
            layouts = [Layout.parse(x) for x in LAYOUTS if Layout.parse(x).world_size == world_size]
        for lay in [reference, *layouts]:
            validate(lay, model, world_size)
            if options.lora_dim % lay.tp:
                raise BadInput(f"layout {lay.id}: the LoRA rank {options.lora_dim} must be divisible by TP {lay.tp} "
                               "(A of a column-parallel linear is split over TP along r)")
        ordered = [reference] + [lay for lay in layouts if lay != reference]
        return [Case(self.name, model, lay, engine, options, backend) for lay in ordered]

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        import os

        import torch.distributed as dist

        from harness.engines import make_engine
        from harness.suites import layout_coords

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        steps = []
        for step in range(case.options.steps):
            with ctx.phase("steps"):
                steps.append(engine.train_step(step))
        with ctx.phase("eval"):
            held_out = engine.eval_step(EVAL_STEP)
        path = adapter_dir(case)
        dist.barrier()
        with ctx.phase("export"), measure("export", artifacts_dir(case.id), ctx.rank, device=not ctx.on_cpu) as peak:
            engine.export_peft_adapter(str(path))
        if peak.capture and os.path.exists(peak.capture):
            os.unlink(peak.capture)  # the peak is read; the flamegraph of an adapter export is not kept
        dist.barrier()
        with ctx.phase("reference"):
            base = engine.hf_base_state_dict(ctx.workdir)  # collective: every rank takes part
            hf = hf_side(case, path, base) if ctx.rank == 0 else None
        with ctx.phase("collect"):
            adapters = [s for s in engine.param_shards() if ".adapter." in s.name]
        legacy = path.parent / "adapter-dist-ckpt"
        coords = layout_coords()
        legacy.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with ctx.phase("save"):
            engine.save_adapter_checkpoint(str(legacy))
        del engine
        teardown_parallel_state()
        target = roundtrip_layout(case.layout)
        with ctx.phase("load"):
            roundtrip = _reload(case, ctx, target, lambda e: e.load_peft_adapter(str(path)))
            old = _reload(case, ctx, target, lambda e: e.load_adapter_checkpoint(str(legacy)))
        return {"coords": coords, "steps": steps, "eval": [held_out],
                "export": peak, "hf": hf, "adapters": adapters, "roundtrip": roundtrip, "legacy": old}

    # -- judges ---------------------------------------------------------------------------------
    def check(self, results: list[CaseResult], params: None = None) -> list[CheckResult]:
        if not results:
            return []
        ref = results[0]
        ref_hf = _hf(ref) if ref.ok else None
        out: list[CheckResult] = []
        for res in results:
            cid = res.case.id
            if not res.ok:
                out.append(CheckResult("peft-ckpt.run", cid, False, res.error.splitlines()[0] if res.error else "failed",
                                       res.error.splitlines()[1:]))
                continue
            hf = _hf(res)
            out.append(self._check_valid(res, hf))
            out.append(self._check_tensors(res, hf))
            out.append(self._check_logprobs(res, hf))
            out.append(self._check_memory(res))
            out.append(self._check_reload(res, "roundtrip"))
            out.append(self._check_reload(res, "legacy"))
            if res is not ref:
                out.append(self._check_export(res, hf, ref, ref_hf))
        return out

    @staticmethod
    def _check_valid(res: CaseResult, hf: dict) -> CheckResult:
        cid, lay, o = res.case.id, res.case.layout.id, res.case.options
        name = "peft-ckpt.valid"
        if "load_error" in hf:
            return CheckResult(name, cid, False, f"{lay}: PEFT refused the exported adapter: {hf['load_error']}")
        cfg = hf["config"]
        want = {"peft_type": "LORA", "r": o.lora_dim, "lora_alpha": o.lora_alpha, "lora_dropout": 0.0,
                "target_modules": hf_target_modules(swiglu=res.case.model.swiglu)}
        got = {k: sorted(cfg.get(k)) if k == "target_modules" and isinstance(cfg.get(k), list) else cfg.get(k)
               for k in want}
        problems = [f"{CONFIG_FILE} {k} = {got[k]!r}, configured {want[k]!r}" for k in want if got[k] != want[k]]
        if hf["missing"]:
            problems.append(f"{len(hf['missing'])} adapter keys PEFT expects are missing, first {hf['missing'][0]}")
        if hf["unexpected"]:
            problems.append(f"{len(hf['unexpected'])} keys PEFT does not expect, first {hf['unexpected'][0]}")
        if hf["base_missing"] or hf["base_unexpected"]:
            problems.append(f"base weights do not fit LlamaForCausalLM (missing {hf['base_missing'][:3]}, "
                            f"unexpected {hf['base_unexpected'][:3]})")
        if problems:
            return CheckResult(name, cid, False, f"{lay}: " + "; ".join(problems[:2]),
                               [f"  {p}" for p in problems])
        return CheckResult(name, cid, True, f"{lay}: PEFT {hf['peft_version']} loads {len(hf['tensors'])} adapter "
                                            f"tensors, no missing or unexpected key; r={o.lora_dim}, "
                                            f"lora_alpha={o.lora_alpha}, {len(want['target_modules'])} target modules")

    @staticmethod
    def _check_tensors(res: CaseResult, hf: dict) -> CheckResult:
        """Every exported tensor against the Megatron model's own adapter parameters, mapped to HF names by
        the harness's arithmetic: names the tensor a wrong split, de-interleave or gather produced."""
        from harness.checks.tensors import assemble
        from harness.engines.lora import expected_hf_adapter

        cid, lay, name = res.case.id, res.case.layout.id, "peft-ckpt.tensors"
        want = expected_hf_adapter(assemble([r.data["adapters"] for r in res.ranks]).tensors, res.case.model)
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
        errs, bad, worst = diff.errs, diff.bad, diff.worst
        if bad:
            return CheckResult(name, cid, False,
                               f"{lay}: {len(bad)}/{len(errs)} exported tensors are not the model's adapter; worst "
                               f"{bad[0]}: rel {fmt_err(errs[bad[0]])} (the export must copy them bit for bit)",
                               [f"  {k}: rel {fmt_err(errs[k])}" for k in bad], value=errs[bad[0]])
        return CheckResult(name, cid, True, f"{lay}: {len(errs)} exported tensors are the model's adapter "
                                            f"parameters, worst rel {errs[worst]:.1e}", value=errs[worst])

    @staticmethod
    def _check_logprobs(res: CaseResult, hf: dict) -> CheckResult:
        from harness.suites.equivalence import LogprobDiff, coverage_problem, first_step_logprobs

        cid, lay, name = res.case.id, res.case.layout.id, "peft-ckpt.logprobs"
        if "load_error" in hf:
            return CheckResult(name, cid, False, f"{lay}: not computed: PEFT refused the adapter")
        got = first_step_logprobs(res, key="eval")
        if got is None:
            return CheckResult(name, cid, False, f"{lay}: the engine captured no log-probs of the held-out batch")
        megatron, counts = got
        coverage = coverage_problem(counts)
        if coverage:
            return CheckResult(name, cid, False, f"{lay}: held-out log-probs: {coverage}")
        peft_lp, off = hf["logprobs"], hf["logprobs_disabled"]
        diff = LogprobDiff.of(peft_lp, megatron, LOGPROB_RTOL)
        worst = diff.worst
        effect = float(((peft_lp - off).abs() / (float(megatron.abs().max()) or 1.0)).max())
        if diff.bad.any():
            sample = diff.first_sample
            return CheckResult(name, cid, False,
                               f"{lay}: HF + PEFT log-probs differ from the Megatron model at {int(diff.bad.sum())}/"
                               f"{megatron.numel()} held-out tokens (worst rel {fmt_err(worst)} > {LOGPROB_RTOL:.0e}); "
                               f"first: sample {sample}, positions {diff.positions(sample)}", value=worst)
        if not effect > NOOP_MIN:
            return CheckResult(name, cid, False,
                               f"{lay}: the adapter is a no-op in PEFT: disabling it moves the log-probs by "
                               f"{fmt_err(effect)} (<= {NOOP_MIN:.0e}) after {res.case.options.steps} steps",
                               value=effect)
        return CheckResult(name, cid, True,
                           f"{lay}: HF + PEFT log-probs of {megatron.numel()} held-out tokens equal the Megatron model's, "
                           f"worst rel {worst:.2e} <= {LOGPROB_RTOL:.0e}; the adapter moves them by {effect:.2e}",
                           value=worst)

    @staticmethod
    def _check_reload(res: CaseResult, which: str) -> CheckResult:
        """roundtrip: the exported PEFT adapter loaded into a fresh Megatron model at another layout gives the
        held-out log-probs of the model that exported it. legacy: the adapter-only distributed checkpoint
        (the layout before HF PEFT export) must load there too (megatron's sharded tensors promise TP / PP
        changes), giving the same log-probs; a refusal fails with the load's own reason."""
        from harness.suites.equivalence import LogprobDiff, assemble_logprobs, coverage_problem, first_step_logprobs

        cid, lay, name = res.case.id, res.case.layout.id, f"peft-ckpt.{which}"
        what = {"roundtrip": "the exported HF PEFT adapter", "legacy": "the adapter-only distributed checkpoint"}[which]
        parts = [r.data[which] for r in res.ranks]
        target = parts[0]["layout"]
        errors = [(r.rank, p) for r, p in zip(res.ranks, parts) if "error" in p]
        if errors:
            rank, p = errors[0]
            kind = f" ({p['refusal']})" if p.get("refusal") else ""
            verb = "was refused" if p["phase"] == "load" else f"failed in {p['phase']}"
            return CheckResult(name, cid, False, f"{lay} -> {target}: {what} {verb} on rank {rank}{kind}: {p['error']}",
                               p.get("traceback", "").splitlines()[-8:])
        reloaded = assemble_logprobs(res.case, parts, key="eval")
        source = first_step_logprobs(res, key="eval")
        if reloaded is None or source is None:
            return CheckResult(name, cid, False, f"{lay} -> {target}: no held-out log-probs captured")
        (got, counts), (want, _) = reloaded, source
        coverage = coverage_problem(counts)
        if coverage:
            return CheckResult(name, cid, False, f"{lay} -> {target}: held-out log-probs: {coverage}")
        diff = LogprobDiff.of(got, want, LOGPROB_RTOL)
        worst = diff.worst
        if diff.bad.any():
            sample = diff.first_sample
            return CheckResult(name, cid, False,
                               f"{lay} -> {target}: {what} loaded, but the held-out log-probs differ from the model "
                               f"that saved it at {int(diff.bad.sum())}/{got.numel()} tokens (worst rel "
                               f"{fmt_err(worst)} > {LOGPROB_RTOL:.0e}); first: sample {sample}, positions "
                               f"{diff.positions(sample)}", value=worst)
        return CheckResult(name, cid, True, f"{lay} -> {target}: {what} loads and gives the saving model's held-out "
                                            f"log-probs, worst rel {worst:.2e} <= {LOGPROB_RTOL:.0e}", value=worst)

    @staticmethod
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
        errs, bad, worst = diff.errs, diff.bad, diff.worst
        if bad:
            return CheckResult(name, cid, False,
                               f"{lay}: {len(bad)}/{len(errs)} exported adapter tensors differ from {rlay}'s; worst "
                               f"{bad[0]}: rel {fmt_err(errs[bad[0]])} > {EXPORT_RTOL:.0e}",
                               [f"  {k}: rel {fmt_err(errs[k])}" for k in bad], value=errs[bad[0]])
        return CheckResult(name, cid, True, f"{lay}: {len(errs)} exported adapter tensors equal {rlay}'s; worst "
                                            f"{worst} rel {errs[worst]:.2e} <= {EXPORT_RTOL:.0e}", value=errs[worst])

    @staticmethod
    def _check_memory(res: CaseResult) -> CheckResult:
        from harness.engines.lora import adapter_values

        cid, lay, m, o = res.case.id, res.case.layout.id, res.case.model, res.case.options
        name = "peft-ckpt.memory"
        bound = export_bound(m, o.lora_dim)
        adapter = 4 * adapter_values(m, o.lora_dim)
        peaks = {r.rank: r.data["export"].host_peak for r in res.ranks}
        worst = max(peaks, key=lambda r: peaks[r])
        rows = [f"  rank {r}: {p / MIB:.2f} MiB" for r, p in sorted(peaks.items())]
        why = (f"adapter {adapter / MIB:.2f} MiB x {EXPORT_COPIES} + {EXPORT_FIXED / MIB:.0f} MiB fixed; "
               f"the whole model is {4 * m.num_params() / MIB:.1f} MiB")
        if within(peaks[worst], bound):
            if 4 * m.num_params() <= bound:  # a whole-model export would fit in the bound too
                return CheckResult(name, cid, True, f"{lay}: export host peak {peaks[worst] / MIB:.2f} MiB <= "
                                                    f"{bound / MIB:.2f} MiB, but this cannot tell an adapter export "
                                                    f"from a whole-model one ({why}): judge on `small`",
                                   rows, value=peaks[worst] / MIB, show=True)
            return CheckResult(name, cid, True, f"{lay}: export host peak {peaks[worst] / MIB:.2f} MiB (rank {worst}) "
                                                f"<= {bound / MIB:.2f} MiB ({why})", rows, value=peaks[worst] / MIB)
        return CheckResult(name, cid, False,
                           f"{lay}: the adapter export peaked at {peaks[worst] / MIB:.2f} MiB of host memory on rank "
                           f"{worst} > {bound / MIB:.2f} MiB ({why}): it gathers or merges more than the adapters",
                           rows, value=peaks[worst] / MIB)


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
    def of(cls, got: dict, want: dict, rtol: float) -> "TensorDiff":
        from harness.checks.tensors import rel_error

        extra, lost = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        shapes = [k for k in want if k in got and got[k].shape != want[k].shape]
        if extra or lost or shapes:
            return cls(extra, lost, shapes, {}, [], None)
        errs = {k: rel_error(got[k], want[k]) for k in want}
        bad = sorted((k for k in errs if beyond(errs[k], rtol)), key=lambda k: -severity(errs[k]))
        return cls([], [], [], errs, bad, max(errs, key=lambda k: severity(errs[k])) if errs else None)


def roundtrip_layout(layout: Layout) -> Layout:
    """Another layout of the same world size to load an adapter into: TP changes (TP2 <-> none)."""
    w = layout.world_size
    if layout.tp == 1 and w % 2 == 0:
        return Layout(tp=2, dp=w // 2)
    return Layout(dp=w)


def _reload(case: Case, ctx: RankContext, layout: Layout, load) -> dict[str, Any]:
    """A fresh LoRA model at `layout` (base weights from global names, B zero), `load` into it, then the
    held-out batch: {"layout", "coords", "eval"} or {"layout", "error", "phase", "refusal"}."""
    import traceback

    from harness.engines import make_engine
    from harness.platform.parallel import teardown_parallel_state
    from harness.suites import layout_coords
    from harness.suites.ckpt_contract import describe_exception, refusal_kind

    engine = make_engine(dataclasses.replace(case, layout=layout), ctx)
    out: dict[str, Any] = {"layout": layout.id}
    phase = "build"
    try:
        engine.build()
        phase = "load"
        load(engine)
        phase = "after the load"
        out["eval"] = [engine.eval_step(EVAL_STEP)]
        out["coords"] = layout_coords()
    except BaseException as exc:  # the finding: a load refused (named) or failed (torch's
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # CheckpointException is a BaseException)
            raise
        out.update(error=describe_exception(exc), phase=phase, refusal=refusal_kind(exc) if phase == "load" else "",
                   traceback=traceback.format_exc()[-1500:])
    finally:
        del engine
        teardown_parallel_state()
    return out


def _hf(result: CaseResult) -> dict:
    return next(r.data["hf"] for r in result.ranks if r.rank == 0)
