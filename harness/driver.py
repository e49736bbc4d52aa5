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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.checks import CheckResult
from harness.errors import BadInput, Interrupted
from harness.launch import CaseResult, run_case
from harness.launch.pool import pool_for
from harness.layouts import validate
from harness.models import load_model
from harness.outcomes import EXIT_FAIL, EXIT_NOTHING_JUDGED, EXIT_PASS
from harness.platform import resolve_backend
from harness.spec import Case, CaseOptions, Layout
from harness.suites import Suite, get_suite


@dataclass
class CaseOutcome:
    """A case's single verdict for summaries: one of OUTCOMES and, unless it passed, why."""

    result: CaseResult
    outcome: str
    reason: str = ""
    checks: list[CheckResult] = field(default_factory=list)


def error_summary(error: str) -> str:
    """The head line of a case error plus the exception its first traceback ends with, e.g.
    "case ...: rank 0 failed in phase 'save' - AssertionError: ..."."""
    lines = error.splitlines() or ["failed"]
    in_traceback = False
    for line in lines[1:]:
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            return f"{lines[0]} - {line.strip()}"
    return lines[0]


def _outcome(result: CaseResult, checks: list[CheckResult], judged: bool = True) -> CaseOutcome:
    if result.skipped:
        return CaseOutcome(result, "skipped", (result.error.splitlines() or ["skipped"])[0], checks)
    if not result.ok:
        return CaseOutcome(result, "error", error_summary(result.error).removeprefix(f"case {result.case.id}: "), checks)
    if not judged:  # written while the run goes on: measured, judged at the end
        return CaseOutcome(result, "pending", "measured; judged when the run ends", checks)
    if not checks:
        return CaseOutcome(result, "unjudged", "the case ran but no check judged it", checks)
    failed = [c for c in checks if not c.passed]
    if not failed:
        return CaseOutcome(result, "pass", "", checks)
    worse = [c for c in failed if not c.improvement]
    c = (worse or failed)[0]
    return CaseOutcome(result, "regression" if worse else "improvement", f"{c.check}: {c.message}", checks)


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
    planned: int = 0  # cases in the plan (results may hold fewer: an interrupted run)
    judged: bool = False  # the suite's checks ran over the results
    interrupted: Interrupted | None = None  # the signal that ended the run early
    label: str | None = None  # the user's name for this run (reports, history)
    params: Any = None  # the suite's parameters (suite.Params) the cases were planned and are judged with

    @property
    def passed(self) -> bool:
        """Something was judged, every case ran (or was skipped for a missing dependency), every case
        that ran was judged by at least one check, and every check passed."""
        return self.verdict == "pass"

    @property
    def verdict(self) -> str:
        """'pass', 'fail' (a check failed, a case errored or went unjudged), 'nothing judged' (no check
        ran at all: every case skipped, or none planned) or 'interrupted' (stopped early by a signal)."""
        if self.interrupted is not None:
            return "interrupted"
        if not self.checks and not self.errors:
            return "nothing judged"
        outcomes = self.outcomes()
        if all(o.outcome in ("pass", "skipped") for o in outcomes) and all(c.passed for c in self.checks):
            return "pass"
        return "fail"

    def judge(self) -> "SuiteRun":
        """Run the suite's checks over the cases that ran (a skipped case has nothing to judge). Checks are
        pure functions of the results and the parameters: what a report does with files (flamegraphs of
        failures, captures of passes deleted) happens in the report stage (harness/report/artifacts.py)."""
        for r in self.results:
            self.describe(r)
        self.checks = self.suite.check([r for r in self.results if not r.skipped], self.params)
        self.judged = True
        return self

    def describe(self, result: CaseResult) -> CaseResult:
        """The suite's figures of a case, taken once when it arrives (`result.figures`): reports are
        rendered from them (and from results.json) without the suite's code."""
        if result.figures is None:
            result.figures = case_figures(self.suite, result)
        return result

    def stop_if_interrupted(self) -> "SuiteRun":
        """Re-raise the interrupt this run was stopped by: for callers that run more than one suite run
        (repeats, rounds, bisect steps), which must stop too."""
        if self.interrupted is not None:
            raise self.interrupted
        return self

    @property
    def exit_code(self) -> int:
        if self.interrupted is not None:
            return self.interrupted.exit_code
        return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "nothing judged": EXIT_NOTHING_JUDGED}[self.verdict]

    @property
    def errors(self) -> list[str]:
        """The error text of every case that failed to run (skipped cases are not errors)."""
        return [r.error for r in self.results if not r.ok and not r.skipped]

    def outcomes(self) -> list[CaseOutcome]:
        """One outcome per case, in plan order; a check belongs to the case whose id starts its own
        (cross-layout checks are filed as `<case id>-><target>`)."""
        by_case: dict[str, list[CheckResult]] = {r.case.id: [] for r in self.results}
        for c in self.checks:
            owner = c.case_id if c.case_id in by_case else c.case_id.split("->")[0]
            by_case.setdefault(owner, []).append(c)
        return [_outcome(r, by_case[r.case.id], self.judged) for r in self.results]


# a parameter whose flag is not `--<name with dashes>`
FLAGS = {"formats": "--ckpt-format"}


def suite_parameters(suite: Suite, given: dict | None = None, baselines_dir: str | None = None) -> Any:
    """The suite's parameters (`suite.Params`, defaults: its default matrix) with the values the user
    gave; BadInput for a parameter the suite does not have or a value it refuses."""
    given = dict(given or {})
    params_type = getattr(suite, "Params", None)
    names = {f.name for f in dataclasses.fields(params_type)} if params_type else set()
    if baselines_dir is not None and "baselines_dir" in names:
        given["baselines_dir"] = baselines_dir
    for name in given:
        if name not in names:
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            raise BadInput(f"{flag} does not apply to the {suite.name} suite")
    return params_type(**given) if params_type else None


def case_figures(suite: Suite, result: CaseResult) -> dict[str, Any]:
    """What a report shows of a case beyond the harness's own fields: the suite's metrics, its report data
    (plots) and, for a baselined suite, the baseline key and samples."""
    out: dict[str, Any] = {"metrics": suite.metrics(result) or {}}
    if result.ok and hasattr(suite, "report_data"):
        out["data"] = suite.report_data(result)
    if result.ok and hasattr(suite, "samples"):
        out["baseline_key"], out["samples"] = suite.key(result.case), suite.samples(result)
    return out


def plan(suite_name: "str | Suite", model_name: str | None, world_size: int, layout_ids: list[str] | None = None,
         **kwargs) -> tuple[Suite, list[Case]]:
    """(suite, cases) or BadInput, before anything runs or is written (see planned_run)."""
    suite, _, cases = planned_run(suite_name, model_name, world_size, layout_ids, **kwargs)
    return suite, cases


def planned_run(suite_name: "str | Suite", model_name: str | None, world_size: int, layout_ids: list[str] | None = None,
                *, engine: str = "mcore", backend: str = "auto", options: CaseOptions = CaseOptions(),
                timeout_s: float | None = None, suite_params: dict | None = None, baselines_dir: str | None = None):
    """(suite, params, cases) or BadInput, before anything runs or is written. model_name None: the suite's
    default. suite_params: values of the suite's parameters (`suite.Params` fields, e.g. step-perf's
    timed_steps). A suite with baselines has its baseline file parsed here (a corrupt one is refused
    before any rank)."""
    suite = get_suite(suite_name)
    params = suite_parameters(suite, suite_params, baselines_dir)
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
    cases = suite.cases(model, world_size, layouts, engine=engine, backend=backend, options=options, params=params)
    if timeout_s is not None:
        cases = [dataclasses.replace(c, timeout_s=timeout_s) for c in cases]
    if hasattr(suite, "samples") and cases:
        from harness import baselines
        from harness.platform import detect_platform

        baselines.load(baselines.baseline_path(getattr(params, "baselines_dir", None),
                                               detect_platform(backend).key, suite.name))
    return suite, params, cases


def run_suite(suite_name: "str | Suite", model_name: str | None, world_size: int, layout_ids: list[str] | None = None, *,
              engine: str = "mcore", backend: str = "auto", options: CaseOptions = CaseOptions(),
              timeout_s: float | None = None, progress: Callable[[str], None] | None = None,
              fresh_ranks: bool = False, shuffle_seed: int | None = None,
              baselines_dir: str | None = None, suite_params: dict | None = None, out_dir: Path | None = None,
              label: str | None = None) -> SuiteRun:
    """Run every case of the suite (warm pool ranks unless fresh_ranks) and judge them.

    shuffle_seed runs the cases in a shuffled order (isolation checks); results keep plan order.
    out_dir: results.json is written there after every case (measured, not yet judged) and at the end
    (judged), so a crash keeps every finished case. A SIGTERM / Ctrl-C (Interrupted, KeyboardInterrupt)
    stops the run: its ranks are killed, the finished cases are judged and written, and the run is
    returned with `interrupted` set (exit code 143 / 130).
    """
    suite, params, cases = planned_run(suite_name, model_name, world_size, layout_ids, engine=engine, backend=backend,
                                       options=options, timeout_s=timeout_s, suite_params=suite_params,
                                       baselines_dir=baselines_dir)
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    run = SuiteRun(suite, model_name or suite.default_model, world_size, cases[0].backend if cases else backend,
                   cases[0].engine if cases else engine, planned=len(cases), label=label,
                   params=params)  # a suite may pick its engine
    t0 = time.monotonic()
    if getattr(suite, "fresh_pool", False) and not fresh_ranks:
        from harness.launch.pool import retire_pools_used_by_others

        # the suite's timings must not depend on what other suites left in the warm ranks (its own
        # earlier runs - baseline repeats, compare rounds - keep them warm)
        retire_pools_used_by_others(suite.name)
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
            result = run_case(case) if fresh_ranks else pool_for(case.layout.world_size, case.backend).run(case)
            results[idx] = run.describe(result)
            warm = "" if result.fresh_ranks else " (warm ranks)"
            why = f": {result.error.splitlines()[0]}" if result.skipped and result.error else ""
            say(f"[{i}/{n}] {case.id} {result.status} in {result.wall_s:.1f}s{warm}{why}")
            for note in result.notes:
                say(f"    {note}")
            if out_dir is not None:
                run.results = [results[j] for j in sorted(results)]
                run.wall_s = time.monotonic() - t0
                _write(run, out_dir)
    except (Interrupted, KeyboardInterrupt) as exc:
        from harness.launch.pool import close_all

        close_all(kill=True)  # the case in flight is lost; its ranks must not outlive the run
        run.interrupted = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        say(f"interrupted ({run.interrupted}) after {len(results)} of {n} cases; judging the finished ones")
    run.results = [results[i] for i in sorted(results)]
    run.judge()
    from harness.report import artifacts

    for note in artifacts.finish(run.checks):
        say(note)
    run.wall_s = time.monotonic() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    if out_dir is not None:
        _write(run, out_dir)
    return run


def _write(run: SuiteRun, out_dir: Path) -> None:
    from harness import report

    report.write_results(run, Path(out_dir))


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
