"""One step of a bisect: run the selected cases in this environment and judge them against the threshold
(`harness bisect-step`), or run that command in a candidate's environment and read its verdict back
(a JSON file: the protocol between the search and its steps)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness import baselines, driver
from harness import platform as harness_platform
from harness.bisect.search import BAD, GOOD, PASS_FAIL, SKIP, StepResult, Threshold
from harness.errors import BadInput
from harness.files import atomic_write
from harness.outcomes import CHECK_METRIC, Outcome
from harness.report.provenance import versions
from harness.report.results_file import run_adjustments
from harness.suite_defs import Baselined, SeesOtherLoad, TimedBaselines, baselines_dir_of

if TYPE_CHECKING:
    from harness.selection import CaseSelection


@dataclass
class StepSpec:
    """What every step judges: the case selection (as `harness run` flags), the metric and threshold."""

    case_argv: list[str]
    metric: str
    max: str = PASS_FAIL
    error_is_bad: bool = False
    baselines_dir: str | None = None  # absolute: steps run in other directories
    fresh_ranks: bool = False

    def command(self, extra: list[str] | None = None) -> list[str]:
        """The interpreter arguments of `harness bisect-step` judging these cases with this metric."""
        cmd = ["-m", "harness.cli", "bisect-step", *self.case_argv, "--metric", self.metric, "--max", self.max]
        if self.baselines_dir is not None:
            cmd += ["--baselines-dir", self.baselines_dir]
        cmd += [flag for flag, on in (("--error-is-bad", self.error_is_bad), ("--fresh-ranks", self.fresh_ranks)) if on]
        return cmd + (extra or [])


# -- judging a run ------------------------------------------------------------------------------------
def judge_run(run, metric: str, threshold: Threshold, error_is_bad: bool = False) -> StepResult:
    """Bad when any case's metric exceeds its threshold (metric 'fail': when any case does not pass); the
    step names what the harness adjusted in the engine it judged."""

    step = _judge_outcomes(run, metric, threshold, error_is_bad)
    step.adjustments = list(run_adjustments(run))
    return step


def _judge_outcomes(run, metric: str, threshold: Threshold, error_is_bad: bool) -> StepResult:

    vers = {k: v for k, v in versions().items() if k not in ("harness", "harness_commit")}
    outcomes = run.outcomes()
    if metric.startswith(CHECK_METRIC):
        return _judge_check(run, metric.removeprefix(CHECK_METRIC), error_is_bad, vers)
    broken = [o for o in outcomes if o.outcome in (Outcome.ERROR, Outcome.SKIPPED, Outcome.INCONCLUSIVE)]
    if broken:
        o = broken[0]
        verdict = BAD if (error_is_bad and o.outcome == Outcome.ERROR) else SKIP
        return StepResult(verdict, case=o.result.case.id, why=f"{o.outcome}: {o.reason}", versions=vers)
    if metric == PASS_FAIL:
        failed = [o for o in outcomes if o.outcome != Outcome.PASS]
        o = (failed or outcomes)[0]
        return StepResult(BAD if failed else GOOD, case=o.result.case.id, why=o.reason or "every check passed",
                          versions=vers)
    suite = run.suite
    if not isinstance(suite, Baselined):
        raise BadInput(f"suite {suite.name!r} has no numeric metrics; use --metric fail")
    books: dict[str, baselines.Book] = {}
    worst: StepResult | None = None
    for o in outcomes:
        samples = suite.samples(o.result)
        if metric not in samples:
            continue
        platform = _platform(o.result)
        if platform not in books:
            books[platform] = baselines.Book(baselines_dir_of(run.params), platform, suite.name)
        key = suite.key(o.result.case)
        case_entry = books[platform].source(key).data.get("entries", {}).get(key, {})
        entry = case_entry.get(metric)
        if entry and "samples" in entry and isinstance(suite, TimedBaselines):
            step = _judge_timed(run, o.result, metric, case_entry, threshold, vers)
        else:
            limit = threshold.resolve(entry["value"] if entry else None)
            value = samples[metric]
            step = StepResult(BAD if value > limit else GOOD, value, limit, o.result.case.id,
                              f"{metric} {value:.2f} {'>' if value > limit else '<='} {limit:.2f}", vers)
        if worst is None or _rank(step) > _rank(worst):
            worst = step
    if worst is None:
        known = sorted({m for o in outcomes for m in suite.samples(o.result)})
        raise BadInput(f"no case of the selection has metric {metric!r}; metrics: {', '.join(known) or 'none'}")
    return worst


def _judge_check(run, name: str, error_is_bad: bool, vers: dict) -> StepResult:
    """Bad where a result of the check `name` does not pass (failed, or inconclusive); cannot tell where it did not
    run (a case that errored: bad with --error-is-bad)."""
    judged = [c for c in run.checks if c.check == name]
    broken = [o for o in run.outcomes() if o.outcome in (Outcome.ERROR, Outcome.SKIPPED)]
    if broken:  # a case that did not run cannot vouch for the check, as with the other metrics
        o = broken[0]
        return StepResult(BAD if (error_is_bad and o.outcome == Outcome.ERROR) else SKIP, case=o.result.case.id,
                          why=f"{o.outcome}: {o.reason}", versions=vers)
    if not judged:
        return StepResult(SKIP, why=f"no {name} ran", versions=vers)
    bad = [c for c in judged if not c.passed]
    c = (bad or judged)[0]
    verdict = "inconclusive" if c.inconclusive else "fail" if c.failed else "pass"
    return StepResult(BAD if bad else GOOD, case=c.case_id, why=f"{name} {verdict}: {c.message}", versions=vers)


def refuse_unknown_metric(planned, metric: str) -> None:
    """BadInput before anything runs for a metric the suite's baseline file names for none of its cases (as
    rankN.name, any rank): else the whole suite would run before the metric was refused."""

    suite = planned.suite
    if metric == PASS_FAIL:
        return
    if metric.startswith(CHECK_METRIC):
        name = metric.removeprefix(CHECK_METRIC)
        if not name.startswith(f"{suite.name}."):
            raise BadInput(f"--metric {metric!r}: name a check of the {suite.name} suite, e.g. "
                           f"check:{suite.name}.<check> (its checks are named in docs/suites.md)")
        return
    if not isinstance(suite, Baselined):
        raise BadInput(f"suite {suite.name!r} has no numeric metrics; use --metric fail")
    platform_key = harness_platform.detect_platform(planned.backend).key
    book = baselines.Book(baselines_dir_of(planned.params), platform_key, suite.name)
    known = sorted({_any_rank(m) for data in (book.data, *(d for _, d in book.others))
                    for entry in data.get("entries", {}).values() for m in entry}, key=lambda m: (len(m), m))
    if known and _any_rank(metric) not in known:
        raise BadInput(f"--metric {metric!r}: the {suite.name} suite has no such metric; its baselined metrics "
                       f"(N: a rank): {', '.join(known[:6])}{' ...' if len(known) > 6 else ''}, or --metric fail")


def _any_rank(metric: str) -> str:
    """A metric named for any rank: rank3.save_heap_peak_mib -> rankN.save_heap_peak_mib."""
    return re.sub(r"\brank\d+\b", "rankN", metric)


def _rank(step: StepResult) -> tuple[int, float]:
    """Which case's step speaks for the run: a bad one over one that cannot be judged over a good one, then the
    one whose figure lies furthest beyond its threshold."""
    return {BAD: 2, SKIP: 1, GOOD: 0}[step.verdict], _margin(step)


def _margin(step: StepResult) -> float:
    """How far a step's figure lies beyond its threshold (-inf: it has none)."""
    if step.value is None or step.threshold is None:
        return -math.inf
    return step.value - step.threshold


def _judge_timed(run, result, metric: str, case_entry: dict, threshold: Threshold, vers: dict) -> StepResult:
    """A timed figure (step-perf) is judged as the suite judges it: bad when significantly slower than the
    baseline's samples beyond the minimum effect (`--max baseline+P%` sets the effect, else the suite's);
    skipped where other processes on the machine explain the slowdown."""

    cmp = run.suite.timed_comparison(result, metric, case_entry, threshold.relative_effect, params=run.params)
    busy = (run.suite.load_explains(result, metric, case_entry, cmp)
            if cmp.slower and isinstance(run.suite, SeesOtherLoad) else "")
    if busy:
        return StepResult(SKIP, cmp.median_b, cmp.median_a * (1 + cmp.min_effect), result.case.id,
                          f"cannot tell: {busy}", vers)
    return StepResult(BAD if cmp.slower else GOOD, cmp.median_b, cmp.median_a * (1 + cmp.min_effect), result.case.id,
                      f"{metric} {cmp.describe()}: "
                      f"{'significantly slower' if cmp.slower else 'not significantly slower'}",
                      vers)


def _platform(result) -> str:

    return harness_platform.detect_platform(result.case.backend).key


def run_step(selection: CaseSelection, spec: StepSpec) -> StepResult:
    """Run the selected cases in this environment and judge them (the body of `harness bisect-step`).
    selection: the cases, as the step's flags select them."""

    threshold = Threshold(spec.max)
    planned = driver.plan(selection, baselines_dir=spec.baselines_dir, full_timing=True)
    refuse_unknown_metric(planned, spec.metric)
    run = driver.execute(planned, fresh_ranks=spec.fresh_ranks).stop_if_interrupted()
    return judge_run(run, spec.metric, threshold, spec.error_is_bad)


# -- the JSON protocol --------------------------------------------------------------------------------
def write_step_json(path: str | Path, r: StepResult, **extra) -> None:
    """The verdict of a step for the process that runs it (extra: e.g. the commit judged, wall seconds)."""
    atomic_write(path, json.dumps({**asdict(r), **extra}))


def read_step_json(path: str | Path) -> tuple[StepResult, dict]:
    """(the step's verdict, the rest of what it wrote)."""
    d = json.loads(Path(path).read_text())
    names = ("verdict", "value", "threshold", "case", "why", "versions", "adjustments")
    return StepResult(**{k: d[k] for k in names if k in d}), {k: v for k, v in d.items() if k not in names}


def step_env(pythonpath: list[str]) -> dict[str, str]:
    """The environment of a step process: the candidate's directories first on the path, then this harness."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(Path(__file__).resolve().parents[2]),
                                         *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def run_in(python: str, spec: StepSpec, pythonpath: list[str], workdir: Path) -> StepResult:
    """One candidate: `harness bisect-step` in a fresh process of that environment."""
    out = workdir / f"step-{time.monotonic_ns()}.json"
    proc = subprocess.run([python, *spec.command(["--json", str(out)])], env=step_env(pythonpath), capture_output=True,
                          text=True, cwd=pythonpath[0] if pythonpath else None)
    if out.exists():
        return read_step_json(out)[0]
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if proc.returncode == 2:  # bad input is the same for every candidate: stop
        raise BadInput(f"bisect-step refused its input: {tail}")
    return StepResult(SKIP, why=f"bisect-step exited {proc.returncode}: {tail}")
