"""What a step-perf rank returns: rank.py writes it, figures.py reads it (a frozen dataclass, not a dict read by
string keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.probes.cpu_share import CpuWindow
from harness.probes.timers import StepTiming


@dataclass(frozen=True)
class Counters:
    """The untimed counting step's exact figures."""

    flops: int
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # "<role>/<kind>" -> calls, bytes
    dp_reductions_in_backward: int = 0  # DP gradient reductions issued during backward (overlap)


@dataclass(frozen=True)
class StepPerfRankData:
    steps: list[StepTiming]  # the timed steps, barrier to barrier, with their phases
    calibration: list[float]  # seconds of the calibration workload's repeats
    counters: Counters
    plain_s: list[float] = field(default_factory=list)  # --overhead: the uninstrumented steps paired with them
    coords: dict[str, int] = field(default_factory=dict)  # the rank's place in the layout
    device: dict[str, Any] = field(default_factory=dict)  # GPU ranks: name, max_allocated, tf32
    cpu: CpuWindow | None = None  # the machine's CPU time over the timed steps (None off Linux)
