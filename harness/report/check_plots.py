"""Plots drawn from what checks recorded in a results file, for any suite whose checks record it: each case's
figures per step against its reference's (`checks.StepSeries`: equivalence, batch-split) or against stored values
with each step's own tolerance (`checks.TrajectoryFigures`: golden), each case's tensors against its reference's
(`checks.ParamErrors`: dynamic-cp's gradients), and each case's baselined figures against their baseline band
(`baselines.BaselineFigures`, where no plot of its own draws them)."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.report.plots import (
    FLOOR,
    distinct_colors,
    failed_cases,
    finish_per_case,
    judged_cases,
    pyplot,
    save_figure,
    variant_labels,
)

if TYPE_CHECKING:
    from harness.report.runs import RunFile

BEYOND = 10.0  # tolerances: a figure further from its baseline (or not finite) is drawn here
CEILING = 1e3  # a relative difference that is NaN or inf, drawn here on the log axis


def on_log_axis(v: float) -> float:
    """A non-negative figure for a log axis: 0 at FLOOR, NaN or inf at CEILING."""
    return CEILING if not math.isfinite(v) else min(max(v, FLOOR), CEILING)


def relative(a: float, b: float) -> float:
    """|a - b| / |b| (|a - b| where b is 0) for a log axis (on_log_axis)."""
    return on_log_axis(abs(a - b) / abs(b) if b else abs(a - b))


# Suites whose baselined figures a plot of their own draws against the band (ckpt-memory's peaks, refit's exports)
OWN_BASELINE_PLOTS = ("ckpt-memory", "refit")



def finish_panels(plt: Any, fig: Any, path: Path, title: str) -> Path | None:
    """A figure of panels titled, its legend on the right, saved."""
    fig.suptitle(title, fontsize=10)
    fig.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return save_figure(plt, fig, path, 100)

def _step_checks(run: RunFile) -> dict[str, list[dict[str, Any]]]:
    """figure -> the checks that recorded it per step against a reference, in the order they ran."""
    out: dict[str, list[dict[str, Any]]] = {}
    for c in run.data["checks"]:
        d = c.get("data") or {}
        if {"figure", "got", "reference", "rtol"} <= set(d) and d["got"]:
            out.setdefault(d["figure"], []).append(c)
    return out


def steps_against_reference(run: RunFile, path: Path) -> Path | None:
    """Per figure (loss, gradient norm, ...), each case's steps as a relative difference from its reference's,
    against the tolerance (log scale; bit for bit drawn at FLOOR)."""
    figures = _step_checks(run)
    if not figures:
        return None
    plt = pyplot()
    labels = variant_labels(run)
    from matplotlib.ticker import MaxNLocator

    cases = {c["id"]: c for c in run.data["cases"]}
    ids = list(dict.fromkeys(c["case_id"] for checks in figures.values() for c in checks))
    colors = dict(zip(ids, distinct_colors(plt, len(ids))))
    failed = failed_cases(run)
    fig, axes = plt.subplots(1, len(figures), figsize=(7 * len(figures), 5.5), squeeze=False)
    named: set[str] = set()
    for ax, (figure, checks) in zip(axes[0], figures.items()):
        for c in checks:
            d = c["data"]
            rel = [relative(a, b) for a, b in zip(d["got"], d["reference"])]
            name = labels.get(c["case_id"], c["case_id"]) + (" (failed)" if c["case_id"] in failed else "")
            ax.plot(range(len(rel)), rel, marker="o", ms=3, lw=1.2, color=colors[c["case_id"]],
                    label=None if name in named else name)
            named.add(name)
            beyond = [i for i, v in enumerate(rel) if v == CEILING]
            if beyond:  # NaN or inf: drawn at the top, marked
                ax.plot(beyond, [CEILING] * len(beyond), ls="none", marker="x", ms=8, color="red",
                        label=None if "not finite" in named else "not finite")
                named.add("not finite")
        for rtol in sorted({c["data"]["rtol"] for c in checks if c["data"]["rtol"] > 0}):
            name = f"tolerance {rtol:.0e}"
            ax.axhline(rtol, color="red", ls="--", lw=1, label=None if name in named else name)
            named.add(name)
        refs = sorted({cases.get(c["data"]["reference_case"], {}).get("layout", "") for c in checks} - {""})
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(f"{figure}: |case - reference| / |reference|")
        ax.set_title(f"{figure} per step against the reference" + (f" ({', '.join(refs)})" if refs else ""),
                     fontsize=9)
        ax.grid(alpha=0.3)
    return finish_panels(plt, fig, path,
                         f"{run.title}: each case's steps against its reference ({FLOOR:.0e}: bit for bit)")


def params_against_reference(run: RunFile, path: Path) -> Path | None:
    """Per check that compared tensors by name (`checks.ParamErrors`: dynamic-cp's gradients), each case's relative
    error per parameter against its reference's, against the tolerance (log scale; bit for bit at FLOOR, NaN or inf
    at CEILING)."""
    checks = [c for c in run.data["checks"] if {"errors", "reference_case", "rtol"} <= set(c.get("data") or {})
              and c["data"]["errors"]]
    if not checks:
        return None
    plt = pyplot()
    labels, failed = variant_labels(run), failed_cases(run)
    names = sorted({n for c in checks for n in c["data"]["errors"]})
    ids = list(dict.fromkeys(c["case_id"] for c in checks))
    colors = dict(zip(ids, distinct_colors(plt, len(ids))))
    per_check: dict[str, list[dict[str, Any]]] = {}
    for c in checks:
        per_check.setdefault(c["check"], []).append(c)
    fig, axes = plt.subplots(1, len(per_check), figsize=(max(8.0, 0.35 * len(names) + 4) * len(per_check), 6),
                             squeeze=False)
    named: set[str] = set()
    for ax, (check, cs) in zip(axes[0], sorted(per_check.items())):
        for c in cs:
            errors = c["data"]["errors"]
            xs = [i for i, n in enumerate(names) if n in errors]
            ys = [on_log_axis(errors[n]) for n in names if n in errors]
            name = labels.get(c["case_id"], c["case_id"]) + (" (failed)" if c["case_id"] in failed else "")
            ax.plot(xs, ys, ls="none", marker="o", ms=4, color=colors[c["case_id"]],
                    label=None if name in named else name)
            named.add(name)
        for rtol in sorted({c["data"]["rtol"] for c in cs}):
            name = f"tolerance {rtol:.0e}"
            ax.axhline(rtol, color="red", ls="--", lw=1, label=None if name in named else name)
            named.add(name)
        ax.set_yscale("log")
        if len(names) <= 60:
            ax.set_xticks(range(len(names)), _short_names(names), rotation=90, fontsize=6)
        ax.set_xlabel("parameter")
        ax.set_ylabel("|case - reference| / |reference|")
        refs = sorted({labels.get(c["data"]["reference_case"], c["data"]["reference_case"]) for c in cs})
        against = f"the reference ({refs[0]})" if len(refs) == 1 else f"its reference (one of {len(refs)})"
        ax.set_title(f"{check}: each tensor against {against}", fontsize=9)
        ax.grid(alpha=0.3)
    return finish_panels(plt, fig, path,
                         f"{run.title}: each case's tensors against its reference ({FLOOR:.0e}: bit for bit)")


def _short_names(names: list[str]) -> list[str]:
    """Tensor names without the dotted prefix they all share and without `decoder.layers.`."""
    common = os.path.commonprefix(names) if len(names) > 1 else ""
    cut = common.rfind(".") + 1
    return [n[cut:].replace("decoder.layers.", "") for n in names]


def steps_against_stored(run: RunFile, path: Path) -> Path | None:
    """Per figure (loss, gradient norm, ...), each case's steps as their distance from the stored trajectory in
    that step's allowed deviations (log scale: at 1 the tolerance; a step held exactly drawn at FLOOR, a step that
    must be exact and is not, or is not finite, at CEILING)."""
    checks = [c for c in run.data["checks"] if {"key", "rows"} <= set(c.get("data") or {}) and c["data"]["rows"]]
    if not checks:
        return None
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}  # figure -> case -> [(step, distance)]
    for c in checks:
        for metric, got, want, allowed in c["data"]["rows"]:
            step, figure = metric.split(".", 1)
            off = abs(got - want) if math.isfinite(got) else math.inf
            distance = off / allowed if allowed else (0.0 if off == 0 else math.inf)
            series.setdefault(figure, {}).setdefault(c["case_id"], []).append(
                (int(step[4:]), on_log_axis(distance)))
    plt = pyplot()
    labels, failed = variant_labels(run), failed_cases(run)
    from matplotlib.ticker import MaxNLocator

    ids = list(dict.fromkeys(c["case_id"] for c in checks))
    colors = dict(zip(ids, distinct_colors(plt, len(ids))))
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 5), squeeze=False)
    named: set[str] = set()
    for ax, (figure, cases) in zip(axes[0], sorted(series.items())):
        for cid, points in cases.items():
            points.sort()
            name = labels.get(cid, cid) + (" (failed)" if cid in failed else "")
            ax.plot([s for s, _ in points], [d for _, d in points], marker="o", ms=3, lw=1.2, color=colors[cid],
                    label=None if name in named else name)
            named.add(name)
        ax.axhline(1.0, color="red", ls="--", lw=1, label=None if "the step's tolerance" in named else
                   "the step's tolerance")
        named.add("the step's tolerance")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(f"{figure}: |case - stored| / allowed")
        ax.set_title(f"{figure} per step against the stored trajectory", fontsize=9)
        ax.grid(alpha=0.3)
    keys = sorted({c["data"]["key"] for c in checks})
    return finish_panels(plt, fig, path, f"{run.title}: each case's steps against {', '.join(keys)} (1: the step's "
                                         f"tolerance; {FLOOR:.0e}: exact)")


def baseline_deviation(run: RunFile, path: Path) -> Path | None:
    """Per case, each baselined figure's distance from its baseline in tolerances ((measured - baseline) /
    tolerance: within the grey band [-1, 1] it passes), for suites with no plot of their own that draws it."""
    if run.data["suite"] in OWN_BASELINE_PLOTS:
        return None
    checks = [c for c in run.data["checks"]
              if c["check"].endswith(".baseline") and (c.get("data") or {}).get("metrics")]
    if not checks:
        return None
    plt = pyplot()
    checks, shown = judged_cases(run, checks)

    def figure(metric: str) -> str:  # rank0.step1_mib -> step1_mib: one series per figure, its worst rank
        return re.sub(r"^rank\d+\.", "", metric)

    def deviations(c: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for m, v in c["data"]["metrics"].items():
            if v.get("baseline") is not None and v.get("tolerance"):
                dev = (v["measured"] - v["baseline"]) / v["tolerance"]
                dev = dev if math.isfinite(dev) else BEYOND  # a NaN measurement is a regression: drawn as beyond
                if abs(dev) >= abs(out.get(figure(m), 0.0)):
                    out[figure(m)] = max(-BEYOND, min(BEYOND, dev))
        return out

    per_case = [deviations(c) for c in checks]
    names = sorted({f for d in per_case for f in d})
    colors = dict(zip(names, distinct_colors(plt, len(names))))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(shown) + 3), 5))
    ax.axhspan(-1, 1, color="0.85", zorder=0, label="within the baseline's tolerance")
    width = 0.8 / max(1, len(names))
    labelled: set[str] = set()
    for i, devs in enumerate(per_case):
        for j, name in enumerate(names):
            if name in devs:
                ax.bar(i + (j - (len(names) - 1) / 2) * width, devs[name], width, color=colors[name],
                       label=None if name in labelled else f"{name} (its rank furthest from the baseline)")
                labelled.add(name)
    ax.axhline(0, color="black", lw=0.8)
    return finish_per_case(plt, fig, ax, run, shown, path, "(measured - baseline) / tolerance",
                           "each baselined figure against its baseline (grey: within the tolerance)",
                           labels=variant_labels(run))


def agreement_bars(ax: Any, run: RunFile, series: dict[str, str]) -> list[dict[str, Any]]:
    """Per case, a bar for each check of `series` (check -> the bar's name) that recorded log-probs against another
    model's (`checks.Agreement`): its worst relative difference (log scale; bit for bit at FLOOR, NaN at CEILING),
    against each tolerance; the cases drawn, in the run's order."""
    checks = [c for c in run.data["checks"] if c["check"] in series and (c.get("data") or {}).get("rtol")]
    ids = set(c["case_id"] for c in checks)
    cases = [c for c in run.data["cases"] if c["id"] in ids]
    if not cases:
        return []
    at = {c["id"]: i for i, c in enumerate(cases)}
    drawn = [name for name in series if any(c["check"] == name for c in checks)]
    colors = dict(zip(drawn, ["tab:purple", "tab:brown", "tab:olive", "tab:cyan"]))  # not the ranks' tab10 colours
    width = 0.8 / len(drawn)
    for j, name in enumerate(drawn):
        mine = [c for c in checks if c["check"] == name and c["case_id"] in at]
        ax.bar([at[c["case_id"]] + (j - (len(drawn) - 1) / 2) * width for c in mine],
               [relative(c["data"]["worst_rel"], 0.0) for c in mine], width, color=colors[name], label=series[name])
    for rtol in sorted({c["data"]["rtol"] for c in checks}):
        ax.axhline(rtol, color="red", ls="--", lw=1, label=f"tolerance {rtol:.0e}")
    ax.set_yscale("log")
    return cases
