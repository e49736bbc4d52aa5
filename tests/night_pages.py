"""Synthetic nights for the report page's tests: results files as `harness run --out` writes them, with a planted
regression, a case failing for nights, an inconclusive check, an interrupted run and charts to draw; earlier nights
in a history database."""

from __future__ import annotations

import json
from pathlib import Path

MIB = 1024 * 1024
TONIGHT = "2026-12-06T02:10:00"
VERSIONS = {"python": "3.12.1", "torch": "2.13.0", "megatron-core": "0.19.2", "harness_commit": "abc1234"}
RECORD = "harness baselines record --suite refit --model tiny --world-size 4 --layout tp2-pp1-cp1-dp2"
REFIT_CASES = ("refit/mcore/tiny/tp1-pp1-cp1-dp4", "refit/mcore/tiny/tp2-pp1-cp1-dp2",
               "refit/mcore/tiny/tp1-pp2-cp1-dp2[variant=untied]")


def _case(case_id: str, outcome: str, reason: str = "", data: dict | None = None) -> dict:
    layout = case_id.split("/", 3)[3].split("[")[0]
    return {"id": case_id, "layout": layout, "variant": "", "options": {}, "status": "ok", "outcome": outcome,
            "reason": reason, "wall_s": 1.0, "timings": {}, "metrics": {}, "data": data or {}}


def _check(name: str, case_id: str, passed: bool, message: str, details: list[str] | None = None,
           inconclusive: bool = False, value: float | None = None) -> dict:
    return {"check": name, "case_id": case_id, "passed": passed, "message": message, "details": details or [],
            "inconclusive": inconclusive, "value": value, "status": "inconclusive" if inconclusive else
            ("pass" if passed else "fail")}


def _write(path: Path, suite: str, model: str, cases: list[dict], checks: list[dict], date: str,
           versions: dict, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    passed = all(c["outcome"] in ("pass", "skipped", "inconclusive") for c in cases)
    (path / "results.json").write_text(json.dumps({
        "suite": suite, "model": model, "world_size": 4, "engine": "mcore", "backend": "gloo",
        "platform": "cpu-gloo", "versions": versions, "date": date, "wall_s": 12.0, "passed": passed,
        "verdict": "pass" if passed else "regression", "exit_code": 0 if passed else 1, "cases": cases,
        "checks": checks, **extra}))
    return path / "results.json"


def refit_run(path: Path, date: str = TONIGHT, versions: dict | None = None,
              outcomes: tuple[str, str, str] = ("pass", "regression", "regression")) -> Path:
    """Three refit cases; the second's export peak is planted twice its baseline, the third's one layer short."""
    cases, checks = [], []
    for case_id, outcome in zip(REFIT_CASES, outcomes):
        cases.append(_case(case_id, outcome, "" if outcome == "pass" else "refit.baseline failed"))
        ok = outcome == "pass"
        checks.append(_check("refit.baseline", case_id, ok,
                             "every rank's export peak within its baseline" if ok else
                             f"rank1.export_mib@512MiB 933 KiB is +447 KiB above baseline 486 +- 97 KiB; record this "
                             f"stack's with `{RECORD}`",
                             [] if ok else ["  rank0.export_mib@512MiB: 933 KiB, baseline 490 +- 98: regression"]))
    return _write(path, "refit", "tiny", cases, checks, date, versions or VERSIONS)


def ckpt_run(path: Path) -> Path:
    """Two checkpoint cases that pass, with save peaks and timelines to draw, one check that cannot tell."""
    peak = {"heap_peak": 30 * MIB, "children_heap_peak": 4 * MIB, "device_allocated_peak": 0,
            "device_reserved_peak": 0, "rss_before": 0, "timeline": [(t / 10, t * MIB) for t in range(10)]}
    ids = ("ckpt-memory/mcore/small/tp1-pp1-cp1-dp4[ckpt_format=torch_dist]",
           "ckpt-memory/mcore/small/tp2-pp1-cp1-dp2[ckpt_format=torch_dist]")
    cases = [_case(i, "pass", data={"save": {str(r): peak for r in range(4)}}) for i in ids]
    checks = [_check("ckpt-memory.peak", i, True, "within the baseline") for i in ids]
    checks.append(_check("ckpt-memory.async", ids[1], True, "one rank: the async and sync saves write the same "
                         "files", inconclusive=True))
    return _write(path, "ckpt-memory", "small", cases, checks, TONIGHT, VERSIONS)


def interrupted_run(path: Path) -> Path:
    case = _case("golden/mcore/tiny/tp1-pp1-cp1-dp4", "pass")
    return _write(path, "golden", "tiny", [case], [_check("golden.loss", case["id"], True, "equal")], TONIGHT,
                  VERSIONS, interrupted="SIGINT", cases_planned=4)


def night(root: Path) -> Path:
    """Tonight's results directory."""
    refit_run(root / "refit")
    ckpt_run(root / "ckpt-memory")
    interrupted_run(root / "golden")
    return root


def history(db: Path, tmp: Path) -> Path:
    """Two earlier nights on megatron-core 0.19.1: the untied case already failing, the TP 2 case passing."""
    from harness.history import store

    older = {**VERSIONS, "megatron-core": "0.19.1"}
    for day in ("2026-12-04", "2026-12-05"):
        refit_run(tmp / day, date=f"{day}T02:10:00", versions=older, outcomes=("pass", "pass", "regression"))
    con = store.open_db(db)
    try:
        store.ingest(con, tmp)
    finally:
        con.close()
    return db
