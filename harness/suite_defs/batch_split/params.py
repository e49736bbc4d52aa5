"""batch-split's parameters, its per-case parameters and its default matrix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.engines.logprob_head import ENTROPY_COEF_HELP, TEMPERATURE_HELP, check_entropy_coef, check_temperature
from harness.engines.loss_agg import MODES, check_mode
from harness.engines.policy_loss import NLL, POLICY_LOSS_HELP, check_policy_loss
from harness.engines.rl_batch import Cut
from harness.errors import BadInput
from harness.option_flags import flag

SUITE = "batch-split"
VOCAB_PADDING = 128  # megatron's --make-vocab-size-divisible-by default
STEPS = 3
GLOBAL_BATCH = 16  # 4 samples per DP rank at DP 4: micro-batches of 1, 2 and 4 samples
# A token budget that cuts `tiny`'s batches (prompt + valid response: 8-72 tokens per sample) into 2-5 micro-batches
# of 1-5 samples per DP rank at DP 2, and 1-2 at DP 4.
TOKEN_BUDGET = 96
DYNAMIC = f"tokens{TOKEN_BUDGET}"
MAX_MTP_LAYERS = 4

# Per mode, the (layout, cut) pairs of the default matrix: every mode through a dynamic cut and a static one, at CP 2
# (where a token count must be summed over CP) and at PP 2 (where the schedule needs as many micro-batches as stages,
# of different sizes passed between them); token-mean, the mode most frameworks default to, also over pure DP with
# one sample per micro-batch and dynamically. Layouts: "dp" is pure DP over the world size, "cp2" and "pp2" that
# with the rest of the ranks as DP.
MATRIX = {
    "token-mean": (("dp", "mbs1"), ("cp2", DYNAMIC), ("pp2", "mbs4"), ("dp", DYNAMIC)),
    "seq-mean-token-mean": (("cp2", DYNAMIC), ("pp2", "mbs2")),
    "seq-mean-token-sum": (("cp2", "mbs2"), ("pp2", DYNAMIC)),
    "token-sum": (("pp2", DYNAMIC), ("cp2", "mbs4")),
}


@dataclass(frozen=True)
class BatchSplitParams:
    """The suite's parameters: the loss aggregation modes and the cuts (none: the default matrix's)."""

    modes: tuple[str, ...] = dataclasses.field(default=MODES, metadata=flag(
        "--loss-agg", f"batch-split: the loss aggregation modes judged (repeatable; default all: {', '.join(MODES)})"))
    cuts: tuple[str, ...] = dataclasses.field(default=(), metadata=flag(
        "--cut", "batch-split: cut every layout's batch this way (repeatable): mbs<N> samples per micro-batch, or "
                 "tokens<B> dynamic micro-batches of at most B valid tokens (default: the suite's matrix)"))
    temperature: float = dataclasses.field(default=1.0, metadata=flag("--temperature", TEMPERATURE_HELP))
    entropy_coef: float = dataclasses.field(default=0.0, metadata=flag("--entropy-coef", ENTROPY_COEF_HELP))
    policy_loss: str = dataclasses.field(default=NLL, metadata=flag("--policy-loss", POLICY_LOSS_HELP))
    vocab_size: int = dataclasses.field(default=0, metadata=flag(
        "--vocab-size", f"batch-split: the model's vocabulary replaced by this many tokens, padded as megatron pads "
                        f"it (to a multiple of {VOCAB_PADDING} x TP): the padded rows must take no log-prob, entropy "
                        f"or gradient (default 0: the model's own)"))
    mtp_layers: int = dataclasses.field(default=0, metadata=flag(
        "--mtp-layers", "batch-split: the model with this many multi-token prediction layers, their heads detached "
                        "(megatron-core's mtp_detach_heads, 0.19 and later): per layout, the first step's main-model "
                        "gradients with MTP on and off, and the tokens and loss megatron's MTP loss takes, against the "
                        "response's (default 0: no MTP; the cut comparisons run without it)"))

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_entropy_coef(self.entropy_coef)
        check_policy_loss(self.policy_loss)
        if self.vocab_size < 0 or self.vocab_size == 1:
            raise BadInput(f"--vocab-size {self.vocab_size}: give a vocabulary of 2 tokens or more (e.g. 127, which "
                           f"TP 2 does not divide), or 0 for the model's own")
        if not 0 <= self.mtp_layers <= MAX_MTP_LAYERS:
            raise BadInput(f"--mtp-layers {self.mtp_layers}: give 1 to {MAX_MTP_LAYERS} MTP layers (DeepSeek-V3 "
                           f"trains 1), or 0 for none")
        for mode in self.modes:
            check_mode(mode)
        for cut in self.cuts:
            Cut.parse(cut)


@dataclass(frozen=True)
class BatchSplitCaseParams:
    """A case's own: its loss aggregation mode and cut. A reference runs on one rank: the global batch as one
    micro-batch, or (`like`, an MoE model's) the micro-batches that layout's DP ranks run, all of them."""

    mode: str = "token-mean"
    cut: str = "mbs1"
    like: str = ""
    temperature: float = 1.0  # the RL steps' log-probs at this sampling temperature
    entropy_coef: float = 0.0  # the training loss minus this x the head's entropy (0: none)
    policy_loss: str = NLL  # the training steps' loss: nll, or ppo-clip (harness/engines/policy_loss.py)
    vocab_size: int = 0  # the model's vocabulary replaced by this many tokens, padded (0: the model's own)
    mtp_layers: int = 0  # the model's MTP layers: the case measures the first step with them on and off (mtp.py)
