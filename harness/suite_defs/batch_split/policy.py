"""batch-split's PPO check (`--policy-loss ppo-clip`): every step's ratio exactly 1, nothing clipped and the KL 0, as
the old log-probs of the pass just before the step are the policy's own (harness/engines/policy_loss.py)."""

from __future__ import annotations

from harness.checks import CheckResult
from harness.checks.step_outputs import reports_batch
from harness.engines.policy_loss import CLIP_EPS, PolicyStats
from harness.launch.results import CaseResult
from harness.suite_defs.batch_split.judge import data, where

CHECK = "batch-split.ppo"


def step_stats(result: CaseResult) -> list[PolicyStats | None]:
    """Per step, the PPO figures over the global batch: the last-stage ranks of TP rank 0 (each its DP and CP part)."""
    per_step: dict[int, list[PolicyStats]] = {}
    ranks = data(result)
    for d in ranks:
        if reports_batch(d.coords):
            for i, out in enumerate(d.steps):
                if out.policy is not None:
                    per_step.setdefault(i, []).append(out.policy)
    steps = len(ranks[0].steps) if ranks else 0
    return [PolicyStats(max(s.max_ratio_dev for s in per_step[i]), sum(s.clipped for s in per_step[i]),
                        sum(s.tokens for s in per_step[i]), sum(s.kl_sum for s in per_step[i]))
            if i in per_step else None for i in range(steps)]


def check_ratio(result: CaseResult) -> CheckResult:
    cid, tp, at = result.case.id, result.case.layout.tp, where(result)
    stats = step_stats(result)
    missing = [i for i, s in enumerate(stats) if s is None or not s.tokens]
    if not stats or missing:
        return CheckResult(CHECK, cid, False, f"{at}: PPO-clip at TP {tp}: no PPO figures reported for step(s) "
                                              f"{missing or 'any'} (StepOutput.policy of the last pipeline stage)")
    off = [(i, s) for i, s in enumerate(stats) if s is not None and (s.max_ratio_dev != 0 or s.clipped or s.kl_sum)]
    tokens = sum(s.tokens for s in stats if s is not None)
    if not off:
        return CheckResult(CHECK, cid, True, f"{at}: PPO-clip at TP {tp}: at each of {len(stats)} steps the ratio is "
                                             f"exactly 1 over its response tokens ({tokens} in all), none clipped "
                                             f"(eps {CLIP_EPS:g}), KL 0", value=0.0)
    i, s = off[0]
    assert s is not None
    return CheckResult(CHECK, cid, False,
                       f"{at}: PPO-clip at TP {tp}: step {i}'s ratio is not exactly 1 over its {s.tokens} response "
                       f"tokens: max |ratio - 1| {s.max_ratio_dev:.3e}, {s.clipped} clipped (eps {CLIP_EPS:g}), KL "
                       f"{s.kl_sum / s.tokens:.3e} per token: the old log-probs are not the policy's own on the "
                       f"weights before the step", [f"  step {k}: max |ratio - 1| {t.max_ratio_dev:.3e}, {t.clipped}/"
                                                    f"{t.tokens} clipped, KL sum {t.kl_sum:.3e}"
                                                    for k, t in enumerate(stats) if t is not None],
                       value=s.max_ratio_dev)
