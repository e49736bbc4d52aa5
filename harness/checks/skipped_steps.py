"""Steps megatron skipped: its optimizer reported no update (`update_successful` False) - non-finite gradients under
fp16's loss scaler on every release, a norm beyond OptimizerConfig.grad_norm_skip_threshold on megatron-core 0.19
and later (in fp32 and bf16 megatron checks for no inf / NaN and applies it: equivalence.finite and golden name
that). Reported
in every suite whose ranks train (a figure, `skipped_steps`, and a failed check naming the steps), never counted as
a trained step: a trajectory that held because nothing trained is no pass."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from harness.checks import CheckResult
from harness.engines.base import StepOutput
from harness.launch.results import CaseResult


@runtime_checkable
class ReportsSteps(Protocol):
    """A rank payload with its training steps' outputs (TrainedRankData and the suites' that extend it)."""

    steps: list[StepOutput]


def skipped(result: CaseResult) -> dict[int, float | None]:
    """Step index -> the gradient norm of a step megatron skipped on some rank (every rank agrees: the decision is
    made on the global norm): from the steps the ranks' payloads report, and from what McoreEngine.train_step noted on
    each rank (the suites whose payloads keep no steps: train-memory, ckpt-memory, grad-sync, step-perf)."""
    out: dict[int, float | None] = {}
    for rank in result.ranks:
        for i, norm in rank.skipped_steps:
            out.setdefault(i, norm)
        payload = rank.data
        if not isinstance(payload, ReportsSteps) or not isinstance(payload.steps, list):
            continue
        for i, step in enumerate(payload.steps):
            if isinstance(step, StepOutput) and step.skipped:
                out.setdefault(i, step.grad_norm)
    return dict(sorted(out.items()))


def figures(result: CaseResult) -> dict[str, Any]:
    """The figure every report shows of a case where steps were skipped: their indices."""
    steps = skipped(result) if result.ok else {}
    return {"skipped_steps": sorted(steps)} if steps else {}


def check(suite: str, results: list[CaseResult]) -> list[CheckResult]:
    """A failed `<suite>.trained-steps` for every case in which megatron skipped a step, naming the steps and why."""
    out = []
    for res in results:
        steps = skipped(res) if res.ok else {}
        if not steps:
            continue
        trained = max((len(r.data.steps) for r in res.ranks if isinstance(r.data, ReportsSteps)),
                      default=res.case.options.steps)
        first, norm = min(steps.items())
        why = ("a non-finite gradient norm" if norm is None or not math.isfinite(norm) else
               f"gradient norm {norm:.4g}, beyond the optimizer's grad_norm_skip_threshold")
        which = ", ".join(map(str, steps))
        out.append(CheckResult(f"{suite}.trained-steps", res.case.id, False,
                               f"megatron skipped {len(steps)} of {trained} steps (steps {which}): "
                               f"its optimizer applied no update ({why} at step {first}), so "
                               f"{trained - len(steps)} steps trained and the figures of the skipped ones judge "
                               "nothing"))
    return out
