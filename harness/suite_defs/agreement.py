"""The options under which the same steps agree across layouts: shared by the suites that compare layouts (equivalence,
golden, peft-ckpt, batch-split)."""

from __future__ import annotations

import dataclasses

from harness.spec import CaseOptions

# Adam's update g / (|g| + eps) turns a rounding difference d in an element with |g| ~ eps into an
# update difference up to lr * d / eps. With megatron's eps = 1e-8, fp32 gradients that differ by
# reduction order (|d| ~ 1e-9 on the rarely-seen embedding rows of `small`) moved those elements by up
# to lr / 2, and the parameters of `small` at TP=2 differed by 2.7e-5 after two steps (1.95e-6
# after one). With eps = 1e-6 the same layouts agree to 4.8e-7 (1e-7: 2.0e-6); a skipped TP
# reduction still differs by ~5e-2. Cases that name their own eps keep it.
EQUIVALENCE_ADAM_EPS = 1e-6


def with_equivalence_eps(options: CaseOptions) -> CaseOptions:
    """The options with EQUIVALENCE_ADAM_EPS unless they name their own eps."""
    if options.adam_eps == CaseOptions.adam_eps:
        return dataclasses.replace(options, adam_eps=EQUIVALENCE_ADAM_EPS)
    return options
