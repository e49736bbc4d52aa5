"""Regression harness for Megatron-based training engines."""

__version__ = "0.1.0"
