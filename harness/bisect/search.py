"""The search over an ordered candidate list (oldest first): the reproduction gate, then a binary search
that steps around candidates it cannot judge; the threshold of a metric; the table of what was tried."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.errors import BadInput
from harness.outcomes import CHECK_METRIC, PASS_FAIL
from harness.tables import table

GOOD, BAD, SKIP = 0, 1, 125  # git bisect run's exit codes
VERDICTS = {GOOD: "good", BAD: "BAD", SKIP: "skip"}
_THRESHOLD_RE = re.compile(r"^baseline\s*\+\s*([0-9.]+)\s*(%?)$")


@dataclass
class Threshold:
    """`--max`: an absolute value, or `baseline+P%` / `baseline+X` from the stored baseline of each case
    (PASS_FAIL: the metric is pass / fail, no threshold)."""

    text: str

    def __post_init__(self) -> None:
        if self.text != PASS_FAIL and not _THRESHOLD_RE.match(self.text.replace(" ", "")):
            try:
                float(self.text)
            except ValueError:
                raise BadInput(f"--max {self.text!r}: give a number, baseline+P% or baseline+X "
                               f"(e.g. --max 40 or --max baseline+10%)") from None

    def resolve(self, baseline: float | None) -> float:
        m = _THRESHOLD_RE.match(self.text.replace(" ", ""))
        if not m:
            return float(self.text)
        if baseline is None:
            raise BadInput(f"--max {self.text}: no stored baseline for this case and metric; give an absolute --max")
        add = float(m.group(1))
        return baseline * (1 + add / 100) if m.group(2) else baseline + add

    @property
    def relative_effect(self) -> float | None:
        """P / 100 for `baseline+P%`, else None."""
        m = _THRESHOLD_RE.match(self.text.replace(" ", ""))
        return float(m.group(1)) / 100 if m and m.group(2) else None


@dataclass
class StepResult:
    verdict: int  # GOOD | BAD | SKIP
    value: float | None = None  # the metric of the worst case (closest to / furthest over its threshold)
    threshold: float | None = None
    case: str = ""
    why: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    adjustments: list[str] = field(default_factory=list)  # what the harness changed in the engine it judged


@dataclass
class Tried:
    index: int
    label: str
    result: StepResult
    role: str  # "gate: ...", "step N" or "git bisect"
    wall_s: float


@dataclass(frozen=True)
class Terms:
    """Names of the two states, as git bisect's old / new: a regression search goes good -> bad,
    a fix search (--find-fix) bad -> good. `new` is what is searched for."""

    old: str = "good"
    new: str = "bad"

    def name(self, verdict: int) -> str:
        return {GOOD: self.old, BAD: self.new.upper(), SKIP: "skip"}[verdict]


REGRESSION, FIX = Terms("good", "bad"), Terms("bad", "fixed")


class GateRefused(BadInput):
    def __init__(self, message: str, tried: list[Tried]):
        super().__init__(message)
        self.tried = tried


def flip(verdict: int) -> int:
    """GOOD and BAD swapped (a fix search looks for the first good one); a skip stays a skip."""
    return {GOOD: BAD, BAD: GOOD}.get(verdict, verdict)


def flipped(judge: Callable[[int], StepResult]) -> Callable[[int], StepResult]:
    """judge with GOOD and BAD swapped."""
    def judge_flipped(i: int) -> StepResult:
        r = judge(i)
        r.verdict = flip(r.verdict)
        return r
    return judge_flipped


def gate(labels: list[str], judge: Callable[[int], StepResult], say: Callable[[str], None],
         terms: Terms = REGRESSION) -> list[Tried]:
    """The reproduction gate: the last candidate must be new, the first old (GateRefused otherwise)."""
    tried: list[Tried] = []
    last = len(labels) - 1
    r = probe(labels, last, f"gate: {terms.new}", judge, say, terms, tried)
    if r.verdict != BAD:
        raise GateRefused(f"the {terms.new} end {labels[last]} does not reproduce: {terms.name(r.verdict)} ({r.why})",
                          tried)
    r = probe(labels, 0, f"gate: {terms.old}", judge, say, terms, tried)
    if r.verdict != GOOD:
        raise GateRefused(f"the {terms.old} end {labels[0]} is not {terms.old}: {terms.name(r.verdict)} ({r.why})",
                          tried)
    return tried


def probe(labels: list[str], i: int, role: str, judge: Callable[[int], StepResult], say: Callable[[str], None],
          terms: Terms, tried: list[Tried]) -> StepResult:
    """Judge candidate i, say so, and record it in `tried`."""
    say(f"[{role}] {labels[i]} ...")
    t0 = time.monotonic()
    r = judge(i)
    tried.append(Tried(i, labels[i], r, role, time.monotonic() - t0))
    say(f"[{role}] {labels[i]}: {terms.name(r.verdict)} ({r.why}) in {time.monotonic() - t0:.0f}s")
    return r


def search(labels: list[str], judge: Callable[[int], StepResult], say: Callable[[str], None],
           terms: Terms = REGRESSION) -> tuple[int, list[Tried]]:
    """Gate (the last must be new, the first old), then binary search; (index of the first new, tried).

    judge returns BAD for the new state, GOOD for the old one. Raises GateRefused when the gate fails.
    Candidates that cannot be judged (SKIP) are stepped around; if every candidate between the last old
    and the first new one is skipped, the first new one is returned and the table shows the skipped ones."""
    tried = gate(labels, judge, say, terms)
    lo, hi, skipped, n = 0, len(labels) - 1, set(), 0
    while True:
        open_ = [i for i in range(lo + 1, hi) if i not in skipped]
        if not open_:
            return hi, tried
        mid = (lo + hi) // 2
        mid = min(open_, key=lambda i: (abs(i - mid), i))
        n += 1
        r = probe(labels, mid, f"step {n}", judge, say, terms, tried)
        if r.verdict == SKIP:
            skipped.add(mid)
        elif r.verdict == BAD:
            hi = mid
        else:
            lo = mid


def format_table(tried: list[Tried], metric: str, first_bad: int | None, terms: Terms = REGRESSION,
                 package: str | None = None) -> str:
    """package: the distribution bisected over (its version column; the candidate label where the step did
    not report it), else megatron-core's."""

    numeric = metric != PASS_FAIL and not metric.startswith(CHECK_METRIC)
    rows = []
    for t in sorted(tried, key=lambda t: t.index):
        r = t.result
        figures = ["-" if r.value is None else f"{r.value:.2f}", "-" if r.threshold is None else f"{r.threshold:.2f}"]
        version = r.versions.get(package or "megatron-core") or (t.label if package else "?")
        rows.append([t.label, t.role, version, *(figures if numeric else []),
                     terms.name(r.verdict) + (f" <- first {terms.new}" if t.index == first_bad else ""),
                     f"{t.wall_s:.0f}s", r.why if r.verdict == SKIP or r.value is None else ""])
    header = ["candidate", "tried as", package or "megatron-core", *([metric, "threshold"] if numeric else []),
              "verdict", "wall", "note"]
    return table(header, rows)
