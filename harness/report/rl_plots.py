"""Plots of the RL suites' results files, from what their checks and cases recorded: refit's export peaks per bucket
size against the bound and the baseline and its log-prob agreement per layout, rl-cycle's device residue per
iteration against its bound (batch-split's steps: check_plots.steps_against_reference)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.report.check_plots import agreement_bars
from harness.report.plots import (
    distinct_colors,
    failed_cases,
    finish_per_case,
    mark_failed,
    pyplot,
    save_figure,
    variant_labels,
)

if TYPE_CHECKING:
    from harness.report.runs import RunFile

KIB = 1024
_UNITS = {"B": 1, "KiB": KIB, "MiB": KIB ** 2, "GiB": KIB ** 3}


def _checks(run: RunFile, name: str) -> list[dict[str, Any]]:
    return [c for c in run.data["checks"] if c["check"] == name and c.get("data")]


def _bucket_bytes(metric: str) -> int | None:
    """The bucket size of a refit baseline metric (`rank0.export_mib@512MiB` -> 536870912)."""
    m = re.search(r"@(\d+(?:\.\d+)?)(B|KiB|MiB|GiB)$", metric)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _size(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}"
    return f"{n} B"


def refit_peaks(run: RunFile, path: Path) -> Path | None:
    """Per bucket size, each case's export peak per rank (KiB) against the baseline +- tolerance box and the bound
    (bucket + 2 x the largest tensor + overhead; named in the title where it is off the scale)."""
    memory = _checks(run, "refit.memory")
    if not memory:
        return None
    plt = pyplot()
    labels = variant_labels(run)
    baseline = {c["case_id"]: c["data"].get("metrics", {}) for c in _checks(run, "refit.baseline")}
    buckets = sorted({c["data"]["bucket_bytes"] for c in memory})
    cases = [c for c in run.data["cases"] if any(m["case_id"] == c["id"] for m in memory)]
    ranks = max(len(c["data"]["peaks"]) for c in memory)
    rank_colors = distinct_colors(plt, ranks)
    width = 0.8 / ranks
    fig, axes = plt.subplots(len(buckets), 1, figsize=(max(8, 0.9 * len(cases) + 3), 4.2 * len(buckets)),
                             squeeze=False)
    for ax, bucket in zip((row[0] for row in axes), buckets):
        top, bounds = 0.0, set()
        for i, case in enumerate(cases):
            for check in (m for m in memory if m["case_id"] == case["id"] and m["data"]["bucket_bytes"] == bucket):
                bounds.add(check["data"]["bound_bytes"])
                for r, peak in sorted(check["data"]["peaks"].items(), key=lambda kv: int(kv[0])):
                    x = i + (int(r) - (ranks - 1) / 2) * width
                    ax.bar(x, peak / KIB, width, color=rank_colors[int(r)],
                           label=f"rank {r}" if i == 0 and bucket == buckets[0] else None)
                    top = max(top, peak / KIB)
                    v = next((v for m, v in baseline.get(case["id"], {}).items()
                              if m.startswith(f"rank{r}.") and _bucket_bytes(m) == bucket), None)
                    if v and v.get("baseline") is not None:
                        base, tol = v["baseline"] * KIB, (v.get("tolerance") or 0) * KIB  # MiB -> KiB
                        ax.add_patch(plt.Rectangle((x - width / 2, max(0.0, base - tol)), width,
                                                   base + tol - max(0.0, base - tol), facecolor="grey", alpha=0.3,
                                                   edgecolor="black", linestyle="--", linewidth=0.7, zorder=3))
                        ax.plot([x - width / 2, x + width / 2], [base, base], color="black", lw=1.2, zorder=4)
                        top = max(top, base + tol)
        shown = [b for b in bounds if b / KIB <= 3 * top]
        for b in shown:
            ax.axhline(b / KIB, color="red", ls="--", lw=1,
                       label="bound" if bucket == buckets[0] and b == shown[0] else None)
        off = sorted(b for b in bounds if b not in shown)
        ax.set_title(f"buckets of {_size(bucket)}" + (f" (bound {', '.join(_size(b) for b in off)}: off the scale)"
                                                      if off else ""), fontsize=9)
        ax.set_xticks(range(len(cases)), [labels[c['id']] for c in cases], rotation=30, ha="right", fontsize=7)
        mark_failed(ax, cases, failed_cases(run))
        ax.set_ylabel("export peak, KiB")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{run.title}: host peak of each export per rank; grey box: baseline +- tolerance", fontsize=10)
    fig.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return save_figure(plt, fig, path, 100)


def refit_policy(run: RunFile, path: Path) -> Path | None:
    """Per case: the worst relative difference of the HF model's log-probs from Megatron's, against the tolerance."""
    if not _checks(run, "refit.policy"):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(run.data["cases"]) + 3), 4.5))
    shown = agreement_bars(ax, run, {"refit.policy": "worst rel. difference of a held-out token"})
    return finish_per_case(plt, fig, ax, run, shown, path, "|HF - Megatron| / |Megatron|, log-prob",
                           "the HF model loaded from the stream against Megatron's log-probs",
                           labels=variant_labels(run))


def rl_cycle_residue(run: RunFile, path: Path) -> Path | None:
    """Small multiples per case: what each rank left on the device after each iteration's offload (KiB), against
    the residue bound."""
    cases = [c for c in run.data["cases"] if c.get("data", {}).get("residue_bytes")]
    if not cases:
        return None
    plt = pyplot()
    labels = variant_labels(run)
    from matplotlib.ticker import MaxNLocator

    cols = min(4, len(cases))
    rows = (len(cases) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    failed = failed_cases(run)
    for n, (ax, c) in enumerate(zip((a for row in axes for a in row), cases)):
        for r, values in sorted(c["data"]["residue_bytes"].items(), key=lambda kv: int(kv[0])):
            points = [(i + 1, v / KIB) for i, v in enumerate(values) if v is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, lw=1,
                    label=f"rank {r}" if n == 0 else None)
        ax.axhline(c["data"]["residue_bound_bytes"] / KIB, color="red", ls="--", lw=1,
                   label="residue bound" if n == 0 else None)
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(labels[c['id']] + (f" ({c['outcome']})" if c["id"] in failed else ""), fontsize=8,
                     **({"color": "red"} if c["id"] in failed else {}))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in [a for row in axes for a in row][len(cases):]:
        ax.set_visible(False)
    fig.legend(fontsize=7, loc="upper right")
    fig.supxlabel("iteration", fontsize=9)
    fig.supylabel("left on the device after the offload, KiB", fontsize=9)
    fig.suptitle(f"{run.title}: device residue per iteration", fontsize=10)
    fig.tight_layout()
    return save_figure(plt, fig, path, 100)
