"""McoreEngine's steps: a step's micro-batches through megatron's forward-backward schedule, each one's per-token loss
(the model's own given the labels, or an RL step's from the logits through the engine's log-prob head), the
log-probs captured, then the optimizer's step."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from harness.engines import data
from harness.engines.base import StepOutput, TokenLogprobs
from harness.engines.cp_data import zigzag_positions
from harness.engines.experts import drop_routing_graphs
from harness.engines.policy_loss import PolicyStats
from harness.upstream import split_on_cp_rank


class McoreSteps:
    """Mixin of McoreEngine: `train_step`, `eval_step` and `run_microbatches` (the RL steps' too)."""

    case: Any
    ctx: Any
    config: Any
    models: list
    optimizer: Any
    scheduler: Any
    _captured: list[TokenLogprobs] | None

    def logprob_head(self) -> Any:
        raise NotImplementedError  # McoreEngine's

    # Steps whose per-token log-probs are captured (StepOutput.token_logprobs): the first step's forward
    # runs on identical weights on every layout, so a position error shows at the token it hits.
    logprob_steps: frozenset[int] = frozenset({0})

    def forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        output = self.token_losses(model, mb, rl="loss_fn" in mb or "head" in mb, capture=self._captured is not None)
        mask = mb["loss_mask"].to(self.ctx.device) if "loss_mask" in mb else None
        loss = mb.get("loss_fn") or functools.partial(self.loss_func, loss_mask=mask)  # an RL step's own (rl_steps)
        if self._captured is not None and "samples" in mb:
            return output, functools.partial(self._capture_then_loss, mb, loss)
        return output, loss

    def token_losses(self, model, mb: dict, rl: bool, capture: bool):
        """A micro-batch's per-token loss ([b, s]; on a stage before the last, what it hands on): the model's own,
        given the labels; in an RL step, minus the log-probs the engine's log-prob head computes from the logits (the
        model called without labels, as RL frameworks call it), the entropy kept in `mb` where captured."""
        import torch
        from megatron.core.utils import get_attr_wrapped_model

        dev = self.ctx.device
        tokens, positions, labels = mb["tokens"].to(dev), mb["position_ids"].to(dev), mb["labels"].to(dev)
        if not rl:
            return model(tokens, positions, None, labels=labels)
        # a model with MTP layers takes the response mask its MTP loss counts (RLSteps.mtp_loss_mask)
        mtp = {"loss_mask": mb["mtp_mask"].to(dev)} if "mtp_mask" in mb else {}
        logits = model(tokens, positions, None, **mtp)
        if not get_attr_wrapped_model(model, "post_process"):
            return logits
        head = self.logprob_head()
        if mb.get("entropy_coef"):  # an entropy bonus in the loss (rl_steps): its gradient reaches every shard
            mb["entropy_term"] = head.entropy(logits)
        if capture and "head" not in mb:  # the RL steps' (refit's held-out log-probs, head_eval_step, need none)
            with torch.no_grad():
                mb["entropy"] = head.entropy(logits.detach()).float().cpu()
        return -head.logprobs(logits, labels)

    def _capture_then_loss(self, mb, loss, output_tensor):
        """Keep the micro-batch's per-token log-probs and entropy, then the loss."""
        self._captured.append(captured(mb, mb["samples"], mb["positions"], output_tensor))
        return loss(output_tensor)

    @staticmethod
    def loss_func(output_tensor, loss_mask=None):
        """Sum of per-token losses and the token count (megatron normalises by the count), over the tokens the
        loss mask keeps (all without one)."""
        import torch

        losses = output_tensor.float()
        if loss_mask is None:
            loss_sum, count = losses.sum(), output_tensor.numel()
        else:
            mask = loss_mask.reshape(losses.shape).float()
            loss_sum, count = (losses * mask).sum(), mask.sum()
        num_tokens = torch.as_tensor(count, device=output_tensor.device).to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    def train_step(self, step: int) -> StepOutput:
        out = self._run_batch(step, forward_only=False, capture=step in self.logprob_steps)
        if out.skipped and self.ctx is not None:  # every suite's figures say so, whatever its payload keeps
            self.ctx.result.skipped_steps.append((step, out.grad_norm))
        return out

    def eval_step(self, step: int) -> StepOutput:
        """Forward only on the batch of `step` (no update), capturing every token's log-prob."""
        return self._run_batch(step, forward_only=True, capture=True)

    def head_eval_step(self, step: int) -> StepOutput:
        """`eval_step` through the log-prob head: the model called without labels (bit for bit at temperature 1)."""
        return self._run_batch(step, forward_only=True, capture=True, head=True)

    def _run_batch(self, step: int, forward_only: bool, capture: bool, head: bool = False) -> StepOutput:
        import torch
        from megatron.core import parallel_state as ps

        dp_rank = ps.get_data_parallel_rank()
        mbs: list[dict[str, Any]] = list(data.microbatches(self.case, step, dp_rank))
        if self.case.layout.cp > 1:
            mbs = [split_on_cp_rank(dict(mb)) for mb in mbs]
        if head:  # forward_step takes the log-probs through the head
            mbs = [{**mb, "head": True} for mb in mbs]
        firsts = [data.first_sample(self.case, dp_rank, i) for i in range(len(mbs))]
        return self.run_microbatches(mbs, [torch.arange(f, f + mb["tokens"].shape[0]) for f, mb in zip(firsts, mbs)],
                                     forward_only, capture)

    def run_microbatches(self, mbs: list[dict], samples: list, forward_only: bool, capture: bool,
                         loss_fns: list | None = None, update: bool = True) -> StepOutput:
        """One forward(-backward) over this rank's micro-batches (already split over CP; `samples`: each one's
        sample indices in the global batch), then the optimizer's step unless forward only or not to `update` (the
        gradients left in megatron's buffers). `loss_fns`: each micro-batch's own loss function (default: the
        per-token loss over its loss mask)."""
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cp = self.case.layout.cp
        for i, fn in enumerate(loss_fns or []):
            mbs[i]["loss_fn"] = fn
        self._captured = [] if capture else None
        if self._captured is not None:
            # Where each local token sits in the global batch, by the harness's own arithmetic (DP slice,
            # zigzag CP chunks) - not read back from megatron's split, which is under test. Added after
            # the split: megatron's CP split slices every key it is given.
            seq = self.case.model.seq_length
            positions = zigzag_positions(seq, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(seq)
            for mb, ids in zip(mbs, samples):
                mb["samples"], mb["positions"] = ids, positions
        iters = [iter(mbs) for _ in self.models]
        if not forward_only:
            for m in self.models:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            losses = get_forward_backward_func()(
                forward_step_func=self.forward_step,
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=self.models if len(self.models) > 1 else self.models[0],
                num_microbatches=len(mbs), seq_length=self.case.model.seq_length,
                micro_batch_size=max(int(mb["tokens"].shape[0]) for mb in mbs), forward_only=forward_only,
            )
        if self.config.num_moe_experts:
            drop_routing_graphs(self.models)
        reported: dict = {"aux_loss": self._take_aux_loss()}
        if not forward_only and update:
            lr = self.optimizer.param_groups[0]["lr"]
            updated, grad_norm, num_zeros = self.optimizer.step()
            if updated and self.scheduler is not None:  # megatron's train_step: by the global batch's samples
                self.scheduler.step(increment=self.case.global_batch_size)
            reported.update(grad_norm=None if grad_norm is None else float(grad_norm),
                            num_zeros=None if num_zeros is None else int(num_zeros), lr=float(lr),
                            skipped=not updated)
        captured, self._captured = self._captured, None
        if not losses:
            return StepOutput(None, None, captured, **reported)
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        policy = [d["policy"] for d in losses if "policy" in d]
        return StepOutput(float(total[0]), int(total[1]), captured, **reported,
                          policy=PolicyStats.of(policy) if policy else None)

    def _take_aux_loss(self) -> float | None:
        """This rank's load-balancing loss of the batch just run, from megatron's MoE loss tracker, which is then
        zeroed (megatron's training loop zeroes it after logging). None for a dense model."""
        if not self.config.num_moe_experts:
            return None
        from megatron.core.transformer.moe import moe_utils

        entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        value = float(entry["values"].sum()) if entry else 0.0
        moe_utils.clear_aux_losses_tracker()
        return value


def captured(mb: dict, samples: Any, positions: Any, token_loss: Any) -> TokenLogprobs:
    """A micro-batch's per-token log-probs (minus its per-token loss) and, where the log-prob head kept it in `mb`,
    its entropy, on the host."""
    n = len(samples)
    entropy = mb.get("entropy")
    return TokenLogprobs(samples, positions, -token_loss.detach().float().cpu().reshape(n, -1),
                         None if entropy is None else entropy.reshape(n, -1))
