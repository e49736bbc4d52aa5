"""Which plots a run gets: every plot of plots.py and rl_plots.py that draws from its results, each rendered as PNG
(the Markdown report) and SVG (the HTML page)."""

from __future__ import annotations

from pathlib import Path

from harness.report import adapter_plots, check_plots, plots, rl_plots
from harness.report.plots import Chart
from harness.report.runs import RunFile

PLOTS = {"peaks": plots.ckpt_peaks, "save-timeline": plots.ckpt_timelines, "collective-bytes": plots.collective_bytes,
         "step-phases": plots.step_phases, "step-times": plots.step_times,
         "steps-vs-reference": check_plots.steps_against_reference,
         "steps-vs-stored": check_plots.steps_against_stored,
         "tensors-vs-reference": check_plots.params_against_reference,
         "baseline-deviation": check_plots.baseline_deviation, "export-peaks": rl_plots.refit_peaks,
         "logprob-agreement": rl_plots.refit_policy, "residue": rl_plots.rl_cycle_residue,
         "adapter-export": adapter_plots.adapter_export}


def render_all(runs: list[RunFile], out_dir: Path) -> dict[str, list[Chart]]:
    """Every plot that applies to each run, as out_dir/<run slug>-<plot>.png and .svg; {results path: [charts]}."""
    out: dict[str, list[Chart]] = {}
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.slug] = seen.get(run.slug, 0) + 1
        slug = run.slug if seen[run.slug] == 1 else f"{run.slug}-{seen[run.slug]}"
        for name, plot in PLOTS.items():
            out_dir.mkdir(parents=True, exist_ok=True)
            png = plot(run, out_dir / f"{slug}-{name}.png")
            if png:
                out.setdefault(str(run.path), []).append(Chart(name, png))
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()  # no empty folder: the report says per run why it has no plot
    return out


# What the plots draw from, for a report's line on a run that has none
PLOTTED = ("checkpoint save peaks and timelines (ckpt-memory), collective bytes (grad-sync), step phases and "
           "times (step-perf), steps against the reference (equivalence, batch-split) and against the stored "
           "trajectory (golden), gradients against the reference (dynamic-cp), baselined figures against "
           "their band (train-memory), export peaks and log-prob agreement (refit), device residue per iteration "
           "(rl-cycle), the exported adapter's tensors, log-probs and host peak (peft-ckpt)")
