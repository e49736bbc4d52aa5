"""Suites that misbehave on purpose, for the runner's fault tests (no megatron import: fast ranks).

Behaviour is chosen by CaseOptions.seed so one suite class covers every fault:
seed 0 ok, 1 rank 1 raises, 2 rank 1 dies (os._exit), 3 rank 1 hangs in a collective,
4 rank 1 is SIGKILLed, 5 every rank sleeps forever outside collectives, 6 every rank runs a parallel op
(OpenMP starts its intra-op pool there on a rank with more than one thread), 7 and large all-gathers
(whose copies start pools in gloo's threads there), 8 gives ATen a second thread first (the plant).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

OK, RAISE, EXIT, HANG_COLLECTIVE, SIGKILL, SLEEP, PARALLEL_OP, LARGE_GATHERS, TWO_THREADS = range(9)
# A case's time limit: rank start-up included (exec'd ranks import torch; a fresh fork server imports it before
# the first fork), which took up to ~40 s on a 2-core machine running other ranks beside the test.
CASE_TIMEOUT_S = 300.0


class Misbehave:
    name = "misbehave"
    imports: tuple[str, ...] = ()

    def cases(self, *a, **k):  # built directly by the tests
        raise NotImplementedError

    def metrics(self, result) -> dict[str, Any]:
        return {}

    def check(self, results, params=None):
        return []

    def rank_work(self, case, ctx) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        mode = case.options.seed
        with ctx.phase("work"):
            t = torch.ones(4) * (ctx.rank + 1)
            dist.all_reduce(t)
            if ctx.rank == 1:
                if mode == RAISE:
                    raise RuntimeError("planted failure on rank 1")
                if mode == EXIT:
                    os._exit(3)
                if mode == SIGKILL:
                    os.kill(os.getpid(), signal.SIGKILL)
            if mode == HANG_COLLECTIVE and ctx.rank != 1:
                dist.all_reduce(t)  # rank 1 never joins
            if mode == HANG_COLLECTIVE and ctx.rank == 1:
                time.sleep(3600)
            if mode == SLEEP:
                time.sleep(3600)
            threads = torch.get_num_threads()
            if mode == TWO_THREADS:  # the plant: a case that gives the rank's ATen a second thread
                torch.set_num_threads(2)
            if mode in (PARALLEL_OP, LARGE_GATHERS, TWO_THREADS):
                torch.ones(1 << 20).sum()
            if mode in (LARGE_GATHERS, TWO_THREADS):  # as the distributed optimizer's, on the world group
                for _ in range(10):
                    dist.all_gather([torch.empty(1 << 20) for _ in range(dist.get_world_size())], torch.ones(1 << 20))
        return {"sum": float(t[0]), "pid": os.getpid(), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "intra_op_threads": threads}


PASS, REGRESS, IMPROVE, ERROR, SKIPPED = range(5)
MIXED_PLAN = [PASS] * 6 + [REGRESS, PASS, ERROR, PASS, IMPROVE, PASS, SKIPPED] + [PASS] * 5 + [REGRESS, PASS]


class Mixed:
    """Twenty quick cases with every outcome: passes, regressions, an improvement, an error, a skip."""

    name = "mixed"
    default_model = "tiny"
    imports: tuple[str, ...] = ()

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:Mixed", model, Layout(dp=world_size), engine, CaseOptions(seed=100 * i + mode),
                     backend, CASE_TIMEOUT_S) for i, mode in enumerate(MIXED_PLAN)]

    def metrics(self, result) -> dict[str, Any]:
        return {"value": result.ranks[0].data["value"]} if result.ok else {}

    def rank_work(self, case, ctx) -> dict[str, Any]:
        from harness.errors import MissingDependency

        mode = case.options.seed % 100
        if mode == SKIPPED:
            raise MissingDependency("case needs package 'frobnicate': pip install frobnicate")
        if mode == ERROR and ctx.rank == 1:
            raise RuntimeError("planted failure on rank 1")
        return {"value": {REGRESS: 12.0, IMPROVE: 7.0}.get(mode, 10.0)}

    def check(self, results, params=None):
        from harness.checks import CheckResult

        out = []
        for res in results:
            if not res.ok:
                out.append(CheckResult("mixed.run", res.case.id, False, res.error.splitlines()[0]))
                continue
            v = res.ranks[0].data["value"]
            msg = f"value {v:.1f} vs baseline 10.0 +- 1.0"
            out.append(CheckResult("mixed.value", res.case.id, abs(v - 10.0) <= 1.0,
                                   msg + (" (improvement: refresh the baseline)" if v < 9.0 else ""),
                                   improvement=v < 9.0, value=v))
        return out


class AllSkipped(Mixed):
    """Three cases whose every rank raises MissingDependency: nothing is judged."""

    name = "all-skipped"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:AllSkipped", model, Layout(dp=world_size), engine,
                     CaseOptions(seed=100 * i + SKIPPED), backend, CASE_TIMEOUT_S) for i in range(3)]


class ForgetsACase(Mixed):
    """Three passing cases, but the check judges only the first two (a check that silently skips one)."""

    name = "forgets-a-case"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:ForgetsACase", model, Layout(dp=world_size), engine,
                     CaseOptions(seed=100 * i + PASS), backend, CASE_TIMEOUT_S) for i in range(3)]

    def check(self, results, params=None):
        return super().check(results[:2])


class Sleepy(Mixed):
    """Eight passing cases of about a second each: time to interrupt a run between cases."""

    name = "sleepy"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:Sleepy", model, Layout(dp=world_size), engine,
                     CaseOptions(seed=100 * i + PASS), backend, CASE_TIMEOUT_S) for i in range(8)]

    def rank_work(self, case, ctx) -> dict[str, Any]:
        time.sleep(1.0)
        return super().rank_work(case, ctx)


class Blind(Mixed):
    """Three cases: one judged (a pass beside a check that cannot tell), one only a check that cannot tell,
    one that needs more ranks than the run has (skipped before any rank starts)."""

    name = "blind"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        cases = [Case("tests.plants.fake_suites:Blind", model, Layout(dp=world_size), engine, CaseOptions(seed=100 * i + PASS),
                      backend, CASE_TIMEOUT_S) for i in range(3)]
        return cases[:2] + [cases[2].to_skip(f"needs world size {2 * world_size}, the run has {world_size}")]

    def check(self, results, params=None):
        from harness.checks import cannot_tell

        out = super().check(results[:1])
        return out + [cannot_tell("blind.sees", r.case.id, "both answers look alike at this size: needs more ranks")
                      for r in results]


class AllBlind(Blind):
    """Two cases whose only check cannot tell: nothing is judged."""

    name = "all-blind"

    def check(self, results, params=None):
        from harness.checks import cannot_tell

        return [cannot_tell("all-blind.sees", r.case.id, "both answers look alike at this size") for r in results]


class BrokenEnvironment(Mixed):
    """Three cases: two pass, one errors (a rank raises, as a module missing in the engine's environment
    would) - the run could not measure everything, and nothing regressed."""

    name = "broken-environment"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:BrokenEnvironment", model, Layout(dp=world_size), engine,
                     CaseOptions(seed=100 * i + mode), backend, CASE_TIMEOUT_S) for i, mode in enumerate((PASS, ERROR, PASS))]


class OwnErrors(Mixed):
    """Five cases: the first three error, each for a reason of its own (its layout, say), the last two pass."""

    name = "own-errors"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:OwnErrors", model, Layout(dp=world_size), engine,
                     CaseOptions(seed=100 * i + (ERROR if i < 3 else PASS)), backend, CASE_TIMEOUT_S) for i in range(5)]

    def rank_work(self, case, ctx) -> dict[str, Any]:
        if case.options.seed % 100 == ERROR:
            raise RuntimeError(f"case {case.options.seed // 100} cannot run here")
        return super().rank_work(case, ctx)


class Scratch(Mixed):
    """Two cases that each look into their scratch directory (ctx.workdir) and leave a file there: the check
    fails a case whose directory held anything when it began (another case's or another run's files)."""

    name = "scratch"

    def cases(self, model, world_size, layouts, *, engine, backend, options, params=None):
        from harness.spec import Case, CaseOptions, Layout

        return [Case("tests.plants.fake_suites:Scratch", model, Layout(dp=world_size), engine, CaseOptions(seed=i), backend,
                     CASE_TIMEOUT_S) for i in range(2)]

    def metrics(self, result) -> dict[str, Any]:
        return {}

    def rank_work(self, case, ctx) -> dict[str, Any]:
        import torch.distributed as dist

        found = sorted(p.name for p in ctx.workdir.iterdir())
        dist.barrier()  # every rank has looked before any leaves its file
        (ctx.workdir / f"left-by-rank{ctx.rank}").write_text(case.id)
        return {"found": found, "workdir": str(ctx.workdir)}

    def check(self, results, params=None):
        from harness.checks import CheckResult

        return [CheckResult("scratch.empty", res.case.id, not found, f"the case's scratch held {found}" if found
                            else "the case's scratch was its own") for res in results
                for found in [sorted({f for r in res.ranks for f in r.data["found"]})]]
