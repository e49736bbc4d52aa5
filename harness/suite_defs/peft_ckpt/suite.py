"""`peft-ckpt` (regression R4): LoRA adapters exported in Hugging Face PEFT format load in PEFT and
reproduce the Megatron model at every layout.

Each case trains LoRA adapters (megatron-bridge's LoRA on every linear; base weights frozen) for a few
steps at its layout, takes the per-token log-probs of a held-out batch from the Megatron model, and
exports the adapter as an HF PEFT directory (the engine's `export_peft_adapter`, host peak measured per
rank). Rank 0 then loads it the way a user would - `PeftModel.from_pretrained` over a
`LlamaForCausalLM` holding the same base weights (the bridge's HF export of the frozen weights; for an MoE
model a `Qwen3MoeForCausalLM` holding them by the harness's own mapping, engines/hf_weights.py) - and
computes the same log-probs with the adapter on and off. The parent judges (harness/suite_defs/peft_ckpt/judge.py):

- valid: PEFT loads it with no missing and no unexpected adapter key, and adapter_config.json holds
  the configured r, lora_alpha, dropout and target modules;
- logprobs: HF + PEFT equals the Megatron model token by token, and the adapter is not a no-op;
- replicas: every copy of an adapter shard (its data-parallel group's ranks) is bit-identical after training;
- export: the adapter exported at every layout equals the pure-DP export, tensor by tensor;
- memory: the export's host peak per rank stays within adapter-sized memory (an export that gathers or
  merges the whole model needs model-sized memory).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult
from harness.checks.tensors import assemble
from harness.engine_names import EngineName
from harness.engines import data, engine_class_with, make_engine, resolve_factory
from harness.engines.base import PeftExporting, RefusesAdapterLayouts, peft_exporting
from harness.engines.hf_policy import label_logprobs
from harness.engines.hf_weights import hf_state_dict, to_module_format
from harness.engines.lora import read_adapter_dir
from harness.engines.mbridge import hf_architecture, hf_config
from harness.errors import BadInput, DoesNotApply, MissingDependency
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import expert_matrix, validate, violations
from harness.platform.parallel import layout_coords, teardown_parallel_state
from harness.probes.memory import MIB, artifacts_dir, captures_dir, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.agreement import with_equivalence_eps
from harness.suite_defs.ckpt_errors import describe_exception, refusal_kind
from harness.suite_defs.peft_ckpt.judge import PeftRankData, Reload, peft_data
from harness.suite_defs.peft_ckpt.judge import check as judge

INSTALL = "pip install peft (the peft-ckpt suite loads the exported adapter with it)"
LAYOUTS = ("tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp2", "tp2-pp2-cp1-dp1")
LORA_DIM, LORA_ALPHA = 8, 16  # scaling alpha / r = 2: an alpha written as r (scaling 1) changes the output
STEPS = 2
EVAL_STEP = 1_000_003  # the held-out batch: a step index no training step uses


def adapter_dir(case: Case) -> Path:
    """Where a case's adapter is exported: its output directory (outside any rank's workdir)."""
    return (Path(case.out_dir) if case.out_dir else artifacts_dir(case.id)) / "adapter"


def _require_peft() -> None:
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise MissingDependency(f"the peft-ckpt suite needs peft: {INSTALL}")


def hf_side(case: Case, path: Path, base: dict) -> dict[str, Any]:
    """Rank 0: the adapter loaded the way a user loads it, and the held-out batch through it."""
    import peft
    import torch
    from peft.utils import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    config, tensors = read_adapter_dir(path)
    out: dict[str, Any] = {"config": config, "tensors": {k: v.float().clone() for k, v in tensors.items()},
                           "peft_version": peft.__version__}
    model = AutoModelForCausalLM.from_config(hf_config(case.model)).float().eval()
    res = model.load_state_dict(to_module_format(base, set(model.state_dict())), strict=False)
    out["base_missing"] = [k for k in res.missing_keys if k != "lm_head.weight" or not case.model.tie_embeddings]
    out["base_unexpected"] = list(res.unexpected_keys)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the missing keys are judged below, from the load result
            pm = peft.PeftModel.from_pretrained(model, str(path)).eval()
        loaded: Any = set_peft_model_state_dict(pm, tensors)  # torch load_state_dict result (keys)
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


def hf_reference_base(engine: PeftExporting, case: Case, ctx: RankContext) -> dict[str, Any]:
    """The frozen base weights under HF names for rank 0's reference (collective): the engine's HF export for a
    dense model; for a mixture of experts the harness's own mapping (engines/hf_weights.py) of the parameters
    gathered from every rank, as megatron-bridge 0.3.1 cannot export megatron's SequentialMLP experts (it parses
    a grouped-GEMM index out of `...linear_fc1.weight`: int('')). Other ranks get {}."""
    if not case.model.moe:
        return engine.hf_base_state_dict(ctx.workdir)
    import torch.distributed as dist

    shards = [s for s in engine.param_shards() if ".adapter." not in s.name]
    gathered: list[Any] | None = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(shards, gathered, dst=0)
    return hf_state_dict(assemble(gathered).tensors, case.model) if gathered is not None else {}


class PeftCkptSuite:
    name = "peft-ckpt"
    default_model = "small"  # big enough that a whole-model export is far above the adapter's memory
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "transformers", "peft")

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        peaks = [p.host_peak / MIB for p in (peft_data(r).export for r in result.ranks) if p is not None]
        return {"export_host_peak_mib": [round(p, 3) for p in peaks]}

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: None = None) -> list[Case]:
        """Pure DP first (the export the others are compared with), then the layouts with TP and PP."""
        # megatron-core alone has no LoRA / PEFT export: the bridge's path is the default
        if engine == EngineName.MCORE:
            engine = EngineName.MEGATRON_BRIDGE

        factory = engine_class_with(engine, PeftExporting, "has no export_peft_adapter(path): the peft-ckpt suite "
                                    "needs an engine that trains LoRA adapters and exports them (built-in: "
                                    "megatron-bridge)")
        _require_peft()  # in the parent: a missing peft is named before any rank starts
        try:
            hf_architecture(model)  # a model the HF side cannot hold is refused before any rank starts
        except BadInput as exc:
            raise DoesNotApply(str(exc)) from None
        options = dataclasses.replace(options, steps=STEPS if options.steps == CaseOptions.steps else options.steps,
                                      lora_dim=options.lora_dim or LORA_DIM,
                                      lora_alpha=options.lora_alpha or LORA_ALPHA)

        options = with_equivalence_eps(options)
        reference = Layout(dp=world_size)
        refused = adapter_refusal(factory, model, backend)
        if layouts is None:
            layouts = default_layouts(model, world_size, refused)
        for lay in layouts:
            if why := refused(lay):
                raise DoesNotApply(f"{why} (--engine {engine} cannot judge --layout {lay.id}: drop it)")
        for lay in [reference, *layouts]:
            validate(lay, model, world_size)
            for what, size in (("TP", lay.tp), ("ETP", lay.expert_tp if model.moe else 1)):
                if options.lora_dim % size:
                    raise BadInput(f"layout {lay.id}: the LoRA rank {options.lora_dim} must be divisible by {what} "
                                   f"{size} (A of a column-parallel linear is split over {what} along r)")
        ordered = [reference] + [lay for lay in layouts if lay != reference]
        return [Case(self.name, model, lay, engine, options, backend) for lay in ordered]

    def rank_work(self, case: Case, ctx: RankContext) -> PeftRankData:
        import os

        import torch.distributed as dist

        engine = peft_exporting(make_engine(case, ctx), case.engine)
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
        with ctx.phase("export"), measure("export", captures_dir(case), ctx.rank, device=not ctx.on_cpu) as peak:
            # who wrote adapter_config.json ("harness" where the engine exports tensors only); None: the engine
            config_by = engine.export_peft_adapter(str(path)) or "engine"
        if peak.capture and os.path.exists(peak.capture):
            os.unlink(peak.capture)  # the peak is read; the flamegraph of an adapter export is not kept
        dist.barrier()
        with ctx.phase("reference"):
            base = hf_reference_base(engine, case, ctx)  # collective: every rank takes part
            hf = {**hf_side(case, path, base), "config_by": config_by} if ctx.rank == 0 else None
        with ctx.phase("collect"):
            adapters = [s for s in engine.param_shards() if ".adapter." in s.name]
        legacy = path.parent / "adapter-dist-ckpt"
        coords = layout_coords()
        legacy.mkdir(parents=True, exist_ok=True)
        dist.barrier()

        target = roundtrip_layout(case.layout, adapter_refusal(resolve_factory(case.engine), case.model, case.backend))
        with ctx.phase("save"):
            saved = _attempt(target, "save", lambda e=engine: e.save_adapter_checkpoint(str(legacy)))
        del engine
        teardown_parallel_state()
        with ctx.phase("load"):
            roundtrip = _reload(case, ctx, target, lambda e: e.load_peft_adapter(str(path)))
            old = saved or _reload(case, ctx, target, lambda e: e.load_adapter_checkpoint(str(legacy)))
        return PeftRankData(coords, steps, eval=[held_out], export=peak, hf=hf, adapters=adapters,
                            roundtrip=roundtrip, legacy=old)

    def check(self, results: list[CaseResult], params: None = None) -> list[CheckResult]:
        return judge(results)


def default_layouts(model: ModelSpec, world_size: int, refused: Callable[[Layout], str | None]) -> list[Layout]:
    """The layouts beside pure DP: TP and PP for a dense model; for an MoE model the expert layouts (EP, EP with
    TP at ETP 2 and 1, EP with PP) as every suite's, or PP 2 where the engine's adapters refuse all of those."""
    if not model.moe:
        return [Layout.parse(x) for x in LAYOUTS if Layout.parse(x).world_size == world_size]
    expert = [lay for lay in expert_matrix(model, world_size) if lay.cp == 1 and not refused(lay)]
    pp = Layout(pp=2, dp=world_size // 2)
    if expert or world_size % 2 or violations(pp, model, world_size):
        return expert
    return [pp]


def adapter_refusal(factory: Any, model: ModelSpec, backend: Backend) -> Callable[[Layout], str | None]:
    """Why the engine factory's adapters cannot be judged at a layout (RefusesAdapterLayouts); None where they can."""
    if isinstance(factory, RefusesAdapterLayouts):
        return lambda lay: factory.adapter_refusal(model, lay, backend)
    return lambda lay: None


def roundtrip_layout(layout: Layout, refused: Callable[[Layout], str | None] = lambda lay: None) -> Layout:
    """Another layout of the same world size to load an adapter into: TP changes (TP2 <-> none); PP 2 where the
    engine's adapters refuse TP 2 (an MoE model's experts at ETP 2)."""
    w = layout.world_size
    if layout.tp > 1 or w % 2:
        return Layout(dp=w)
    tp = Layout(tp=2, dp=w // 2)
    if not refused(tp):
        return tp
    return Layout(pp=2, dp=w // 2) if layout.pp == 1 else Layout(dp=w)


def _attempt(layout: Layout, phase: str, work) -> Reload | None:
    """Run `work`; None where it succeeds, else the Reload that failed in `phase` (the finding: a refusal is
    named) - an adapter checkpoint the engine cannot save is not loaded."""
    import traceback

    try:
        work()
        return None
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Reload(layout.id, error=describe_exception(exc), phase=phase,
                      refusal=refusal_kind(exc) if phase == "load" else "", traceback=traceback.format_exc()[-1500:])


def _reload(case: Case, ctx: RankContext, layout: Layout, load) -> Reload:
    """A fresh LoRA model at `layout` (base weights from global names, B zero), `load` into it, then the
    held-out batch's outputs, or where and why it failed."""

    engine = peft_exporting(make_engine(dataclasses.replace(case, layout=layout), ctx), case.engine)
    try:
        failed = _attempt(layout, "build", engine.build) or _attempt(layout, "load", lambda e=engine: load(e))
        if failed is not None:
            return failed
        held_out: list = []
        failed = _attempt(layout, "after the load", lambda e=engine: held_out.append(e.eval_step(EVAL_STEP)))
        return failed or Reload(layout.id, layout_coords(), held_out)
    finally:
        del engine
        teardown_parallel_state()
