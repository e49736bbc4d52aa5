"""Where a run's time went, from the harness's own phase timers (results.json data alone): per run, the seconds its
cases spent starting ranks, importing, building, stepping and in the suite's other phases (saves, loads, exports,
offloads, ...), the parent's judging, and the rest of the wall (the parent's planning and bookkeeping between cases).
`harness report DIR` writes the table; tests/support/phase_table.py makes the same per test module."""

from __future__ import annotations

from typing import Any

# phase timer names (harness/launch/worker.py, the suites' ctx.phase) folded into the table's columns
COLUMNS = ("rank start", "imports", "build", "steps", "other phases", "judging", "rest")
_FOLD = {"rank_start": "rank start", "imports": "imports", "init": "build", "build": "build", "steps": "steps"}


def spent(data: dict[str, Any]) -> dict[str, float]:
    """A results.json's seconds per column: its cases' phase timings (each case's slowest rank), summed; judging;
    the rest of its wall."""
    out = dict.fromkeys(COLUMNS, 0.0)
    cases_wall = 0.0
    for case in data.get("cases", []):
        cases_wall += float(case.get("wall_s") or 0.0)
        for phase, seconds in (case.get("timings") or {}).items():
            out[_FOLD.get(phase, "other phases")] += float(seconds)
    out["judging"] = float(data.get("judge_s") or 0.0)
    out["rest"] = max(0.0, float(data.get("wall_s") or 0.0) - cases_wall - out["judging"])
    return out


def rows(named: list[tuple[str, list[dict[str, Any]]]]) -> list[list[str]]:
    """One table row per name (a run, a test module): its runs' cases, wall and seconds per column, summed."""
    out = []
    for name, runs in named:
        total = dict.fromkeys(COLUMNS, 0.0)
        for data in runs:
            for k, v in spent(data).items():
                total[k] += v
        wall = sum(float(d.get("wall_s") or 0.0) for d in runs)
        cases = sum(len(d.get("cases", [])) for d in runs)
        out.append([name, str(len(runs)), str(cases), f"{wall:.0f}", *(f"{total[c]:.0f}" for c in COLUMNS)])
    return out


HEADERS = ["", "runs", "cases", "wall s", *(f"{c} s" for c in COLUMNS)]
