"""Steps on RL batches as RL frameworks run them through megatron (McoreEngine's; the batch-split suite).

The framework's part, each a method a user engine overrides to have its own code judged:
- `batch_totals`: the global batch's normalisers, all-reduced from what this rank holds (tokens over DP x CP, samples
  over DP), before the step;
- `sample_token_counts`: each local sample's valid tokens over the whole sequence (summed over CP);
- `aggregate_loss`: a micro-batch's share of the global loss in the case's mode (`harness/engines/loss_agg.py`);
- `to_schedule`: that share as handed to megatron's schedule, which divides a loss by the number of micro-batches
  (the 2-tuple return) and whose DDP averages gradients over DP x CP after multiplying by CP: x micro-batches x DP.
`loss_form` says how the loss takes the sequence at CP > 1 ("chunk", the default, or "sequence": whole sequences
gathered over CP before `aggregate_loss`; `harness/engines/loss_agg.py`). The forward-only log-prob pass calls no
aggregation: it has no loss.
The step reports the shares' sum as its loss (`StepOutput.loss_sum`: summed over the last-stage ranks of TP rank 0,
the global batch's loss) and the valid tokens as `num_tokens`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from harness.engines.base import StepOutput, TokenLogprobs
from harness.engines.cp_data import whole_sequences
from harness.engines.logprob_head import case_entropy_coef, check_head
from harness.engines.loss_agg import CHUNK, LOSS_FORMS, SEQUENCE, BatchTotals, MicroBatchLoss, aggregate
from harness.engines.mtp import token_mask
from harness.engines.policy_loss import PPO_CLIP, advantage, case_policy_loss, ppo_clip
from harness.engines.rl_batch import RLBatch, microbatch_tensors
from harness.errors import BadInput
from harness.upstream import split_on_cp_rank

if TYPE_CHECKING:
    import torch


def check_rl_engine(engine: str, factory: type, temperature: float) -> None:
    """What the RL suites ask of an engine class before any rank (BadInput otherwise): an RLSteps engine's `loss_form`
    is chunk or sequence, and a temperature other than 1 has a log-prob head to take it."""
    check_head(engine, factory, temperature)
    form = factory.loss_form if issubclass(factory, RLSteps) else CHUNK
    if form not in LOSS_FORMS:
        raise BadInput(f"engine {engine}: loss_form {form!r}: give {CHUNK!r} (this CP rank's part of each sequence) "
                       f"or {SEQUENCE!r} (whole sequences gathered over CP), as its loss takes them (docs/engines.md)")


class RLSteps:
    """Mixin of McoreEngine: `train_rl_batch` and `rl_logprobs` (the `TrainsRLBatches` protocol)."""

    case: Any
    config: Any
    loss_form: str = CHUNK  # at CP > 1, what aggregate_loss gets: this rank's part of the sequences, or SEQUENCE

    def run_microbatches(self, mbs: list[dict], samples: list, forward_only: bool, capture: bool,
                         loss_fns: list | None = None, update: bool = True) -> StepOutput:
        raise NotImplementedError  # McoreEngine's

    # -- the framework's part -----------------------------------------------------------------
    def batch_totals(self, local_masks: list[torch.Tensor], local_counts: list[torch.Tensor]) -> BatchTotals:
        """The global batch's totals from this rank's micro-batches (masks of its CP part, per-sample counts)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        tokens = torch.tensor([float(sum(m.sum() for m in local_masks))], dtype=torch.float64)
        dist.all_reduce(tokens, group=ps.get_data_parallel_group(with_context_parallel=True))
        counts = torch.cat(local_counts) if local_counts else torch.zeros(0)
        samples = torch.tensor([float(counts.numel()), float((counts > 0).sum())], dtype=torch.float64)
        dist.all_reduce(samples, group=ps.get_data_parallel_group())
        return BatchTotals(int(tokens[0]), int(samples[0]), int(samples[1]))

    def sample_token_counts(self, local_mask: torch.Tensor) -> torch.Tensor:
        """[n] each sample's valid tokens over the whole sequence: this CP rank's counts summed over CP."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        counts = local_mask.sum(dim=1).to(torch.float64)
        if ps.get_context_parallel_world_size() > 1:
            dist.all_reduce(counts, group=ps.get_context_parallel_group())
        return counts.round().to(torch.int64)

    def mtp_loss_mask(self, loss_mask: torch.Tensor) -> torch.Tensor | None:
        """The loss mask a model with MTP layers is called with ([n, s], before the CP split): megatron's MTP loss
        derives its labels from the input ids and rolls this mask with them, so it is the response aligned with the
        input tokens (None: megatron counts every position)."""
        return token_mask(loss_mask)

    def aggregate_loss(self, inputs: MicroBatchLoss) -> torch.Tensor:
        """A micro-batch's share of the global batch's loss (override to plug in a framework's own aggregation)."""
        return aggregate(inputs)

    def to_schedule(self, share: torch.Tensor, num_microbatches: int) -> torch.Tensor:
        """The share as megatron's schedule takes a 2-tuple loss: it multiplies by CP, divides by the number of
        micro-batches, and DDP averages the gradients over DP x CP, so the gradient is the share's."""
        from megatron.core import parallel_state as ps

        return share * num_microbatches * ps.get_data_parallel_world_size()

    # -- the steps ------------------------------------------------------------------------------
    def train_rl_batch(self, batch: RLBatch, microbatches: list[list[int]], mode: str,
                       capture: bool = False, update: bool = True) -> StepOutput:
        """One training step on this DP rank's micro-batches (sample indices into the global batch); capture: its
        forward's per-token log-probs too; update False: the gradients only, left in megatron's buffers."""
        mbs, samples, fns = self._rl_inputs(batch, microbatches, mode)
        if case_policy_loss(self.case) == PPO_CLIP:
            self.old_logprobs(mbs, samples)
        return self.run_microbatches(mbs, samples, forward_only=False, capture=capture, loss_fns=fns, update=update)

    def old_logprobs(self, mbs: list[dict], samples: list) -> None:
        """PPO's old log-probs: a forward-only pass over the step's own micro-batches on the weights before the step
        (as a framework's compute_log_prob before its update), each kept in its micro-batch as "old_logprobs"."""
        keep = [functools.partial(_keep_old, mb) for mb in mbs]
        self.run_microbatches(mbs, samples, forward_only=True, capture=False, loss_fns=keep)

    def rl_logprobs(self, batch: RLBatch, microbatches: list[list[int]]) -> list[TokenLogprobs]:
        """Forward only, no gradient (as a framework's compute_log_prob): every token's log-prob."""
        mbs, samples, fns = self._rl_inputs(batch, microbatches, None)
        return self.run_microbatches(mbs, samples, forward_only=True, capture=True, loss_fns=fns).token_logprobs or []

    def _rl_inputs(self, batch: RLBatch, microbatches: list[list[int]], mode: str | None):
        """The micro-batches, their samples and their loss functions (mode None: forward only, no loss)."""
        import torch
        from megatron.core import parallel_state as ps

        seq, cp = self.case.model.seq_length, ps.get_context_parallel_world_size()
        if self.case.layout.pp > 1:
            self.config.variable_seq_lengths = True  # micro-batches of different sizes pass between stages
        mbs: list[dict[str, Any]] = [microbatch_tensors(batch, group, seq) for group in microbatches]
        if self.case.model.mtp_num_layers:
            mbs = [{**mb, "mtp_mask": mask} if (mask := self.mtp_loss_mask(mb["loss_mask"])) is not None else mb
                   for mb in mbs]
        if cp > 1:
            mbs = [split_on_cp_rank(dict(mb)) for mb in mbs]
        coef = case_entropy_coef(self.case)
        if mode is not None and coef:  # the head keeps the entropy with its gradient
            mbs = [{**mb, "entropy_coef": coef} for mb in mbs]
        if mode is not None and case_policy_loss(self.case) == PPO_CLIP:  # after the CP split: one per sample
            mbs = [{**mb, "advantages": torch.tensor([advantage(i) for i in group], dtype=torch.float32)}
                   for mb, group in zip(mbs, microbatches)]
        counts = [self.sample_token_counts(mb["loss_mask"]) for mb in mbs]
        totals = self.batch_totals([mb["loss_mask"] for mb in mbs], counts)
        n = len(mbs)
        fns = [functools.partial(self._rl_loss, mode, mb, c, totals, n) for mb, c in zip(mbs, counts)]
        return mbs, [torch.tensor(group) for group in microbatches], fns

    def _rl_loss(self, mode: str | None, mb: dict, counts, totals: BatchTotals, num_microbatches: int, output_tensor):
        import torch
        from megatron.core import parallel_state as ps

        if mode is None:
            return _no_loss(mb, output_tensor)
        dev, mask = output_tensor.device, mb["loss_mask"]
        tokens = mask.sum().float().to(dev)
        token_loss, mask, cp = output_tensor.float().reshape(mask.shape), mask.to(dev).float(), 1
        policy = None
        if "advantages" in mb:  # PPO-clip over the old log-probs of the pass before the step
            if "old_logprobs" not in mb:
                raise RuntimeError("a ppo-clip step without old log-probs (old_logprobs() keeps them per micro-batch)")
            old, adv = mb.pop("old_logprobs").to(dev), mb["advantages"].to(dev)
            token_loss, policy = ppo_clip(-token_loss, old, adv, mask)
        if "entropy_term" in mb:  # the entropy bonus: the loss minus C x each token's entropy, aggregated alike
            token_loss = token_loss - mb["entropy_coef"] * mb.pop("entropy_term").float().reshape(mask.shape)
        if self.loss_form == SEQUENCE and ps.get_context_parallel_world_size() > 1:
            group, cp = ps.get_context_parallel_group(), ps.get_context_parallel_world_size()
            token_loss, mask = whole_sequences(token_loss, group), whole_sequences(mask, group)
        share = self.aggregate_loss(MicroBatchLoss(mode, token_loss, mask, counts.to(dev), totals))
        # every CP rank of the sequence form holds the whole share: each reports its 1/cp, so the sum is the share
        reported = {"lm loss": torch.stack([share.detach().float() / cp, tokens])}
        if policy is not None:
            reported["policy"] = policy
        return self.to_schedule(share, num_microbatches), reported


def _no_loss(mb: dict, output_tensor):
    """A forward-only pass's loss function: log-probs, no loss (the micro-batch's tokens reported)."""
    import torch

    dev = output_tensor.device
    tokens = mb["loss_mask"].sum().float().to(dev)
    return torch.zeros((), device=dev), {"lm loss": torch.stack([torch.zeros((), device=dev), tokens])}


def _keep_old(mb: dict, output_tensor):
    """The forward-only pass's loss function that keeps the micro-batch's log-probs ([b, s], this CP rank's part)."""
    mb["old_logprobs"] = -output_tensor.detach().float().reshape(mb["loss_mask"].shape)
    return _no_loss(mb, output_tensor)
