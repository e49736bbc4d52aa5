"""Judging step times on noisy machines: ratio of medians with a block bootstrap confidence interval and a
Mann-Whitney U test over blocks of consecutive steps, failing only when a slowdown is both significant and
larger than a minimum effect.

Why both: on a shared 2-core box a 3% difference can be "significant" with enough samples and
still be noise of the box (other load, thermal state), while a large ratio from a handful of
outliers need not be significant. asv flags a change only when a Mann-Whitney U test agrees with a
ratio threshold; this does the same and also reports the confidence interval of the ratio.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from harness.backends import Tier
from harness.outcomes import Outcome

ALPHA = 0.01  # one-sided significance level of the Mann-Whitney U test
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
# Smallest slowdown that fails, as a fraction of the baseline median. Against stored samples the unit of
# noise is the run, not the step: steps of one run are correlated, so the U test is significant for 1-3%
# shifts, and what separates a regression from noise is the run-to-run drift. Measured on 4 CPU ranks of a
# 2-core machine, 10 consecutive reruns of the step-perf default matrix against its baseline: per-case
# median ratios 0.92-1.14 (sd of log ratio 0.014-0.054), and at world size 1 (tp1-pp1-cp1-dp1 against its own
# baseline minutes later) up to x1.26: hence 50% on CPU, from the CLI and from pytest alike (--min-effect sets
# another). Interleaved A/B runs (harness compare) cancel the drift and judge small effects: MIN_EFFECT_INTERLEAVED.
MIN_EFFECT = {Tier.CPU: 0.5, Tier.GPU: 0.05}
# the figures judged by these statistics against stored samples (step-perf), where `harness bisect --max`
# takes a relative effect (baseline+P%), not an absolute threshold
TIMED_METRICS = ("step_time_ms", "exposed_comm_ms")
MIN_EFFECT_INTERLEAVED = {Tier.CPU: 0.05, Tier.GPU: 0.03}


@dataclass(frozen=True)
class Comparison:
    """B (measured) against A (baseline) for one figure."""

    ratio: float  # median(B) / median(A)
    ci_low: float
    ci_high: float
    p_slower: float  # one-sided Mann-Whitney U: B stochastically larger than A
    p_faster: float
    n_a: int
    n_b: int
    median_a: float
    median_b: float
    min_effect: float
    alpha: float = ALPHA
    test: str = "Mann-Whitney"  # the significance test behind p_slower / p_faster
    unit: str = ""  # what n counts when not steps (e.g. "rounds")

    @property
    def slower(self) -> bool:
        """A regression: significantly slower and beyond the minimum effect."""
        return self.p_slower < self.alpha and self.ratio > 1 + self.min_effect

    @property
    def faster(self) -> bool:
        """An improvement: significantly faster and beyond the minimum effect."""
        return self.p_faster < self.alpha and self.ratio < 1 / (1 + self.min_effect)

    @property
    def undecided(self) -> bool:
        """Neither slower nor ruled out: the interval still reaches a slowdown beyond the minimum effect."""
        return not self.slower and self.ci_high > 1 + self.min_effect

    @property
    def verdict(self) -> Outcome:
        return Outcome.REGRESSION if self.slower else Outcome.IMPROVEMENT if self.faster else Outcome.PASS

    def describe(self, unit: str = "ms") -> str:
        """e.g. '123.4 ms vs 110.2 ms: x1.12 [1.08, 1.16] 95% CI, Mann-Whitney p=0.0003 (n=20/60), min effect 10%'."""
        p = self.p_slower if self.ratio >= 1 else self.p_faster
        return (f"{self.median_b:.1f} {unit} vs {self.median_a:.1f} {unit}: x{self.ratio:.3f} "
                f"[{self.ci_low:.3f}, {self.ci_high:.3f}] {CONFIDENCE:.0%} CI, {self.test} p={p:.2g} "
                f"(n={self.n_b}/{self.n_a}{' ' + self.unit if self.unit else ''}), min effect {self.min_effect:.0%}")


def block_length(n: int) -> int:
    """Consecutive steps kept together: n^(1/3) (the rule of thumb for the block bootstrap's variance and
    intervals), so 3 for 20 timed steps, 1 below 4 steps."""
    return max(1, round(n ** (1 / 3)))


def block_means(x, block: int):
    """Means of consecutive, non-overlapping blocks of `block` steps (a short tail joins the last block)."""
    import numpy as np

    m = max(1, len(x) // block)
    return np.array([np.mean(x[i * block:(i + 1) * block if i < m - 1 else len(x)]) for i in range(m)])


def _block_bootstrap_medians(rng, x, block: int, resamples: int):
    """Medians of moving-block bootstrap resamples of x: runs of `block` consecutive steps drawn with
    replacement, so a resample keeps the correlation of neighbouring steps."""
    import numpy as np

    n = len(x)
    k = math.ceil(n / block)
    starts = rng.integers(0, n - block + 1, (resamples, k))
    idx = (starts[:, :, None] + np.arange(block)).reshape(resamples, -1)[:, :n]
    return np.median(x[idx], axis=1)


def compare_samples(baseline: list[float], measured: list[float], min_effect: float, *, alpha: float = ALPHA,
                    seed: int = 0) -> Comparison:
    """Ratio of medians (measured / baseline), its moving-block bootstrap CI, and one-sided Mann-Whitney U
    p-values over block means. Both sides are steps in the order they ran: consecutive steps share the
    machine's state (lag-1 autocorrelation 0-0.8 in the committed CPU baselines), so steps are kept together
    in blocks of block_length(n) - a test treating each step as independent called identical AR(1)
    series (phi 0.5) significantly different in 8% of simulated pairs at alpha 1%, over blocks in 2%."""
    import numpy as np
    from scipy import stats

    a, b = np.asarray(baseline, dtype=float), np.asarray(measured, dtype=float)
    if len(a) < 3 or len(b) < 3:
        raise ValueError(f"need at least 3 samples on each side, got {len(a)} baseline and {len(b)} measured")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("non-finite step times cannot be judged")
    block = block_length(min(len(a), len(b)))
    med_a, med_b = float(np.median(a)), float(np.median(b))
    rng = np.random.default_rng(seed)
    ra = _block_bootstrap_medians(rng, a, block, BOOTSTRAP_RESAMPLES)
    rb = _block_bootstrap_medians(rng, b, block, BOOTSTRAP_RESAMPLES)
    ratios = _ratio(rb, ra)
    tail = (1 - CONFIDENCE) / 2
    with np.errstate(invalid="ignore"):  # infinite ratios (A's figure 0): inf - inf between neighbours
        low, high = (float(x) for x in np.quantile(ratios, [tail, 1 - tail]))
    if np.ptp(np.concatenate([a, b])) == 0:  # every sample the same (e.g. no exposed communication at all)
        p_slower = p_faster = 1.0
    else:
        ua, ub = block_means(a, block), block_means(b, block)
        p_slower = float(stats.mannwhitneyu(ub, ua, alternative="greater").pvalue)
        p_faster = float(stats.mannwhitneyu(ub, ua, alternative="less").pvalue)
    test = "Mann-Whitney" if block == 1 else f"Mann-Whitney over {block}-step blocks"
    return Comparison(float(_ratio(np.float64(med_b), np.float64(med_a))), low, high, p_slower, p_faster, len(a),
                      len(b), med_a, med_b, min_effect, alpha, test)


def compare_rounds(a_rounds: list[list[float]], b_rounds: list[list[float]], min_effect: float, *,
                   alpha: float = ALPHA) -> Comparison:
    """B against A from rounds run interleaved (round i of A and of B back to back, in a random order): the
    rounds are the units, not the steps. Steps of one round share its state of the machine (correlated), so
    a test over pooled steps calls a round-to-round drift significant; here each round gives one log ratio
    of medians, log(B_i / A_i), and the ratio is exp(their mean) with a t interval and a one-sided paired
    t-test over the rounds. A figure that is 0 in some round (no exposed communication) falls back to the
    pooled steps."""
    import numpy as np
    from scipy import stats

    if len(a_rounds) != len(b_rounds) or len(a_rounds) < 2:
        raise ValueError(f"need at least 2 paired rounds, got {len(a_rounds)} and {len(b_rounds)}")
    med_a = np.array([np.median(r) for r in a_rounds], dtype=float)
    med_b = np.array([np.median(r) for r in b_rounds], dtype=float)
    if not (np.isfinite(med_a).all() and np.isfinite(med_b).all()):
        raise ValueError("non-finite step times cannot be judged")
    if (med_a <= 0).any() or (med_b <= 0).any():
        return compare_samples([x for r in a_rounds for x in r], [x for r in b_rounds for x in r], min_effect,
                               alpha=alpha)
    d = np.log(med_b / med_a)
    n, mean = len(d), float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n)
    half = float(stats.t.ppf(1 - (1 - CONFIDENCE) / 2, n - 1)) * se
    if se == 0:  # every round the same ratio: nothing to be unsure about
        p_slower, p_faster = (0.0 if mean > 0 else 1.0), (0.0 if mean < 0 else 1.0)
    else:
        t = mean / se
        p_slower, p_faster = float(stats.t.sf(t, n - 1)), float(stats.t.cdf(t, n - 1))
    return Comparison(math.exp(mean), math.exp(mean - half), math.exp(mean + half), p_slower, p_faster, n, n,
                      float(np.median(med_a)), float(np.median(med_b)), min_effect, alpha, "paired t", "rounds")


def _ratio(b, a):
    """b / a where a zero median of A (a figure that was 0: no exposed communication) reads x1 against a zero
    B and infinitely slower against anything more."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a > 0, b / np.where(a > 0, a, 1.0), np.where(b > 0, np.inf, 1.0))


def minimum_detectable_effect(samples: list[float], n_measured: int, *, alpha: float = ALPHA, power: float = 0.9,
                              floor: float = 0.0) -> float:
    """The smallest relative slowdown (a shift of the whole distribution) the test detects with the
    given power, from the spread of the baseline's block means (normal approximation of the Mann-Whitney U
    test over blocks, asymptotic relative efficiency 3/pi against the t-test); at least `floor` (the minimum
    effect)."""
    if len(samples) < 3 or statistics.median(samples) <= 0:  # nothing to be a fraction of
        return math.inf
    block = block_length(min(len(samples), n_measured))  # the units compare_samples tests
    units = block_means(samples, block)
    if len(units) < 2:
        return math.inf
    return max(floor, _detectable(samples, units, len(units), max(1, n_measured // block), alpha, power))


def _detectable(samples: list[float], units, n_a: int, n_b: int, alpha: float, power: float) -> float:
    """minimum_detectable_effect's shift over the median, for n_a baseline and n_b measured block means."""
    from scipy import stats

    z = stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)
    shift = z * statistics.stdev(units) * math.sqrt((1 / n_a + 1 / n_b) / (3 / math.pi))
    return shift / statistics.median(samples)


def fewest_steps_detecting(samples: list[float], effect: float, repeats: int, *, up_to: int = 200,
                           alpha: float = ALPHA, power: float = 0.9) -> int | None:
    """The fewest timed steps per case that detect `effect` with the given power, at the spread these samples
    show, when the baseline is `repeats` runs of as many steps and a check times one run; None: not within
    up_to."""
    if len(samples) < 3 or statistics.median(samples) <= 0:
        return None
    for n in range(3, up_to + 1):
        block = block_length(n)
        units = block_means(samples, block)
        if len(units) >= 2 and _detectable(samples, units, max(1, repeats * n // block), max(1, n // block),
                                           alpha, power) <= effect:
            return n
    return None


@dataclass(frozen=True)
class PairedRatio:
    """B against A over pairs run back to back: the median per-pair ratio b_i / a_i."""

    ratio: float
    ci_low: float
    ci_high: float
    p_greater: float  # one-sided Wilcoxon signed-rank: b_i > a_i
    n: int

    def describe(self) -> str:
        return (f"x{self.ratio:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}] {CONFIDENCE:.0%} CI, "
                f"Wilcoxon p={self.p_greater:.2g} (n={self.n} pairs)")


def paired_ratio(a: list[float], b: list[float], *, seed: int = 0) -> PairedRatio:
    """Median of b_i / a_i with a bootstrap CI over the pairs. Each pair ran back to back in a random order,
    so the machine's drift (the reason consecutive steps are not independent) cancels within a pair, and the
    pairs are the resampled units."""
    import numpy as np
    from scipy import stats

    if len(a) != len(b) or len(a) < 3:
        raise ValueError(f"need at least 3 pairs, got {len(a)} and {len(b)} samples")
    ratios = np.asarray(b, dtype=float) / np.asarray(a, dtype=float)
    if not np.isfinite(ratios).all():
        raise ValueError("non-finite step times cannot be judged")
    rng = np.random.default_rng(seed)
    boot = np.median(rng.choice(ratios, (BOOTSTRAP_RESAMPLES, len(ratios))), axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = (float(x) for x in np.quantile(boot, [tail, 1 - tail]))
    p = float(stats.wilcoxon(np.log(ratios), alternative="greater").pvalue) if np.any(ratios != 1) else 1.0
    return PairedRatio(float(np.median(ratios)), low, high, p, len(ratios))
