"""The policy loss of the RL training steps (batch-split's `--policy-loss`): the log-prob's negative (`nll`, the
default), or PPO's clipped surrogate with a KL penalty (`ppo-clip`, as verl and OpenRLHF compute it) over the old
log-probs of a forward-only pass on the same micro-batches and weights just before the step, and each sample's
advantage from the harness's own arithmetic (`advantage`). With the old log-probs the policy's own, every step's
ratio is exactly 1, nothing is clipped and the KL is 0: each figure is reported (`PolicyStats`) and judged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harness.errors import BadInput

if TYPE_CHECKING:
    import torch

NLL, PPO_CLIP = "nll", "ppo-clip"
POLICY_LOSSES = (NLL, PPO_CLIP)
CLIP_EPS = 0.2  # verl's and OpenRLHF's default clip ratio
KL_COEF = 0.001  # the penalty's coefficient (verl's kl_loss_coef default); k3, verl's low_var_kl

POLICY_LOSS_HELP = ("batch-split: the policy loss of the training steps: nll (each token's negative log-prob; the "
                    "default) or ppo-clip (PPO's clipped surrogate with a KL penalty over the old log-probs of a "
                    "forward-only pass just before each step, and per-sample advantages: each step's ratio must be "
                    "exactly 1, its clipped fraction and its KL 0)")


def check_policy_loss(name: str) -> None:
    if name not in POLICY_LOSSES:
        raise BadInput(f"--policy-loss {name}: give one of {', '.join(POLICY_LOSSES)}")


@runtime_checkable
class TrainedWithPolicyLoss(Protocol):
    """A case's parameters that name the policy loss of its RL training steps (batch-split's)."""

    policy_loss: str


def case_policy_loss(case: Any) -> str:
    return case.params.policy_loss if isinstance(case.params, TrainedWithPolicyLoss) else NLL


def advantage(sample: int) -> float:
    """Sample `sample`'s advantage in the global batch: -0.5, 0, 0.5, 1 or 1.5, the same on every layout and cut. Not
    centred: at ratio 1 the loss is the advantages' negative aggregate, and one near 0 would leave the loss checks
    comparing rounding residues (tiny-moe's step 1 at CP 2 read -3.7e-09 against -7.5e-09 with centred ones)."""
    return ((sample * 7) % 5 - 1) / 2


@dataclass
class PolicyStats:
    """PPO's figures of one step over this rank's response tokens (summed over its micro-batches): the largest
    |ratio - 1|, the tokens whose clipped term won, the tokens, and the KL penalty's sum."""

    max_ratio_dev: float
    clipped: int
    tokens: int
    kl_sum: float

    @classmethod
    def of(cls, rows: list[torch.Tensor]) -> PolicyStats:
        """From the micro-batches' [max |r - 1|, clipped, tokens, KL sum] rows."""
        import torch

        t = torch.stack([r.double().cpu() for r in rows])
        return cls(float(t[:, 0].max()), int(t[:, 1].sum()), int(t[:, 2].sum()), float(t[:, 3].sum()))


def ppo_clip(logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss plus the KL penalty ([b, s]), and the micro-batch's [max |r - 1|, clipped, tokens,
    KL sum] over the mask's tokens (no gradient)."""
    import torch

    keep = mask > 0
    log_ratio = torch.where(keep, logprobs - old, torch.zeros_like(logprobs))  # a masked position may be -inf
    ratio = torch.exp(log_ratio)
    a = advantages.reshape(-1, 1).to(logprobs.dtype)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
    kl = torch.exp(-log_ratio) + log_ratio - 1
    loss = torch.maximum(unclipped, clipped) + KL_COEF * kl
    with torch.no_grad():
        dev = ((ratio - 1).abs() * keep).max() if keep.any() else ratio.new_zeros(())
        stats = torch.stack([dev.float(), ((clipped > unclipped) & keep).sum().float(), keep.sum().float(),
                             (kl * keep).sum().float()])
    return loss, stats
