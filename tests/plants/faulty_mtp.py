"""Planted multi-token prediction faults (batch-split --mtp-layers), each an engine that builds megatron's MTP layers
and hands its forward what a framework got wrong: judged by batch-split.mtp_grads / batch-split.mtp_loss."""

from __future__ import annotations

from typing import Any

from harness.engines.mcore import McoreEngine


class _HeadsAttached:
    """A TransformerConfig seen with mtp_detach_heads off."""

    mtp_detach_heads = False

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class MTPReachesTheOutputLayer(McoreEngine):
    """The MTP loss computed with the output layer's weight not detached (verl #6432: MTP gradients reached an untied
    lm_head), the MTP layers' inputs detached as megatron detaches them: only the output layer's (here the tied
    embedding's) gradient moves."""

    def token_losses(self, model, mb: dict, rl: bool, capture: bool):
        from megatron.core.models.gpt import gpt_model

        upstream = gpt_model.process_mtp_loss

        def attached(*args: Any, config: Any, **kwargs: Any) -> Any:
            return upstream(*args, config=_HeadsAttached(config), **kwargs)

        gpt_model.process_mtp_loss = attached  # for this forward only: the graph it builds keeps the weight attached
        try:
            return super().token_losses(model, mb, rl, capture)
        finally:
            gpt_model.process_mtp_loss = upstream


class MTPLossOverEveryPosition(McoreEngine):
    """The model with MTP layers called without a loss mask (ms-swift #8192): megatron's MTP loss counts every
    position, prompt and padding too."""

    def mtp_loss_mask(self, loss_mask: Any) -> Any:
        return None


class MTPMaskOnTheLabels(McoreEngine):
    """The response mask handed to the forward as aligned with the labels, not the input tokens: megatron rolls it
    with the labels it derives from the input ids, one position too far."""

    def mtp_loss_mask(self, loss_mask: Any) -> Any:
        return loss_mask
