"""RL-step engines with planted loss-aggregation regressions (batch-split), each one seen in 2026's RL frameworks."""

from __future__ import annotations

from harness.engines.base import TokenLogprobs
from harness.engines.loss_agg import BatchTotals, MicroBatchLoss
from harness.engines.fsdp2 import FSDP2Engine
from harness.engines.mcore import McoreEngine


class PerMicroBatchTokenMean(McoreEngine):
    """verl <= 0.6: token-mean over each micro-batch's own tokens, averaged over micro-batches by megatron's 2-tuple
    path, so a micro-batch with 3 valid tokens weighs as much as one with 3000."""

    def aggregate_loss(self, inputs: MicroBatchLoss):
        return (inputs.token_loss * inputs.mask).sum() / inputs.mask.sum().clamp(min=1)

    def to_schedule(self, share, num_microbatches: int):
        return share


class LossDividedByMicroBatchesTwice(McoreEngine):
    """AReaL #1273: the framework divides by the number of micro-batches and megatron's schedule does again."""

    def to_schedule(self, share, num_microbatches: int):
        return super().to_schedule(share, num_microbatches) / num_microbatches


class CPTokensNotSummedOverCP(McoreEngine):
    """verl #5863: the global token count summed over DP only, so with CP 2 each rank counts its half of the tokens."""

    def batch_totals(self, local_masks, local_counts) -> BatchTotals:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        right = super().batch_totals(local_masks, local_counts)
        tokens = torch.tensor([float(sum(m.sum() for m in local_masks))], dtype=torch.float64)
        dist.all_reduce(tokens, group=ps.get_data_parallel_group())
        return BatchTotals(int(tokens[0]), right.samples, right.nonempty)


class AuxLossCoefficientPerMicroBatch(McoreEngine):
    """Megatron-LM #5694's shape: the load-balancing loss at its full coefficient in every micro-batch, megatron's
    averaging over the micro-batches (MoEAuxLossAutoScaler's scale, 1 / micro-batches) undone."""

    def train_rl_batch(self, batch, microbatches, mode):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        original = MoEAuxLossAutoScaler.set_loss_scale
        n = len(microbatches)
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda scale: original(scale * n))  # type: ignore[method-assign]
        try:
            return super().train_rl_batch(batch, microbatches, mode)
        finally:
            MoEAuxLossAutoScaler.set_loss_scale = staticmethod(original)  # type: ignore[method-assign]


class FSDP2LocalTokenCount(FSDP2Engine):
    """An FSDP path that normalises token-mean by its local token count (the same model on the second backend
    reports different losses and gradient norms: verl #4710, slime #290)."""

    def batch_totals(self, local_masks, local_counts) -> BatchTotals:
        right = super().batch_totals(local_masks, local_counts)
        return BatchTotals(int(sum(float(m.sum()) for m in local_masks)), right.samples, right.nonempty)


class ForwardPassMixesSamples(McoreEngine):
    """A log-prob pass that hands each micro-batch's rows back in the wrong order (a regrouped cut not undone), so
    the old policy's log-probs sit under other samples' tokens."""

    def rl_logprobs(self, batch, microbatches):
        return [TokenLogprobs(p.samples.flip(0), p.positions, p.logprobs) for p in super().rl_logprobs(batch,
                                                                                                    microbatches)]


class UnknownLossForm(McoreEngine):
    """A loss form the harness does not know: refused before any rank."""

    loss_form = "gathered"


class RLStepsWithoutAHead:
    """A framework's RL-steps engine of its own (no McoreEngine): no log-prob head to take a temperature."""

    def __init__(self, case, ctx):
        self.case, self.ctx = case, ctx

    def train_rl_batch(self, batch, microbatches, mode, capture=False):
        raise NotImplementedError

    def rl_logprobs(self, batch, microbatches):
        raise NotImplementedError
