"""`harness report DIR`: every results.json under DIR rendered as report.md, report.json, junit.xml
and plots/*.png, written next to them."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.files import atomic_write
from harness.outcomes import OUTCOMES, check_failed
from harness.report import junit, time_spent
from harness.report.charts import PLOTTED, render_all
from harness.report.page import Earlier, write_page
from harness.report.plots import Chart
from harness.report.runs import RunFile, load_runs
from harness.tables import markdown_table, md_escape


def prepare_out_dir(path: Path, flag: str = "--out") -> Path:
    """Create the directory and show it writable, before anything runs; BadInput naming the flag otherwise.
    A directory this call created is removed again when it is not writable."""
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".harness-write-test-"):
            pass
    except OSError as exc:
        if created and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        raise BadInput(f"{flag} {path}: cannot write there ({exc.strerror or exc}); "
                       f"give a writable directory") from None
    return path


# What a run (results.json) and `harness report` (the rest) write into a run's directory.
RUN_FILES = ("results.json", "report.md", "report.json", "junit.xml", "report.html", "plots")


def refuse_earlier_run(path: Path, force: bool, flag: str = "--out") -> None:
    """BadInput where the directory holds an earlier run's files, which this run would replace or sit beside
    (a report describing a run no longer there); with force they are removed first."""
    found = [name for name in RUN_FILES if (path / name).exists()]
    if not found:
        return
    if not force:
        raise BadInput(f"{flag} {path} holds an earlier run ({', '.join(found)}): give a new directory, or add "
                       "--force to replace that run")
    remove_run_files(path)
    print(f"harness: --force: removed the earlier run's {', '.join(found)} from {path}", file=sys.stderr)


def remove_run_files(path: Path, also: tuple[str, ...] = ()) -> list[str]:
    """The run's files (RUN_FILES, and `also`) removed from the directory; their names."""
    found = [name for name in (*RUN_FILES, *also) if (path / name).exists()]
    for name in found:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return found


def summary_json(runs: list[RunFile], plots: dict[str, list[Chart]]) -> dict[str, Any]:
    first = runs[0].data
    return {
        "platform": sorted({r.data.get("platform", "?") for r in runs}),
        "versions": first.get("versions", {}),
        "runs": [{"title": r.title, "results": str(r.path), "date": r.data.get("date"),
                  "passed": r.data.get("passed"), "wall_s": r.data.get("wall_s"),
                  "outcomes": dict(r.counts()),
                  "cases": [{"id": c["id"], "outcome": c.get("outcome"), "reason": c.get("reason", "")}
                            for c in r.data["cases"]],
                  "plots": [str(p.png) for p in plots.get(str(r.path), [])]}
                 for r in runs],
        "outcomes": dict(sum((r.counts() for r in runs), Counter())),
    }


def _case_cell(case: dict) -> str:
    """The layout and the options of a case id (`tp2-pp1-cp1-dp2 [distopt]`)."""
    opts = case["id"].split("[", 1)[1].rstrip("]") if "[" in case["id"] else ""
    return f"{case['layout']} {opts}".rstrip()


def markdown(runs: list[RunFile], plots: dict[str, list[Chart]], out_dir: Path) -> str:
    first = runs[0].data
    versions = first.get("versions", {})
    total = sum((r.counts() for r in runs), Counter())
    lines = ["# Harness report", "",
             f"- platform: {', '.join(sorted({r.data.get('platform', '?') for r in runs}))}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
             f"- runs: {len(runs)}, cases: " + ", ".join(f"{total[k]} {k}" for k in OUTCOMES if total[k]), ""]
    lines.append(markdown_table(["run", "date", "wall", *OUTCOMES],
                                [[r.title, r.data.get("date", ""), f"{r.data.get('wall_s', 0):.0f}s",
                                  *(n[k] for k in OUTCOMES)] for r in runs for n in [r.counts()]]))
    lines += ["", "Where the time went (the phase timers: each case's slowest rank; rest: the parent between cases):",
              "", markdown_table(time_spent.HEADERS, time_spent.rows([(r.title, [r.data]) for r in runs]))]
    for r in runs:
        lines += ["", f"## {r.title}", "", f"results: `{r.path}`", ""]
        if r.partial:
            lines += [f"**partial** (a failure): {md_escape(r.partial)}", ""]
        if r.nothing_judged:
            lines += [f"**nothing judged** (a failure): {md_escape(r.nothing_judged)}", ""]
        if r.data.get("stopped"):
            lines += [f"**stopped after {len(r.data['cases'])} of {r.data.get('cases_planned', '?')} cases** "
                      f"(the environment could not run them): {md_escape(r.data['stopped'])}", ""]
        if not r.data["cases"]:
            continue
        lines.append(markdown_table(["#", "case", "outcome", "reason"],
                                    [[i, _case_cell(c), c.get("outcome", c["status"]), c.get("reason", "")]
                                     for i, c in enumerate(r.data["cases"], 1)]))
        for chart in plots.get(str(r.path), []):
            lines += ["", f"![{chart.png.stem}]({chart.png.relative_to(out_dir)})"]
        if not plots.get(str(r.path)):
            lines += ["", f"No plot: none of the report's plots draws from this run's results (they show {PLOTTED})."]
        failed = [c for c in r.data["checks"] if check_failed(c)]
        if failed:
            lines += ["", "### Failed checks", ""]
            for c in failed:
                lines += [f"- **{c['check']}** `{c['case_id']}`: {md_escape(c['message'])}"]
                lines += [f"    - {md_escape(d)}" for d in c.get("details", [])[:12]]
    return "\n".join(lines) + "\n"


def write_report(directory: Path, earlier_of: Callable[[list[RunFile]], Earlier] | None = None) -> dict[str, Path]:
    """Render every run under the directory (the HTML page against the earlier nights where `earlier_of` compares
    the runs with them: harness.history.nights.compare); returns what was written, by kind."""
    runs = load_runs(directory)
    charts = render_all(runs, directory / "plots")
    out = {"markdown": directory / "report.md", "json": directory / "report.json", "junit": directory / "junit.xml",
           "html": directory / "report.html"}
    atomic_write(out["markdown"], markdown(runs, charts, directory))
    atomic_write(out["json"], json.dumps(summary_json(runs, charts), indent=2))
    atomic_write(out["junit"], junit.render(runs, page=out["html"].name))
    write_page(runs, charts, out["html"], earlier_of(runs) if earlier_of else None)
    return {**out, **{c.png.stem: c.png for cs in charts.values() for c in cs}}
