"""Run a suite: its plan (harness/planning.py) executed case by case on ranks, and judged: the one executor of
every command and of the torchrun entry."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from harness.backends import Backend
from harness.broken_env import broken_environment
from harness.engine_names import EngineName
from harness.engines import resolve_factory
from harness.engines.base import ImportsInRanks
from harness.errors import Interrupted
from harness.launch import CaseResult, run_case, zygote
from harness.launch.pool import close_all, pool_for, retire_pools_used_by_others
from harness.launch.profiler_crash import profiler_crash
from harness.launch.rank_imports import MEGATRON
from harness.outcomes import CaseStatus
from harness.planning import Plan, plan
from harness.probes.memory import run_captures
from harness.report import artifacts
from harness.report.results_file import write_results
from harness.spec import Case, CaseOptions
from harness.suite_defs import FreshRanks, FreshRanksPerCase, Suite
from harness.suite_run import SuiteRun

__all__ = ["CaseRunner", "LocalRanks", "Plan", "execute", "new_run_dir", "plan", "run_order", "run_suite",
           "with_outputs"]


def run_suite(suite_name: str | Suite, model_name: str | None, world_size: int, layout_ids: list[str] | None = None, *,
              engine: str = EngineName.MCORE, backend: str = Backend.AUTO, options: CaseOptions | None = None,
              timeout_s: float | None = None, suite_params: dict | None = None, baselines_dir: str | None = None,
              **run_options) -> SuiteRun:
    """plan then execute: the suite's cases planned from these arguments, run with run_options (execute's)."""
    return execute(plan(suite_name, model_name, world_size, layout_ids, engine=engine, backend=backend, options=options,
                        timeout_s=timeout_s, suite_params=suite_params, baselines_dir=baselines_dir), **run_options)


class CaseRunner(Protocol):
    """Where the executor's cases run: on rank processes this one starts (LocalRanks), or in this process and its
    peers under torchrun (harness/torchrun.py). judges: this process keeps the results and judges them (under
    torchrun rank 0 alone; every process runs each case)."""

    judges: bool

    def start(self) -> Path:
        """Before the first case: the run's directory (cases pass artefacts through it)."""
        ...

    def run(self, case: Case) -> CaseResult | None:
        """One case on the ranks; None in a process that does not judge."""
        ...

    def agree(self, stop: str) -> str:
        """Why every process stops after this case ("" goes on), as the judging one decided."""
        ...

    def abort(self) -> None:
        """An interrupted run: the case in flight is lost; its ranks must not outlive the run."""
        ...

    def finish(self, run_dir: Path) -> None:
        """After the run (judged): the run's directory goes."""
        ...


class LocalRanks:
    """Cases on rank processes of this machine: warm pool ranks, or ranks forked per case (fresh_ranks, or a suite
    that asks for them)."""

    judges = True

    def __init__(self, planned: Plan, fresh_ranks: bool = False):
        self.planned = planned
        self.per_case = fresh_ranks or (isinstance(planned.suite, FreshRanksPerCase)
                                        and planned.suite.fresh_ranks_per_case)
        self.fresh_ranks = fresh_ranks
        # ranks forked per case start with the suite's own imports done, in a fork server of their own; pool ranks
        # with their engines' (the same for every suite: what a pool's ranks ran earlier does not change them)
        engines = engine_imports(case.engine for case in planned.cases)
        self.preload = fork_preload(planned.suite) + engines if self.per_case else engines

    def start(self) -> Path:
        zygote.prestart(self.planned.backend, self.preload)  # only for a valid plan: bad input starts no process
        suite = self.planned.suite
        if isinstance(suite, FreshRanks) and suite.fresh_pool and not self.fresh_ranks:
            # the suite's timings must not depend on what other suites left in the warm ranks (its own
            # earlier runs - baseline repeats, compare rounds - keep them warm)
            retire_pools_used_by_others(suite.name)
        return new_run_dir()

    def run(self, case: Case) -> CaseResult:
        result = self._once(case)
        crash = profiler_crash(result)
        if crash:  # the profiler's defect, not the code's: once more (the failed case retired its warm ranks)
            result = self._once(case)
            result.notes.append(f"ran twice: the first time {crash}, a memray defect, not a verdict on the code")
        return result

    def _once(self, case: Case) -> CaseResult:
        if self.per_case:
            return run_case(case, preload=self.preload)
        return pool_for(case.layout.world_size, case.backend, self.preload).run(case)

    def agree(self, stop: str) -> str:
        return stop

    def abort(self) -> None:
        close_all(kill=True)

    def finish(self, run_dir: Path) -> None:
        shutil.rmtree(run_dir, ignore_errors=True)


def fork_preload(suite: Suite) -> tuple[str, ...]:
    """What a suite's ranks import beyond the modules every fork server has (torch's, megatron-core's)."""

    return tuple(m for m in suite.imports if m not in MEGATRON)


def engine_imports(engines: Iterable[str]) -> tuple[str, ...]:
    """What these engines' ranks import of their own (ImportsInRanks), in order, once each."""
    out: dict[str, None] = {}
    for engine in dict.fromkeys(engines):
        factory = resolve_factory(engine)
        if isinstance(factory, ImportsInRanks):
            out.update(dict.fromkeys(factory.rank_imports))
    return tuple(out)


def execute(planned: Plan, *, progress: Callable[[str], None] | None = None, fresh_ranks: bool = False,
            shuffle_seed: int | None = None, out_dir: Path | None = None, label: str | None = None,
            runner: CaseRunner | None = None) -> SuiteRun:
    """Run every case of the plan and judge them: the one executor of every command (run, baselines, compare,
    power, bisect-step, nightly) and of the torchrun entry.

    runner: where the cases run (default LocalRanks: warm pool ranks unless fresh_ranks).
    shuffle_seed runs the cases in a shuffled order (isolation checks); results keep plan order.
    out_dir: results.json is written there after every case (measured, not yet judged) and at the end
    (judged), so a crash keeps every finished case. A SIGTERM / Ctrl-C (Interrupted, KeyboardInterrupt)
    stops the run: its ranks are killed, the finished cases are judged and written, and the run is
    returned with `interrupted` set (exit code 143 / 130). A run whose first cases all error alike stops
    there (`stopped` says why; harness/broken_env.py): exit 3, what it measured kept. In a process that does
    not judge (torchrun's other ranks) the run is returned unjudged, with no results.
    """
    suite, params, cases = planned.suite, planned.params, planned.cases
    runner = runner or LocalRanks(planned, fresh_ranks)
    judges = runner.judges
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not judges:
        say = lambda msg: None  # noqa: E731
    run = SuiteRun(suite, planned.model_name, planned.world_size, planned.backend, planned.engine,
                   planned=len(cases), label=label, params=params)
    t0 = time.monotonic()
    run_dir = runner.start()
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
            if case.skip_reason:  # every process skips it alike
                result: CaseResult | None = CaseResult(case, [], CaseStatus.SKIPPED, error=case.skip_reason,
                                                       fresh_ranks=False)
            else:
                result = runner.run(case)
            if result is not None and judges:
                results[idx] = run.describe(result)
                warm = "" if result.fresh_ranks or case.skip_reason else " (warm ranks)"
                why = f": {result.error.splitlines()[0]}" if result.skipped and result.error else ""
                say(f"[{i}/{n}] {case.id} {result.status} in {result.wall_s:.1f}s{warm}{why}")
                for note in result.notes:
                    say(f"    {note}")
                if out_dir is not None:
                    run.results = [results[j] for j in sorted(results)]
                    run.wall_s = time.monotonic() - t0
                    _write(run, out_dir)
            stop = broken_environment([results[j] for j in order[:i]]) if judges and i < n else ""
            run.stopped = runner.agree(stop)
            if run.stopped:
                say(f"stopping after {i} of {n} cases: {run.stopped}")
                break
    except (Interrupted, KeyboardInterrupt) as exc:
        runner.abort()
        run.interrupted = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        say(f"interrupted ({run.interrupted}) after {len(results)} of {n} cases; judging the finished ones")
    if not judges:
        runner.finish(run_dir)
        return run
    run.results = [results[i] for i in sorted(results)]
    run.judge()

    for note in artifacts.finish(run.checks, str(run_captures(run_dir))):
        say(note)
    run.wall_s = time.monotonic() - t0
    runner.finish(run_dir)
    if out_dir is not None:
        _write(run, out_dir)
    return run


def _write(run: SuiteRun, out_dir: Path) -> None:
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
