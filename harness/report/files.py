"""`harness report DIR`: every results.json under DIR rendered as report.md, report.json, junit.xml
and plots/*.png, written next to them."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.files import atomic_write
from harness.outcomes import OUTCOMES, check_failed
from harness.tables import markdown_table, md_escape


@dataclass
class RunFile:
    """One suite run as written by `harness run --out` (results.json)."""

    path: Path
    data: dict[str, Any]

    @property
    def title(self) -> str:
        d = self.data
        dist = d.get("engine_dist") or {}
        engine = d["engine"] + (f" {dist['version']}" if dist.get("version") and dist.get("name") not in
                                ("megatron-core", "torch") else "")
        return (f"{d['suite']} / {engine} / {d['model']} / world size {d['world_size']}"
                + (f" [{d['label']}]" if d.get("label") else ""))

    @property
    def slug(self) -> str:
        d = self.data
        return f"{d['suite']}-{d['engine']}-{d['model']}-ws{d['world_size']}".replace(":", "-").replace("/", "-")

    @property
    def partial(self) -> str:
        """Why the file holds fewer cases or verdicts than planned ('' when it is whole)."""
        d = self.data
        if d.get("interrupted"):
            return f"interrupted ({d['interrupted']}) after {len(d['cases'])} of {d.get('cases_planned', '?')} cases"
        if d.get("judged") is False:
            return (f"written while the run was going ({len(d['cases'])} of {d.get('cases_planned', '?')} cases "
                    f"measured, not judged): the run ended without finishing")
        return ""

    @property
    def nothing_judged(self) -> str:
        """Why nothing was judged in this run ('' when something was): no check ran, or the run was
        refused (nightly records a BadInput that way)."""
        d = self.data
        if d.get("nothing_judged"):
            return d["nothing_judged"]
        if d.get("verdict") == "nothing judged" or (not d["checks"] and not d["cases"] and not self.partial):
            return "no check ran: every case was skipped or none was planned"
        return ""

    def counts(self) -> Counter:
        return Counter(c.get("outcome", "pass" if c["status"] == "ok" else "error") for c in self.data["cases"])


def load_runs(directory: Path) -> list[RunFile]:
    """Every results.json below the directory (itself included), sorted by path; BadInput if none
    or one is unreadable."""
    if not directory.is_dir():
        raise BadInput(f"{directory} is not a directory; give the --out directory of `harness run` "
                       f"(or the --results-dir of the pytest suites)")
    runs = []
    for path in sorted(directory.rglob("results.json")):
        try:
            data = json.loads(path.read_text())
            for key in ("suite", "engine", "model", "world_size", "cases", "checks"):
                data[key]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{path} is not a harness results file ({type(exc).__name__}: {exc}); "
                           f"re-run the suite with `harness run ... --out {path.parent}`") from None
        runs.append(RunFile(path, data))
    if not runs:
        raise BadInput(f"no results.json under {directory}; write one with `harness run ... --out {directory}`")
    return runs


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


def summary_json(runs: list[RunFile], plots: dict[str, list[Path]]) -> dict[str, Any]:
    first = runs[0].data
    return {
        "platform": sorted({r.data.get("platform", "?") for r in runs}),
        "versions": first.get("versions", {}),
        "runs": [{"title": r.title, "results": str(r.path), "date": r.data.get("date"),
                  "passed": r.data.get("passed"), "wall_s": r.data.get("wall_s"),
                  "outcomes": dict(r.counts()),
                  "cases": [{"id": c["id"], "outcome": c.get("outcome"), "reason": c.get("reason", "")}
                            for c in r.data["cases"]],
                  "plots": [str(p) for p in plots.get(str(r.path), [])]}
                 for r in runs],
        "outcomes": dict(sum((r.counts() for r in runs), Counter())),
    }


def _case_cell(case: dict) -> str:
    """The layout and the options of a case id (`tp2-pp1-cp1-dp2 [distopt]`)."""
    opts = case["id"].split("[", 1)[1].rstrip("]") if "[" in case["id"] else ""
    return f"{case['layout']} {opts}".rstrip()


def markdown(runs: list[RunFile], plots: dict[str, list[Path]], out_dir: Path) -> str:
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
    for r in runs:
        lines += ["", f"## {r.title}", "", f"results: `{r.path}`", ""]
        if r.partial:
            lines += [f"**partial** (a failure): {md_escape(r.partial)}", ""]
        if r.nothing_judged:
            lines += [f"**nothing judged** (a failure): {md_escape(r.nothing_judged)}", ""]
        if not r.data["cases"]:
            continue
        lines.append(markdown_table(["#", "case", "outcome", "reason"],
                                    [[i, _case_cell(c), c.get("outcome", c["status"]), c.get("reason", "")]
                                     for i, c in enumerate(r.data["cases"], 1)]))
        for png in plots.get(str(r.path), []):
            lines += ["", f"![{png.stem}]({png.relative_to(out_dir)})"]
        failed = [c for c in r.data["checks"] if check_failed(c)]
        if failed:
            lines += ["", "### Failed checks", ""]
            for c in failed:
                lines += [f"- **{c['check']}** `{c['case_id']}`: {md_escape(c['message'])}"]
                lines += [f"    - {md_escape(d)}" for d in c.get("details", [])[:12]]
    return "\n".join(lines) + "\n"


def write_report(directory: Path) -> dict[str, Path]:
    """Render every run under the directory; returns what was written, by kind."""
    from harness.report import junit, plots

    runs = load_runs(directory)
    pngs = plots.render_all(runs, directory / "plots")
    out = {"markdown": directory / "report.md", "json": directory / "report.json", "junit": directory / "junit.xml"}
    atomic_write(out["markdown"], markdown(runs, pngs, directory))
    atomic_write(out["json"], json.dumps(summary_json(runs, pngs), indent=2))
    atomic_write(out["junit"], junit.render(runs))
    return {**out, **{p.stem: p for ps in pngs.values() for p in ps}}
