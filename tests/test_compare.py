"""harness compare's verdict from what the two sides measured (the rounds themselves run in other tests)."""

from __future__ import annotations

import argparse
import random

import pytest

from harness.selection import CaseSelection
from harness.compare import CaseSamples


def _samples(mean: float, counters: dict[str, float], seed: int, round_sd: float = 0.0,
             rounds: int = 5) -> dict[str, CaseSamples]:
    """`rounds` rounds of 6 steps; each round's steps share a drift of the machine (sd `round_sd`)."""
    rng = random.Random(seed)
    per_round = []
    for _ in range(rounds):
        drift = 1 + rng.gauss(0, round_sd)
        per_round.append([mean * drift * (1 + rng.gauss(0, 0.01)) for _ in range(6)])
    steps = [x for r in per_round for x in r]
    return {"tiny/tp1-pp1-cp1-dp2/distopt=1,overlap=1": CaseSamples(
        steps, [1.0] * len(steps), dict(counters), per_round, [[1.0] * 6 for _ in per_round])}


def _compare(monkeypatch, capsys, b_mean: float, b_counters: dict[str, float], round_sd: float = 0.0,
             seeds: tuple[int, int] = (1, 2), rounds: int = 5, gpus: int = 0) -> tuple[int, str]:
    """compare's verdict on the samples, on a machine with `gpus` GPUs (the minimum effect follows the ranks)."""
    from harness import compare

    monkeypatch.setattr("harness.platform.backend.cuda_device_count", lambda: gpus)

    a = _samples(100.0, {"rank0.flops": 1e9, "rank0.dp-cp/reduce_scatter.calls": 7.0}, seeds[0], round_sd, rounds)
    b = _samples(b_mean, b_counters, seeds[1], round_sd, rounds)
    monkeypatch.setattr(compare, "run_rounds", lambda *args, **kw: (a, b, ["A", "B"]))
    args = argparse.Namespace(engine=["mcore", "tests.plants.faulty_engines:SmallBuckets"], megatron_core=None, package=None,
                              repo=None,
                              cache=None, rounds=rounds, steps_per_round=6, out=None)
    code = compare.compare_main(args, CaseSelection("step-perf", "tiny", 2), lambda msg: None, {})
    return code, capsys.readouterr().out


SAME = {"rank0.flops": 1e9, "rank0.dp-cp/reduce_scatter.calls": 7.0}


def test_same_time_and_same_work_passes(monkeypatch, capsys):
    code, out = _compare(monkeypatch, capsys, 100.0, SAME)
    assert code == 0 and "does the same work" in out


@pytest.mark.parametrize("gpus,effect", [(0, "5%"), (2, "3%")])
def test_compare_judges_at_the_minimum_effect_of_the_ranks_it_runs(monkeypatch, capsys, gpus, effect):
    """--backend auto (the default) runs NCCL ranks where every rank has a GPU: judged at the GPU's effect."""
    code, out = _compare(monkeypatch, capsys, 100.0, SAME, gpus=gpus)
    assert code == 0 and f"min effect {effect}" in out


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


def test_rounds_are_the_units_a_drift_between_rounds_is_not_a_slowdown():
    """Steps of one round share the machine's state: between two identical engines whose rounds drift (sd 5%),
    a Mann-Whitney test over the pooled steps finds 'significant' slowdowns (4 in 40 at a 2% minimum effect,
    alpha 1%); over rounds none - most of those comparisons cannot tell at 5 rounds, and say so."""
    import statistics

    from scipy import stats

    from harness.compare import judge

    pooled_alarms, round_alarms, undecided = 0, 0, 0
    for seed in range(40):
        a = _samples(100.0, SAME, 2 * seed, round_sd=0.05)
        b = _samples(100.0, SAME, 2 * seed + 1, round_sd=0.05)
        (key,) = a
        pa, pb = ([x for r in side[key].rounds_step_ms for x in r] for side in (a, b))
        pooled_alarms += (stats.mannwhitneyu(pb, pa, alternative="greater").pvalue < 0.01
                          and statistics.median(pb) > 1.02 * statistics.median(pa))
        step, _, _ = judge(a, b, 0.02)[key]
        round_alarms += step.slower
        undecided += step.undecided
    assert pooled_alarms >= 2, pooled_alarms
    assert round_alarms == 0 and undecided >= 20, (round_alarms, undecided)


def test_a_comparison_that_cannot_tell_exits_5_and_says_why(monkeypatch, capsys):
    code, out = _compare(monkeypatch, capsys, 100.0, SAME, round_sd=0.08, seeds=(3, 4), rounds=3)
    assert code == 5, out
    assert "cannot tell on 1 case(s)" in out and "run more --rounds" in out and "CANNOT TELL" in out


def test_a_slowdown_beyond_the_drift_between_rounds_is_still_found(monkeypatch, capsys):
    code, out = _compare(monkeypatch, capsys, 125.0, SAME, round_sd=0.03, rounds=8)
    assert code == 1, out
    assert "paired t-test over the rounds" in out


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


def test_no_exposed_communication_in_any_round_reads_x1_and_nothing_more():
    from harness.checks.timing import compare_rounds

    none = compare_rounds([[0.0] * 6] * 3, [[0.0] * 6] * 3, 0.05)
    assert none.ratio == 1.0 and not none.slower and not none.undecided
    assert compare_rounds([[0.0] * 6] * 3, [[2.0] * 6] * 3, 0.05).ratio == float("inf")


def _results_json(out_dir, foreign: float) -> None:
    """What `harness run` writes for one step-perf case: its step times, exact counters and the others' load."""
    import json

    out_dir.mkdir(parents=True)
    (out_dir / "results.json").write_text(json.dumps({"cases": [{
        "id": "step-perf/mcore/tiny/tp1-pp1-cp1-dp2", "status": "ok", "reason": "",
        "baseline_key": "tiny/tp1-pp1-cp1-dp2/distopt=0,overlap=0",
        "data": {"step_ms": [100.0, 101.0, 99.0], "exposed_comm_ms": [1.0, 1.0, 1.0]},
        "samples": {"step_time_ms": 100.0, "exposed_comm_ms": 1.0, "calibration_ms": 5.0,
                    "foreign_cpu_share": foreign, "rank0.flops": 1e9}}]}))


def test_a_side_in_another_environment_does_the_same_work_whatever_the_machine_load(monkeypatch, tmp_path):
    """A release or commit side runs `harness run` in a subprocess; the others' share of the CPUs it reads is
    the machine's, not B's work: it is kept apart from the exact counters (it once read as a differing counter)."""
    import subprocess
    from pathlib import Path

    from harness import compare

    loads = iter([0.02, 0.31])

    def fake_run(cmd, **kwargs):
        _results_json(Path(cmd[cmd.index("--out") + 1]), next(loads))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    sel, args = CaseSelection("step-perf", "tiny", 2), argparse.Namespace(steps_per_round=3)
    a = compare._subprocess_round(compare.Side("A", python="/venv/a"), sel, args, tmp_path, 0)
    b = compare._subprocess_round(compare.Side("B", python="/venv/b"), sel, args, tmp_path, 0)
    key = "tiny/tp1-pp1-cp1-dp2/distopt=0,overlap=0"
    assert a[key].counters == b[key].counters == {"rank0.flops": 1e9}
    assert (a[key].foreign_share, b[key].foreign_share) == (0.02, 0.31)


def _with_load(samples: dict[str, CaseSamples], shares: list[float]) -> dict[str, CaseSamples]:
    for s in samples.values():
        s.rounds_foreign_share = list(shares)
    return samples


@pytest.mark.parametrize("b_mean,b_load,advice", [
    (100.0, 0.04, False),  # same time, little load: said, nothing to do
    (100.0, 0.35, False),  # much load but nothing slower or undecided: said, no advice
    (125.0, 0.35, True),  # slower beside 35% others: the way out
])
def test_compare_says_what_other_processes_used_of_the_machine(monkeypatch, capsys, b_mean, b_load, advice):
    from harness import compare

    a = _with_load(_samples(100.0, SAME, 1), [0.01, 0.03, 0.02, 0.01, 0.02])
    b = _with_load(_samples(b_mean, SAME, 2), [0.02, b_load, 0.01, 0.02, 0.01])
    monkeypatch.setattr(compare, "run_rounds", lambda *args, **kw: (a, b, ["A", "B"]))
    args = argparse.Namespace(engine=["mcore", "tests.plants.faulty_engines:SmallBuckets"], megatron_core=None, package=None,
                              repo=None, cache=None, rounds=5, steps_per_round=6, out=None)
    compare.compare_main(args, CaseSelection("step-perf", "tiny", 2), lambda msg: None, {})
    out = capsys.readouterr().out
    assert f"other processes used up to 3% of the CPUs while A's steps were timed, {b_load:.0%} while B's" in out
    assert ("stop them or compare on a quiet machine" in out) is advice, out
