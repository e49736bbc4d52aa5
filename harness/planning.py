"""Planning a run: a command's selection turned into a Plan (the suite, its parameters and its cases), validating
every input first; it starts no process and writes nothing (harness/driver.py executes a plan)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from harness import baselines, platform
from harness.backends import Backend
from harness.checks import training_memory
from harness.engine_names import EngineName
from harness.engines import resolve_factory
from harness.engines.base import RefusesCases
from harness.errors import BadInput, DoesNotApply, DoesNotFit
from harness.layouts import validate
from harness.models import load_model
from harness.platform import backend as platform_backend
from harness.platform import resolve_backend
from harness.selection import DEFAULT_WORLD_SIZE, CaseSelection
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suite_defs import (
    Baselined,
    Parameterised,
    Suite,
    baselines_dir_of,
    default_model,
    get_suite,
    moe_suites,
)
from harness.suite_flags import flag_of
from harness.suite_registry import default_dtype, spec_of


def suite_parameters(suite: Suite, given: dict | None = None, baselines_dir: str | None = None,
                     full_timing: bool = False) -> Any:
    """The suite's parameters (`suite.Params`, defaults: its default matrix) with the values the user
    gave; BadInput for a parameter the suite does not have or a value it refuses. full_timing: told to a suite
    whose parameters have a `full_timing` field (`plan`)."""
    given = dict(given or {})
    params_type = suite.Params if isinstance(suite, Parameterised) else None
    names = {f.name for f in dataclasses.fields(params_type)} if params_type else set()
    if baselines_dir is not None and "baselines_dir" in names:
        given["baselines_dir"] = baselines_dir
    if full_timing and "full_timing" in names:
        given["full_timing"] = True
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
         layout_ids: list[str] | None = None, *, engine: str = EngineName.MCORE, backend: str = Backend.AUTO,
         options: CaseOptions | None = None, timeout_s: float | None = None, suite_params: dict | None = None,
         baselines_dir: str | None = None, local_world_size: int | None = None, full_timing: bool = False) -> Plan:
    """The run's Plan, or BadInput, before anything runs or is written; it starts no process and writes nothing.
    selection: what a command read from its flags (CaseSelection: the other selecting arguments are its), or a
    suite by name or object with the model, world size, layouts and options given one by one. model_name None: the
    suite's default; options None: the defaults, in the suite's dtype for the backend (default_dtype).
    suite_params: values of the suite's parameters (`suite.Params` fields, e.g. step-perf's timed_steps). A suite
    with baselines has its baseline file parsed here (a corrupt one is refused before any rank).
    local_world_size: the ranks on this node where they span several (torchrun's LOCAL_WORLD_SIZE): NCCL needs a
    GPU for each of those, not for the whole world. full_timing: every timed figure measured in full, whatever this
    machine's baselines can judge - the caller uses them itself (a recording, a bisect step, the nightly's history)."""
    if isinstance(selection, CaseSelection):
        sel = selection
        selection, model_name, world_size, layout_ids = sel.suite, sel.model, sel.world_size, sel.layout_ids
        engine, backend, options, timeout_s = sel.engine, sel.backend, sel.options, sel.timeout
        suite_params = dict(sel.suite_params)
    suite = get_suite(selection)
    params = suite_parameters(suite, suite_params, baselines_dir, full_timing)
    if world_size < 1:
        raise BadInput(f"--world-size must be >= 1, got {world_size}")
    backend = resolve_backend(backend, local_world_size or world_size)
    if options is None:
        options = CaseOptions(dtype=default_dtype(suite.name, backend))
    model = load_model(model_name or default_model(suite, backend))
    why = spec_of(suite.name).moe_refusal
    if model.moe and why is not None:
        raise DoesNotApply(f"the {suite.name} suite does not judge mixture-of-experts models yet (model "
                           f"{model.name}): {why}; run {model.name} with --suite {' or --suite '.join(moe_suites())}, "
                           "or a dense model here")
    factory = None
    if engine != EngineName.MCORE:
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
        # every stack's file
        baselines.Book(baselines_dir_of(params), platform.detect_platform(backend).key, suite.name)
    return Plan(suite, params, cases, model.name, world_size, backend, cases[0].engine if cases else engine)


def refusal(factory: Any, model: ModelSpec, layout: Layout) -> str | None:
    """Why the engine factory cannot build the model at the layout (RefusesCases); None where it can."""

    return factory.refusal(model, layout) if isinstance(factory, RefusesCases) else None


def buildable(cases: list[Case], factory: Any, engine: str) -> list[Case]:
    """The cases of a suite's default matrix that the engine can build (and those that read their outputs);
    DoesNotApply naming why when it can build none of its own."""
    if engine != EngineName.MCORE and cases and not any(c.engine == engine for c in cases):
        engines = sorted({c.engine for c in cases})
        raise DoesNotApply(f"--engine {engine} runs no case of this selection (its cases are {' and '.join(engines)}'s"
                           f" alone): run it with --engine {engines[0]}")
    refused = {c.id: why for c in cases if not c.skip_reason and c.engine == engine
               and (why := refusal(factory, c.model, c.layout))}
    if not refused:
        return cases
    kept = [c for c in cases if c.id not in refused and not set(c.after) & refused.keys()]
    if not [c for c in kept if not c.skip_reason and c.engine == engine]:  # (golden adds cases of other engines)
        raise DoesNotApply(f"{next(iter(refused.values()))} (--engine {engine} can build no case of this "
                           "selection)")
    return kept


def refuse_what_does_not_fit(cases: list[Case], backend: Backend, local_world_size: int) -> None:
    """DoesNotFit (exit 2, a skip in pytest) for the first case the training-memory model predicts will not fit
    the memory a rank has, before any rank starts; local_world_size: the ranks sharing this node."""
    if not cases:
        return
    available = platform_backend.memory_per_rank(backend, local_world_size)
    for case in cases:
        why = "" if case.skip_reason else training_memory.refusal(case, available)
        if why:
            raise DoesNotFit(why)
