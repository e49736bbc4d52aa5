"""Baselines lifecycle: noisy metrics are refused at record time (nothing written), diff against git
or another file, provenance in every recorded entry."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from harness import baselines, cli, driver, recording


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

    def run_suite(*args, **kwargs):
        suite.calls.append(1)
        run = SimpleNamespace(suite=suite, backend="gloo", results=[SimpleNamespace(ok=True, skipped=False, case=None)])
        run.stop_if_interrupted = lambda: run  # a run that was not interrupted
        return run
    monkeypatch.setattr(driver, "run_suite", run_suite)


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
    path = tmp_path / "cpu-gloo" / "ckpt-memory.json"
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
    assert "cannot read cpu-gloo/ckpt-memory.json at revision 'no-such-rev'" in capsys.readouterr().err
