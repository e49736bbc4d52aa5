"""What ranks send back, and what the parent makes of a whole case."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harness.files import atomic_write
from harness.outcomes import CaseStatus
from harness.spec import Case

T = TypeVar("T")


@dataclass(frozen=True)
class RankMemory:
    """The rank process's own memory over the case (warm ranks: the peak is reset per case)."""

    rss_before_mib: float
    rss_peak_mib: float
    threads: int


@dataclass
class RankResult:
    rank: int
    ok: bool = True
    error: str = ""  # traceback text when the rank raised
    phase: str = ""  # where the rank is; after an error, the phase that raised it
    skip_reason: str = ""  # set when the rank raised MissingDependency (the case is skipped, not failed)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    data: Any = field(default_factory=dict)  # what the suite's rank_work returned (step-perf: StepPerfRankData)
    # the harness's own, beside the suite's data:
    adjustments: list[str] = field(default_factory=list)  # what it changed in the engine (harness/adjustments.py)
    memory: RankMemory | None = None
    leaks: list[str] = field(default_factory=list)  # what the case left in a warm rank (launch/isolation.py)
    # (step, its gradient norm) of every training step megatron skipped on this rank (harness/checks/skipped_steps.py)
    skipped_steps: list[tuple[int, float | None]] = field(default_factory=list)

    def payload_as(self, kind: type[T]) -> T:
        """`data` as the suite's payload dataclass; TypeError naming the rank and what it returned otherwise."""
        if not isinstance(self.data, kind):
            raise TypeError(f"rank {self.rank} returned {type(self.data).__name__}, not {kind.__name__}")
        return self.data


@dataclass
class CaseResult:
    case: Case
    ranks: list[RankResult]
    status: CaseStatus
    error: str = ""  # one readable paragraph when status != ok (skipped: the reason)
    wall_s: float = 0.0
    fresh_ranks: bool = True  # False: ran on warm pool ranks started for an earlier case
    notes: list[str] = field(default_factory=list)  # e.g. why the warm ranks were retired after it
    figures: dict[str, Any] | None = None  # the suite's figures of the case (suite_run.case_figures), for reports

    @property
    def ok(self) -> bool:
        return self.status == CaseStatus.OK

    @property
    def skipped(self) -> bool:
        return self.status == CaseStatus.SKIPPED

    def adjustments(self) -> list[str]:
        """What the harness changed in the engine under test for this case, over all ranks (harness/adjustments.py)."""
        return list(dict.fromkeys(a for r in self.ranks for a in r.adjustments))

    def timings(self) -> dict[str, float]:
        """Per-phase seconds, max over ranks (the slowest rank sets the case's pace)."""
        out: dict[str, float] = {}
        for r in self.ranks:
            for k, v in r.timings.items():
                out[k] = max(out.get(k, 0.0), v)
        return out


def write_atomic(path: Path, obj: Any) -> None:
    """The object pickled into path, whole or not at all (harness.files.atomic_write)."""
    atomic_write(path, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def read(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
