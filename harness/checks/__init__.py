"""Checks run in the parent on collected results; each returns CheckResults a person can act on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Captures:
    """The memray captures a check looked at: the report stage deletes them where the check passed and keeps them
    where it failed, and renders the flamegraph of the one it names (`flamegraph_of`; of what stayed allocated at
    the capture's end where `leaks`). Judging only names them, so it has no side effects."""

    files: list[str] = field(default_factory=list)
    flamegraph_of: str = ""
    leaks: bool = False


@dataclass
class CheckData:
    """A check's machine-readable figures for reports: each kind a dataclass deriving from this, written to
    results.json as its fields (`dataclasses.asdict`)."""


@dataclass
class StepSeries(CheckData):
    """A figure of every step against its reference's (the case it was judged against), and the tolerance: what a
    report draws of a check that compares steps."""

    figure: str
    got: list[float]
    reference: list[float]
    reference_case: str
    rtol: float


@dataclass
class ParamErrors(CheckData):
    """Each parameter's (or gradient's) relative error against the reference case's, and the tolerance: what a report
    draws of a check that compares tensors by name."""

    reference_case: str
    rtol: float
    errors: dict[str, float]


@dataclass
class Agreement(CheckData):
    """Log-probs against another model's: the worst relative difference, the tolerance, the tokens beyond it."""

    worst_rel: float
    rtol: float
    tokens_off: int
    tokens: int


@dataclass
class HostPeaks(CheckData):
    """A phase's host peak per rank (bytes) against the bound it is judged by, and the size a bound must stay below
    for the peak to tell (peft-ckpt's adapter export: the whole model's, which a merging export would hold)."""

    peaks: dict[int, int]
    bound_bytes: int
    tells_below_bytes: int


@dataclass
class TrajectoryFigures(CheckData):
    """Each step's figures against stored values, with each one's allowed deviation (golden's trajectory against its
    recorded values): what a report draws of a trajectory judged step by step."""

    key: str  # the stored values' key
    rows: list[tuple[str, float, float, float]]  # ("step03.loss", measured, stored, allowed absolute deviation)


@dataclass
class CheckResult:
    check: str  # e.g. "equivalence.loss"
    case_id: str
    passed: bool
    message: str  # one line; names the output, the value and the tolerance
    details: list[str] = field(default_factory=list)  # extra lines (tables) printed under a failure
    value: float | None = None  # the figure the check judged (worst error, peak, ...) for tables
    show: bool = False  # print details even when the check passes (e.g. plan-vs-observed tables)
    improvement: bool = False  # failed only because a figure is better than its baseline (refresh it)
    data: CheckData | None = None  # machine-readable figures for reports
    captures: Captures = field(default_factory=Captures)
    # a check of the case's work at another layout (a checkpoint loaded there): that layout's id
    target: str = ""
    # The check ran but cannot tell right from wrong here (this model, world size or layout): neither a
    # pass nor a failure. Built with `cannot_tell`, which keeps `passed` False, so code that reads only
    # `passed` errs towards a false alarm, never towards a false pass.
    inconclusive: bool = False

    @property
    def failed(self) -> bool:
        return not self.passed and not self.inconclusive

    @property
    def status(self) -> str:
        return "inconclusive" if self.inconclusive else ("pass" if self.passed else "fail")


def cannot_tell(check: str, case_id: str, message: str, details: list[str] | None = None,
                value: float | None = None, data: CheckData | None = None) -> CheckResult:
    """A check that ran but cannot discriminate here; the message says why and what would (e.g. the
    world size or model that can)."""
    return CheckResult(check, case_id, False, f"cannot tell: {message}", list(details or []), value, show=True,
                       data=data, inconclusive=True)


def case_failed(check: str, result) -> CheckResult:
    """The `<suite>.run` failure of a case that did not run: its error's first line, the rest as details."""
    lines = (result.error or "failed").splitlines()
    return CheckResult(check, result.case.id, False, lines[0], lines[1:])
