"""`harness history show`: a metric's nights per case, the change points found in them, what changed
between the nights around each (package versions, harness commit) and the bisect command that pins it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from harness.checks.timing import TIMED_METRICS
from harness.errors import BadInput
from harness.history import store
from harness.history.changes import Change, detect
from harness.history.store import Point
from harness.report.plots import pyplot
from harness.selection import case_argv
from harness.stack import COMPONENTS
from harness.stack import key as stack_key_of
from harness.tables import table as text_table

# what a bisect can walk over: distributions in results.json "versions" (the harness's own are not)
NOT_BISECTABLE = ("harness", "harness_commit", "python")


def stack_changed(a: Point, b: Point) -> bool:
    """Whether a component of the stack (harness.stack.COMPONENTS: Python, torch, megatron-core, the bridges) changed
    between two nights of one series (its key holds Python's minor, the torch build and megatron-core: a bridge
    upgrade or a Python patch release stays in it, marked)."""

    return any(a.versions.get(c) != b.versions.get(c) for c in COMPONENTS)


def changed_between(a: dict[str, str], b: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """name -> (before, after) for every version that differs between two nights' versions."""
    keys = sorted(set(a) | set(b))
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


# the distribution most likely behind a change, when several changed between two nights: the engine's
LIKELY_FIRST = ("megatron-core", "megatron-bridge", "mbridge", "transformer-engine", "torch")


def bisectable(diff: dict[str, tuple[str | None, str | None]]) -> list[tuple[str, tuple[str, str]]]:
    """The packages of a version diff a bisect can walk over (a release on both nights; not the harness's own or
    Python), the engine's first."""
    packages = [(k, (a, b)) for k, (a, b) in diff.items()
                if k not in NOT_BISECTABLE and a and b and " " not in a and " " not in b]
    return sorted(packages,
                  key=lambda p: (LIKELY_FIRST.index(p[0]) if p[0] in LIKELY_FIRST else len(LIKELY_FIRST), p[0]))


def bisect_commands(case_id: str, metric: str, world_size: int | None, change: Change,
                    diff: dict[str, tuple[str | None, str | None]]) -> list[str]:
    """One `harness bisect --package NAME A..B ...` per package whose version changed (the engine's first),
    selecting the case again (its layout and variant) with a threshold between the values before and after:
    absolute for an exact figure, `baseline+P%` for a timed one (bisect judges those by statistics)."""

    packages = bisectable(diff)
    middle = (change.before + change.after) / 2
    if metric in TIMED_METRICS:
        threshold = f"baseline+{abs(middle / change.before - 1) * 100:.3g}%"
    else:
        threshold = f"{middle:.6g}"
    out = []
    for name, (a, b) in packages:
        argv = ["harness", "bisect", "--package", name, f"{a}..{b}", *case_argv(case_id, world_size),
                "--metric", metric, "--max", threshold]
        if change.after < change.before:  # the metric fell: the search is for the first good candidate
            argv.append("--find-fix")
        out.append(shlex.join(argv))
    return out


def describe(case_id: str, metric: str, points: list[Point], changes: list[Change],
             world_size: int | None) -> list[str]:
    lines = []
    for c in changes:
        if c.kind == "creep":
            first, last = points[0], points[-1]
            lines.append(f"  creep: {c.before:.4g} -> {c.after:.4g} ({(c.ratio - 1) * 100:+.1f}%) over "
                         f"{len(points)} nights {first.date[:10]} .. {last.date[:10]} (Kendall tau, Theil-Sen): "
                         "no single night to bisect; compare the first and the last night")
            continue
        before, after = points[c.index - 1], points[c.index]
        diff = changed_between(before.versions, after.versions)
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()) or \
            "no package version or harness commit changed: the machine or the environment did"
        lines.append(f"  change at {after.date[:10]}: {c.before:.4g} -> {c.after:.4g} ({(c.ratio - 1) * 100:+.1f}%); "
                     f"last night before {before.date[:10]}, first after {after.date[:10]}; changed: {what}")
        commands = bisect_commands(case_id, metric, world_size, c, diff)
        if len(commands) > 1:
            lines.append(f"    {len(commands)} packages changed between the nights: one bisect each, the engine's "
                         f"first; the one whose gate reproduces the change is responsible")
        lines += [f"    {cmd}" for cmd in commands]
    return lines


def trend_figure(case_id: str, metric: str, points: list[Point], changes: list[Change]):
    """The metric per night: each step a dashed line with its change, creep its fitted line, each night whose stack
    changed a grey band (seen behind a step on the same night); (pyplot, the figure), to be saved."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    xs = list(range(len(points)))
    ax.plot(xs, [p.value for p in points], marker="o", ms=3, lw=1, color="tab:blue", label=metric)
    restacked = [i for i in range(1, len(points)) if stack_changed(points[i - 1], points[i])]
    for k, i in enumerate(restacked):
        ax.axvspan(i - 0.8, i - 0.2, color="0.55", alpha=0.3, lw=0, label="stack changed" if k == 0 else None)
    steps = [c for c in changes if c.kind == "step"]
    for k, c in enumerate(steps):
        ax.axvline(c.index - 0.5, color="red", ls="--", lw=1.2, label="change point" if k == 0 else None)
        ax.annotate(f"{(c.ratio - 1) * 100:+.1f}%", (c.index - 0.5, max(p.value for p in points)), color="red",
                    fontsize=8, ha="left", va="top")
    for c in changes:
        if c.kind == "creep":
            ax.plot([0, len(points) - 1], [c.before, c.after], color="red", ls=":", lw=1.5,
                    label=f"creep {(c.ratio - 1) * 100:+.1f}%")
    step = max(1, len(points) // 10)
    ax.set_xticks(xs[::step], [p.date[:10] for p in points][::step], rotation=30, fontsize=7)
    ax.set_xlabel("night")
    ax.set_ylabel(metric, fontsize=8)
    ax.set_title(case_id, fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return plt, fig


def plot(path: Path, case_id: str, metric: str, points: list[Point], changes: list[Change]) -> Path:
    """`history show`'s PNG trend of one case."""
    plt, fig = trend_figure(case_id, metric, points, changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def show(con, metric: str, case_glob: str, since: str | None, plots_dir: Path | None) -> tuple[str, list[Path]]:
    data = store.series(con, metric, case_glob, since)
    if not data:
        known = store.metrics(con)
        hint = f"; metrics in the database: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}" if known else ""

        raise BadInput(f"no figures of metric {metric!r} for cases matching {case_glob!r}"
                       f"{f' since {since}' if since else ''}{hint}")
    world = dict(con.execute("SELECT id, world_size FROM runs"))
    rows, notes, pngs = [], [], []

    for (platform, label, case_id), points in sorted(data.items()):
        stack_key = stack_key_of(points[-1].versions)
        changes = detect([p.value for p in points])
        restacked = [b.date[:10] for a, b in zip(points, points[1:]) if stack_changed(a, b)]
        when = (lambda p: p.date[:16].replace("T", " ")) if points[0].date[:10] == points[-1].date[:10] \
            else (lambda p: p.date[:10])  # nights of one day (reruns) by the minute
        rows.append([platform, label or "-", case_id, stack_key, str(len(points)), when(points[0]), when(points[-1]),
                     f"{points[-1].value:.4g}", ", ".join(restacked) or "-",
                     "; ".join(f"{c.kind} {(c.ratio - 1) * 100:+.1f}%" + (f" at {points[c.index].date[:10]}"
                                                                            if c.kind == "step" else "")
                               for c in changes) or "-"])
        if changes:
            notes.append(f"{case_id} ({platform}, {stack_key}{f', label {label}' if label else ''}):")
            notes += describe(case_id, metric, points, changes, world.get(points[-1].run_id))
        if plots_dir is not None:
            slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_",
                          f"{platform}-{stack_key}-{label + '-' if label else ''}{case_id}-{metric}")
            pngs.append(plot(Path(plots_dir) / f"{slug}.png", case_id, metric, points, changes))
    table = text_table(["platform", "label", "case", "stack (latest)", "nights", "first", "last", "latest",
                        "stack changed", "changes"], rows)
    return "\n".join([f"{metric}:", table, *([""] + notes if notes else [])]), pngs
