"""`equivalence`: the same training steps on different layouts give the same losses and parameters."""

from __future__ import annotations

import math
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult, StepSeries, case_failed
from harness.checks.numeric import beyond, fmt_err, nonfinite_summary, severity, within
from harness.checks.step_outputs import (
    LogprobDiff,
    TrainedRankData,
    coverage_problem,
    first_step_logprobs,
    position_ranges,
    step_aux_losses,
    step_losses,
    trained,
)
from harness.checks.tensors import assemble, max_abs, rel_error
from harness.dtypes import dtype
from harness.engine_names import EngineName
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import default_matrix, validate
from harness.platform.parallel import layout_coords
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs.agreement import with_equivalence_eps

# Losses, log-probs and parameters across layouts: within the dtype's rtol (harness/dtypes.py).
# Copies of one shard (DP replicas, tied embedding copies) must stay bit-identical.
REPLICA_ATOL = 0.0
class EquivalenceSuite:
    name = "equivalence"
    default_model = "tiny"  # the CPU tier's model when none is given
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        return {"losses": step_losses(result)} if result.ok else {}

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: None = None) -> list[Case]:
        """The pure-DP reference first, then every other layout (default: every valid layout, CP included; for an
        MoE model with the expert layouts of layouts.expert_matrix)."""
        options = with_equivalence_eps(options)
        reference = Layout(dp=world_size)
        others = [lay for lay in default_matrix(model, world_size) if lay != reference]
        given = layouts is not None
        if layouts is None:
            layouts = others
        batch = dict(global_batch_size=options.global_batch_size, micro_batch_size=options.micro_batch_size)
        for lay in [reference, *layouts]:
            validate(lay, model, world_size, **batch)
        ordered = [reference] + [lay for lay in layouts if lay != reference]
        if len(ordered) == 1 and given and others:
            return [Case(self.name, model, reference, engine, options, backend).to_skip(
                f"equivalence compares every layout with pure DP, and --layout named only pure DP: add a layout to "
                f"compare (valid for {model.name} at world size {world_size}: {', '.join(map(str, others[:4]))}"
                f"{' ...' if len(others) > 4 else ''}) or drop --layout")]
        if len(ordered) == 1:  # nothing to compare the reference with: say so, judge nothing
            return [Case(self.name, model, reference, engine, options, backend).to_skip(
                f"equivalence compares every layout with pure DP, and world size {world_size} has no other valid "
                f"layout for {model.name}: needs world size 2 or more (e.g. --world-size 2 or 4)")]
        return [Case(self.name, model, lay, engine, options, backend) for lay in ordered]

    def rank_work(self, case: Case, ctx: RankContext) -> TrainedRankData:
        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        steps = []
        for step in range(case.options.steps):
            with ctx.phase("steps"):
                steps.append(engine.train_step(step))
        with ctx.phase("collect"):
            shards = engine.param_shards()
        return TrainedRankData(layout_coords(), steps, shards)

    def check(self, results: list[CaseResult], params: None = None) -> list[CheckResult]:
        if not results:
            return []
        ref = results[0]
        out: list[CheckResult] = []
        ref_losses = step_losses(ref) if ref.ok else []
        ref_params = assemble([trained(r).params for r in ref.ranks]) if ref.ok else None
        for res in results:
            cid = res.case.id
            if not res.ok:
                out.append(case_failed("equivalence.run", res))
                continue
            full = assemble([trained(r).params for r in res.ranks])
            out.append(self._check_finite(res, full.tensors))
            out.append(self._check_replicas(cid, full.replica_spread))
            if res is ref:
                continue
            if ref_params is None:
                out.append(CheckResult("equivalence.loss", cid, False, f"reference {ref.case.layout.id} did not run"))
                continue
            rtol = dtype(res.case.options.dtype).rtol
            out.append(self._check_losses(res, ref, step_losses(res), ref_losses, rtol))
            aux, ref_aux = step_aux_losses(res), step_aux_losses(ref)
            if aux is not None or ref_aux is not None:
                out.append(self._check_losses(res, ref, aux or [], ref_aux or [], rtol,
                                              "equivalence.aux_loss", "load-balancing loss"))
            out.append(self._check_logprobs(res, ref, rtol))
            out.append(self._check_params(res, ref, full.tensors, ref_params.tensors, rtol))
        return out

    @staticmethod
    def _check_finite(res: CaseResult, params: dict) -> CheckResult:
        """Every loss and every parameter element finite (the reference's too: it judges the rest)."""
        cid, lay = res.case.id, res.case.layout.id
        losses = step_losses(res)
        bad_losses = [i for i, x in enumerate(losses) if not math.isfinite(x)]
        n_bad, what = nonfinite_summary(params)
        if not bad_losses and not n_bad:
            return CheckResult("equivalence.finite", cid, True,
                               f"{lay}: {len(losses)} step losses and {len(params)} params finite")
        parts = []
        if bad_losses:
            parts.append(f"loss of step {bad_losses[0]} is {losses[bad_losses[0]]}")
        if n_bad:
            parts.append(f"{n_bad}/{len(params)} params hold non-finite values after {res.case.options.steps} "
                         f"steps: {what}")
        return CheckResult("equivalence.finite", cid, False, f"{lay}: " + "; ".join(parts))

    @staticmethod
    def _check_replicas(cid: str, spread: dict[str, float]) -> CheckResult:
        bad = {n: s for n, s in spread.items() if beyond(s, REPLICA_ATOL)}
        if not bad:
            return CheckResult("equivalence.replicas", cid, True, f"{len(spread)} params identical across replicas",
                               value=0.0)
        worst = max(bad, key=lambda n: severity(bad[n]))
        return CheckResult("equivalence.replicas", cid, False,
                           f"{len(bad)} params differ between copies that must be identical (DP/CP replicas, "
                           f"TP-replicated params, tied embeddings); worst {worst}: max abs {bad[worst]:.3g}",
                           [f"  {n}: max abs {s:.3g}" for n, s in sorted(bad.items())], value=bad[worst])

    @staticmethod
    def _check_losses(res, ref, losses, ref_losses, rtol, check: str = "equivalence.loss",
                      what: str = "loss") -> CheckResult:
        cid, lay, rlay = res.case.id, res.case.layout.id, ref.case.layout.id
        if len(losses) != len(ref_losses):
            return CheckResult(check, cid, False, f"{lay} reported the {what} of {len(losses)} steps, {rlay} of "
                                                  f"{len(ref_losses)}")
        errs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(losses, ref_losses)]
        rows = [f"  step {i}: {lay} {a:.8f}  {rlay} {b:.8f}  rel {fmt_err(e)}"
                for i, (a, b, e) in enumerate(zip(losses, ref_losses, errs))]
        worst = max(range(len(errs)), key=lambda i: severity(errs[i]))
        ok = within(errs[worst], rtol)
        msg = (f"{what} step {worst}: {lay} {losses[worst]:.8f} vs {rlay} {ref_losses[worst]:.8f}, "
               f"rel diff {fmt_err(errs[worst])} {'<=' if ok else '>'} {rtol:.0e}")
        return CheckResult(check, cid, ok, msg, rows, value=errs[worst],
                           data=StepSeries(what, list(losses), list(ref_losses), ref.case.id, rtol))

    @staticmethod
    def _check_logprobs(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
        """Per-token log-probs of the first step against the reference, token by token: where the loss
        moves by 1e-5, a wrong CP chunk or RoPE slice moves the tokens it hits by far more, and the
        message names them."""
        cid, lay, rlay = res.case.id, res.case.layout.id, ref.case.layout.id
        got, want = first_step_logprobs(res), first_step_logprobs(ref)
        if got is None or want is None:
            who = lay if got is None else rlay
            return CheckResult("equivalence.logprobs", cid, False,
                               f"{who}: the engine captured no per-token log-probs of the first step "
                               f"(StepOutput.token_logprobs; harness/engines/mcore.py captures them)")
        (values, counts), (ref_values, _) = got, want
        coverage = coverage_problem(counts)
        if coverage:
            return CheckResult("equivalence.logprobs", cid, False, f"{lay}: step-0 log-probs: {coverage}")
        diff = LogprobDiff.of(values, ref_values, rtol)
        bad, worst = diff.bad, diff.worst
        if not bad.any():
            return CheckResult("equivalence.logprobs", cid, True,
                               f"{lay}: step-0 log-probs of {values.numel()} tokens equal {rlay}, worst rel "
                               f"{worst:.2e} <= {rtol:.0e}", value=worst)
        rows = []
        for sample in bad.any(dim=1).nonzero().flatten().tolist():
            where = bad[sample].nonzero().flatten().tolist()
            i = where[0]
            rows.append(f"  sample {sample}: {len(where)} tokens off at positions {position_ranges(where)}; "
                        f"position {i}: "
                        f"{float(values[sample, i]):.6f} vs {float(ref_values[sample, i]):.6f}")
        first = diff.first_sample
        return CheckResult("equivalence.logprobs", cid, False,
                           f"{lay}: step-0 log-probs differ from {rlay} at {int(bad.sum())}/{values.numel()} tokens "
                           f"(worst rel {fmt_err(worst)} > {rtol:.0e}); first: sample {first}, positions "
                           f"{diff.positions(first)}", rows, value=worst)

    @staticmethod
    def _check_params(res, ref, params, ref_params, rtol) -> CheckResult:
        cid, lay, rlay = res.case.id, res.case.layout.id, ref.case.layout.id
        missing = sorted(set(ref_params) ^ set(params))
        if missing:
            return CheckResult("equivalence.params", cid, False,
                               f"parameter names differ between {lay} and {rlay}: {missing[:5]}")
        errs = {n: rel_error(params[n], ref_params[n]) for n in ref_params}
        bad = sorted((n for n in errs if beyond(errs[n], rtol)), key=lambda n: -severity(errs[n]))
        worst = max(errs, key=lambda n: severity(errs[n]))
        if not bad:
            return CheckResult("equivalence.params", cid, True,
                               f"{len(errs)} params equal to {rlay}; worst {worst} rel {errs[worst]:.2e} <= {rtol:.0e}",
                               value=errs[worst])
        rows = [f"  {n}: rel {fmt_err(errs[n])}, max abs {max_abs(params[n], ref_params[n]):.3g}" for n in bad]
        _, nonfinite = nonfinite_summary({n: params[n] for n in bad})
        return CheckResult("equivalence.params", cid, False,
                           f"{len(bad)}/{len(errs)} params differ from {rlay} after {res.case.options.steps} steps; "
                           f"worst {bad[0]}: rel {fmt_err(errs[bad[0]])} > {rtol:.0e}"
                           + (f" (non-finite: {nonfinite})" if nonfinite else ""), rows, value=errs[bad[0]])

