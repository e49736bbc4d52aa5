"""Run a suite: build its cases (validating all input first), run them one by one, judge them."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.backends import Backend
from harness.broken_env import broken_environment
from harness.errors import BadInput, DoesNotApply, Interrupted
from harness.launch import CaseResult, run_case, zygote
from harness.launch.pool import pool_for
from harness.layouts import validate
from harness.models import load_model
from harness.outcomes import CaseStatus
from harness.platform import resolve_backend
from harness.selection import DEFAULT_WORLD_SIZE, CaseSelection
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs import (
    Baselined,
    FreshRanks,
    FreshRanksPerCase,
    Parameterised,
    Suite,
    baselines_dir_of,
    default_dtype,
    default_model,
    get_suite,
    moe_suites,
)
from harness.suite_defs.flags import flag_of
from harness.suite_registry import spec_of
from harness.suite_run import SuiteRun


def suite_parameters(suite: Suite, given: dict | None = None, baselines_dir: str | None = None) -> Any:
    """The suite's parameters (`suite.Params`, defaults: its default matrix) with the values the user
    gave; BadInput for a parameter the suite does not have or a value it refuses."""
    given = dict(given or {})
    params_type = suite.Params if isinstance(suite, Parameterised) else None
    names = {f.name for f in dataclasses.fields(params_type)} if params_type else set()
    if baselines_dir is not None and "baselines_dir" in names:
        given["baselines_dir"] = baselines_dir
    for name in given:
        if name not in names:
            flag = flag_of(name)
            raise BadInput(f"{flag} does not apply to the {suite.name} suite")
    return params_type(**given) if params_type else None


@dataclass(frozen=True)
class Plan:
    """What a run will do, decided before anything runs: the suite, its parameters and its cases (each with its
    model, layout, engine, backend and options)."""

    suite: Suite
    params: Any
    cases: list[Case]
    model_name: str
    world_size: int
    backend: Backend
    engine: str


def plan(selection: CaseSelection | str | Suite, model_name: str | None = None, world_size: int = DEFAULT_WORLD_SIZE,
         layout_ids: list[str] | None = None, *, engine: str = "mcore", backend: str = Backend.AUTO,
         options: CaseOptions | None = None, timeout_s: float | None = None, suite_params: dict | None = None,
         baselines_dir: str | None = None, local_world_size: int | None = None) -> Plan:
    """The run's Plan, or BadInput, before anything runs or is written; it starts no process and writes nothing.
    selection: what a command read from its flags (CaseSelection: the other selecting arguments are its), or a
    suite by name or object with the model, world size, layouts and options given one by one. model_name None: the
    suite's default; options None: the defaults, in the suite's dtype for the backend (default_dtype).
    suite_params: values of the suite's parameters (`suite.Params` fields, e.g. step-perf's timed_steps). A suite
    with baselines has its baseline file parsed here (a corrupt one is refused before any rank).
    local_world_size: the ranks on this node where they span several (torchrun's LOCAL_WORLD_SIZE): NCCL needs a
    GPU for each of those, not for the whole world."""
    if isinstance(selection, CaseSelection):
        sel = selection
        selection, model_name, world_size, layout_ids = sel.suite, sel.model, sel.world_size, sel.layout_ids
        engine, backend, options, timeout_s = sel.engine, sel.backend, sel.options, sel.timeout
        suite_params = dict(sel.suite_params)
    suite = get_suite(selection)
    params = suite_parameters(suite, suite_params, baselines_dir)
    if world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {world_size}")
    backend = resolve_backend(backend, local_world_size or world_size)
    if options is None:
        options = CaseOptions(dtype=default_dtype(suite.name, backend))
    model = load_model(model_name or default_model(suite, backend))
    why = spec_of(suite.name).dense_only
    if model.moe and why:
        raise DoesNotApply(f"the {suite.name} suite does not judge mixture-of-experts models yet (model "
                           f"{model.name}): {why}; run {model.name} with --suite {' or --suite '.join(moe_suites())}, "
                           "or a dense model here")
    factory = None
    if engine != "mcore":
        from harness.engines import resolve_factory

        factory = resolve_factory(engine)  # fail fast in the parent on a bad import path
    batch = dict(global_batch_size=options.global_batch_size, micro_batch_size=options.micro_batch_size)
    layouts = None
    if layout_ids:
        layouts = [validate(Layout.parse(i), model, world_size, **batch) for i in layout_ids]
        for lay in layouts:
            refused = refusal(factory, model, lay)
            if refused:
                raise DoesNotApply(f"{refused} (--engine {engine} cannot build --layout {lay.id}; drop it or "
                                   "use --engine mcore)")
    cases = suite.cases(model, world_size, layouts, engine=engine, backend=backend, options=options, params=params)
    cases = buildable(cases, factory, engine)
    if timeout_s is not None:
        cases = [dataclasses.replace(c, timeout_s=timeout_s) for c in cases]
    refuse_what_does_not_fit(cases, backend, local_world_size or world_size)
    if isinstance(suite, Baselined) and cases:
        from harness import baselines
        from harness.platform import detect_platform

        baselines.load(baselines.baseline_path(baselines_dir_of(params),
                                               detect_platform(backend).key, suite.name))
    return Plan(suite, params, cases, model.name, world_size, backend, cases[0].engine if cases else engine)


def refusal(factory: Any, model: ModelSpec, layout: Layout) -> str | None:
    """Why the engine factory cannot build the model at the layout (RefusesCases); None where it can."""
    from harness.engines.base import RefusesCases

    return factory.refusal(model, layout) if isinstance(factory, RefusesCases) else None


def buildable(cases: list[Case], factory: Any, engine: str) -> list[Case]:
    """The cases of a suite's default matrix that the engine can build (and those that read their outputs);
    DoesNotApply naming why when it can build none of its own."""
    if engine != "mcore" and cases and not any(c.engine == engine for c in cases):
        engines = sorted({c.engine for c in cases})
        raise DoesNotApply(f"--engine {engine} runs no case of this selection (its cases are {' and '.join(engines)}'s"
                           f" alone): run it with --engine {engines[0]}")
    refused = {c.id: why for c in cases if not c.skip and c.engine == engine
               and (why := refusal(factory, c.model, c.layout))}
    if not refused:
        return cases
    kept = [c for c in cases if c.id not in refused and not set(c.after) & refused.keys()]
    if not [c for c in kept if not c.skip and c.engine == engine]:  # (golden adds cases of other engines)
        raise DoesNotApply(f"{next(iter(refused.values()))} (--engine {engine} can build no case of this "
                           "selection)")
    return kept


def refuse_what_does_not_fit(cases: list[Case], backend: Backend, local_world_size: int) -> None:
    """DoesNotFit (exit 2, a skip in pytest) for the first case the training-memory model predicts will not fit
    the memory a rank has, before any rank starts; local_world_size: the ranks sharing this node."""
    from harness.checks.training_memory import refusal
    from harness.errors import DoesNotFit
    from harness.platform.backend import memory_per_rank

    if not cases:
        return
    available = memory_per_rank(backend, local_world_size)
    for case in cases:
        why = "" if case.skip else refusal(case, available)
        if why:
            raise DoesNotFit(why)


def run_suite(suite_name: str | Suite, model_name: str | None, world_size: int, layout_ids: list[str] | None = None, *,
              engine: str = "mcore", backend: str = Backend.AUTO, options: CaseOptions | None = None,
              timeout_s: float | None = None, suite_params: dict | None = None, baselines_dir: str | None = None,
              **run_options) -> SuiteRun:
    """plan then execute: the suite's cases planned from these arguments, run with run_options (execute's)."""
    return execute(plan(suite_name, model_name, world_size, layout_ids, engine=engine, backend=backend, options=options,
                        timeout_s=timeout_s, suite_params=suite_params, baselines_dir=baselines_dir), **run_options)


def execute(planned: Plan, *, progress: Callable[[str], None] | None = None, fresh_ranks: bool = False,
            shuffle_seed: int | None = None, out_dir: Path | None = None, label: str | None = None) -> SuiteRun:
    """Run every case of the plan (warm pool ranks unless fresh_ranks) and judge them.

    shuffle_seed runs the cases in a shuffled order (isolation checks); results keep plan order.
    out_dir: results.json is written there after every case (measured, not yet judged) and at the end
    (judged), so a crash keeps every finished case. A SIGTERM / Ctrl-C (Interrupted, KeyboardInterrupt)
    stops the run: its ranks are killed, the finished cases are judged and written, and the run is
    returned with `interrupted` set (exit code 143 / 130). A run whose first cases all error alike stops
    there (`stopped` says why; harness/broken_env.py): exit 3, what it measured kept.
    """
    suite, params, cases = planned.suite, planned.params, planned.cases
    zygote.prestart(planned.backend)  # only for a valid plan: bad input starts no process
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    run = SuiteRun(suite, planned.model_name, planned.world_size, planned.backend, planned.engine,
                   planned=len(cases), label=label, params=params)
    t0 = time.monotonic()
    if isinstance(suite, FreshRanks) and suite.fresh_pool and not fresh_ranks:
        from harness.launch.pool import retire_pools_used_by_others

        # the suite's timings must not depend on what other suites left in the warm ranks (its own
        # earlier runs - baseline repeats, compare rounds - keep them warm)
        retire_pools_used_by_others(suite.name)
    per_case = fresh_ranks or (isinstance(suite, FreshRanksPerCase) and suite.fresh_ranks_per_case)
    run_dir = new_run_dir()
    cases = with_outputs(cases, run_dir, suite)
    order = run_order(cases, shuffle_seed)
    results: dict[int, CaseResult] = {}
    n = len(cases)
    try:
        for i, idx in enumerate(order, 1):
            case = cases[idx]
            elapsed = time.monotonic() - t0
            eta = f", ETA {format_clock(elapsed / (i - 1) * (n - i + 1))}" if i > 1 else ""
            say(f"[{i}/{n} {format_clock(elapsed)} elapsed{eta}] {case.id} ...")
            if case.skip:
                result = CaseResult(case, [], CaseStatus.SKIPPED, error=case.skip, fresh_ranks=False)
            else:
                result = run_case(case) if per_case else pool_for(case.layout.world_size, case.backend).run(case)
            results[idx] = run.describe(result)
            warm = "" if result.fresh_ranks or case.skip else " (warm ranks)"
            why = f": {result.error.splitlines()[0]}" if result.skipped and result.error else ""
            say(f"[{i}/{n}] {case.id} {result.status} in {result.wall_s:.1f}s{warm}{why}")
            for note in result.notes:
                say(f"    {note}")
            if out_dir is not None:
                run.results = [results[j] for j in sorted(results)]
                run.wall_s = time.monotonic() - t0
                _write(run, out_dir)
            run.stopped = broken_environment([results[j] for j in order[:i]]) if i < n else ""
            if run.stopped:
                say(f"stopping after {i} of {n} cases: {run.stopped}")
                break
    except (Interrupted, KeyboardInterrupt) as exc:
        from harness.launch.pool import close_all

        close_all(kill=True)  # the case in flight is lost; its ranks must not outlive the run
        run.interrupted = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        say(f"interrupted ({run.interrupted}) after {len(results)} of {n} cases; judging the finished ones")
    run.results = [results[i] for i in sorted(results)]
    run.judge()
    from harness.probes.memory import run_captures
    from harness.report import artifacts

    for note in artifacts.finish(run.checks, str(run_captures(run_dir))):
        say(note)
    run.wall_s = time.monotonic() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    if out_dir is not None:
        _write(run, out_dir)
    return run


def _write(run: SuiteRun, out_dir: Path) -> None:
    from harness.report.results_file import write_results

    write_results(run, Path(out_dir))


def with_outputs(cases: list[Case], run_dir: Path, suite: Suite | None = None) -> list[Case]:
    """Each case with its own output directory under the run's, and the output directories of the
    cases it reads (`after`) as its inputs: the driver resolves the links, a case never guesses a path.
    With the suite: the import path of its class, which the ranks load."""
    out = {c.id: str(run_dir / f"case{i:03d}") for i, c in enumerate(cases)}
    ref = f"{type(suite).__module__}:{type(suite).__qualname__}" if suite is not None else ""
    ref = "" if "<locals>" in ref else ref  # a class defined in a function: the ranks load it by `suite`
    return [dataclasses.replace(c, out_dir=out[c.id], inputs=tuple(out[d] for d in c.after if d in out),
                                suite_ref=c.suite_ref or ref) for c in cases]


def new_run_dir() -> Path:
    """A directory private to one run (cases pass artefacts such as checkpoints through it), so
    concurrent runs never share one; under $HARNESS_ARTIFACTS when set."""
    root = Path(os.environ.get("HARNESS_ARTIFACTS", Path(tempfile.gettempdir()) / "harness-artifacts"))
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


def run_order(cases: list, shuffle_seed: int | None = None) -> list[int]:
    """Indices of the cases in the order they run: plan order, or shuffled; a case always runs after
    the cases it names in `after` (a dependency outside the plan is ignored: its check says so)."""
    ids = {c.id: i for i, c in enumerate(cases)}
    needs = {i: {ids[d] for d in c.after if d in ids} for i, c in enumerate(cases)}
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    order: list[int] = []
    pending = list(range(len(cases)))
    if rng:
        rng.shuffle(pending)
    while pending:
        ready = next(i for i in pending if needs[i] <= set(order))
        order.append(ready)
        pending.remove(ready)
    return order


def format_clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"
