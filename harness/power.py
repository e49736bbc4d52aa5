"""`harness power`: the detection power of step time judgements, measured by planting slowdowns.

Planted engines (`harness.power:Step05`, `harness.power:Comm10`, ...) wait a fraction of their own median
warm-up step after the warm-up: in every step on every rank (`Step*`: the step got slower) or inside the
gradient sync (`Comm*`: the communication alone). On CPU ranks the wait is a busy loop; on GPU ranks it is a
device-side wait on the rank's stream (`torch.cuda._sleep`, in clock cycles measured per rank), since a wait
on the host would overlap the kernels already queued and not slow the step. It runs on the node's backend.
Each size runs `trials` times, in a random order per trial so the machine's drift falls on every size alike:
- against a baseline: step-perf's time check against a baseline of the unplanted engine recorded here at the
  start (3 repeats), at the tier's minimum effect - detected = a regression;
- interleaved: `harness compare` A = mcore, B = planted, `rounds` rounds - detected = B significantly slower.
Printed: the detection rate per size with its Wilson 95% interval; at 0% that rate is the false alarms.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness import driver, recording
from harness.backends import Backend, tier_of
from harness.checks.timing import MIN_EFFECT_INTERLEAVED
from harness.compare import Side, judge, plan_sides, run_rounds
from harness.engine_names import EngineName
from harness.engines.mcore import McoreEngine
from harness.selection import CaseSelection
from harness.spec import CaseOptions
from harness.suite_registry import default_dtype

SIZES = (0.0, 0.03, 0.05, 0.10, 0.25)
WHERE = ("step", "comm")


def busy_wait(seconds: float) -> None:
    """The host's wait: busy, not asleep (a sleeping rank hands its core to the others on 2 cores)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class DeviceWait:
    """A wait enqueued on the device: `sleep(cycles)` spins the GPU for that many clock cycles on the current
    stream, at a rate of cycles per second measured by `calibrate` (`timed(cycles)` gives the seconds a sleep of
    them took on the device): after the warm-up steps, at the clocks the steps run at, which an idle GPU's are
    not; a wait before any calibration calibrates first. On GPU ranks torch.cuda._sleep timed by CUDA events;
    tests stand in for both."""

    CALIBRATION_CYCLES = 50_000_000

    def __init__(self, sleep: Callable[[int], None], timed: Callable[[int], float]):
        self.sleep = sleep
        self.timed = timed
        self.cycles_per_s: float | None = None

    def calibrate(self) -> float:
        self.cycles_per_s = self.CALIBRATION_CYCLES / max(self.timed(self.CALIBRATION_CYCLES), 1e-9)
        return self.cycles_per_s

    def __call__(self, seconds: float) -> None:
        if seconds > 0:
            self.sleep(int(seconds * (self.cycles_per_s or self.calibrate())))

    @classmethod
    def on_gpu(cls) -> DeviceWait:
        import torch

        def timed(cycles: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)  # warm: the first launch pays for the kernel's load
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000

        return cls(torch.cuda._sleep, timed)


class PlantedSlowdown(McoreEngine):
    """Waits SIZE x the median of its own warm-up steps per step after the warm-up, in the step (WHERE "step")
    or inside finalize_model_grads, the gradient sync the step waits for ("comm"): busy on CPU ranks, on the
    device on GPU ranks."""

    SIZE = 0.0
    WHERE = "step"

    def __init__(self, case, ctx):
        super().__init__(case, ctx)
        self._own: list[float] = []
        self._wait_s = 0.0
        self._wrapped = False
        self._on_cpu = ctx.on_cpu
        self._wait: Callable[[float], None] = busy_wait if ctx.on_cpu else DeviceWait.on_gpu()

    def _sync(self) -> None:
        if not self._on_cpu:
            import torch

            torch.cuda.synchronize()

    def wait_s(self) -> float:
        """The wait planted in every step after the warm-up: SIZE x the median of the warm-up steps."""
        return self.SIZE * statistics.median(self._own)

    def train_step(self, step: int):
        if self.WHERE == "comm" and not self._wrapped and self.config.finalize_model_grads_func is not None:
            finalize = self.config.finalize_model_grads_func

            def waiting(*args, **kwargs):
                self._wait(self._wait_s)
                return finalize(*args, **kwargs)

            self.config.finalize_model_grads_func = waiting
            self._wrapped = True
        warmup = self.case.options.warmup_steps
        self._wait_s = self.wait_s() if step >= warmup and self._own else 0.0
        if self.WHERE == "step":
            self._wait(self._wait_s)
        if step < warmup:  # the warm-up steps' own time, the device's work included
            self._sync()
            t0 = time.perf_counter()
            out = super().train_step(step)
            self._sync()
            self._own.append(time.perf_counter() - t0)
            if step == warmup - 1 and isinstance(self._wait, DeviceWait):
                self._wait.calibrate()  # the device hot from the warm-up steps, outside the timed ones
            return out
        return super().train_step(step)


def engine_name(where: str, size: float) -> str:
    return f"{where.capitalize()}{round(size * 100):02d}"


for _where in WHERE:  # Step00, Step03, ..., Comm25: importable by ranks as harness.power:<name>
    for _size in SIZES:
        globals()[engine_name(_where, _size)] = type(engine_name(_where, _size), (PlantedSlowdown,),
                                                     {"SIZE": _size, "WHERE": _where})


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95%): sound at 0 / n and n / n, where the normal one is not."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Tally:
    mode: str  # "vs baseline" | "interleaved"
    where: str
    size: float
    hits: int = 0
    trials: int = 0
    undecided: int = 0  # neither detected nor ruled out: the verdict was "cannot tell"

    def row(self) -> list[str]:
        low, high = wilson(self.hits, self.trials)
        what = "false alarms" if self.size == 0 else "detected"
        return [self.mode, self.where, f"{self.size:.0%}", f"{self.hits}/{self.trials}",
                f"{self.hits / self.trials:.0%} [{low:.0%}, {high:.0%}] {what}" if self.trials else "-",
                f"{self.undecided}/{self.trials}"]


def run_power(model: str, world_size: int, layout: str, trials: int, rounds: int, timed_steps: int,
              modes: tuple[str, ...], say: Callable[[str], None], backend: Backend = Backend.GLOO) -> list[Tally]:
    """Each planted size `trials` times per mode on `backend`'s ranks, judged at that tier's minimum effects."""
    import argparse

    options = CaseOptions(use_distributed_optimizer=True, overlap_grad_reduce=True,
                          dtype=default_dtype("step-perf", backend))
    params = {"timed_steps": timed_steps, "option_sets": ((True, True),)}
    tallies: dict[tuple, Tally] = {}
    rng = random.Random(0)
    if "baseline" in modes:
        baselines = tempfile.mkdtemp(prefix="harness-power-")
        say(f"recording the unplanted engine's baseline ({model}, {layout}, 3 repeats)")
        # Fresh ranks for the recording and every trial: a warm pool's ranks gather threads and heap case after
        # case (measured on `small` at world size 2: 64 -> 382 threads, 290 -> 986 MiB RSS per rank over 12
        # step-perf cases, step time +5-9%), so trials late in a warm pool read as slower than a baseline
        # recorded in its first cases - a drift of the pool's age, not of the planted size.
        recording.record_suite("step-perf", model, world_size, [layout], baselines_dir=baselines, backend=backend,
                               options=options, suite_params=params, fresh_ranks=True)
        planted = [(w, s) for w in WHERE for s in SIZES]
        plans = {(w, s): driver.plan("step-perf", model, world_size, [layout],
                                     engine=f"harness.power:{engine_name(w, s)}", backend=backend, options=options,
                                     baselines_dir=baselines, suite_params=params)
                 for w, s in planted}
        for trial in range(trials):
            rng.shuffle(planted)
            for where, size in planted:
                run = driver.execute(plans[where, size], fresh_ranks=True,
                                     progress=lambda msg: None).stop_if_interrupted()
                time_check = next(c for c in run.checks if c.check == "step-perf.time")
                t = tallies.setdefault(("vs baseline", where, size), Tally("vs baseline", where, size))
                t.trials += 1
                t.hits += int(time_check.failed and not time_check.improvement)
                t.undecided += int(time_check.inconclusive)
                verdict = "DETECTED" if time_check.failed and not time_check.improvement else \
                    "cannot tell" if time_check.inconclusive else "not detected"
                say(f"trial {trial + 1}/{trials} vs baseline {where} +{size:.0%}: {verdict} ({time_check.message})")
    if "compare" in modes:
        sel = CaseSelection("step-perf", model, world_size, (layout,), backend=backend, options=options)
        engines = [EngineName.MCORE, *(f"harness.power:{engine_name('step', size)}" for size in SIZES)]
        side_plans = plan_sides(sel, engines, timed_steps)  # each side's plan, made once
        sizes = list(SIZES)
        for trial in range(trials):
            rng.shuffle(sizes)
            for size in sizes:
                args = argparse.Namespace(rounds=rounds, steps_per_round=timed_steps, order_seed=trial)
                a = Side("A=mcore", EngineName.MCORE)
                b = Side(f"B=+{size:.0%}", f"harness.power:{engine_name('step', size)}")
                samples_a, samples_b, _ = run_rounds(a, b, sel, args, lambda msg: None, side_plans)
                step, _, _ = next(iter(judge(samples_a, samples_b, MIN_EFFECT_INTERLEAVED[tier_of(backend)]).values()))
                t = tallies.setdefault(("interleaved", "step", size), Tally("interleaved", "step", size))
                t.trials += 1
                t.hits += int(step.slower)
                t.undecided += int(step.undecided)
                say(f"trial {trial + 1}/{trials} interleaved step +{size:.0%}: x{step.ratio:.3f} "
                    f"[{step.ci_low:.3f}, {step.ci_high:.3f}] "
                    f"{'DETECTED' if step.slower else 'cannot tell' if step.undecided else 'not detected'}")
    return [tallies[k] for k in sorted(tallies, key=lambda k: (k[0], k[1], k[2]))]
