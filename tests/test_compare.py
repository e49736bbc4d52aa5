"""harness compare's verdict from what the two sides measured (the rounds themselves run in other tests)."""

from __future__ import annotations

import argparse
import random

import pytest

from harness.commands.selection import CaseSelection
from harness.compare import CaseSamples


def _samples(mean: float, counters: dict[str, float], seed: int) -> dict[str, CaseSamples]:
    rng = random.Random(seed)
    steps = [mean * (1 + rng.gauss(0, 0.01)) for _ in range(30)]
    return {"tiny/tp1-pp1-cp1-dp2/distopt=1,overlap=1": CaseSamples(steps, [1.0] * 30, dict(counters))}


def _compare(monkeypatch, capsys, b_mean: float, b_counters: dict[str, float]) -> tuple[int, str]:
    from harness import compare

    a = _samples(100.0, {"rank0.flops": 1e9, "rank0.dp-cp/reduce_scatter.calls": 7.0}, 1)
    b = _samples(b_mean, b_counters, 2)
    monkeypatch.setattr(compare, "run_rounds", lambda *args, **kw: (a, b, ["A", "B"]))
    args = argparse.Namespace(engine=["mcore", "tests.faulty_engines:SmallBuckets"], megatron_core=None, package=None,
                              repo=None,
                              cache=None, rounds=5, steps_per_round=6, out=None)
    code = compare.compare_main(args, CaseSelection("step-perf", "tiny", 2), lambda msg: None)
    return code, capsys.readouterr().out


SAME = {"rank0.flops": 1e9, "rank0.dp-cp/reduce_scatter.calls": 7.0}


def test_same_time_and_same_work_passes(monkeypatch, capsys):
    code, out = _compare(monkeypatch, capsys, 100.0, SAME)
    assert code == 0 and "does the same work" in out


def test_differing_exact_counters_fail_even_when_b_is_not_slower(monkeypatch, capsys):
    code, out = _compare(monkeypatch, capsys, 100.0, {**SAME, "rank0.dp-cp/reduce_scatter.calls": 12.0})
    assert code == 1
    assert "B does different work than A on 1 case(s): its exact counters differ" in out
    assert "rank0.dp-cp/reduce_scatter.calls: 7.0 -> 12.0" in out


@pytest.mark.parametrize("b_mean,code", [(120.0, 1), (90.0, 0)])
def test_a_significant_slowdown_fails_and_a_speed_up_does_not(monkeypatch, capsys, b_mean, code):
    got, out = _compare(monkeypatch, capsys, b_mean, SAME)
    assert got == code, out
    if code:
        assert "B is slower than A beyond 5% (significant) on 1 case(s)" in out


def test_b_can_be_a_release_of_any_package(monkeypatch, tmp_path):
    from harness import bisect, compare

    built = []
    monkeypatch.setattr(bisect, "version_env", lambda name, version, cache: built.append((name, version)) or "/venv/py")
    args = argparse.Namespace(engine=None, megatron_core=None, package="megatron-bridge==0.3.1", repo=None)
    a, b = compare.sides_from_args(args, tmp_path)
    assert built == [("megatron-bridge", "0.3.1")] and (b.label, b.python) == ("B=megatron-bridge 0.3.1", "/venv/py")
    args.package, args.megatron_core = None, "0.16.0"
    assert compare.sides_from_args(args, tmp_path)[1].label == "B=megatron-core 0.16.0"


@pytest.mark.parametrize("argv,message", [
    (["--package", "megatron-bridge"], "--package 'megatron-bridge': expected NAME==VERSION"),
    (["--package", "megatron-bridge==0.3.1", "--megatron-core", "0.16.0"], "give B once"),
])
def test_a_malformed_package_is_bad_input(argv, message, capsys):
    from harness import cli

    assert cli.main(["compare", "--model", "tiny", "--world-size", "2", *argv]) == 2
    assert message in capsys.readouterr().err
