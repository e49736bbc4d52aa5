"""Suite definitions shared by the CLI and the pytest suites in suites/: cases, rank work, checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harness.backends import Backend
from harness.suite_registry import SUITES, load_suite, spec_of

if TYPE_CHECKING:
    from harness.checks import CheckResult
    from harness.checks.timing import Comparison
    from harness.launch.context import RankContext
    from harness.launch.results import CaseResult
    from harness.spec import Case, CaseOptions, Layout, ModelSpec

@dataclass(frozen=True)
class RegressionRun:
    """A run the regression suites (suites/test_*.py) make: a suite on a model (None: the suite's default for
    the backend); cpu_only: its figures are recorded for CPU ranks only, so elsewhere it is skipped."""

    suite: str
    model: str | None = None
    cpu_only: bool = False


# Every run of the regression suites, as each suite's spec lists them (SuiteSpec.runs)
REGRESSION_RUNS = tuple(RegressionRun(name, run.model, run.cpu_only) for name, spec in SUITES.items()
                        for run in spec.runs)


def moe_suites() -> list[str]:
    """The registered suites that judge a mixture-of-experts model (no SuiteSpec.moe_refusal)."""
    return [name for name, spec in SUITES.items() if spec.moe_refusal is None]


def default_model(suite: Suite, backend: Backend) -> str:
    """The model a suite runs when none is given: its own (sized for CPU ranks), or on NCCL ranks its GPU one."""
    gpu = spec_of(suite.name).gpu_model
    return gpu if gpu and backend == Backend.NCCL else suite.default_model


class Suite(Protocol):
    name: str
    default_model: str  # the model run when none is given (sized for CPU ranks)
    imports: tuple[str, ...]  # modules a rank imports in its timed "imports" phase

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str, backend: Backend, options: CaseOptions, params: Any = None) -> list[Case]: ...

    def rank_work(self, case: Case, ctx: RankContext) -> Any:
        """What this rank measured, picklable: a dict, or the suite's own frozen dataclass (step-perf's
        StepPerfRankData)."""
        ...

    def check(self, results: list[CaseResult], params: Any = None) -> list[CheckResult]: ...

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        """Suite-specific figures of a case for results.json and the printed table."""
        ...


# Optional capabilities of a suite, each checked with isinstance where it is used (grep the name to find
# every suite that offers one).
@runtime_checkable
class Baselined(Protocol):
    """A suite whose figures are recorded as baselines (ckpt-memory, step-perf, train-memory, golden)."""

    name: str

    def key(self, case: Case) -> str: ...

    def samples(self, result: CaseResult) -> dict[str, float]: ...

    def record_command(self, case: Case) -> str: ...


@runtime_checkable
class RecordingPolicy(Protocol):
    """A baselined suite's own recording policy: which metrics are too noisy to record, the tolerance of one,
    and the significant digits stored (None: full precision)."""

    digits: int | None

    def tolerance(self, metric: str, values: list[float]) -> float: ...

    def noisy_metrics(self, samples: dict[str, dict[str, list[float]]]) -> list[str]: ...


@runtime_checkable
class RawSamples(Protocol):
    """A baselined suite that stores per-sample figures (step times) beside the per-run ones."""

    def raw_samples(self, result: CaseResult) -> dict[str, list[float]]: ...


@runtime_checkable
class TimedBaselines(Protocol):
    """A suite whose timed figures are judged against baseline samples by statistics (`harness bisect` too)."""

    def timed_comparison(self, res: CaseResult, metric: str, entry: dict, effect: float | None = None,
                         params: Any = None) -> Comparison: ...


@runtime_checkable
class SizesRecording(Protocol):
    """A baselined suite that reads from a new recording's own samples whether its cases time enough (step-perf:
    what its timed steps detect, the fewest that detect the minimum effect); lines `baselines record` prints."""

    def recording_notes(self, entries: dict[str, dict], params: Any, backend: Backend) -> list[str]: ...


@runtime_checkable
class SeesOtherLoad(Protocol):
    """A timed suite that can tell when other processes on the machine explain a slower figure (step-perf:
    the CPU time its ranks did not use while timed); `harness bisect` skips such a step."""

    def load_explains(self, res: CaseResult, metric: str, entry: dict, cmp: Comparison) -> str: ...


@runtime_checkable
class Parameterised(Protocol):
    """A suite with parameters: `Params`, a frozen dataclass of them whose defaults are its default matrix
    (every case carries them as `Case.params`)."""

    Params: type


@runtime_checkable
class FreshRanks(Protocol):
    """A suite timed or measured on ranks that ran nothing but it (step-perf, train-memory, ckpt-memory): the
    driver retires warm ranks other suites used before it runs."""

    name: str
    fresh_pool: bool


@runtime_checkable
class RunsAlone(Protocol):
    """A timed suite whose figures other processes on the machine move (step-perf): where the suites share a machine
    (pytest-xdist workers), its run waits for the others' and none starts beside it (harness.launch.machine_lock)."""

    runs_alone: bool


def runs_alone(suite: object) -> bool:
    return isinstance(suite, RunsAlone) and suite.runs_alone


@runtime_checkable
class FreshRanksPerCase(Protocol):
    """A suite whose figures a rank's own earlier cases move (ckpt-memory): each case runs on ranks forked for it
    from the fork server, as with --fresh-ranks, so a figure does not depend on what ran before it."""

    fresh_ranks_per_case: bool


@runtime_checkable
class WithBaselinesDir(Protocol):
    """Suite parameters that name the baselines directory (None: the repository's baselines/)."""

    baselines_dir: str | None


def baselines_dir_of(params: object) -> str | None:
    """The baselines directory a run's parameters name (None: the repository's, also for suites without one)."""
    return params.baselines_dir if isinstance(params, WithBaselinesDir) else None


@runtime_checkable
class ReportsData(Protocol):
    """A suite that hands the report per-case data for its plots."""

    def report_data(self, result: CaseResult) -> dict[str, Any]: ...


def get_suite(name: str | Suite) -> Suite:
    """A suite by contract name, or by import path `package.module:Class` (tests plant fake suites).

    A suite object is returned as it is (a configured suite, e.g. a test's subclass).
    """
    return name if not isinstance(name, str) else load_suite(name)
