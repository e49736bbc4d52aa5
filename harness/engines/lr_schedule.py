"""The learning-rate schedule an engine steps: megatron-core's OptimizerParamScheduler, as megatron's training loop
builds and steps it (training.py: warm-up and decay counted in samples, stepped by the global batch's samples after
every optimizer step) and as its checkpointing saves and restores it (`opt_param_scheduler` in the state dict)."""

from __future__ import annotations

from typing import Any

from harness.errors import MissingDependency
from harness.spec import CaseOptions

SCHEDULER_KEY = "opt_param_scheduler"  # megatron's key in a checkpoint's common state


def make_scheduler(optimizer: Any, options: CaseOptions, global_batch_size: int) -> Any | None:
    """megatron's OptimizerParamScheduler over the optimizer's parameter groups (megatron's or torch's), its first
    learning rate set; None where the options train at a constant lr."""
    if not options.lr_decay_steps:
        return None
    try:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    except ImportError as exc:
        raise MissingDependency("a learning-rate schedule needs megatron-core's OptimizerParamScheduler "
                                "(megatron.core.optimizer_param_scheduler): pip install megatron-core") from exc
    samples = global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=options.lr_warmup_init, max_lr=options.lr, min_lr=options.min_lr,
        lr_warmup_steps=options.lr_warmup_steps * samples, lr_decay_steps=options.lr_decay_steps * samples,
        lr_decay_style=options.lr_decay_style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=options.lr_decay_steps * samples, wd_incr_style="constant")


def saved_schedule(state: dict, ckpt_dir: str) -> dict:
    """The schedule's state a loaded checkpoint holds (megatron's `opt_param_scheduler`); a checkpoint without one
    cannot resume a scheduled run where it stopped."""
    if SCHEDULER_KEY not in state:
        raise RuntimeError(f"checkpoint {ckpt_dir} holds no learning-rate schedule ({SCHEDULER_KEY}): it was saved "
                           f"without one, so a resume could not continue the warm-up and decay where they stopped")
    return state[SCHEDULER_KEY]
