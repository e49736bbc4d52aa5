"""Run one Case on N ranks: local spawn (default) or torchrun; results come back as data."""

from harness.launch.results import CaseResult, RankResult
from harness.launch.runner import run_case

__all__ = ["CaseResult", "RankResult", "run_case"]
