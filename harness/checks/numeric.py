"""NaN- and Inf-safe comparisons: every check judges errors through these.

`err > tol` is False for NaN, so a check written that way passes a NaN error. Here a non-finite
error, value or tensor never counts as within tolerance, and the message says how many elements
were not finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # judging imports no torch: a payload holding tensors brings it
    import torch


def within(err: float, tol: float) -> bool:
    """err <= tol, and err is a finite number (NaN / Inf are never within any tolerance)."""
    return math.isfinite(err) and err <= tol


def beyond(err: float, tol: float) -> bool:
    """The negation of `within`: what a check fails on."""
    return not within(err, tol)


def severity(err: float) -> float:
    """Sort key for errors that ranks NaN above every number (NaN is the worst error there is);
    max(errs, key=severity) names the NaN one, where key=errs.get would not."""
    return math.inf if math.isnan(err) else err


def worst(values: Iterable[float], default: float = 0.0) -> float:
    """The largest value, NaN counting as the largest (built-in max() keeps a number over a later NaN)."""
    return max(values, key=severity, default=default)


def nonfinite_count(t: torch.Tensor) -> int:
    """Elements of t that are NaN or +-Inf (0 for integer tensors)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0
    return int((~t.isfinite()).sum())


def nonfinite_summary(tensors: Mapping[str, torch.Tensor]) -> tuple[int, str]:
    """(number of tensors with non-finite elements, a one-line description naming the first few),
    (0, '') when every element of every tensor is finite."""
    bad = {}
    for name, t in tensors.items():
        n = nonfinite_count(t)
        if n:
            nan = int(t.isnan().sum())
            bad[name] = (n, nan, t.numel())
    if not bad:
        return 0, ""
    parts = [f"{name}: {n}/{total} elements non-finite ({nan} NaN, {n - nan} Inf)"
             for name, (n, nan, total) in sorted(bad.items())[:3]]
    more = f" (+{len(bad) - 3} more tensors)" if len(bad) > 3 else ""
    return len(bad), "; ".join(parts) + more


def fmt_err(err: float) -> str:
    """An error for messages; NaN / Inf spelled out."""
    return f"{err:.2e}" if math.isfinite(err) else str(err)
