"""The refit suite: its cases (layouts and model variants per path) and the rank work."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.backends import Backend
from harness.baselines import noisy_metrics, tolerance_for
from harness.checks import CheckResult
from harness.dtypes import dtype
from harness.engine_names import EngineName
from harness.engines import data, engine_class_with, make_engine
from harness.engines.base import ExportsWeights, HasLogprobHead, PadsVocabulary, RefusesCases, RefusesExports
from harness.engines.hf_policy import hf_model_modules, label_logprobs
from harness.engines.hf_weights import checkpoint_shapes, to_module_format
from harness.engines.logprob_head import case_temperature, check_head
from harness.engines.mbridge import hf_architecture, hf_config
from harness.engines.weight_export import export_reference
from harness.errors import BadInput, DoesNotApply
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate, violations
from harness.platform.parallel import layout_coords
from harness.probes.memory import captures_dir, largest_allocation, measure
from harness.probes.retention import measure_retention
from harness.probes.weight_stream import digest, receive
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.refit import figures
from harness.suite_defs.refit.judge import judge, table_figures
from harness.suite_defs.refit.params import STEPS, SUITE, RefitParams, RefitVariant, bucket_bytes
from harness.suite_defs.refit.payload import Export, HFSide, RefitRankData

EVAL_STEP = 1_000_003  # the held-out batch: a step index no training step uses


VARIANTS: dict[RefitVariant, dict[str, Any]] = {RefitVariant.UNTIED: dict(tie_embeddings=False),
                                               RefitVariant.FOUR_LAYERS: dict(num_layers=4),
                                               RefitVariant.EXPERT_BIAS: dict(moe_expert_bias=True)}


def variant(model: ModelSpec, what: RefitVariant) -> ModelSpec:
    """The model as the variant (`RefitVariant`) builds it, under its own name (the case's parameters name the
    variant: `--refit-variant`)."""
    if what == RefitVariant.PADDED_VOCAB:
        return dataclasses.replace(model, vocab_size=model.vocab_size - 1, make_vocab_size_divisible_by=128)
    return dataclasses.replace(model, **VARIANTS[what])


def matrix(model: ModelSpec, world_size: int) -> list[tuple[RefitVariant, Layout]]:
    """The default (model variant, layout) pairs: pure DP; TP 2; PP 2 with the model's embeddings and the other way;
    PP 2 with two virtual stages each; CP 2. An MoE model's: pure DP, EP 2, EP 2 with ETP 2, EP 2 with PP 2, and EP 2
    with aux-loss-free balancing. What the world size or the model cannot lay out is left out."""
    w, half = world_size, world_size // 2
    if half == 0 or w % 2:
        return [(RefitVariant.AS_IS, Layout(dp=w))]
    as_is = RefitVariant.AS_IS
    pairs = [(as_is, Layout(dp=w)), (as_is, Layout(tp=2, dp=half)), (as_is, Layout(pp=2, dp=half))]
    if model.tie_embeddings:
        pairs.append((RefitVariant.UNTIED, Layout(pp=2, dp=half)))
    pairs += [(RefitVariant.FOUR_LAYERS if model.num_layers < 4 else as_is, Layout(pp=2, dp=half, vpp=2)),
              (as_is, Layout(cp=2, dp=half))]
    if model.moe:  # the dense layouts are the dense model's matrix; here the expert grid's
        pairs = pairs[:1] + [(as_is, Layout(dp=w, ep=2)), (as_is, Layout(dp=w, ep=2, etp=2)),
                             (as_is, Layout(pp=2, dp=half, ep=2)), (RefitVariant.EXPERT_BIAS, Layout(dp=w, ep=2))]
    return [(v, lay) for v, lay in pairs
            if not violations(lay, variant(model, v) if v else model, world_size)]


class RefitSuite:
    name = SUITE
    default_model = "tiny"
    Params = RefitParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               *(hf_model_modules() or ("transformers",)), "memray")
    # An export's heap peak moves with what the rank ran before it (tiny-moe's at pure DP, 8 KiB buckets: 225 KiB
    # as the first case of its run, 135 KiB after tiny's cases): every case on ranks forked for it.
    fresh_ranks_per_case = True

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: RefitParams | None = None) -> list[Case]:
        params = params or RefitParams()
        factory = engine_class_with(
            engine, ExportsWeights, "has no export_buckets(bucket_bytes) (harness.engines.base.ExportsWeights): refit "
            "needs the export your framework streams to its rollout engine; give a subclass of McoreEngine whose "
            "hf_weight_stream is yours (docs/engines.md)")
        if isinstance(factory, RefusesExports) and (why := factory.export_refusal(model, backend)):
            raise DoesNotApply(f"engine {engine!r}: {why}")
        check_head(engine, factory, params.temperature)
        if params.variant == RefitVariant.PADDED_VOCAB and not issubclass(factory, PadsVocabulary):
            raise BadInput(f"--refit-variant padded-vocab: engine {engine} does not build the vocabulary padded as "
                           "megatron's training scripts do (a bridge builds it from its Hugging Face config); give "
                           "mcore or fsdp2")
        options = dataclasses.replace(options, steps=STEPS if options.steps == CaseOptions.steps else options.steps)
        def of(what: RefitVariant) -> ModelSpec:
            return variant(model, what) if what else model

        if layouts is not None:
            pairs = [(params.variant, validate(lay, of(params.variant), world_size)) for lay in layouts]
        elif params.variant:
            raise BadInput(f"--refit-variant {params.variant} runs the variant at the layouts given: add --layout "
                           "(e.g. tp1-pp2-cp1-dp2), or drop it for the matrix's variants")
        else:
            pairs = matrix(model, world_size)
        refusal = factory.refusal if isinstance(factory, RefusesCases) else (lambda m, lay: None)
        if layouts is None:  # a default matrix drops what the path cannot build (a variant is skipped, saying why)
            kept = [(v, lay) for v, lay in pairs if not refusal(of(v), lay)]
            if not kept:
                raise DoesNotApply(f"engine {engine!r}: {refusal(of(pairs[0][0]), pairs[0][1])}")
            pairs = [(v, lay) for v, lay in pairs if v == RefitVariant.EXPERT_BIAS or (v, lay) in kept]
        out = []
        for what, lay in pairs:
            case = Case(self.name, of(what), lay, engine, options, backend,
                        params=dataclasses.replace(params, variant=what))
            why = refusal(of(what), lay) if what else None
            out.append(case.to_skip(f"the {what} variant of {model.name}: {why}") if why else case)
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> RefitRankData:
        import torch.distributed as dist

        engine = make_engine(case, ctx)
        if not isinstance(engine, ExportsWeights):  # the plan refuses such a factory; here for the type checker
            raise DoesNotApply(f"engine {case.engine} has no export_buckets (ExportsWeights)")
        with ctx.phase("build"):
            engine.build()
        steps = []
        for step in range(case.options.steps):
            with ctx.phase("steps"):
                steps.append(engine.train_step(step))
        with ctx.phase("eval"):  # through the log-prob head where the engine has one, as the RL steps score
            held_out = engine.head_eval_step(EVAL_STEP) if isinstance(engine, HasLogprobHead) else \
                engine.eval_step(EVAL_STEP)
        with ctx.phase("collect"):
            params = export_reference(engine)
        p = case.params if isinstance(case.params, RefitParams) else RefitParams()
        with ctx.phase("refit"):
            # the first export, unmeasured, kept whole on rank 0: its values are judged, and it plans what a
            # bridge plans once (its conversion tasks) and imports what the export imports
            stream = engine.export_buckets(bucket_bytes(p.bucket_sizes[0]))
            kept: dict[str, Any] | None = None
            if ctx.rank == 0:
                kept = {name: t.detach().cpu().clone() for bucket in stream for name, t in bucket}
            else:
                receive(stream)
            exports = [_exports(engine, bucket_bytes(size), p.refits, case, ctx) for size in p.bucket_sizes]
        hf, hf_none = None, ""
        if ctx.rank == 0:
            with ctx.phase("hf"):
                hf, hf_none = hf_side(case, kept or {})
        dist.barrier()
        return RefitRankData(layout_coords(), steps, params, held_out=[held_out], exports=exports,
                             stream=kept, hf=hf, hf_none=hf_none)

    key = staticmethod(figures.key)
    record_command = staticmethod(figures.record_command)
    samples = staticmethod(figures.samples)
    digits = 3

    @staticmethod
    def tolerance(metric: str, values: list[float]) -> float:
        return tolerance_for(values, figures.FLOOR_MIB)

    @staticmethod
    def noisy_metrics(samples: dict[str, dict[str, list[float]]]) -> list[str]:
        return noisy_metrics(samples, lambda metric: figures.FLOOR_MIB)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        return table_figures(result) if result.ok else {}

    def check(self, results: list[CaseResult], params: RefitParams | None = None) -> list[CheckResult]:
        return judge(results, params or RefitParams())


def _exports(engine: ExportsWeights, size: int, refits: int, case: Case, ctx: RankContext) -> Export:
    """One bucket size: an export measured (host peak, largest allocation), then `refits` more under a tracker of what
    they leave allocated."""
    import torch.distributed as dist

    dist.barrier()
    with measure(f"refit-{size}", captures_dir(case), ctx.rank, device=not ctx.on_cpu) as peak:
        sent = receive(engine.export_buckets(size))
    largest, at = largest_allocation(peak.capture)
    first = [(s.name, s.digest) for s in sent]
    differ: list[str] = []  # only what differs is kept: what the exports leave allocated is judged

    def refit(i: int) -> None:
        stream = [(name, digest(t)) for bucket in engine.export_buckets(size) for name, t in bucket]
        if stream != first:
            at = next((a[0] for a, b in zip(stream, first) if a != b), f"{len(stream)} tensors, not {len(first)}")
            differ.append(f"{'its warm-up repeat' if i < 0 else f'repeat {i + 1} of {refits}'} differs from the "
                          f"measured export at {at}")

    refit(-1)  # this loop's own first-time costs (what its first call caches) before what the refits keep
    dist.barrier()
    kept = measure_retention(refit, refits, captures_dir(case) / f"memray-refits-{size}-rank{ctx.rank}.bin",
                             c10d_apart=True)
    return Export(size, sent, peak, largest, at, kept, differ)


def hf_side(case: Case, stream: dict[str, Any]) -> tuple[HFSide | None, str]:
    """Rank 0: the HF model's own keys (built from the config on the meta device), that model loaded from the
    stream, and the held-out batch through it; (None, why) for a model with no Hugging Face architecture here."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        hf_architecture(case.model)
    except BadInput as exc:
        return None, str(exc)
    config = hf_config(case.model)
    torch_dtype = dtype(case.options.dtype).torch
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, torch_dtype=torch_dtype)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    # the checkpoint format a rollout engine loads (experts one by one, however the module holds them)
    expected = {k: (shape, str(dt).removeprefix("torch.")) for k, (shape, dt) in
                checkpoint_shapes(meta.state_dict()).items() if k not in tied}
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch_dtype).eval()
    try:
        res = model.load_state_dict(to_module_format(stream, set(model.state_dict())), strict=False)
    except RuntimeError as exc:  # shapes HF refuses
        return HFSide(expected, tied, load_error=str(exc).splitlines()[0][:300]), ""
    missing = [k for k in res.missing_keys if k not in tied]
    tokens = data.global_batch(case, EVAL_STEP)
    with torch.no_grad():
        logprobs = label_logprobs(model(input_ids=tokens[:, :-1]).logits, tokens, case_temperature(case))
    return HFSide(expected, tied, missing, list(res.unexpected_keys), logprobs=logprobs), ""
