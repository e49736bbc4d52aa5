"""step-perf's work in a rank: warm-up steps, the calibration workload, the timed steps (with --overhead each
paired with an uninstrumented one; the machine's CPU time over them, to see who else used it), then one untimed
step with the counters installed."""

from __future__ import annotations

from harness.checks.expected_collectives import dp_records
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.platform.parallel import layout_coords
from harness.probes.cpu_share import cpu_window
from harness.probes.timers import PhaseTimer, calibrate
from harness.spec import Case
from harness.suite_defs.step_perf.params import StepPerfParams
from harness.suite_defs.step_perf.payload import Counters, StepPerfRankData


def count_work(engine, step: int) -> Counters:
    """One untimed step with the counters installed: FLOPs, collectives by role/kind, overlap."""
    from harness.probes.collectives import CollectiveRecorder, GroupRoles, instrument
    from harness.probes.flops import FlopCounter

    recorder = CollectiveRecorder(GroupRoles())
    with instrument(engine, recorder), recorder, FlopCounter() as flops, recorder.phase("forward-backward"):
        engine.train_step(step)
    collectives: dict[str, dict[str, int]] = {}
    for c in recorder.by_source("dispatch"):
        entry = collectives.setdefault(f"{c.role}/{c.kind}", {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += c.bytes
    in_backward = sum(1 for c in dp_records(recorder.by_source("dispatch"))
                      if c.kind in ("all_reduce", "reduce_scatter") and c.phase == "backward")
    return Counters(flops.total, collectives, in_backward)


def rank_work(case: Case, ctx: RankContext) -> StepPerfRankData:
    import functools
    import random

    import torch.distributed as dist

    engine = make_engine(case, ctx)
    with ctx.phase("build"):
        engine.build()
    warmup, timed = case.options.warmup_steps, case.options.steps
    with ctx.phase("steps"):
        for step in range(warmup):
            engine.train_step(step)
    with ctx.phase("calibrate"):
        calibration = calibrate(ctx.device, ctx.on_cpu)
    timer = PhaseTimer(engine, ctx.on_cpu)
    steps, plain = [], []
    overhead = isinstance(case.params, StepPerfParams) and case.params.overhead
    order = random.Random(case.options.seed)  # the same draws on every rank: their barriers pair up
    step = warmup
    with ctx.phase("steps"), cpu_window() as cpu:
        for _ in range(timed):
            kinds = ["timed", "plain"] if overhead else ["timed"]
            order.shuffle(kinds)
            for kind in kinds:
                run = functools.partial(engine.train_step, step)
                if kind == "plain":
                    plain.append(timer.plain_step(run, dist.barrier))
                else:
                    with timer.installed():
                        timing, _ = timer.step(run, dist.barrier)
                    steps.append(timing)
                step += 1
    with ctx.phase("counters"):
        counters = count_work(engine, step)
    device = {}
    if not ctx.on_cpu:
        import torch

        device = {"name": torch.cuda.get_device_name(), "max_allocated": torch.cuda.max_memory_allocated(),
                  "tf32": torch.backends.cuda.matmul.allow_tf32}  # fp32 matmuls on tensor cores
    return StepPerfRankData(steps, calibration, counters, plain, layout_coords(), device, cpu[0] if cpu else None)
