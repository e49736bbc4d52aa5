"""What ranks send back, and what the parent makes of a whole case."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.spec import Case


@dataclass
class RankResult:
    rank: int
    ok: bool = True
    error: str = ""  # traceback text when the rank raised
    phase: str = ""  # where the rank is; after an error, the phase that raised it
    skip_reason: str = ""  # set when the rank raised MissingDependency (the case is skipped, not failed)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    data: dict[str, Any] = field(default_factory=dict)  # suite-specific measurements


@dataclass
class CaseResult:
    case: Case
    ranks: list[RankResult]
    status: str  # ok | error | timeout | skipped
    error: str = ""  # one readable paragraph when status != ok (skipped: the reason)
    wall_s: float = 0.0
    fresh_ranks: bool = True  # False: ran on warm pool ranks started for an earlier case
    notes: list[str] = field(default_factory=list)  # e.g. why the warm ranks were retired after it

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"

    def adjustments(self) -> list[str]:
        """What the harness changed in the engine under test for this case, over all ranks (harness/adjustments.py)."""
        return list(dict.fromkeys(a for r in self.ranks for a in r.data.get("adjustments", [])))

    def timings(self) -> dict[str, float]:
        """Per-phase seconds, max over ranks (the slowest rank sets the case's pace)."""
        out: dict[str, float] = {}
        for r in self.ranks:
            for k, v in r.timings.items():
                out[k] = max(out.get(k, 0.0), v)
        return out


def write_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def read(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
