"""What a train-memory rank returns: suite.py's rank work writes it, figures.py reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.probes.memory import MemoryPeak


@dataclass(frozen=True)
class TrainMemoryRankData:
    build: MemoryPeak  # model chunks, DDP buffers, optimizer
    steps: list[MemoryPeak]  # each training step
    coords: dict[str, int] = field(default_factory=dict)  # the rank's place in the layout
