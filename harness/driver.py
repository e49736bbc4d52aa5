"""Run a suite: build its cases (validating all input first), run them one by one, judge them."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from harness.checks import CheckResult
from harness.errors import BadInput
from harness.launch import CaseResult, run_case
from harness.launch.pool import pool_for
from harness.layouts import validate
from harness.models import load_model
from harness.platform import resolve_backend
from harness.spec import CaseOptions, Layout
from harness.suites import Suite, get_suite


@dataclass
class SuiteRun:
    suite: Suite
    model: str
    world_size: int
    backend: str
    engine: str
    results: list[CaseResult] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results) and all(c.passed for c in self.checks)


def plan(suite_name: "str | Suite", model_name: str | None, world_size: int, layout_ids: list[str] | None = None, *,
         engine: str = "mcore", backend: str = "auto", options: CaseOptions = CaseOptions(),
         timeout_s: float | None = None, ckpt_formats: list[str] | None = None):
    """(suite, cases) or BadInput, before anything runs or is written. model_name None: the suite's default."""
    suite = get_suite(suite_name)
    if ckpt_formats:
        if not hasattr(suite, "formats"):
            raise BadInput(f"--ckpt-format applies to the ckpt-memory suite, not {suite_name!r}")
        unknown = set(ckpt_formats) - set(suite.ALL_FORMATS)
        if unknown:
            raise BadInput(f"unknown checkpoint format(s) {sorted(unknown)}; known: {', '.join(suite.ALL_FORMATS)}")
        suite.formats = tuple(ckpt_formats)
    for flag in ("fully_parallel_save", "async_save"):
        if getattr(options, flag) and not hasattr(suite, "formats"):
            raise BadInput(f"--{flag.replace('_', '-')} applies to the ckpt-memory suite, not {suite_name!r}")
    model = load_model(model_name or suite.default_model)
    if world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {world_size}")
    backend = resolve_backend(backend, world_size)
    if engine != "mcore":
        from harness.engines import resolve_factory

        resolve_factory(engine)  # fail fast in the parent on a bad import path
    batch = dict(global_batch_size=options.global_batch_size, micro_batch_size=options.micro_batch_size)
    layouts = None
    if layout_ids:
        layouts = [validate(Layout.parse(i), model, world_size, **batch) for i in layout_ids]
    cases = suite.cases(model, world_size, layouts, engine=engine, backend=backend, options=options)
    if timeout_s is not None:
        import dataclasses

        cases = [dataclasses.replace(c, timeout_s=timeout_s) for c in cases]
    return suite, cases


def run_suite(suite_name: "str | Suite", model_name: str | None, world_size: int, layout_ids: list[str] | None = None, *,
              engine: str = "mcore", backend: str = "auto", options: CaseOptions = CaseOptions(),
              timeout_s: float | None = None, progress: Callable[[str], None] | None = None,
              fresh_ranks: bool = False, shuffle_seed: int | None = None,
              baselines_dir: str | None = None, ckpt_formats: list[str] | None = None) -> SuiteRun:
    """Run every case of the suite (warm pool ranks unless fresh_ranks) and judge them.

    shuffle_seed runs the cases in a shuffled order (isolation checks); results keep plan order.
    """
    suite, cases = plan(suite_name, model_name, world_size, layout_ids, engine=engine, backend=backend,
                        options=options, timeout_s=timeout_s, ckpt_formats=ckpt_formats)
    if baselines_dir is not None:
        suite.baselines_dir = baselines_dir
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    run = SuiteRun(suite, model_name or suite.default_model, world_size, cases[0].backend if cases else backend, engine)
    t0 = time.monotonic()
    order = list(range(len(cases)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    results: dict[int, CaseResult] = {}
    for i, idx in enumerate(order, 1):
        case = cases[idx]
        say(f"[{i}/{len(cases)}] {case.id} ...")
        result = run_case(case) if fresh_ranks else pool_for(case.layout.world_size, case.backend).run(case)
        results[idx] = result
        warm = "" if result.fresh_ranks else " (warm ranks)"
        say(f"[{i}/{len(cases)}] {case.id} {result.status} in {result.wall_s:.1f}s{warm}")
        for note in result.notes:
            say(f"    {note}")
    run.results = [results[i] for i in range(len(cases))]
    run.checks = suite.check(run.results)
    run.wall_s = time.monotonic() - t0
    return run
