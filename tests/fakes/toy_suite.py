"""A toy suite: everything a new suite needs is this module and one line in harness/suite_registry.py (SUITES: its SuiteSpec)
(tests/test_toy_suite.py registers it and runs it through the CLI, the driver and the report).

Each rank all-reduces its rank number; the check compares the sum with the arithmetic series. Its
parameter `offset` plants a regression (every rank adds it before the all-reduce)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.checks import CheckResult
from harness.checks.numeric import within
from harness.spec import Case, Layout
from harness.option_flags import flag


@dataclass(frozen=True)
class ToyParams:
    """The toy suite's parameters."""

    offset: float = field(default=0.0, metadata=flag(
        "--toy-offset", "toy: added by every rank before the all-reduce (a planted regression when not 0)"))
    cases: int = 2


@dataclass(frozen=True)
class ToyCaseParams:
    """A toy case's own parameters (`Case.params`)."""

    index: int = 0
    offset: float = field(default=0.0, metadata=flag("--toy-offset", "", cli=False))


class ToySuite:
    name = "toy"
    default_model = "tiny"
    imports: tuple[str, ...] = ()
    Params = ToyParams

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None) -> list[Case]:
        p = params or ToyParams()
        return [Case(self.name, model, Layout(dp=world_size), engine, options, backend,
                     params=ToyCaseParams(i, p.offset)) for i in range(p.cases)]

    def rank_work(self, case: Case, ctx) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        with ctx.phase("work"):
            t = torch.tensor([ctx.rank + case.params.offset], dtype=torch.float64)
            dist.all_reduce(t)
        return {"sum": float(t[0])}

    def metrics(self, result) -> dict[str, Any]:
        return {"sum": result.ranks[0].data["sum"]} if result.ok else {}

    def check(self, results, params=None) -> list[CheckResult]:
        out = []
        for res in results:
            n = res.case.layout.world_size
            expected = n * (n - 1) / 2
            if not res.ok:
                out.append(CheckResult("toy.sum", res.case.id, False, (res.error or "failed").splitlines()[0]))
                continue
            got = res.ranks[0].data["sum"]
            err = abs(got - expected)
            ok = within(err, 0.0)
            out.append(CheckResult("toy.sum", res.case.id, ok,
                                   f"all-reduced sum {got:g} {'==' if ok else '!='} {expected:g} (error {err:g})",
                                   value=err))
        return out


class ToySuiteRanksPerCase(ToySuite):
    """The toy suite on ranks forked for each case (harness.suite_defs.FreshRanksPerCase)."""

    fresh_ranks_per_case = True
