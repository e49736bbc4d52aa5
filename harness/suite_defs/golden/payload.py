"""What a golden rank returns: suite.py's rank work writes it, figures.py reads it."""

from __future__ import annotations

from dataclasses import dataclass

from harness.checks.step_outputs import TrainedRankData
from harness.engines.base import ParamShard


@dataclass(frozen=True)
class GoldenRankData(TrainedRankData):
    """The steps the case trained; after the last one (not in a first half, which saves instead) the parameter
    shards (`params`) and the engine's Adam state, where it hands it out (HasOptimizerState)."""

    finished: bool = True  # False: the first half of a resumed run - steps only
    optimizer: list[ParamShard] | None = None
