"""Baselines lifecycle: noisy metrics are refused at record time (nothing written), diff against git
or another file, provenance in every recorded entry."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from harness import baselines, cli, driver, recording, stack
from harness.suite_registry import spec_of


@dataclass
class FakeSuite:
    values: list  # one value per repeat
    name: str = "ckpt-memory"
    calls: list = field(default_factory=list)

    def samples(self, result):
        return {"rank0.save_heap_peak_mib": self.values[len(self.calls) - 1]}

    @staticmethod
    def key(case):
        return "small/tp1-pp1-cp1-dp4/default"

    @staticmethod
    def record_command(case):
        return "harness baselines record --suite ckpt-memory"


def _fake_runs(monkeypatch, values):
    suite = FakeSuite(values)

    def execute(planned, **kwargs):
        suite.calls.append(1)
        run = SimpleNamespace(suite=suite, backend="gloo", params=None,
                              results=[SimpleNamespace(ok=True, skipped=False, case=None)])
        run.stop_if_interrupted = lambda: run  # a run that was not interrupted
        return run
    monkeypatch.setattr(driver, "execute", execute)


def test_noisy_metric_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    _fake_runs(monkeypatch, [10.0, 10.5, 13.0])  # spread 3.0 > max(20% of 10.5, 0.25)
    with pytest.raises(RuntimeError) as exc:
        recording.record_suite("ckpt-memory", "small", 4, baselines_dir=str(tmp_path))
    assert "not recording: 1 metric(s) too noisy to baseline" in str(exc.value)
    assert ("small/tp1-pp1-cp1-dp4/default rank0.save_heap_peak_mib: spread 3.000 over 3 repeats > tolerance 2.100 "
            "(values 10.000, 10.500, 13.000)") in str(exc.value)
    assert not list(tmp_path.rglob("*"))


def test_quiet_metric_is_recorded_with_provenance(tmp_path, monkeypatch):
    _fake_runs(monkeypatch, [10.0, 10.5, 11.0])
    path, diff = recording.record_suite("ckpt-memory", "small", 4, baselines_dir=str(tmp_path))
    assert diff == "+ small/tp1-pp1-cp1-dp4/default rank0.save_heap_peak_mib: 10.5 (tolerance 4.0, spread 1.0)"
    data = json.loads(path.read_text())
    prov = data["provenance"]["small/tp1-pp1-cp1-dp4/default"]
    assert {"torch", "megatron-core", "date", "repeats"} <= set(prov) and prov["repeats"] == 3


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_diff_against_git_and_against_a_file(tmp_path, capsys):
    path = baselines.suite_path(tmp_path, "cpu-gloo", "ckpt-memory")  # this stack's file
    old = baselines.build_entries({"k/a": {"m": [10.0, 10.0, 10.0]}, "k/b": {"m": [5.0, 5.0, 5.0]}})
    baselines.write(path, "ckpt-memory", "cpu-gloo", old, {})
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "add", ".")
    _git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "baselines")
    saved = tmp_path / "old.json"
    saved.write_text(path.read_text())
    data = json.loads(path.read_text())
    del data["entries"]["k/b"]
    data["entries"]["k/a"]["m"]["value"] = 12.0
    path.write_text(json.dumps(data))
    for extra in ([], ["--old", str(saved)]):
        assert cli.main(["baselines", "diff", "--suite", "ckpt-memory", "--baselines-dir", str(tmp_path), *extra]) == 0
        out = capsys.readouterr().out
        assert "~ k/a m: 10.0 -> 12.0 (+2.000, +20.0%; tolerance 2.0 -> 2.0)" in out
        assert "- k/b m: 5.0" in out
    assert cli.main(["baselines", "diff", "--suite", "ckpt-memory", "--baselines-dir", str(tmp_path),
                     "--against", "no-such-rev"]) == 2
    assert f"cannot read cpu-gloo/{stack.key()}/ckpt-memory.json at revision 'no-such-rev'" in capsys.readouterr().err


# -- record --missing: what the regression suites look for and a platform lacks ------------------------------

def test_the_committed_cpu_baselines_hold_every_entry_the_cpu_suite_looks_for():
    """`nox -s cpu-suite` (gloo, world size 4) finds an entry for every baselined case it runs; planned only."""
    assert recording.missing_baselines(4, "gloo") == []


def test_an_empty_platform_lacks_every_baselined_run_of_the_regression_suites(tmp_path):
    from harness.suite_defs import REGRESSION_RUNS, Baselined, get_suite

    todo = recording.missing_baselines(4, "gloo", str(tmp_path))
    assert {(m.suite, m.model) for m in todo} == {
        (r.suite, r.model or get_suite(r.suite).default_model) for r in REGRESSION_RUNS
        if isinstance(get_suite(r.suite), Baselined)}
    # a stack-bound suite records under this stack's directory, golden (one trajectory for every stack) beside them
    assert all(len(m.missing) == m.planned and m.path.parent == tmp_path / "cpu-gloo" / (
        stack.key() if spec_of(m.suite).stack_bound else "") for m in todo)
    saves = next(m for m in todo if (m.suite, m.model) == ("ckpt-memory", "small"))
    # 19 saves and the contract's 4 cases, whose loads' peaks are baselined (the DP-only load at half the DP)
    contract = [k for k in saves.missing if k.endswith(("/reshard", "/reshard-load"))]
    assert len(saves.missing) == 23 and contract == [
        "small/tp1-pp1-cp1-dp4/dp_reshardable/reshard", "small/tp1-pp1-cp1-dp2/dp_reshardable/reshard-load",
        "small/tp1-pp1-cp1-dp4/fully_reshardable/reshard", "small/tp1-pp1-cp1-dp2/fully_reshardable/reshard-load"]


def _fake_recorder(monkeypatch, refuse: str = ""):
    """record_suite writing one entry per planned key of the run (refusing the suite `refuse`, as a noisy or busy
    machine is refused); what it was asked to record."""
    from harness.driver import plan
    asked = []

    def record_suite(suite, model, world_size, layout_ids=None, *, repeats=3, baselines_dir=None, backend="auto"):
        asked.append((suite, model, world_size, layout_ids, repeats, backend))
        if suite == refuse:
            raise RuntimeError("not recording: 1 metric(s) too noisy to baseline")
        planned = plan(suite, model, world_size, backend=backend, baselines_dir=baselines_dir)
        found, cases = planned.suite, planned.cases
        path = baselines.suite_path(baselines_dir, "cpu-gloo", found.name)
        keys = {found.key(c) for c in cases if not c.skip_reason}  # as record_suite: a skipped case records nothing
        data = baselines.load(path)
        entries = {**data.get("entries", {}), **baselines.build_entries({k: {"m": [1.0] * 3} for k in keys})}
        return path, baselines.write(path, found.name, "cpu-gloo", entries, data.get("provenance", {}))

    monkeypatch.setattr(recording, "record_suite", record_suite)
    return asked


def test_record_missing_records_each_lacking_run_then_finds_nothing(tmp_path, monkeypatch, capsys):
    asked = _fake_recorder(monkeypatch)
    argv = ["baselines", "record", "--missing", "--backend", "gloo", "--world-size", "2", "--baselines-dir",
            str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "step-perf tiny-moe: 7 of 7 entries missing from " in out
    assert re.search(r"recorded every missing baseline of the regression suites at world size 2 \(10 runs in \d+ s\)$",
                     out.rstrip())
    assert len(re.findall(r"^recorded \S+ in \d+ s:$", out, re.M)) == 10  # each run's own time
    assert ("golden", "tiny-moe", 2, None, 3, "gloo") in asked and len(asked) == 10
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("nothing missing: every baseline the regression suites look for at "
                                              "world size 2 is recorded")


def test_record_missing_at_world_size_1_finds_nothing_once_recorded(tmp_path, monkeypatch, capsys):
    """At world size 1 some planned cases are skipped (the DP-only reshard load needs DP 2): they are not looked
    for, as they are not recorded, so a second run finds nothing missing."""
    asked = _fake_recorder(monkeypatch)
    argv = ["baselines", "record", "--missing", "--backend", "gloo", "--world-size", "1", "--baselines-dir",
            str(tmp_path)]
    assert cli.main(argv) == 0 and asked
    assert "ckpt-memory small: 13 of 13 entries missing from " in capsys.readouterr().out
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("nothing missing: ")
    assert len(asked) == len({a[:2] for a in asked})  # each run recorded once


def test_record_missing_goes_on_past_a_refused_run_and_exits_1_naming_it(tmp_path, monkeypatch, capsys):
    asked = _fake_recorder(monkeypatch, refuse="step-perf")
    code = cli.main(["baselines", "record", "--missing", "--backend", "gloo", "--world-size", "2", "--baselines-dir",
                     str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and len(asked) == 10
    assert re.search(r"harness: error: 2 of 10 runs not recorded \(\d+ s in all\):\n", err)
    assert err.rstrip().endswith(" in all):\n"
                                 "  step-perf small: not recording: 1 metric(s) too noisy to baseline\n"
                                 "  step-perf tiny-moe: not recording: 1 metric(s) too noisy to baseline")
    assert [(m.suite, m.model) for m in recording.missing_baselines(2, "gloo", str(tmp_path))] == [
        ("step-perf", "small"), ("step-perf", "tiny-moe")]


def test_the_regression_runs_are_what_the_suites_run():
    """harness.suite_defs.REGRESSION_RUNS, which `record --missing` records, against suites/test_*.py: every
    suite_runner call's suite and model, and the runs skipped off CPU ranks."""
    import re
    from pathlib import Path

    from harness.suite_defs import REGRESSION_RUNS

    runs, cpu_only = set(), set()
    for path in sorted((Path(__file__).resolve().parents[1] / "suites").glob("test_*.py")):
        text = path.read_text()
        for suite, model in re.findall(r'suite_runner\("([a-z-]+)"(?:[^)]*?model="([a-z0-9-]+)")?', text):
            runs.add((suite, model or None))
        cpu_only |= set(re.findall(r'skip_off_cpu\("([a-z-]+)", "([a-z0-9-]+)"', text))
    assert {(r.suite, r.model) for r in REGRESSION_RUNS} == runs
    assert {(r.suite, r.model) for r in REGRESSION_RUNS if r.cpu_only} == cpu_only


def _two_recordings_at_once(tmp_path, monkeypatch, wait_s: float) -> set:
    """Two recordings into one file at the same moment, each reading the file before either writes if nothing
    makes them take turns (the first reader waits up to wait_s for the second); the file's entries after."""
    import threading

    path = tmp_path / "cpu-gloo" / "step-perf.json"
    load, reads, second_read = baselines.load, [], threading.Event()

    def load_then_wait(p):
        data = load(p)
        reads.append(p)
        if len(reads) == 1:
            second_read.wait(wait_s)
        else:
            second_read.set()
        return data

    monkeypatch.setattr(baselines, "load", load_then_wait)
    threads = [threading.Thread(target=baselines.write, args=(path, "step-perf", "cpu-gloo", baselines.build_entries(
        {key: {"m": [1.0, 1.0, 1.0]}}), {})) for key in ("small/a", "small/b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return set(load(path)["entries"])


def test_two_recordings_into_one_file_keep_both(tmp_path, monkeypatch):
    assert _two_recordings_at_once(tmp_path, monkeypatch, wait_s=0.5) == {"small/a", "small/b"}


def test_without_the_lock_one_recording_writes_over_the_other(tmp_path, monkeypatch):
    """The plant: the write's directory lock taken away; both read the empty file, the second write wins."""
    import contextlib

    monkeypatch.setattr(baselines, "locked_dir", lambda path: contextlib.nullcontext())
    assert len(_two_recordings_at_once(tmp_path, monkeypatch, wait_s=60)) == 1


def test_a_suite_that_sizes_its_recording_says_so_after_the_changes(tmp_path, monkeypatch):
    """A suite with recording_notes (step-perf: what its timed steps detect) has them printed after the diff."""
    seen = []

    class Sizing(FakeSuite):
        def recording_notes(self, entries, params, backend):
            seen.append((sorted(entries), params, backend))
            return ["small/tp1-pp1-cp1-dp4/default: 20 timed steps detect >= 4.0% slower"]

    suite = Sizing([10.0, 10.5, 11.0])

    def execute(planned, **kwargs):
        suite.calls.append(1)
        run = SimpleNamespace(suite=suite, backend="gloo", params="the run's params",
                              results=[SimpleNamespace(ok=True, skipped=False, case=None)])
        run.stop_if_interrupted = lambda: run
        return run

    monkeypatch.setattr(driver, "execute", execute)
    _, text = recording.record_suite("ckpt-memory", "small", 4, baselines_dir=str(tmp_path))
    assert text.splitlines() == ["+ small/tp1-pp1-cp1-dp4/default rank0.save_heap_peak_mib: 10.5 (tolerance 4.0, "
                                 "spread 1.0)", "small/tp1-pp1-cp1-dp4/default: 20 timed steps detect >= 4.0% slower"]
    assert seen == [(["small/tp1-pp1-cp1-dp4/default"], "the run's params", "gloo")]
