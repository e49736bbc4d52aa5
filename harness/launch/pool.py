"""Warm rank pools: N rank processes per (world size, backend) that run many cases in turn.

Ranks import torch and megatron-core (on CPU: forked from the zygote that imported them,
harness/launch/zygote.py) and join one process group once; each case then costs only its own work.
Megatron's parallel state is rebuilt per case in one place (harness/platform/parallel.py) and every
rank checks after each case that nothing leaked
(harness/launch/isolation.py). A case that fails, hangs or leaks retires the pool: its ranks are
killed and the next case starts fresh ones (the poison-pill rule).
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from harness.backends import Backend
from harness.launch import runner
from harness.launch.results import CaseResult, write_atomic
from harness.launch.runner import GRACE_S, collect, supervise
from harness.launch.zygote import ForkedRank
from harness.spec import Case


class RankPool:
    def __init__(self, world_size: int, backend: Backend, preload: tuple[str, ...] = ()):
        self.world_size, self.backend = world_size, backend
        self.preload = preload  # what the fork server of its ranks imported besides megatron-core (their engines')
        self.procs: list[subprocess.Popen | ForkedRank] = []
        self.dir: Path | None = None
        self.cases_run = 0
        self.starts = 0
        self.retired: list[str] = []  # why each earlier set of ranks was retired
        self.suites: set[str] = set()  # the suites whose cases the current ranks ran

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def _start(self, case: Case) -> None:
        self.close()
        self.dir = Path(tempfile.mkdtemp(prefix="harness-pool-"))
        for r in range(self.world_size):
            env = runner.rank_env(case, r, self.dir)
            env["HARNESS_BACKEND"] = self.backend
            # runner.spawn_rank looked up per call: the one place every rank start goes through
            self.procs.append(runner.spawn_rank(["--pool-dir", str(self.dir)], env, self.dir / f"rank{r}.log",
                                                self.backend, stdin=subprocess.PIPE, preload=self.preload))
        self.starts += 1

    def run(self, case: Case, grace_s: float = GRACE_S) -> CaseResult:
        if case.layout.world_size != self.world_size or case.backend != self.backend:
            raise ValueError(f"pool for {self.world_size} {self.backend} ranks cannot run {case.id}")
        t0 = time.monotonic()
        fresh = not self.alive
        if fresh:
            self._start(case)
            self.suites = set()
        self.suites.add(case.suite)
        assert self.dir is not None
        case_dir = self.dir / f"case{self.cases_run:04d}"
        case_dir.mkdir()
        self.cases_run += 1
        write_atomic(case_dir / "case.pkl", case)
        for p in self.procs:
            try:
                if p.stdin is not None:
                    p.stdin.write(f"{case_dir}\n".encode())
                    p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        codes, timed_out = supervise(self.procs, case_dir, case.timeout_s, grace_s, t0)
        logs = [self.dir / f"rank{r}.log" for r in range(self.world_size)]
        result = collect(case, case_dir, logs, codes, timed_out, time.monotonic() - t0)
        result.fresh_ranks = fresh
        leaked = sorted({item for r in result.ranks for item in r.leaks})
        if leaked:
            result.notes.append(f"retired the warm ranks after this case: it left {'; '.join(leaked)}")
        if not result.ok or leaked:
            self.retired.append(result.notes[-1] if leaked else f"{case.id} {result.status}")
            keep = self.dir if not result.ok else None
            self.close(keep_dir=keep is not None)
            if keep:
                result.error += f"\n(rank logs kept in {keep})"
        else:
            shutil.rmtree(case_dir, ignore_errors=True)
        return result

    def close(self, keep_dir: bool = False, kill: bool = False) -> None:
        """Ask the ranks to exit (kill: at once, e.g. mid-case on an interrupt), then kill what is left."""
        for p in self.procs if not kill else ():
            try:
                if p.stdin is not None:
                    p.stdin.write(b"exit\n")
                    p.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        deadline = time.monotonic() + (0 if kill else 5)
        for p in self.procs if not kill else ():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        runner.kill_ranks(self.procs)
        self.procs = []
        if self.dir is not None and not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


_POOLS: dict[tuple[int, str, tuple[str, ...]], RankPool] = {}


def pool_for(world_size: int, backend: Backend, preload: tuple[str, ...] = ()) -> RankPool:
    """The process-wide pool for a world size, backend and preload (closed at exit)."""
    key = (world_size, backend, preload)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, backend, preload)
    return _POOLS[key]


def retire_pools_used_by_others(suite: str) -> None:
    """Close the pools whose ranks ran cases of another suite (their imports and heap stay in the ranks)."""
    for key, pool in list(_POOLS.items()):
        if pool.suites - {suite}:
            pool.retired.append(f"ran {', '.join(sorted(pool.suites - {suite}))} before {suite}")
            pool.close()
            del _POOLS[key]


def close_all(kill: bool = False) -> None:
    for pool in _POOLS.values():
        pool.close(kill=kill)
    _POOLS.clear()


atexit.register(close_all)
