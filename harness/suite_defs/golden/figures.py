"""golden's figures of a finished case: its trajectory as baseline metrics, and the key it is stored under."""

from __future__ import annotations

from harness import selection
from harness.checks.tensors import assemble
from harness.dtypes import dtype
from harness.engines import baseline_suffix
from harness.launch.results import CaseResult
from harness.spec import Case


def step_metric(step: int, figure: str) -> str:
    """The baseline metric of a figure at a step (1-based, as people count steps)."""
    return f"step{step:02d}.{figure}"


def trajectory(result: CaseResult, first_step: int = 1) -> dict[str, float]:
    """The case's figures as baseline metrics: per step loss, grad_norm, num_zeros (fp32 only: DType), lr (and an MoE
    model's load-balancing loss, aux_loss); after the last step
    param.<name> (L2 norm of the full parameter), exp_avg.<name> / exp_avg_sq.<name> (of its Adam moments, where
    the engine hands out its optimizer state) and optimizer.step (Adam's step counter)."""
    from harness.checks.step_outputs import step_aux_losses, step_losses
    from harness.suite_defs.golden.payload import GoldenRankData

    data = [r.payload_as(GoldenRankData) for r in result.ranks]
    out: dict[str, float] = {}
    for i, loss in enumerate(step_losses(result), start=first_step):
        out[step_metric(i, "loss")] = loss
    for i, aux in enumerate(step_aux_losses(result) or [], start=first_step):
        out[step_metric(i, "aux_loss")] = aux
    figures = ("grad_norm", "num_zeros", "lr") if dtype(result.case.options.dtype).zero_count_comparable \
        else ("grad_norm", "lr")
    for i, s in enumerate(data[0].steps, start=first_step):
        for figure in figures:
            value = getattr(s, figure)
            if value is not None:
                out[step_metric(i, figure)] = float(value)
    if not data[0].finished:  # the first half of a resumed run: steps only
        return out
    for name, tensor in sorted(assemble([d.params for d in data]).tensors.items()):
        out[f"param.{name}"] = float(tensor.double().norm())
    if hands_out_moments(result):
        steps = []
        for key, tensor in sorted(assemble([d.optimizer or [] for d in data]).tensors.items()):
            name, _, moment = key.rpartition("#")
            if moment == "step":
                steps.append(float(tensor.max()))
            else:
                out[f"{moment}.{name}"] = float(tensor.double().norm())
        if steps:
            out["optimizer.step"] = max(steps)  # Adam's step counter (bias correction)
    return out


def is_optimizer_state(metric: str) -> bool:
    """A figure of the engine's Adam state (trajectory's exp_avg.<name>, exp_avg_sq.<name>, optimizer.step)."""
    return metric.startswith(("exp_avg.", "exp_avg_sq.")) or metric == "optimizer.step"


def hands_out_moments(result: CaseResult) -> bool:
    """Whether the case's engine handed out its Adam state (HasOptimizerState) on every rank."""
    from harness.suite_defs.golden.payload import GoldenRankData

    return all(r.payload_as(GoldenRankData).optimizer is not None for r in result.ranks)


def key(case: Case) -> str:
    """One trajectory per model, dtype, step count and learning-rate schedule: every layout is judged against it.
    The fsdp2 engine (torch Adam, no loss mask) trains another one, stored beside it."""

    o = case.options
    engine = baseline_suffix(case.engine)
    schedule = (f"/lr=warmup{o.lr_warmup_steps}-{o.lr_decay_style}{o.lr_decay_steps}-min{o.min_lr:g}"
                if o.lr_decay_steps else "")
    return f"{case.model.name}/{o.dtype}/steps={o.steps}{schedule}{engine}"


def record_command(case: Case) -> str:
    """The whole suite at the case's world size, dtype, steps and engine: one trajectory for every layout."""

    return selection.record_command(case, layout=False)
