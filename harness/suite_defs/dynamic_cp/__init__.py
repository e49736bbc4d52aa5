"""`dynamic-cp`: megatron's dynamic context parallelism (a CP size per sample) against the same samples without CP.
The package: suite.py (the Suite the registry names: its mixes, cases and rank work), judge.py (the checks, in the
parent)."""

from harness.suite_defs.dynamic_cp.suite import DynamicCPSuite

__all__ = ["DynamicCPSuite"]
