"""Runs read back: one results.json (as `harness run --out` writes it) as a RunFile, and every one under a
directory - what the report files, JUnit and the plots are rendered from."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import schema
from harness.errors import BadInput
from harness.outcomes import CaseStatus, Outcome

NIGHT_PLAN = "nightly.json"  # `harness nightly`'s plan against what ran, beside the night's results files


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
        return Counter(case_outcome(c) for c in self.data["cases"])


def case_outcome(case: dict[str, Any]) -> str:
    """A results file's case's outcome (one written before outcomes were kept: pass where it ran, else error)."""
    return case["outcome"] if "outcome" in case else (Outcome.PASS if case.get("status") == CaseStatus.OK
                                                      else Outcome.ERROR)


def read_run(path: Path) -> RunFile:
    """One results.json; BadInput where it is unreadable or not a harness results file."""
    try:
        data = json.loads(path.read_text())
        for key in ("suite", "engine", "model", "world_size", "cases", "checks"):
            data[key]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path} is not a harness results file ({type(exc).__name__}: {exc}); "
                       f"re-run the suite with `harness run ... --out {path.parent}`") from None
    data = schema.checked(data, schema.RESULTS, "results file", str(path),
                          f"re-run the suite with `harness run ... --out {path.parent}`")
    return RunFile(path, data)


def load_runs(directory: Path) -> list[RunFile]:
    """Every results.json below the directory (itself included), sorted by path; BadInput if none
    or one is unreadable."""
    if not directory.is_dir():
        raise BadInput(f"{directory} is not a directory; give the --out directory of `harness run` "
                       f"(or the --results-dir of the pytest suites)")
    runs = [read_run(path) for path in sorted(directory.rglob("results.json"))]
    if not runs:
        raise BadInput(f"no results.json under {directory}; write one with `harness run ... --out {directory}`")
    return runs
