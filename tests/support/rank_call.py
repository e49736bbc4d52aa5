"""A test's function run on gloo ranks forked from the harness's fork server, instead of interpreters spawned
by torch.multiprocessing: the fork server has torch and megatron-core imported already (a spawned rank
imports them itself, ~5 s of CPU each on these machines), and the ranks are the harness's own - process
group, CPU layer and teardown as a suite's ranks get them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallParams:
    target: str  # "package.module:function", called as function(rank, world_size) on every rank


class RankCall:
    """The suite that calls CallParams.target on each rank and returns what it returned."""

    name = "rank-call"
    imports: tuple[str, ...] = ()

    def cases(self, *a, **k):  # built by on_ranks
        raise NotImplementedError

    def metrics(self, result) -> dict[str, Any]:
        return {}

    def check(self, results, params=None):
        return []

    def rank_work(self, case, ctx) -> Any:
        module, _, function = case.params.target.partition(":")
        with ctx.phase("work"):
            return getattr(importlib.import_module(module), function)(ctx.rank, ctx.world_size)


def on_ranks(target: str, world_size: int, timeout_s: float = 300.0) -> list[Any]:
    """What `target(rank, world_size)` returned on each of world_size fresh gloo ranks (the process group
    initialised over all of them), in rank order; fails the test with the ranks' error."""
    from harness.launch import run_case
    from harness.models import load_model
    from harness.spec import Case, CaseOptions, Layout

    case = Case("tests.support.rank_call:RankCall", load_model("tiny"), Layout(dp=world_size), "mcore", CaseOptions(), "gloo",
                timeout_s, params=CallParams(target))
    result = run_case(case)
    assert result.ok, result.error
    return [r.data for r in sorted(result.ranks, key=lambda r: r.rank)]
