"""The plot of peft-ckpt's results files, from what its checks recorded: per case, the held-out log-probs of the
exported adapter (in HF + PEFT, and reloaded into Megatron both ways) against the model that trained it, and the
export's host peak per rank against its bound and the whole model's size (each exported tensor against the
reference layout's: check_plots.params_against_reference)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.report.check_plots import agreement_bars, finish_panels
from harness.report.plots import distinct_colors, failed_cases, mark_failed, pyplot, variant_labels

if TYPE_CHECKING:
    from harness.report.runs import RunFile

MIB = 1024 ** 2
LOGPROBS = {"peft-ckpt.logprobs": "HF + PEFT against Megatron",
            "peft-ckpt.roundtrip": "the PEFT adapter reloaded into Megatron",
            "peft-ckpt.legacy": "the adapter-only checkpoint reloaded"}


def adapter_export(run: RunFile, path: Path) -> Path | None:
    """Two panels per run: each case's log-prob agreements (worst relative difference, log scale) against the
    tolerance, and each case's export host peak per rank (MiB) against the bound, with the whole model's size where
    it is on the scale (a merging export would hold it)."""
    peaks = [c for c in run.data["checks"] if c["check"] == "peft-ckpt.memory" and (c.get("data") or {}).get("peaks")]
    if not peaks and not any(c["check"] in LOGPROBS and c.get("data") for c in run.data["checks"]):
        return None
    plt = pyplot()
    labels, failed = variant_labels(run), failed_cases(run)
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 1.6 * len(run.data["cases"]) + 6), 5))
    shown = agreement_bars(left, run, LOGPROBS)
    _ticks(left, shown, labels, failed)
    left.set_ylabel("|reloaded - trained| / |trained|, log-prob")
    left.set_title("held-out log-probs against the model that trained the adapter", fontsize=9)
    cases = [c for c in run.data["cases"] if any(p["case_id"] == c["id"] for p in peaks)]
    _peaks(plt, right, cases, peaks)
    _ticks(right, cases, labels, failed)
    right.set_ylabel("export host peak, MiB")
    return finish_panels(plt, fig, path, f"{run.title}: the exported adapter")


def _peaks(plt: Any, ax: Any, cases: list[dict[str, Any]], checks: list[dict[str, Any]]) -> None:
    ranks = max((len(c["data"]["peaks"]) for c in checks), default=1)
    colors, width = distinct_colors(plt, ranks), 0.8 / ranks
    top, bounds, wholes = 0.0, set(), set()
    for i, case in enumerate(cases):
        for check in (c for c in checks if c["case_id"] == case["id"]):
            bounds.add(check["data"]["bound_bytes"] / MIB)
            wholes.add(check["data"]["tells_below_bytes"] / MIB)
            for r, peak in sorted(check["data"]["peaks"].items(), key=lambda kv: int(kv[0])):
                ax.bar(i + (int(r) - (ranks - 1) / 2) * width, peak / MIB, width, color=colors[int(r)],
                       label=f"rank {r}" if i == 0 else None)
                top = max(top, peak / MIB)
    for k, b in enumerate(sorted(bounds)):
        ax.axhline(b, color="red", ls="--", lw=1, label="bound" if k == 0 else None)
    top = max([top, *bounds])
    for k, w in enumerate(sorted(x for x in wholes if x <= 3 * top)):
        ax.axhline(w, color="grey", ls=":", lw=1.2, label="the whole model (a merging export)" if k == 0 else None)
    off = sorted(x for x in wholes if x > 3 * top)
    ax.set_title("the adapter export's host peak per rank" + (
        f" (the whole model: {', '.join(f'{x:.1f} MiB' for x in off)}, off the scale)" if off else ""), fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)


def _ticks(ax: Any, cases: list[dict[str, Any]], labels: dict[str, str], failed: set[str]) -> None:
    ax.set_xticks(range(len(cases)), [labels.get(c["id"], c["id"]) for c in cases], rotation=30, ha="right",
                  fontsize=7)
    mark_failed(ax, cases, failed)
