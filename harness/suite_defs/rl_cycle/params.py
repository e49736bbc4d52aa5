"""rl-cycle's parameters and its cases' own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from harness.engines.logprob_head import TEMPERATURE_HELP, check_temperature
from harness.errors import BadInput
from harness.option_flags import flag

SUITE = "rl-cycle"
ITERATIONS = 4
GLOBAL_BATCH = 16
# Each iteration trains its batch as two mini-batches (two optimizer steps, as PPO's mini-batches do), so the second
# one's forward runs on weights the first changed: routing afresh would choose other experts there than the log-prob
# pass recorded, and replay has something to hold. The learning rate makes that change large enough to move tiny-moe's
# routing at some tokens of every case (`rl-cycle.replay` says so, or cannot tell).
MINI_BATCHES = 2
LR = 1e-2
MODE = "token-mean"
# Each iteration's export to the rollout engine, in buckets of this many bytes: tiny's tensors over many buckets,
# as refit's smallest size sends them.
REFIT_BUCKET = 8 << 10


class ModelVariant(StrEnum):
    """The model a case builds: AS_IS (the empty string: no mark in its id), with 4 layers (two virtual stages per PP
    stage), with aux-loss-free balancing (EXPERT_BIAS: its router trains, routing not replayed; REPLAYED_BIAS:
    trained and replayed) or with it and the router frozen (FROZEN_ROUTER, routing replayed)."""

    AS_IS = ""
    FOUR_LAYERS = "4-layers"
    EXPERT_BIAS = "expert-bias"
    REPLAYED_BIAS = "replayed-bias"
    FROZEN_ROUTER = "frozen-router"


VARIANTS = tuple(v.value for v in ModelVariant if v)
EXPERT_BIAS_VARIANTS = (ModelVariant.EXPERT_BIAS, ModelVariant.REPLAYED_BIAS, ModelVariant.FROZEN_ROUTER)


class Weights(StrEnum):
    """Where a case's starting weights come from: BUILT (the empty string: no mark in its id) as the build
    initialised them; LOADED built, then the weights of the next seed loaded alone (no optimizer state); AS_LOADED
    built with those weights (the loaded case's twin)."""

    BUILT = ""
    LOADED = "loaded"
    AS_LOADED = "as-loaded"


class Kind(StrEnum):
    """A kind of case before its twin: AS_IS (the model as it is, its routing replayed where it is an MoE model),
    DISTOPT (the same with the distributed optimizer: the matrix's only), built twice in the process, a model variant
    (ModelVariant), a weights-only load, the export before any offload, LoRA in the loop."""

    AS_IS = ""
    DISTOPT = "distopt"
    BUILT_TWICE = "built-twice"
    FOUR_LAYERS = "4-layers"
    EXPERT_BIAS = "expert-bias"
    REPLAYED_BIAS = "replayed-bias"
    FROZEN_ROUTER = "frozen-router"
    WEIGHTS_ONLY_LOAD = "weights-only-load"
    EXPORT_FIRST = "export-first"
    LORA = "lora"


# --rl-variant: a case of the default matrix's kinds at the layouts given
RL_VARIANTS = tuple(k.value for k in Kind if k not in (Kind.AS_IS, Kind.DISTOPT))
# LoRA in the loop (megatron-bridge's LoRA on every linear): rank and alpha as peft-ckpt's, scaling alpha / r = 2
LORA_DIM, LORA_ALPHA = 8, 16
# What an export may leave allocated once it ended, at every iteration from the second on, before `refit` calls it a
# leak: memory a sender holds past the send (serialized buckets, IPC handles, numpy copies) grows with every refit.
# Correct engines on CPU ranks left up to 0.6 MiB at one iteration (not garbage: a collection before reading changed
# nothing) but at most 79 KiB at each of iterations 2-4 (the live heap, glibc's mallinfo2; every shipped model on
# mcore, tiny on megatron-bridge, tiny-qwen3-moe at PP 2 with VPP 2 the most).
EXPORT_KEPT = 256 << 10
# the merged refit exported this many times in a row with no training between: a merge applied again at every refit
# (into the base weights in place) moves the weights the rollout gets
LORA_REFITS = 10


@dataclass(frozen=True)
class RLCycleParams:
    """The suite's parameters: how many RL iterations each case runs."""

    iterations: int = dataclasses.field(default=ITERATIONS, metadata=flag(
        "--iterations", f"rl-cycle: RL iterations per case (log-probs, training, offload, reload; default "
                        f"{ITERATIONS}, the least)"))

    rl_variant: Kind = dataclasses.field(default=Kind.AS_IS, metadata=flag(
        "--rl-variant", "rl-cycle: run this kind of case at every layout given: built-twice (the model built twice "
                        "in the process), 4-layers (for virtual stages), expert-bias (the router training, not "
                        "replayed), replayed-bias (training, replayed), frozen-router (frozen and replayed), "
                        "weights-only-load, export-first (the export before any offload; default: "
                        "the matrix's, the model as it is with --layout)"))
    temperature: float = dataclasses.field(default=1.0, metadata=flag("--temperature", TEMPERATURE_HELP))

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.rl_variant and self.rl_variant not in RL_VARIANTS:
            raise BadInput(f"--rl-variant {str(self.rl_variant)!r}: expected one of {', '.join(RL_VARIANTS)}")
        object.__setattr__(self, "rl_variant", Kind(self.rl_variant))
        if self.iterations < ITERATIONS:
            raise BadInput(f"--iterations {self.iterations}: at least {ITERATIONS} (what an offload leaves is judged "
                           "from the second iteration on: growth needs two more)")


@dataclass(frozen=True)
class RLCycleCaseParams:
    """A case's own. variant: the model it builds (`ModelVariant`). offload: parameters, gradients and optimizer state
    offloaded and reloaded after each iteration (False: the twin the trajectory is compared with). builds: the model
    built this many times in the process, the policy last. weights: where the starting weights come from (`Weights`).
    export_first: the export before any offload (default: a colocated framework's order, the optimizer's state
    offloaded before the export and the parameters after it)."""

    iterations: int = ITERATIONS
    variant: ModelVariant = ModelVariant.AS_IS
    offload: bool = True
    builds: int = 1
    weights: Weights = Weights.BUILT
    export_first: bool = False
    temperature: float = 1.0  # the RL steps' log-probs, and the rollout's, at this sampling temperature

    def __post_init__(self) -> None:
        if self.variant and self.variant not in VARIANTS:
            raise BadInput(f"rl-cycle variant {str(self.variant)!r}: expected one of {', '.join(VARIANTS)}")
        object.__setattr__(self, "variant", ModelVariant(self.variant))
        if self.weights not in tuple(Weights):
            raise BadInput(f"rl-cycle weights {self.weights!r}: expected loaded or as-loaded")

    def twin(self) -> RLCycleCaseParams:
        """The case whose trajectory this one's must equal: the same without offload; a loaded case's, built with
        the loaded weights."""
        return dataclasses.replace(self, offload=False, weights=Weights.AS_LOADED if self.weights == Weights.LOADED
                                   else self.weights)
