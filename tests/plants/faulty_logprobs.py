"""Log-prob heads with planted regressions, each one seen in 2026's RL frameworks (the RL suites: rl-cycle's
`policy` against a Hugging Face model at the same temperature, batch-split's gradients at TP 2 against TP 1)."""

from __future__ import annotations

from harness.engine_api import LogprobHead, McoreEngine


class ScalesTwice(LogprobHead):
    def logprobs(self, logits, labels):
        return super().logprobs(self.scaled(logits), labels)


class TemperatureTwice(McoreEngine):
    """The logits divided by the temperature where the model's output is post-processed and again in the log-prob
    function (OpenRLHF #1319, miles #1345's shape): right at temperature 1 only."""

    logprob_part = ScalesTwice


class UnscaledEntropy(LogprobHead):
    def entropy(self, logits):
        kept, self.temperature = self.temperature, 1.0
        try:
            return super().entropy(logits)
        finally:
            self.temperature = kept


class EntropyOnUnscaledLogits(McoreEngine):
    """The log-probs at the temperature, the entropy on the raw logits (OpenRLHF #1319: 1.03 nats off at 0.5)."""

    logprob_part = UnscaledEntropy


def _normaliser_outside_autograd(z):
    """The softmax's max and normaliser over the TP ranks' vocabulary shards, all-reduced outside autograd (ms-swift
    #9947's shape): the values right, no gradient through them."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    with torch.no_grad():
        top = z.max(dim=-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = torch.exp(z - top).sum(dim=-1)
        dist.all_reduce(total, group=group)
    return top, total


class NormaliserReducedOutsideAutograd(LogprobHead):
    def logprobs(self, logits, labels):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        if ps.get_tensor_model_parallel_world_size() == 1:  # one shard: the plain path
            return super().logprobs(logits, labels)
        z = self.scaled(logits.float())
        top, total = _normaliser_outside_autograd(z)
        shard = z.shape[-1]
        local = labels - ps.get_tensor_model_parallel_rank() * shard
        owned = (local >= 0) & (local < shard)
        picked = reduce_from_tensor_model_parallel_region(
            z.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * owned)
        return picked - top.squeeze(-1) - torch.log(total)


class VocabReduceOutsideAutograd(McoreEngine):
    """A vocabulary-parallel log-prob at TP > 1 whose softmax normaliser is all-reduced outside autograd (ms-swift
    #9947's shape): the values right, the gradient only the label's, so the shards that do not own a label get none;
    at TP 1 it takes the plain path."""

    logprob_part = NormaliserReducedOutsideAutograd


class ShiftedLabels(LogprobHead):
    def logprobs(self, logits, labels):
        import torch

        return super().logprobs(logits, torch.roll(labels, -1, dims=1))


class LabelShiftOffByOne(McoreEngine):
    """The one-token shift done twice (a roll on labels already shifted: verl #6564's shape): each position scored
    against the token after its label."""

    logprob_part = ShiftedLabels


class EntropyNormaliserOutsideAutograd(LogprobHead):
    def entropy(self, logits):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        if ps.get_tensor_model_parallel_world_size() == 1:  # one shard: the plain path
            return super().entropy(logits)
        z = self.scaled(logits.float())
        top, total = _normaliser_outside_autograd(z)
        shifted = z - top
        return torch.log(total) - reduce_from_tensor_model_parallel_region((torch.exp(shifted) * shifted).sum(-1)) / total


class EntropyReduceOutsideAutograd(McoreEngine):
    """A vocabulary-parallel entropy at TP > 1 whose softmax normaliser is all-reduced outside autograd (ms-swift
    #9947's shape, on the entropy bonus): the values right, the gradient without the normaliser's part; at TP 1 it
    takes the plain path."""

    logprob_part = EntropyNormaliserOutsideAutograd


class OldLogprobsAtTemperatureOne(McoreEngine):
    """PPO's old log-probs taken by a pass that does not apply the rollout's temperature (the log-prob pass before
    the update run with the model's default sampling parameters), the training forward at it: every token's ratio is
    off by what the temperature moves; right at temperature 1 only."""

    def old_logprobs(self, mbs, samples):
        head = self.logprob_head()
        kept, head.temperature = head.temperature, 1.0
        try:
            super().old_logprobs(mbs, samples)
        finally:
            head.temperature = kept


class KeepsPaddedColumns(LogprobHead):
    def padding(self, logits):
        return None


class PaddedVocabularyInTheSoftmax(McoreEngine):
    """megatron's padded vocabulary columns left in the log-probs' and the entropy's softmax (the issue's miles #1031
    shape: the padding not cut): probability mass on rows no token has, as much as the layout pads; right where
    nothing pads."""

    logprob_part = KeepsPaddedColumns
