"""`rl-cycle`: an RL iteration as frameworks run it through megatron - log-probs with the routing recorded, training
with it replayed, parameters, gradients and optimizer state offloaded and reloaded - again and again, on every layout.

Each case runs N iterations of: a forward-only log-prob pass over the iteration's batch (an MoE model's routers
recording their top-k, megatron-core's RouterReplay), two training steps on its halves with that routing replayed,
then an offload and a reload. Judged: the routing training used is the recorded one, layer by layer, and the first
step's log-probs are the log-prob pass's bit for bit (replay, logprobs); RouterReplay holds the live model's routers
only (replay); an expert bias moves where it should and is held where the router is frozen or replayed
(expert-bias); N iterations with offload train exactly as N without, an offload leaves the device no more than a
stated residue and nothing grows from one iteration to the next (trajectory, offload); and a weights-only load is
what the first step starts from (load).

The package: params.py (the parameters), suite.py (cases and rank work), judge.py (the checks).
"""

from harness.suite_defs.rl_cycle.params import RLCycleParams

__all__ = ["RLCycleParams", "RLCycleSuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "RLCycleSuite":
        from harness.suite_defs.rl_cycle.suite import RLCycleSuite

        return RLCycleSuite
    raise AttributeError(name)
