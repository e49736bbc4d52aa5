"""`ckpt-memory`: per-rank host (and device) memory peaks of a checkpoint save, per optimizer format, and the
checkpoint contract (a checkpoint loads where its format promises, with the values it saved).

The package: params.py (formats, CkptMemoryParams, a case's CkptCaseParams), figures.py (baselined peaks, key),
judge.py (format on disk, model band, baseline), contract.py and contract_judge.py (the reshard cases: rank work
and judges), suite.py (the Suite the registry names: cases and the measured save).
"""

from harness.suite_defs.ckpt_memory.params import CkptCaseParams, CkptMemoryParams

__all__ = ["CkptCaseParams", "CkptMemoryParams", "CkptMemorySuite"]


def __getattr__(name: str):
    # the suite is imported where it is asked for; its parameters are the CLI's flags, read on every call
    if name == "CkptMemorySuite":
        from harness.suite_defs.ckpt_memory.suite import CkptMemorySuite

        return CkptMemorySuite
    raise AttributeError(name)
