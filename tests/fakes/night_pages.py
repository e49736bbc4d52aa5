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
           inconclusive: bool = False, value: float | None = None, data: dict | None = None) -> dict:
    return {"check": name, "case_id": case_id, "passed": passed, "message": message, "details": details or [],
            "inconclusive": inconclusive, "value": value, "data": data or {},
            "status": "inconclusive" if inconclusive else ("pass" if passed else "fail")}


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
    """Three refit cases; a regression's export peak at 512 MiB buckets is planted twice its baseline. The checks'
    figures are the judge's own types, as results.json holds them."""
    from dataclasses import asdict

    from harness.baselines import BaselineFigures, BaselineStatus, Verdict
    from harness.checks import Agreement
    from harness.suite_defs.refit.judge import ExportPeaks

    cases, checks = [], []
    for case_id, outcome in zip(REFIT_CASES, outcomes):
        cases.append(_case(case_id, outcome, "" if outcome == "pass" else "refit.baseline failed"))
        ok = outcome == "pass"
        peak = (0.45 if ok else 0.91) * MIB
        verdicts = {f"rank{r}.export_mib@{size}": Verdict(BaselineStatus.PASS if ok or size == "8KiB"
                                                          else BaselineStatus.REGRESSION, measured, 0.47, 0.09)
                    for r in range(4) for size, measured in (("8KiB", 0.3), ("512MiB", peak / MIB))}
        checks.append(_check("refit.baseline", case_id, ok,
                             "every rank's export peak within its baseline" if ok else
                             f"rank1.export_mib@512MiB 933 KiB is +447 KiB above baseline 486 +- 97 KiB; record this "
                             f"stack's with `{RECORD}`",
                             [] if ok else ["  rank0.export_mib@512MiB: 933 KiB, baseline 490 +- 98: regression"],
                             data=asdict(BaselineFigures("tiny/x/fp32/mcore", verdicts))))
        for bucket, at in ((8 * 1024, 0.3 * MIB), (512 * MIB, peak)):
            checks.append(_check("refit.memory", case_id, True, "within", data=asdict(
                ExportPeaks(bucket, bucket + 2 * 64 * 1024 + MIB, {r: int(at) for r in range(4)}))))
        checks.append(_check("refit.policy", case_id, True, "agrees", value=9.8e-8,
                             data=asdict(Agreement(9.8e-8, 1e-5, 0, 512))))
    return _write(path, "refit", "tiny", cases, checks, date, versions or VERSIONS)


def batch_split_run(path: Path) -> Path:
    """A cut whose gradient norm drifts from its reference's (the plant) beside one equal bit for bit."""
    from dataclasses import asdict

    from harness.checks import StepSeries

    ref = "batch-split/mcore/tiny/tp1-pp1-cp1-dp1[cut=mbs16]"
    good = "batch-split/mcore/tiny/tp1-pp1-cp2-dp2[cut=tokens96]"
    bad = "batch-split/mcore/tiny/tp2-pp1-cp1-dp2[cut=mbs2]"
    cases = [_case(ref, "pass"), _case(good, "pass"), _case(bad, "regression", "batch-split.grad_norm failed")]
    for c, cut in zip(cases, ("mbs16", "tokens96", "mbs2")):
        c["params"] = {"mode": "token-mean", "cut": cut, "like": "", "temperature": 1.0}
    want = [4.88, 4.87, 4.86]
    checks = []
    for cid, got_norm in ((good, [1.5, 1.4, 1.3]), (bad, [1.5, 1.47, 1.39])):
        checks.append(_check("batch-split.loss", cid, True, "equal", data=asdict(StepSeries("loss", want, want, ref,
                                                                                          1e-5))))
        ok = cid == good
        checks.append(_check("batch-split.grad_norm", cid, ok, "equal" if ok else "grad norm of step 1 differs",
                             data=asdict(StepSeries("grad norm", got_norm, [1.5, 1.4, 1.3], ref, 1e-5))))
    return _write(path, "batch-split", "tiny", cases, checks, TONIGHT, VERSIONS)


def rl_cycle_run(path: Path) -> Path:
    """Two cases' device residue per iteration: one flat, one growing every iteration (the plant)."""
    ids = ("rl-cycle/mcore/tiny/tp1-pp1-cp1-dp4", "rl-cycle/mcore/tiny/tp2-pp1-cp1-dp2")
    flat = {str(r): [70 * 1024] * 4 for r in range(4)}
    grows = {str(r): [70 * 1024 * (i + 1) for i in range(4)] for r in range(4)}
    cases = [_case(ids[0], "pass", data={"residue_bytes": flat, "residue_bound_bytes": 192 * 1024}),
             _case(ids[1], "regression", "rl-cycle.offload failed",
                   data={"residue_bytes": grows, "residue_bound_bytes": 192 * 1024})]
    checks = [_check("rl-cycle.offload", ids[0], True, "flat"),
              _check("rl-cycle.offload", ids[1], False, "the device held more after every offload")]
    return _write(path, "rl-cycle", "tiny", cases, checks, TONIGHT, VERSIONS)


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


def night(root: Path, rl: bool = False) -> Path:
    """Tonight's results directory (rl: the batch-split and rl-cycle runs too)."""
    refit_run(root / "refit")
    ckpt_run(root / "ckpt-memory")
    interrupted_run(root / "golden")
    if rl:
        batch_split_run(root / "batch-split")
        rl_cycle_run(root / "rl-cycle")
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
