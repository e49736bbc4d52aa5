"""Suites that misbehave on purpose, for the runner's fault tests (no megatron import: fast ranks).

Behaviour is chosen by CaseOptions.seed so one suite class covers every fault:
seed 0 ok, 1 rank 1 raises, 2 rank 1 dies (os._exit), 3 rank 1 hangs in a collective,
4 rank 1 is SIGKILLed, 5 every rank sleeps forever outside collectives.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

OK, RAISE, EXIT, HANG_COLLECTIVE, SIGKILL, SLEEP = range(6)


class Misbehave:
    name = "misbehave"
    imports: tuple[str, ...] = ()

    def cases(self, *a, **k):  # built directly by the tests
        raise NotImplementedError

    def metrics(self, result) -> dict[str, Any]:
        return {}

    def check(self, results):
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
        return {"sum": float(t[0]), "pid": os.getpid()}
