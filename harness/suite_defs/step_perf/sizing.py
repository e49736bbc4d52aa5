"""How many timed steps a platform's step-perf cases need, read from a recording's own samples: what the
recorded number detects against the new baseline, the fewest that still detect the minimum effect, and how far
the repeats' medians drift apart (a change within that drift cannot be told from the machine's own)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.backends import Backend, tier_of
from harness.checks.timing import MIN_EFFECT, fewest_steps_detecting, minimum_detectable_effect

UP_TO = 200  # timed steps searched for the fewest that detect the minimum effect


@dataclass(frozen=True)
class Sizing:
    """One baseline entry's step times: what its case's timed steps detect, and what would."""

    key: str
    timed_steps: int
    detects: float  # the smallest slowdown a run of timed_steps detects against this baseline
    fewest: int | None  # the fewest timed steps that detect min_effect (None: more than UP_TO)
    drift: float  # between the repeats' medians, as a fraction of the smallest
    min_effect: float

    def describe(self) -> str:
        fewest = f"more than {UP_TO}" if self.fewest is None else str(self.fewest)
        line = (f"{self.key}: {self.timed_steps} timed steps detect >= {self.detects:.1%} slower against this "
                f"baseline (minimum effect {self.min_effect:.0%}); the fewest that detect {self.min_effect:.0%}: "
                f"{fewest}; the repeats' medians differ by {self.drift:.1%}")
        if self.drift > self.min_effect:
            line += (", more than the minimum effect: a step time within it reads as this machine's drift "
                     "(cannot tell)")
        return line


def sizing(key: str, entry: dict, timed_steps: int, min_effect: float) -> Sizing | None:
    """The Sizing of a recorded entry's step times; None where it holds no samples."""
    step = entry.get("step_time_ms", {})
    samples, medians = step.get("samples") or [], step.get("values") or []
    if len(samples) < 3 or not medians or min(medians) <= 0:
        return None
    return Sizing(key, timed_steps, minimum_detectable_effect(samples, timed_steps),
                  fewest_steps_detecting(samples, min_effect, len(medians), up_to=UP_TO),
                  max(medians) / min(medians) - 1, min_effect)


def recording_notes(entries: dict[str, dict], timed_steps: int, min_effect: float | None,
                    backend: Backend) -> list[str]:
    """A line per recorded entry: its Sizing at the run's timed steps and the tier's minimum effect (or the
    one given)."""
    effect = min_effect if min_effect is not None else MIN_EFFECT[tier_of(backend)]
    found = [sizing(k, e, timed_steps, effect) for k, e in sorted(entries.items())]
    return [s.describe() for s in found if s is not None]
