"""Plots of results files (matplotlib, headless), each saved as PNG (the Markdown report) and SVG (the HTML page):
checkpoint host / device peaks per rank against the baseline's tolerance band, per-rank RSS timelines of the save
phase, the bytes the collectives moved per group role, and step phases per rank and step-time distributions against
the baseline. Cases that did not pass have red labels."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.baselines import BaselineStatus
from harness.engine_names import EngineName
from harness.errors import MissingDependency
from harness.selection import parse_case_id

if TYPE_CHECKING:
    from harness.report.runs import RunFile

MIB = 1024 * 1024
FLOOR = 1e-10  # a relative difference of 0 (bit for bit) drawn here on a log axis


@dataclass(frozen=True)
class Chart:
    """One plot of a run: the PNG the Markdown report links and the SVG beside it that the HTML page inlines."""

    name: str
    png: Path

    @property
    def svg(self) -> Path:
        return self.png.with_suffix(".svg")


def pyplot():
    """matplotlib.pyplot on the Agg backend; MissingDependency naming the install where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency("harness report needs matplotlib for its plots: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path, dpi: int) -> Path:
    """The figure as PNG at path and as SVG beside it (path.svg, for the HTML page), then closed. In the SVG, text
    stays text and each legend entry's artists get the ids `<stem>-s<k>-<j>` (k: the entry, j: its artist), the
    entries' names in the root's `data-series`: a browser, or a test, finds every series of the chart."""
    import json
    from html import escape

    fig.savefig(path, dpi=dpi, bbox_inches="tight")  # a legend placed beside the axes stays in the picture
    names: list[str] = []
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            artists = list(handle) if isinstance(handle, tuple) else [handle]  # a bar series (a container): its bars
            for j, artist in enumerate(artists):
                artist.set_gid(f"{path.stem}-s{len(names)}-{j}")
            names.append(label)
    svg = path.with_suffix(".svg")
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": path.stem}):
        fig.savefig(svg, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    svg.write_text(_compact(svg.read_text(), path.stem).replace(
        "<svg ", f"<svg data-series=\"{escape(json.dumps(names))}\" ", 1))
    return path


def _compact(text: str, stem: str) -> str:
    """The SVG smaller, drawing the same: coordinates to a tenth of a point, each distinct inline style once as a
    class named after the chart (a page inlines many)."""
    text = _COORDS.sub(lambda m: _DECIMALS.sub(r"\1", m.group(0)), text)
    styles: dict[str, str] = {}
    prefix = f"c{zlib.crc32(stem.encode()):08x}"

    def to_class(m: re.Match) -> str:
        name = styles.setdefault(m.group(1), f"{prefix}-{len(styles)}")
        return f' class="{name}"'

    text = _STYLE.sub(to_class, text)
    sheet = "".join(f".{name}{{{style}}}" for style, name in styles.items())
    return text.replace("</style>", sheet + "</style>", 1) if "</style>" in text else text


# Coordinates in points to a tenth (a page of a night's charts stays small); text is not touched
_COORDS = re.compile(r'\b(?:d|x|y|x1|x2|y1|y2|width|height|transform|points)="[^"]*"')
_DECIMALS = re.compile(r"(\d\.\d)\d+")
_STYLE = re.compile(r' style="([^"]*)"')


def distinct_colors(plt, n: int) -> list:
    """n colours no two of which are the same: tab10 / tab20 where they suffice, else evenly spaced on turbo."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("turbo")(i / (n - 1)) for i in range(n)]


def case_label(case: dict[str, Any]) -> str:
    """Short label: the layout and what distinguishes the case within its suite."""
    o = {**case.get("options", {}), **(case.get("params") or {})}  # older results.json: params in options
    bits = [case["layout"]]
    if o.get("ckpt_role"):
        bits.append(f"{o['ckpt_format']} {o['ckpt_role']}")
    elif o.get("ckpt_format") and case["id"].startswith("ckpt-memory"):
        bits.append(o["ckpt_format"] + (" fully-par" if o.get("fully_parallel_save") else "")
                    + (" async" if o.get("async_save") else ""))
    if o.get("use_distributed_optimizer") and not case["id"].startswith("ckpt-memory"):
        bits.append("distopt")
    if o.get("overlap_grad_reduce"):
        bits.append("overlap")
    if o.get("mix"):
        bits.append(f"{o['mix']} {o.get('cp_mode', '')}")
    return " ".join(bits)


def variant_labels(run: RunFile) -> dict[str, str]:
    """case id -> its layout and what tells it apart from the run's other cases at that layout: the parts of its
    variant that not every case of the run shares (`use_distributed_optimizer=True` as distopt), and its engine
    where it is not mcore."""

    cases = [parse_case_id(c["id"]) for c in run.data["cases"]]
    parts = [[p for p in c["variant"].split(",") if p] for c in cases]
    common = set.intersection(*(set(p) for p in parts)) if parts else set()
    short = {"use_distributed_optimizer=True": "distopt", "overlap_grad_reduce=True": "overlap"}
    out = {}
    for case, own, sel in zip(run.data["cases"], parts, cases):
        bits = [sel["layout"], *(short.get(p, p) for p in own if p not in common)]
        out[case["id"]] = " ".join(bits + ([sel["engine"]] if sel["engine"] != EngineName.MCORE else []))
    return out


def _baseline_checks(run: RunFile) -> dict[str, dict]:
    return {c["case_id"]: c.get("data", {}).get("metrics", {}) for c in run.data["checks"]
            if c["check"].endswith(".baseline")}


def ckpt_peaks(run: RunFile, path: Path) -> Path | None:
    """Per case, per rank: host peak of the save (rank heap + forked writers) as stacked bars, and the
    baseline band (sum of both baselines +- the sum of their tolerances); device peaks beside them on GPU."""
    cases = [c for c in run.data["cases"] if c.get("data", {}).get("save")]
    if not cases:
        return None
    plt = pyplot()
    bases = _baseline_checks(run)
    ranks = max(len(c["data"]["save"]) for c in cases)
    rank_colors = distinct_colors(plt, ranks)
    device = any(p.get("device_allocated_peak") for c in cases for p in c["data"]["save"].values())
    fig, axes = plt.subplots(2 if device else 1, 1,
                             figsize=(max(8, 0.9 * len(cases) * ranks / 4 + 2), 9 if device else 5.5),
                             squeeze=False)
    ax = axes[0][0]
    width = 0.8 / ranks
    for i, c in enumerate(cases):
        metrics = bases.get(c["id"], {})
        for r, peak in sorted(c["data"]["save"].items(), key=lambda kv: int(kv[0])):
            x = i + (int(r) - (ranks - 1) / 2) * width
            heap, kids = peak["heap_peak"] / MIB, peak["children_heap_peak"] / MIB
            color = rank_colors[int(r)]
            ax.bar(x, heap, width, color=color, label=f"rank {r}" if i == 0 else None)
            ax.bar(x, kids, width, bottom=heap, color=color, alpha=0.4, hatch="//")
            h, w = metrics.get(f"rank{r}.save_heap_peak_mib"), metrics.get(f"rank{r}.save_writer_peak_mib")
            parts = [m for m in (h, w) if m and m.get("baseline") is not None]
            if parts:
                base = sum(m["baseline"] for m in parts)
                tol = sum(m["tolerance"] for m in parts)
                low = max(0.0, base - tol)
                ax.add_patch(plt.Rectangle((x - width / 2, low), width, base + tol - low, facecolor="grey", alpha=0.25,
                                           edgecolor="black", linestyle="--", linewidth=0.7, zorder=3))
                ax.plot([x - width / 2, x + width / 2], [base, base], color="black", linewidth=1.2, zorder=4)
                off = [m["status"] for m in parts if m["status"] != BaselineStatus.PASS]
                if off:
                    ax.annotate(" / ".join(off), (x, heap + kids),
                                rotation=90, fontsize=7, color="red", ha="center", va="bottom")
    ax.set_xticks(range(len(cases)), [case_label(c) for c in cases], rotation=60, ha="right", fontsize=7)
    mark_failed(ax, cases, failed_cases(run))
    ax.set_ylabel("host peak of the save, MiB")
    ax.set_title(f"{run.title}: host peak per rank (solid: rank heap, hatched: forked writers);\n"
                 "grey box: baseline +- tolerance, line: baseline", fontsize=9)
    ax.legend(fontsize=7, ncol=ranks)
    ax.grid(axis="y", alpha=0.3)
    if device:
        ax = axes[1][0]
        for i, c in enumerate(cases):
            for r, peak in sorted(c["data"]["save"].items(), key=lambda kv: int(kv[0])):
                x = i + (int(r) - (ranks - 1) / 2) * width
                ax.bar(x, peak["device_reserved_peak"] / MIB, width, color=rank_colors[int(r)], alpha=0.4)
                ax.bar(x, peak["device_allocated_peak"] / MIB, width, color=rank_colors[int(r)])
        ax.set_xticks(range(len(cases)), [case_label(c) for c in cases], rotation=60, ha="right", fontsize=7)
        mark_failed(ax, cases, failed_cases(run))
        ax.set_ylabel("device peak, MiB")
        ax.set_title("device peak per rank (solid: max allocated, light: max reserved)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(plt, fig, path, 110)


def ckpt_timelines(run: RunFile, path: Path) -> Path | None:
    """Small multiples: each rank's RSS above its level at the start of the save, over the save."""
    cases = [c for c in run.data["cases"]
             if any(p.get("timeline") for p in c.get("data", {}).get("save", {}).values())]
    if not cases:
        return None
    plt = pyplot()
    cols = min(4, len(cases))
    rows = (len(cases) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for ax, c in zip((a for row in axes for a in row), cases):
        for r, peak in sorted(c["data"]["save"].items(), key=lambda kv: int(kv[0])):
            t = [s for s, _ in peak["timeline"]]
            mib = [(rss - peak["rss_before"]) / MIB for _, rss in peak["timeline"]]
            ax.plot(t, mib, label=f"rank {r}", linewidth=1)
        failed = c["id"] in failed_cases(run)
        ax.set_title(case_label(c) + (f" ({c['outcome']})" if failed else ""), fontsize=8,
                     **({"color": "red"} if failed else {}))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in [a for row in axes for a in row][len(cases):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=6)
    fig.supxlabel("seconds into the save")
    fig.supylabel("rank RSS above its start, MiB")
    fig.suptitle(f"{run.title}: RSS of each rank during the save", fontsize=10)
    fig.tight_layout()
    return save_figure(plt, fig, path, 100)


def collective_bytes(run: RunFile, path: Path) -> Path | None:
    """Per case, the bytes all ranks' collectives moved, stacked by group role and collective kind."""
    cases = [c for c in run.data["cases"] if c.get("data", {}).get("collective_bytes")]
    if not cases:
        return None
    plt = pyplot()
    totals = []
    for c in cases:
        per: dict[str, float] = {}
        for rank in c["data"]["collective_bytes"].values():
            for key, b in rank.items():
                per[key] = per.get(key, 0.0) + b / MIB
        totals.append(per)
    keys = sorted({k for t in totals for k in t})
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(cases) + 3), 5.5))
    bottom = [0.0] * len(cases)
    colors = distinct_colors(plt, len(keys))  # an MoE run has over 20 (role, kind) series
    for j, key in enumerate(keys):
        vals = [t.get(key, 0.0) for t in totals]
        ax.bar(range(len(cases)), vals, 0.7, bottom=bottom, label=key, color=colors[j])
        bottom = [b + v for b, v in zip(bottom, vals)]
    return finish_per_case(plt, fig, ax, run, cases, path, "MiB moved, all ranks, all recorded steps",
                            "collective bytes by group role / kind", rotation=70)


def finish_per_case(plt, fig, ax, run: RunFile, cases: list[dict], path: Path, ylabel: str, title: str,
                    rotation: int = 30, legend: bool = True, labels: dict[str, str] | None = None) -> Path:
    """Case labels on the x axis (case_label's, or `labels` by case id; red for cases that did not pass), labels,
    legend, grid; saved and closed."""
    ticks = [labels[c["id"]] if labels else case_label(c) for c in cases]
    ax.set_xticks(range(len(cases)), ticks, rotation=rotation, ha="right", fontsize=7)
    mark_failed(ax, cases, failed_cases(run))
    ax.set_ylabel(ylabel)
    ax.set_title(f"{run.title}: {title}", fontsize=9)
    if legend:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(plt, fig, path, 110)


def judged_cases(run: RunFile, checks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checks whose case is in the run's results, and those cases, in the checks' order."""
    cases = {c["id"]: c for c in run.data["cases"]}
    kept = [c for c in checks if c["case_id"] in cases]
    return kept, [cases[c["case_id"]] for c in kept]


def failed_cases(run: RunFile) -> set[str]:
    return {c["id"] for c in run.data["cases"] if c.get("outcome") not in (None, "pass", "skipped")}


def mark_failed(ax, cases: list[dict], failed: set[str]) -> None:
    """Red tick labels for cases that did not pass, so a regression does not look like a pass."""
    for label, c in zip(ax.get_xticklabels(), cases):
        if c["id"] in failed:
            label.set_color("red")


def step_phases(run: RunFile, path: Path) -> Path | None:
    """Per case and rank, the median ms of each phase of a step, stacked (a straggler's bar stands out)."""
    cases = [c for c in run.data["cases"] if c.get("data", {}).get("phases_ms")]
    if not cases:
        return None
    plt = pyplot()
    phases = ["forward", "backward", "grad-sync", "param-gather", "optimizer", "other"]
    ranks = max(len(c["data"]["phases_ms"]) for c in cases)
    width = 0.8 / ranks
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cases) + 3), 5.5))
    colors = distinct_colors(plt, len(phases))
    for r in range(ranks):
        bottom = [0.0] * len(cases)
        for j, phase in enumerate(phases):
            vals = [c["data"]["phases_ms"].get(str(r), {}).get(phase, 0.0) for c in cases]
            xs = [i + (r - (ranks - 1) / 2) * width for i in range(len(cases))]
            ax.bar(xs, vals, width * 0.9, bottom=bottom, color=colors[j], label=phase if r == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    return finish_per_case(plt, fig, ax, run, cases, path, "median ms per step (one bar per rank)",
                            "step phases per rank")


def step_times(run: RunFile, path: Path) -> Path | None:
    """Per case, the distribution of step times (this run) beside the baseline's stored samples."""
    cases = [c for c in run.data["cases"] if c.get("data", {}).get("step_ms")]
    if not cases:
        return None
    plt = pyplot()
    base = {c["case_id"]: c.get("data", {}).get("baseline_samples", {}).get("step_time_ms", [])
            for c in run.data["checks"] if c["check"] == "step-perf.time"}
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cases) + 3), 5))
    for i, c in enumerate(cases):
        if base.get(c["id"]):
            ax.boxplot([base[c["id"]]], positions=[i - 0.18], widths=0.3, patch_artist=True,
                       boxprops={"facecolor": "0.85"}, medianprops={"color": "black"}, showfliers=True)
        ax.boxplot([c["data"]["step_ms"]], positions=[i + 0.18], widths=0.3, patch_artist=True,
                   boxprops={"facecolor": "tab:blue", "alpha": 0.6}, medianprops={"color": "black"})
    return finish_per_case(plt, fig, ax, run, cases, path, "step time, ms (grey: baseline samples, blue: this run)",
                            "step times", legend=False)
