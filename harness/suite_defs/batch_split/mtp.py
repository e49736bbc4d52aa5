"""batch-split's MTP checks (`--mtp-layers`), from each rank's measurements of the first step with the model's MTP
layers on and off (harness/engines/mtp.py):
- `batch-split.mtp_grads`: with the MTP heads detached, the embedding's, decoder's and output layer's gradients equal
  the same step's with MTP off, and the MTP layers take a gradient (MTP trains);
- `batch-split.mtp_loss`: megatron's MTP loss counts the response tokens only (each position whose target, k tokens
  on, is a response token), and its value is the cross-entropy of the MTP logits over them."""

from __future__ import annotations

import math

from harness.checks import CheckResult, case_failed
from harness.checks.numeric import fmt_err, within
from harness.checks.step_outputs import reports_batch
from harness.dtypes import DType, dtype
from harness.engines.mtp import MAIN_PARTS, MTPProbe
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


def grad_rtol(kind: DType) -> float:
    """How far a main-model gradient with MTP on may lie from the same step's with MTP off, relative to the
    parameter's largest: the same kernels run twice (bit for bit equal on CPU ranks, every shipped model and layout);
    the bound leaves a GPU's non-deterministic reductions room, far below what MTP's loss moves (1e-01 of the output
    layer's gradient when its weight is not detached)."""
    return 1e-6 if kind == DType.fp32 else 1e-3


def _grads(result: CaseResult, at: str, probes: list[MTPProbe]) -> CheckResult:
    cid = result.case.id
    rtol = grad_rtol(dtype(result.case.options.dtype))
    moved: dict[str, float] = {}  # per parameter, its worst rank's |on - off| relative to its own largest gradient
    for p in probes:
        for name, (diff, size) in p.grads.items():
            rel = diff / size if size else (math.inf if diff else 0.0)
            moved[name] = max(moved.get(name, 0.0), rel)
    if not moved:
        return CheckResult(GRADS, cid, False, f"{at}: no rank reported the main model's gradients")
    worst = {}
    for prefix, part in MAIN_PARTS.items():
        names = [n for n in moved if n.startswith(prefix)]
        if names:
            worst[part] = max(names, key=lambda n: moved[n])
    rows = [f"  {part}: worst {name}, |on - off| {fmt_err(moved[name])} of its largest gradient"
            for part, name in worst.items()]
    mtp = [p.mtp_grad for p in probes if p.mtp_grad is not None]
    part = max(worst, key=lambda k: moved[worst[k]])
    name = worst[part]
    if not within(moved[name], rtol):
        tied = " (tied to the output layer)" if part == "embedding" and result.case.model.tie_embeddings else ""
        bad = sum(1 for n in moved if not within(moved[n], rtol))
        return CheckResult(GRADS, cid, False,
                           f"{at}: MTP's loss reached the {part}{tied}: {name}'s gradient with MTP on differs from "
                           f"the same step's with MTP off by {fmt_err(moved[name])} of its largest (> {rtol:.0e}; "
                           f"{bad} of {len(moved)} main-model parameters moved); with the MTP heads detached "
                           f"(mtp_detach_heads) only the MTP layers take MTP's gradient", rows, value=moved[name])
    if not mtp or max(mtp) == 0:
        return CheckResult(GRADS, cid, False,
                           f"{at}: the MTP layers took no gradient (largest {max(mtp) if mtp else 'none reported'}): "
                           "MTP did not train", rows, value=moved[name])
    return CheckResult(GRADS, cid, True,
                       f"{at}: with MTP's heads detached, the {_parts(worst, result)} gradients equal the same step's "
                       f"with MTP off, parameter by parameter (worst {name} {fmt_err(moved[name])} <= {rtol:.0e}); "
                       f"the MTP layers' largest {max(mtp):.3g}", rows, value=moved[name])


def _loss(result: CaseResult, at: str, probes: list[tuple[dict[str, int], MTPProbe]]) -> CheckResult:
    cid = result.case.id
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
        why = ("positions whose target is prompt or padding counted: the loss mask the forward took is missing or not "
               "the response aligned with the input tokens" if counted[k] > expected[k] else
               "response tokens left out: the loss mask the forward took is not the response aligned with the input "
               "tokens")
        return CheckResult(LOSS, cid, False, f"{at}: megatron's MTP loss at depth {k + 1} counted {counted[k]} tokens, "
                                             f"the response holds {expected[k]} whose target lies in the window "
                                             f"({why})", rows, value=float(abs(counted[k] - expected[k])))
    if not within(worst[0], rtol):
        return CheckResult(LOSS, cid, False, f"{at}: megatron's MTP loss {worst[1]:.8g} is not the "
                                             f"cross-entropy of its logits over the response tokens, {worst[2]:.8g} "
                                             f"(rel {fmt_err(worst[0])} > {rtol:.0e}): it counts other positions or "
                                             f"targets than the response's", rows, value=worst[0])
    counts = ", ".join(f"{n} at depth {k + 1}" for k, n in enumerate(expected))
    return CheckResult(LOSS, cid, True, f"{at}: megatron's MTP loss counts the response tokens whose target lies in "
                                        f"the window ({counts}) and equals their cross-entropy (worst rel "
                                        f"{fmt_err(worst[0])} <= {rtol:.0e})", rows, value=worst[0])


def _parts(worst: dict[str, str], result: CaseResult) -> str:
    """'embedding and decoder (the output layer tied to the embedding)' from the parts judged."""
    names = list(worst)
    said = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]
    tied = result.case.model.tie_embeddings and "output layer" not in worst
    return said + (" (the output layer tied to the embedding)" if tied else "")
