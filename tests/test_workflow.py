"""A 20-case run: progress lines, every case run after failures, one summary with the right outcomes,
results.json and `harness report` (Markdown, JSON, JUnit XML)."""

from __future__ import annotations

import pytest

import json
import re
import xml.etree.ElementTree as ET

from harness import cli
from tests.plants.fake_suites import MIXED_PLAN


@pytest.mark.slow
def test_twenty_case_run_shows_progress_and_a_correct_summary(tmp_path, capsys):
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:Mixed", "--world-size", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1  # regressions, an improvement and an error: not a pass
    starts = re.findall(r"^\[(\d+)/20 (\d+:\d\d) elapsed(, ETA \d+:\d\d)?\] ", err, re.M)
    assert [int(s[0]) for s in starts] == list(range(1, 21))  # every case ran, failures did not stop the run
    assert not starts[0][2] and all(s[2] for s in starts[1:])  # an ETA once a case has finished
    assert "[13/20] tests.plants.fake_suites:Mixed/mcore/tiny/tp1-pp1-cp1-dp2[seed=1204] skipped in " in err
    assert "case needs package 'frobnicate': pip install frobnicate" in err

    summary = out.split("summary:\n", 1)[1]
    rows = [line.split() for line in summary.splitlines()[2:22]]
    outcomes = [r[3] for r in rows]
    expected = {0: "pass", 1: "regression", 2: "improvement", 3: "error", 4: "skipped"}
    assert outcomes == [expected[m] for m in MIXED_PLAN]
    assert "mixed.value: value 12.0 vs baseline 10.0 +- 1.0" in summary.splitlines()[2 + 6]
    # the phase that raised: the suite's rank_work, outside its timed phases (not the last one entered)
    assert "rank 1 failed in phase 'rank_work' - RuntimeError: planted failure on rank 1" in summary
    assert "case needs package 'frobnicate'" in summary
    assert re.search(r"^mixed: 15 checks passed, 4 failed \(20 cases, [0-9.]+s\): "
                     r"15 pass, 2 regression, 1 improvement, 1 error, 1 skipped$", out, re.M)

    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in results["cases"]] == outcomes

    assert cli.main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "| pass | regression | improvement | error | skipped | inconclusive | unjudged |" in md
    assert "| 15 | 2 | 1 | 1 | 1 | 0 | 0 |" in md
    assert "torch" in md and "cpu-gloo" in md  # versions and platform are named
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("20", "3", "1", "1")
    failure = suite.findall("testcase")[6].find("failure")
    assert failure.get("type") == "regression" and "value 12.0 vs baseline" in failure.get("message")
    assert json.loads((tmp_path / "report.json").read_text())["outcomes"] == {
        "pass": 15, "regression": 2, "improvement": 1, "error": 1, "skipped": 1}


@pytest.mark.slow
def test_a_run_where_every_case_is_skipped_judged_nothing_and_does_not_pass(tmp_path, capsys):
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:AllSkipped", "--world-size", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 5, out  # its own exit code: neither a pass (0) nor a failed check (1)
    assert "all-skipped: 0 checks passed, 0 failed (3 cases" in out and "3 skipped" in out
    assert ("all-skipped: NOTHING JUDGED - no check could judge anything (every case skipped or inconclusive, or none "
            "planned); this is not a pass (exit 5)") in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["passed"], results["verdict"]) == (False, "nothing judged")
    assert cli.main(["report", str(tmp_path)]) == 0
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "1", "3")
    failure = suite.findall("testcase")[-1].find("failure")
    assert failure.get("type") == "nothing-judged"
    assert "**nothing judged** (a failure): no check ran" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_a_case_that_no_check_judged_is_not_a_pass(tmp_path, capsys):
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:ForgetsACase", "--world-size", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "forgets-a-case: 2 checks passed, 0 failed (3 cases" in out and "2 pass, 1 unjudged" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in results["cases"]] == ["pass", "pass", "unjudged"]
    assert results["cases"][2]["reason"] == "the case ran but no check judged it"
    assert cli.main(["report", str(tmp_path)]) == 0
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("3", "1")


def test_nightly_counts_a_run_that_judged_nothing_as_a_failure(tmp_path, capsys, monkeypatch):
    from harness import nightly
    from harness.errors import BadInput

    def refuse(*args, **kwargs):
        raise BadInput("baseline file baselines/cpu-gloo/golden.json is corrupt")

    monkeypatch.setattr("harness.driver.execute", refuse)
    code = nightly.run_nightly(tmp_path, ["ckpt-memory"], ["small"], 2, "gloo", None, lambda msg: None)
    out = capsys.readouterr().out
    assert code == 1
    assert "NOTHING JUDGED" in out
    results = json.loads((tmp_path / "ckpt-memory-mcore-small" / "results.json").read_text())
    assert (results["passed"], results["verdict"]) == (False, "nothing judged")
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("1", "1")
    assert "corrupt" in suite.find("testcase").find("failure").get("message")


def test_an_interrupted_nightly_names_the_runs_it_did_not_run_at_the_top_of_its_page(tmp_path, capsys, monkeypatch):
    import signal
    from datetime import datetime, timezone

    from harness import nightly
    from harness.errors import Interrupted
    from harness.suite_run import SuiteRun

    def execute(planned, out_dir, **kwargs):  # the first run is stopped by SIGTERM after its one case
        run = SuiteRun(planned.suite, planned.model_name, planned.world_size, planned.backend, planned.engine)
        run.interrupted = Interrupted(signal.SIGTERM)
        out_dir.mkdir(parents=True)
        (out_dir / "results.json").write_text(json.dumps(
            {"suite": planned.suite.name, "engine": planned.engine, "model": planned.model_name, "world_size": 2,
             "cases": [], "checks": [], "interrupted": "SIGTERM", "cases_planned": 3,
             "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
        return run

    monkeypatch.setattr("harness.driver.execute", execute)
    code = nightly.run_nightly(tmp_path, ["equivalence", "golden"], ["tiny"], 2, "gloo", "mcore", lambda msg: None)
    assert code == 128 + signal.SIGTERM
    plan = json.loads((tmp_path / "nightly.json").read_text())
    assert {k: plan[k] for k in ("planned", "interrupted", "not_run")} == \
        {"planned": 2, "interrupted": "SIGTERM", "not_run": ["golden-mcore-tiny"]}
    page = (tmp_path / "report.html").read_text()
    top = page[:page.index("Did not pass tonight") if "Did not pass tonight" in page else page.index("Nothing regressed")]
    assert "the nightly was interrupted (SIGTERM): 1 of 2 runs did not run (golden-mcore-tiny)" in top
    assert "partial: interrupted (SIGTERM) after 0 of 3 cases" in top


def test_a_nightly_that_reuses_its_out_shows_tonights_runs_only_and_keeps_the_earlier_nights_in_the_history(
        tmp_path, capsys, monkeypatch):
    """Night 1 ran both runs; night 2, into the same --out, is stopped after the first: its page and report.json
    hold tonight's one run, not night 1's golden beside it; night 1's runs stay in the history database."""
    import signal
    import sqlite3
    from datetime import datetime, timezone

    from harness import nightly
    from harness.errors import Interrupted
    from harness.suite_run import SuiteRun

    def execute_until(stop_after: int):
        ran = []

        def execute(planned, out_dir, **kwargs):
            ran.append(planned.suite.name)
            run = SuiteRun(planned.suite, planned.model_name, planned.world_size, planned.backend, planned.engine)
            run.interrupted = Interrupted(signal.SIGTERM) if len(ran) == stop_after else None
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "results.json").write_text(json.dumps(
                {"suite": planned.suite.name, "engine": planned.engine, "model": planned.model_name,
                 "world_size": 2, "cases": [], "checks": [], "night": stop_after,
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
            return run
        return execute

    said = []
    monkeypatch.setattr("harness.driver.execute", execute_until(0))
    nightly.run_nightly(tmp_path, ["equivalence", "golden"], ["tiny"], 2, "gloo", "mcore", said.append)
    assert (tmp_path / "golden-mcore-tiny" / "results.json").exists()
    killed = tmp_path / "refit-mcore-tiny"  # a run of a night killed before its ingest
    killed.mkdir()
    (killed / "results.json").write_text(json.dumps(
        {"suite": "refit", "engine": "mcore", "model": "tiny", "world_size": 2, "cases": [], "checks": [],
         "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}))
    monkeypatch.setattr("harness.driver.execute", execute_until(1))
    nightly.run_nightly(tmp_path, ["equivalence", "golden"], ["tiny"], 2, "gloo", "mcore", said.append)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["title"].split(" / ")[0] for r in report["runs"]] == ["equivalence"]
    assert not (tmp_path / "golden-mcore-tiny").exists()  # not run tonight: last night's is not shown as tonight's
    assert f"nightly: {tmp_path} held 3 runs of an earlier night: in {tmp_path / 'history.sqlite'} (1 added now), " \
           "their files removed" in said
    with sqlite3.connect(tmp_path / "history.sqlite") as con:
        assert sorted(s for (s,) in con.execute("SELECT suite FROM runs")) == ["equivalence", "equivalence", "golden",
                                                                               "refit"]


def test_report_refuses_a_directory_without_results(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert f"no results.json under {tmp_path}" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "is not a harness results file" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


def test_nightly_plan_covers_every_suite_model_and_construction_path():
    from harness.nightly import plan_items

    items = plan_items(["grad-sync", "peft-ckpt"], ["default", "small"], None)
    paths = ["mcore", "mbridge", "megatron-bridge", "fsdp2"]
    assert [(i.suite, i.model, i.engine) for i in items] == [
        *(("grad-sync", "tiny", e) for e in paths), *(("grad-sync", "small", e) for e in paths),
        ("peft-ckpt", "small", "megatron-bridge")]  # small is its own model: once
    assert [i.engine for i in plan_items(["grad-sync"], ["default"], "my_rl.engine:make")] == ["my_rl.engine:make"]
    assert len(plan_items(["ckpt-memory"], ["default", "small"], None)) == 4  # small is its own model: once


def test_nightly_reports_a_pair_that_does_not_apply_and_is_no_failure(tmp_path, capsys, monkeypatch):
    """fsdp2 under grad-sync, a bridge and tiny-moe: not applicable rows; the applicable runs decide the exit."""
    from harness import nightly
    from harness.suite_run import SuiteRun

    ran = []

    def execute(planned, **kwargs):
        ran.append((planned.suite.name, planned.model_name, planned.engine))
        return SuiteRun(planned.suite, planned.model_name, planned.world_size, planned.backend, planned.engine)

    monkeypatch.setattr("harness.driver.execute", execute)
    monkeypatch.setattr("harness.report.directory.write_report",
                        lambda out, db=None: {"markdown": "-", "junit": "-", "html": "-"})
    for judged in ("passed", "conclusive"):  # as a run that judged and passed
        monkeypatch.setattr(f"harness.suite_run.SuiteRun.{judged}", property(lambda self: True))
    code = nightly.run_nightly(tmp_path, ["grad-sync"], ["tiny-moe"], 2, "gloo", None, lambda msg: None)
    out = capsys.readouterr().out
    assert ran == [("grad-sync", "tiny-moe", "mcore")]
    assert out.count("does not apply") == 3, out  # mbridge, megatron-bridge (no mapping), fsdp2 (not DDP)
    assert code == 0, out


@pytest.mark.slow
def test_checks_that_cannot_tell_are_neither_passes_nor_failures(tmp_path, capsys):
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:Blind", "--world-size", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, out  # one case judged and passed; nothing failed
    assert "[3/3] tests.plants.fake_suites:Blind/mcore/tiny/tp1-pp1-cp1-dp2[seed=200] skipped in 0.0s: needs world size 4, " \
           "the run has 2" in err
    assert re.search(r"^blind: 1 checks passed, 0 failed, 2 inconclusive \(3 cases, [0-9.]+s\): "
                     r"1 pass, 1 skipped, 1 inconclusive$", out, re.M), out
    assert "CANNOT TELL blind.sees tests.plants.fake_suites:Blind/mcore/tiny/tp1-pp1-cp1-dp2[seed=100]: cannot tell: both " \
           "answers look alike at this size: needs more ranks" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in results["cases"]] == ["pass", "inconclusive", "skipped"]
    assert [c["status"] for c in results["checks"]] == ["pass", "inconclusive", "inconclusive"]
    assert results["cases"][1]["reason"] == "blind.sees: cannot tell: both answers look alike at this size: needs more ranks"
    assert cli.main(["report", str(tmp_path)]) == 0
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("3", "0", "0", "2")
    first, second, third = suite.findall("testcase")
    assert first.find("skipped") is None and first.find("properties/property").get("name") == "inconclusive:blind.sees"
    assert second.find("skipped").get("type") == "inconclusive"
    assert third.find("skipped").get("message") == "needs world size 4, the run has 2"
    assert "| 1 | 0 | 0 | 0 | 1 | 1 | 0 |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_a_run_whose_every_check_cannot_tell_judged_nothing(tmp_path, capsys):
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:AllBlind", "--world-size", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 5, out
    assert "all-blind: 0 checks passed, 0 failed, 2 inconclusive" in out and "NOTHING JUDGED" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["passed"], results["verdict"]) == (False, "nothing judged")


@pytest.mark.slow
def test_cases_that_errored_without_a_failed_check_exit_3_not_1(tmp_path, capsys):
    """A broken environment (a case errored) and a regression are told apart: exit 3 and verdict 'errored'."""
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:BrokenEnvironment", "--world-size", "2",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 3, out
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["verdict"], results["exit_code"]) == ("errored", 3)
    assert [c["outcome"] for c in results["cases"]] == ["pass", "error", "pass"]
    assert cli.main(["report", str(tmp_path)]) == 0
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("errors"), suite.get("failures")) == ("1", "0")
    # one regression beside the error: the code's failure decides
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:Mixed", "--world-size", "2"])
    assert code == 1


@pytest.mark.slow
def test_a_nightly_whose_runs_only_errored_exits_3(tmp_path, capsys, monkeypatch):
    from harness import driver, nightly

    real = driver.plan
    monkeypatch.setattr("harness.driver.plan", lambda suite, *a, **k: real("tests.plants.fake_suites:BrokenEnvironment",
                                                                           *a, **k))
    code = nightly.run_nightly(tmp_path, ["equivalence"], ["tiny"], 2, "gloo", None, lambda msg: None)
    out = capsys.readouterr().out
    assert code == 3, out
    assert "ERRORED" in out


@pytest.mark.slow
def test_a_broken_environment_stops_the_run_after_its_first_cases(tmp_path, capsys):
    """Every case of an engine whose environment lacks a module errors in build alike: the run stops after
    broken_env.STOP_AFTER cases, names the module and the install once, keeps what ran, and exits 3."""
    from harness.broken_env import STOP_AFTER

    code = cli.main(["run", "--suite", "grad-sync", "--model", "tiny", "--world-size", "2",
                     "--engine", "tests.plants.faulty_engines:NeedsMissingModule", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 3, out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in results["cases"]] == ["error"] * STOP_AFTER
    assert results["cases_planned"] > STOP_AFTER and results["verdict"] == "errored"
    why = (f"the first {STOP_AFTER} cases all errored in phase 'build' with ModuleNotFoundError: No module named "
           f"'harness_missing_framework': the ranks cannot import 'harness_missing_framework': install it into the "
           f"environment the ranks run in (pip install harness_missing_framework")
    assert results["stopped"].startswith(why), results["stopped"]
    assert f"grad-sync: STOPPED after {STOP_AFTER} of {results['cases_planned']} cases: {why}" in out, out
    assert out.count("pip install harness_missing_framework") == 2  # once as it stops, once at the end
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "**stopped after 3 of" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_cases_that_error_each_for_a_reason_of_their_own_do_not_stop_the_run(tmp_path, capsys):
    code = cli.main(["run", "--suite", "tests.plants.fake_suites:OwnErrors", "--world-size", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 3, out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["outcome"] for c in results["cases"]] == ["error"] * 3 + ["pass"] * 2
    assert results["stopped"] is None and "STOPPED" not in out


def _errored(i: int, phase: str, exception: str, status: str = "error"):
    from harness.launch.results import CaseResult
    from harness.models import load_model
    from harness.spec import Case, Layout

    case = Case("grad-sync", load_model("tiny"), Layout(dp=2), "mcore")
    error = (f"case {case.id}: rank 0 failed in phase '{phase}'\nTraceback (most recent call last):\n"
             f"  File \"x.py\", line {i}, in build\n    import ray\n{exception}\n")
    return CaseResult(case, [], status, error=error if status != "ok" else "")


def test_only_the_first_cases_erring_alike_stop_a_run():
    from harness.broken_env import broken_environment

    missing = "ModuleNotFoundError: No module named 'ray.util'"
    why = broken_environment([_errored(i, "build", missing) for i in range(3)])
    assert why == ("the first 3 cases all errored in phase 'build' with ModuleNotFoundError: No module named "
                   "'ray.util': the ranks cannot import 'ray.util': install it into the environment the ranks run "
                   "in (pip install ray, or the distribution that provides it) and run again")
    assert broken_environment([_errored(i, "build", missing) for i in range(2)]) == ""  # not yet
    assert broken_environment([_errored(i, "build", missing) for i in range(4)]) == ""  # judged at the third only
    assert broken_environment([_errored(0, "build", missing), _errored(1, "build", "", "ok"),
                               _errored(2, "build", missing)]) == ""  # a case ran: the environment can
    assert broken_environment([_errored(0, "build", missing), _errored(1, "steps", missing),
                               _errored(2, "build", missing)]) == ""  # another phase
    assert broken_environment([_errored(i, "build", f"RuntimeError: layout {i}") for i in range(3)]) == ""
    assert broken_environment([_errored(i, "build", "x", "timeout") for i in range(3)]) == ""  # a hang is its own
    assert broken_environment([_errored(i, "build", "RuntimeError: CUDA driver too old") for i in range(3)]).endswith(
        "with RuntimeError: CUDA driver too old: fix what it names and run again")


def test_an_engine_the_suite_plans_no_case_for_is_refused_not_run_as_another():
    """A suite whose cases for --engine X are all another engine's (ckpt-memory on fsdp2 once ran megatron's
    saves of an MoE model under fsdp2's name) is refused before any rank, naming the engine to run."""
    from harness.driver import plan
    from harness.errors import DoesNotApply
    from harness.suite_defs import get_suite

    class OnlyMcore:
        def __init__(self, suite):
            self._suite = suite

        def __getattr__(self, name):
            return getattr(self._suite, name)

        def cases(self, *args, engine="mcore", **kwargs):
            return self._suite.cases(*args, engine="mcore", **kwargs)

    with pytest.raises(DoesNotApply, match=r"--engine megatron-bridge runs no case of this selection \(its cases are "
                                           r"mcore's alone\): run it with --engine mcore"):
        plan(OnlyMcore(get_suite("equivalence")), "tiny", 2, None, engine="megatron-bridge", backend="gloo")
