"""batch-split's MTP checks (`--mtp-layers`), from each rank's measurements of the first step with the model's MTP
layers on and off (harness/engines/mtp.py):
- `batch-split.mtp_grads`: with the MTP heads detached, the embedding's, decoder's and output layer's gradients equal
  the same step's with MTP off, and the MTP layers take a gradient (MTP trains);
- `batch-split.mtp_loss`: megatron's MTP loss counts the response tokens only (each position whose target, k tokens
  on, is a response token), and its value is the cross-entropy of the MTP logits over them."""

from __future__ import annotations

from harness.checks import CheckResult, case_failed
from harness.checks.numeric import fmt_err, within
from harness.checks.step_outputs import reports_batch
from harness.dtypes import dtype
from harness.engines.mtp import MTPProbe
from harness.launch.results import CaseResult
from harness.suite_defs.batch_split.judge import data, where

GRADS, LOSS = "batch-split.mtp_grads", "batch-split.mtp_loss"


def check_mtp(result: CaseResult) -> list[CheckResult]:
    if not result.ok:
        return [case_failed("batch-split.run", result)]
    probes = [(d.coords, d.mtp) for d in data(result)]
    at = where(result)
    missing = [c for c, p in probes if p is None]
    if missing:
        msg = f"{at}: {len(missing)} rank(s) reported no MTP measurements (ProbesMTP.mtp_probe)"
        return [CheckResult(GRADS, result.case.id, False, msg), CheckResult(LOSS, result.case.id, False, msg)]
    got = [(c, p) for c, p in probes if p is not None]
    return [_grads(result, at, [p for _, p in got]), _loss(result, at, got)]


def _grads(result: CaseResult, at: str, probes: list[MTPProbe]) -> CheckResult:
    cid, tp = result.case.id, result.case.layout.tp
    rtol = dtype(result.case.options.dtype).rtol
    moved: dict[str, float] = {}
    for p in probes:
        for part, (diff, size) in p.grads.items():
            rel = diff / size if size else diff
            moved[part] = max(moved.get(part, 0.0), rel)
    rows = [f"  {part}: max |on - off| {fmt_err(rel)} of its largest gradient" for part, rel in moved.items()]
    mtp = [p.mtp_grad for p in probes if p.mtp_grad is not None]
    if not moved:
        return CheckResult(GRADS, cid, False, f"{at}: no rank reported the main model's gradients")
    part = max(moved, key=lambda k: moved[k])
    if not within(moved[part], rtol):
        tied = " (the output layer's weight, tied)" if part == "embedding" and result.case.model.tie_embeddings else ""
        return CheckResult(GRADS, cid, False,
                           f"{at}: MTP's loss reached the {part}{tied} at TP {tp}: its gradient with MTP on differs "
                           f"from the same step's with MTP off by {fmt_err(moved[part])} of its largest (> "
                           f"{rtol:.0e}); with the MTP heads detached (mtp_detach_heads) only the MTP layers take "
                           f"MTP's gradient", rows,
                           value=moved[part])
    if not mtp or max(mtp) == 0:
        return CheckResult(GRADS, cid, False,
                           f"{at}: the MTP layers took no gradient at TP {tp} (largest "
                           f"{max(mtp) if mtp else 'none reported'}): MTP did not train", rows, value=moved[part])
    return CheckResult(GRADS, cid, True,
                       f"{at}: with MTP's heads detached, the {_parts(moved, result)} gradients equal the same step's "
                       f"with MTP off at TP {tp} (worst {part} {fmt_err(moved[part])} <= {rtol:.0e}); the MTP layers' "
                       f"largest {max(mtp):.3g}", rows, value=moved[part])


def _loss(result: CaseResult, at: str, probes: list[tuple[dict[str, int], MTPProbe]]) -> CheckResult:
    cid, tp = result.case.id, result.case.layout.tp
    rtol = dtype(result.case.options.dtype).rtol
    reporting = [p for c, p in probes if reports_batch(c)]
    depth = result.case.model.mtp_num_layers
    if not reporting or any(len(p.counted) != depth or len(p.expected) != depth or len(p.losses) != depth
                            for p in reporting):
        return CheckResult(LOSS, cid, False, f"{at}: the last pipeline stage reported no MTP loss for each of its "
                                             f"{depth} depth(s) (megatron's MTPLossLoggingHelper)")
    counted = [sum(p.counted[k] for p in reporting) for k in range(depth)]
    expected = [sum(p.expected[k] for p in reporting) for k in range(depth)]
    errs = [(abs(got - want) / abs(want) if want else abs(got), got, want)
            for p in reporting for got, want in p.losses]
    worst = max(errs, key=lambda e: e[0])
    rows = [f"  depth {k + 1}: {counted[k]} tokens counted, {expected[k]} response tokens" for k in range(depth)]
    off = [k for k in range(depth) if counted[k] != expected[k]]
    if off:
        k = off[0]
        why = ("positions whose target is prompt or padding counted" if counted[k] > expected[k]
               else "response tokens left out") + ": the loss mask the forward took is missing or not the response " \
            "aligned with the input tokens"
        return CheckResult(LOSS, cid, False, f"{at}: megatron's MTP loss at depth {k + 1} counted {counted[k]} tokens "
                                             f"at TP {tp}, the response holds {expected[k]} whose target lies in the "
                                             f"window ({why})", rows, value=float(abs(counted[k] - expected[k])))
    if not within(worst[0], rtol):
        return CheckResult(LOSS, cid, False, f"{at}: megatron's MTP loss {worst[1]:.8g} at TP {tp} is not the "
                                             f"cross-entropy of its logits over the response tokens, {worst[2]:.8g} "
                                             f"(rel {fmt_err(worst[0])} > {rtol:.0e}): it counts other positions or "
                                             f"targets than the response's", rows, value=worst[0])
    return CheckResult(LOSS, cid, True, f"{at}: megatron's MTP loss counts the {sum(expected)} response tokens whose "
                                        f"target lies in the window at TP {tp}, and equals their cross-entropy (worst "
                                        f"rel {fmt_err(worst[0])} <= {rtol:.0e})", rows, value=worst[0])


def _parts(moved: dict[str, float], result: CaseResult) -> str:
    """'embedding and decoder (the output layer tied to the embedding)'."""
    names = list(moved)
    said = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
    tied = result.case.model.tie_embeddings and "output layer" not in moved
    return said + (" (the output layer tied to the embedding)" if tied else "")
