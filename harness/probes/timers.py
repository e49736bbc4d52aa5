"""Time a training step on a rank: between barrier-aligned boundaries, with a phase breakdown.

Phases are taken at megatron's own seams: `schedules.forward_step` (forward, loss included),
`schedules.backward_step`, the config's `finalize_model_grads_func` (the DP gradient sync that was not
overlapped, plus embedding / layernorm gradient reductions), the optimizer's step, and within it the
distributed optimizer's parameter all-gather. `other` is the rest of the step (pipeline p2p, data,
zeroing buffers). Exposed communication = grad-sync + param-gather: the data-parallel communication
the step waited for outside the overlap window.

On CPU ranks the clock is time.perf_counter. On GPU a step is bracketed by a barrier and
torch.cuda.synchronize (as Megatron's timers do) and phases are CUDA events, read after the step, so
timing does not synchronize inside the step and change the overlap it measures.

`calibrate` times a fixed workload (GEMMs and an all-reduce); step-perf's `normalise` parameter scales
step times by it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
PHASES = ("forward", "backward", "grad-sync", "optimizer", "param-gather", "other")
CALIBRATION_REPS = 5


@dataclass
class StepTiming:
    """One step on one rank, seconds."""

    wall_s: float  # barrier to barrier: the step as the job sees it
    busy_s: float  # start barrier to the end of this rank's own work (before the closing barrier)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_comm_s(self) -> float:
        return self.phases.get("grad-sync", 0.0) + self.phases.get("param-gather", 0.0)


class _CpuClock:
    def mark(self):
        return time.perf_counter()

    @staticmethod
    def elapsed(start, end) -> float:
        return end - start

    def sync(self) -> None:
        pass


class _CudaClock:
    def mark(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed(start, end) -> float:
        return start.elapsed_time(end) / 1000.0

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()


class PhaseTimer:
    """Wraps megatron's step seams while installed; `step(fn)` times one call of fn."""

    def __init__(self, engine, on_cpu: bool = True):
        self.engine = engine
        self.clock = _CpuClock() if on_cpu else _CudaClock()
        self._spans: list[tuple[str, object, object]] = []
        self._depth: dict[str, int] = {}

    def _timed(self, fn: Callable, phase: str) -> Callable:
        def wrapper(*args, **kwargs):
            # re-entrant seams (a chained optimizer stepping its parts) are timed once, at the outside
            if self._depth.get(phase):
                return fn(*args, **kwargs)
            self._depth[phase] = 1
            start = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spans.append((phase, start, self.clock.mark()))
                self._depth[phase] = 0
        return wrapper

    @contextlib.contextmanager
    def installed(self):
        from megatron.core.distributed import param_and_grad_buffer as pgb
        from megatron.core.pipeline_parallel import schedules

        cfg, opt = self.engine.config, self.engine.optimizer
        group_cls = pgb._ParamAndGradBucketGroup
        saved = (schedules.forward_step, schedules.backward_step, cfg.finalize_model_grads_func, opt.step,
                 group_cls.start_param_sync)
        schedules.forward_step = self._timed(saved[0], "forward")
        schedules.backward_step = self._timed(saved[1], "backward")
        if saved[2] is not None:
            cfg.finalize_model_grads_func = self._timed(saved[2], "grad-sync")
        opt.step = self._timed(saved[3], "optimizer")
        group_cls.start_param_sync = self._timed(saved[4], "param-gather")
        try:
            yield self
        finally:
            schedules.forward_step, schedules.backward_step = saved[0], saved[1]
            cfg.finalize_model_grads_func, opt.step = saved[2], saved[3]
            group_cls.start_param_sync = saved[4]

    def _bracketed(self, fn: Callable[[], T], barrier: Callable[[], None]) -> tuple[T, float, float]:
        """The boundaries every timed step shares: barrier, sync, fn(), sync (busy), barrier (wall);
        (fn's result, busy seconds, wall seconds)."""
        barrier()
        self.clock.sync()
        t0 = time.perf_counter()
        out = fn()
        self.clock.sync()
        busy = time.perf_counter() - t0
        barrier()
        return out, busy, time.perf_counter() - t0

    def step(self, fn: Callable[[], object], barrier: Callable[[], None]) -> tuple[StepTiming, object]:
        """Barrier, time fn() with its phases, barrier; (timing, fn's result)."""
        self._spans.clear()

        def marked():
            start = self.clock.mark()
            result = fn()
            return start, result, self.clock.mark()

        (start, out, end), busy, wall = self._bracketed(marked, barrier)
        phases = {p: 0.0 for p in PHASES}
        for phase, s, e in self._spans:
            phases[phase] += self.clock.elapsed(s, e)
        phases["optimizer"] -= phases["param-gather"]  # the all-gather runs inside the optimizer's step
        step_s = self.clock.elapsed(start, end)
        phases["other"] = max(0.0, step_s - sum(v for k, v in phases.items() if k != "other"))
        return StepTiming(wall, busy, phases), out

    def plain_step(self, fn: Callable[[], object], barrier: Callable[[], None]) -> float:
        """Seconds of fn() between the same barrier-aligned boundaries as `step`, with no seam wrapped (call it
        while the timer is not installed): what an uninstrumented loop of the same engine measures."""
        return self._bracketed(fn, barrier)[2]


def calibrate(device, on_cpu: bool) -> list[float]:
    """Seconds of a fixed workload per repetition on the rank's device: 4 GEMMs of 256 x 256 and an all-reduce of
    1 MiB."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=gen).to(device)
    buf = torch.ones(256 * 1024, device=device)
    out = []
    for _ in range(CALIBRATION_REPS):
        dist.barrier()
        if not on_cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = a
        for _ in range(4):
            x = x @ a
        dist.all_reduce(buf)
        if not on_cpu:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out
