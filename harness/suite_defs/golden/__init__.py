"""`golden`: the training trajectory of a reference config, judged against the stored one of its model and dtype.

Every other numerics check compares layouts with each other, so a change that moves every layout alike (a
changed default, initialisation, constant, optimizer or clipping behaviour) passes them all. This suite
trains each case from a fixed seed on fixed data for STEPS steps (enough that Adam's second moment matters:
it has no effect on the first update) and records per step the loss, the gradient norm before clipping,
the number of zero gradient elements and the learning rate; after the last step the L2 norm of every
parameter (full, TP-unsharded, by global name), of its Adam moments and Adam's step counter. Layouts are
equivalent, so one stored trajectory per model and dtype (baselines/<platform>/golden.json) judges every
layout, world size 1 included.

The package: params.py (GoldenParams, steps, formats), figures.py (a case's trajectory as baseline metrics),
judge.py (the checks and tolerances), suite.py (the Suite the registry names: cases and rank work).
"""

from harness.suite_defs.golden.params import GoldenParams

__all__ = ["GoldenParams", "GoldenSuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "GoldenSuite":
        from harness.suite_defs.golden.suite import GoldenSuite

        return GoldenSuite
    raise AttributeError(name)
