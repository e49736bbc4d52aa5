"""Tonight against the earlier nights of the history database, for the night's page: each case that does not pass,
new tonight or failing since which night (and, new on another stack, the bisects between the two nights); where the
stack changed since the last night; the cases that pass again."""

from __future__ import annotations

import json
import shlex
import sqlite3

from packaging.version import InvalidVersion, Version

from harness.history.show import bisectable, changed_between
from harness.outcomes import NOT_PASSING, Outcome
from harness.report.page import Earlier, Since
from harness.report.runs import RunFile, case_outcome
from harness.selection import case_argv
from harness.stack import COMPONENTS


def bisect_commands(case_id: str, world_size: int, before: dict[str, str], after: dict[str, str]) -> list[str]:
    """One `harness bisect --package` per package whose version changed between the night the case passed and
    tonight (the engine's first), judging the case's verdict (--metric fail); --find-fix where tonight's release is
    the older one."""
    out = []
    for name, (was, now) in bisectable(changed_between(before, after)):
        try:
            older = Version(now) < Version(was)
        except InvalidVersion:  # a local build, a commit: nothing to walk over
            continue
        lo, hi = (now, was) if older else (was, now)
        out.append(shlex.join(["harness", "bisect", "--package", name, f"{lo}..{hi}",
                               *case_argv(case_id, world_size), "--metric", "fail",
                               *(["--find-fix"] if older else [])]))
    return out


def compare(con: sqlite3.Connection, runs: list[RunFile]) -> Earlier:
    """Each failing case's `since` from the earlier nights of the same suite, model, engine, world size, label and
    platform (a night is a run dated before tonight's; a run with none is its first night in the history); the
    stack's change since the last such night; the cases that failed then and pass tonight."""
    out = Earlier()
    for run in runs:
        d = run.data
        tonight = d.get("date")
        if not tonight:
            continue
        earlier = con.execute(
            "SELECT id, date, versions FROM runs WHERE suite=? AND model=? AND engine=? AND world_size=? "
            "AND IFNULL(label,'')=? AND platform=? AND date < ? ORDER BY date DESC, id DESC",
            (d["suite"], d["model"], d["engine"], d["world_size"], d.get("label") or "", d.get("platform", "?"),
             tonight)).fetchall()
        if not earlier:
            for case in d["cases"]:
                if case_outcome(case) in NOT_PASSING:
                    out.since[case["id"]] = Since("its first night in the history")
            continue
        last = json.loads(earlier[0][2])
        changed = [f"{n} {last.get(n)} -> {d.get('versions', {}).get(n)}" for n in COMPONENTS
                   if last.get(n) != d.get("versions", {}).get(n)]
        if changed:
            out.stack_notes.append(f"{run.title}: {', '.join(changed)} since {earlier[0][1][:10]}")
        for case in d["cases"]:

            def outcome_on(i: int, case_id: str = case["id"], nights: list = earlier) -> str | None:
                row = con.execute("SELECT outcome FROM outcomes WHERE run_id=? AND case_id=?",
                                  (nights[i][0], case_id)).fetchone()
                return row[0] if row else None

            outcome, before = case_outcome(case), outcome_on(0)
            if outcome not in NOT_PASSING:
                if outcome == Outcome.PASS and before in NOT_PASSING:
                    out.fixed.append(f"{case['id']}: {before} on {earlier[0][1][:10]}, {outcome} tonight")
                continue
            streak = 0
            while streak < len(earlier) and (before if streak == 0 else outcome_on(streak)) in NOT_PASSING:
                streak += 1  # one query a night back, to the last night it did not fail
            if streak == 0:
                out.since[case["id"]] = Since(f"new tonight (it was {before or 'not run'} on {earlier[0][1][:10]})",
                                              new=True)
                out.bisect[case["id"]] = bisect_commands(case["id"], d["world_size"], last, d.get("versions", {}))
            else:
                out.since[case["id"]] = Since(f"since {earlier[streak - 1][1][:10]} ({streak + 1} nights)")
    return out
