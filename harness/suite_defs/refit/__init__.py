"""`refit`: what the trainer streams to the rollout engine is the policy it trained, complete, on every layout,
within a memory bound.

Each case trains a few steps at its layout, then runs the path's weight export as an RL framework calls it after
every step (harness/engines/weight_export.py; the bridges' own exports), cut into buckets of each bucket size, and
judges per bucket size: every rank sends each of the Hugging Face model's keys once and nothing else (complete), with
HF's shapes and the trained values bit for bit, the same from every rank (values), within a bucket + twice the
largest tensor it must build + an overhead, building nothing larger than that tensor at once (memory), and ten more
exports give the same stream and leave nothing allocated (repeat); per case, a Hugging Face model loaded from the
stream computes the Megatron model's log-probs (policy).

The package: params.py (the parameters), payload.py (what a rank returns), suite.py (cases and rank work), judge.py
(the checks).
"""

from harness.suite_defs.refit.params import RefitParams

__all__ = ["RefitParams", "RefitSuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "RefitSuite":
        from harness.suite_defs.refit.suite import RefitSuite

        return RefitSuite
    raise AttributeError(name)
