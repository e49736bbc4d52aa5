"""How the trainer turns the model's logits into what an RL loss takes: each token's log-prob of its label and the
entropy, at a sampling temperature, over the vocabulary-parallel logits of the TP ranks. A part of the engine
(`McoreEngine.logprob_part`): a framework's engine names its own subclass to have its own code judged.

The RL steps (harness/engines/rl_steps.py: the log-prob pass and training, batch-split's and rl-cycle's) run the
model without labels, as RL frameworks call it, and hand its logits here. The default is megatron's own
`vocab_parallel_cross_entropy` on the logits divided by the temperature: at temperature 1 the log-probs are bit for
bit those of the model's forward with labels.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harness.engines.base import HasLogprobHead
from harness.errors import BadInput

if TYPE_CHECKING:
    import torch

# the flag of the suites that score log-probs (batch-split's, refit's and rl-cycle's parameters declare it alike)
TEMPERATURE_HELP = ("batch-split, refit, rl-cycle: the sampling temperature the trainer's log-probs and entropy are "
                    "taken at (the engine's log-prob head; the Hugging Face model that stands in for the rollout "
                    "scores at it too; default 1.0)")


ENTROPY_COEF_HELP = ("batch-split: the entropy bonus's coefficient C: each training step's loss minus C x the entropy "
                     "of the log-prob head, aggregated in the case's mode (verl's entropy_coeff; default 0: none)")


def check_entropy_coef(c: float) -> None:
    if not (math.isfinite(c) and c >= 0):
        raise BadInput(f"--entropy-coef {c:g}: give a coefficient of 0 or more (e.g. 0.01; 0 trains without the "
                       "entropy bonus)")


def check_temperature(t: float) -> None:
    if not (math.isfinite(t) and t > 0):
        raise BadInput(f"--temperature {t:g}: give a positive temperature (e.g. 0.7; 1.0 leaves the logits as they "
                       "are)")


@runtime_checkable
class SampledAtTemperature(Protocol):
    """A case's parameters that name the rollout's sampling temperature (batch-split's, refit's, rl-cycle's)."""

    temperature: float


@runtime_checkable
class TrainedWithEntropyBonus(Protocol):
    """A case's parameters that name an entropy bonus for its RL training steps (batch-split's)."""

    entropy_coef: float


def case_entropy_coef(case: Any) -> float:
    """The coefficient of the entropy bonus the case's RL training steps subtract from their loss (0: none)."""
    return case.params.entropy_coef if isinstance(case.params, TrainedWithEntropyBonus) else 0.0


def case_temperature(case: Any) -> float:
    """The sampling temperature the case's RL steps take log-probs at (1.0 where its parameters name none)."""
    return case.params.temperature if isinstance(case.params, SampledAtTemperature) else 1.0


class LogprobHead:
    """The engine's part that computes per-token log-probs and entropy from this TP rank's vocabulary shard of the
    logits; `temperature` is the rollout's sampling temperature (the engine makes its head at the case's:
    `--temperature`)."""

    def __init__(self, engine: Any, temperature: float = 1.0):
        self.engine = engine
        self.temperature = temperature

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits at the temperature, divided in fp32 (the same tensor at 1.0)."""
        return logits if self.temperature == 1.0 else logits.float() / self.temperature

    def padding(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[V / TP] True at this shard's padded columns (megatron's vocabulary padded past the model's: no token's),
        None where the shard has none."""
        import torch
        from megatron.core import parallel_state as ps

        shard, vocab = logits.shape[-1], self.engine.case.model.vocab_size
        start = ps.get_tensor_model_parallel_rank() * shard
        if start + shard <= vocab:
            return None
        return torch.arange(start, start + shard, device=logits.device) >= vocab

    def logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[b, s] log-prob of each label under the softmax of the scaled logits ([b, s, V / TP], this TP rank's
        shard; padded columns out of it), with the gradient flowing to every shard."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        z = self.scaled(logits)
        pad = self.padding(z)
        if pad is not None:  # a padded row takes no probability and no gradient
            z = z.masked_fill(pad, float("-inf"))
        # megatron's cross-entropy takes [s, b, V / TP] and shifts what it is given in place: the model's own logits
        # where the transpose needs no copy (one sample per micro-batch at temperature 1), so the entropy goes first
        loss = vocab_parallel_cross_entropy(z.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
        return -loss.transpose(0, 1).contiguous()  # as the model returns it: [b, s] in memory order

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, s] entropy of the softmax of the scaled logits over the whole vocabulary (every TP rank's shard)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        z = self.scaled(logits.float())
        pad = self.padding(z)
        if pad is not None:
            z = z.masked_fill(pad, float("-inf"))
        top = z.max(dim=-1, keepdim=True).values.detach()
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        shifted = z - top
        e = torch.exp(shifted)
        if pad is not None:  # 0 x -inf: a padded column adds nothing to the entropy, not NaN
            shifted = shifted.masked_fill(pad, 0.0)
        total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
        return torch.log(total) - reduce_from_tensor_model_parallel_region((e * shifted).sum(dim=-1)) / total


def check_head(engine: str, factory: type, temperature: float) -> None:
    """A temperature other than 1 needs an engine class with a log-prob head (BadInput, before any rank)."""

    if temperature != 1.0 and not issubclass(factory, HasLogprobHead):
        raise BadInput(f"--temperature {temperature:g}: engine {engine} has no log-prob head (logprob_head(): "
                       "harness.engines.base.HasLogprobHead) to take its log-probs at a temperature; give a subclass "
                       "of McoreEngine, or drop --temperature")
