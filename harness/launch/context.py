"""What a rank knows about itself while it runs a case."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.backends import Backend
from harness.launch.results import RankResult


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    backend: Backend  # gloo | nccl
    workdir: Path  # per-case scratch directory shared by the ranks of a case on one node
    result: RankResult = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.result is None:
            self.result = RankResult(self.rank)

    @property
    def on_cpu(self) -> bool:
        return self.backend == Backend.GLOO

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase into result.timings (accumulating) and log its start for hang diagnosis.
        result.phase names where the rank is: this phase while it runs, the enclosing one after it
        ends, and this one still if it raised - so an error names the phase it was raised in."""
        outer = self.result.phase
        self.result.phase = name
        if os.environ.get("HARNESS_PHASE_LOG", "1") != "0":
            print(f"[harness] rank {self.rank} phase {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.result.timings[name] = self.result.timings.get(name, 0.0) + time.perf_counter() - t0
        self.result.phase = outer  # not reached when the phase raised
