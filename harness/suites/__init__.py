"""Suite definitions shared by the CLI and the pytest suites in suites/: cases, rank work, checks."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from harness.errors import BadInput

if TYPE_CHECKING:
    from harness.checks import CheckResult
    from harness.launch.context import RankContext
    from harness.launch.results import CaseResult
    from harness.spec import Case, CaseOptions, Layout, ModelSpec

# Contract names of ARCHITECTURE.md; the ones not yet implemented are refused with that reason.
SUITES = {
    "equivalence": "harness.suites.equivalence:EquivalenceSuite",
}
PLANNED = ("grad-sync", "ckpt-memory", "dynamic-cp", "step-perf")


class Suite(Protocol):
    name: str

    def cases(self, model: "ModelSpec", world_size: int, layouts: list["Layout"] | None, *,
              engine: str, backend: str, options: "CaseOptions") -> list["Case"]: ...

    def rank_work(self, case: "Case", ctx: "RankContext") -> dict[str, Any]: ...

    def check(self, results: list["CaseResult"]) -> list["CheckResult"]: ...


def get_suite(name: str) -> Suite:
    if name in PLANNED and name not in SUITES:
        raise BadInput(f"suite {name!r} is not implemented yet; available: {', '.join(SUITES)}")
    if name not in SUITES:
        raise BadInput(f"unknown suite {name!r}; available: {', '.join(SUITES)}")
    module, _, attr = SUITES[name].partition(":")
    return getattr(importlib.import_module(module), attr)()


def layout_coords() -> dict[str, int]:
    """This rank's position in megatron's parallel state (after it is initialised)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(), "dp": ps.get_data_parallel_rank(),
        "last_stage": int(ps.is_pipeline_last_stage(ignore_virtual=True)),
    }
