"""The equivalence suite: its checks on fabricated results, a real passing run, and a planted TP bug."""

from __future__ import annotations

import re

import pytest
import torch

from harness.checks.step_outputs import TrainedRankData
from harness.checks.tensors import assemble
from harness.driver import run_suite
from harness.engines.base import ParamShard, StepOutput, tp_shard
from harness.launch.results import CaseResult, RankResult
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from harness.suite_defs.agreement import EQUIVALENCE_ADAM_EPS
from harness.suite_defs.equivalence import EquivalenceSuite


def test_tp_unshard_inverts_shard_for_glu_blocks():
    full = torch.arange(24.0).reshape(8, 3)  # [gate(4); up(4)]
    shards = [tp_shard(full, 0, 2, r, parts=2) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([full[0:2], full[4:6]]))
    got = assemble([[ParamShard("w", s, 0, r, 2, 2)] for r, s in enumerate(shards)])
    assert torch.equal(got.tensors["w"], full)


def test_assemble_reports_replica_spread_and_missing_shards():
    a, b = torch.zeros(2), torch.tensor([0.0, 0.5])
    got = assemble([[ParamShard("n", a, None, 0, 1)], [ParamShard("n", b, None, 0, 1)]])
    assert got.replica_spread["n"] == 0.5
    with pytest.raises(ValueError, match=r"parameter w: no rank reported TP shards \[1\]"):
        assemble([[ParamShard("w", a, 0, 0, 2)]])


def _fake_result(layout: Layout, losses: list[float], w: torch.Tensor) -> CaseResult:
    case = Case("equivalence", load_model("tiny"), layout)
    rank = RankResult(0, data=TrainedRankData({"tp": 0, "pp": 0, "cp": 0, "dp": 0, "last_stage": 1},
                                              [StepOutput(l * 64, 64) for l in losses],
                                              [ParamShard("w", w, None, 0, 1)]))
    return CaseResult(case, [rank], "ok")


def test_checks_fail_with_the_output_the_value_and_the_tolerance():
    ref = _fake_result(Layout(dp=2), [4.0, 3.5], torch.ones(4))
    bad = _fake_result(Layout(tp=2), [4.0, 3.6], torch.ones(4) * 1.01)
    checks = {c.check: c for c in EquivalenceSuite().check([ref, bad]) if c.case_id == bad.case.id}
    assert not checks["equivalence.loss"].passed
    assert "loss step 1: tp2-pp1-cp1-dp1 3.60000000 vs tp1-pp1-cp1-dp2 3.50000000, rel diff 2.86e-02 > 1e-05" \
        == checks["equivalence.loss"].message
    assert not checks["equivalence.params"].passed
    assert "1/1 params differ from tp1-pp1-cp1-dp2 after 2 steps; worst w: rel 1.00e-02 > 1e-05" \
        == checks["equivalence.params"].message


@pytest.mark.slow
def test_world_size_2_layouts_match():
    run = run_suite("equivalence", "tiny", 2, backend="gloo")
    assert [r.case.layout.id for r in run.results] == ["tp1-pp1-cp1-dp2", "tp1-pp1-cp2-dp1", "tp1-pp2-cp1-dp1",
                                                       "tp2-pp1-cp1-dp1"]
    assert run.passed, [c.message for c in run.checks if c.failed] + [r.error for r in run.results]


@pytest.mark.slow
def test_planted_tp_gradient_bug_fails_the_suite():
    run = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo",
                    engine="tests.plants.faulty_engines:SkipOneTpGradReduce")
    assert all(r.ok for r in run.results), "\n".join(r.error for r in run.results if not r.ok)
    failed = {c.check: c for c in run.checks if c.failed}
    # what docs/suites.md promises: the losses, the first step's log-probs, the full parameters and the
    # TP-replicated copies all fail
    assert set(failed) == {"equivalence.loss", "equivalence.logprobs", "equivalence.params", "equivalence.replicas"}, \
        [c.message for c in run.checks]
    assert failed["equivalence.logprobs"].message.startswith(
        "tp2-pp1-cp1-dp1: step-0 log-probs differ from tp1-pp1-cp1-dp2 at "), failed["equivalence.logprobs"].message
    assert re.fullmatch(r"loss step \d: tp2-pp1-cp1-dp1 [0-9.]+ vs tp1-pp1-cp1-dp2 [0-9.]+, rel diff [0-9.e-]+ > 1e-05",
                        failed["equivalence.loss"].message), failed["equivalence.loss"].message
    assert failed["equivalence.loss"].value > 1e-4
    msg = failed["equivalence.params"].message
    assert re.match(r"\d+/14 params differ from tp1-pp1-cp1-dp2 after 2 steps; worst \S+: rel [0-9.e-]+ > 1e-05$", msg), msg
    assert failed["equivalence.params"].value > 1e-2
    assert re.match(r"\d+ params differ between copies that must be identical \(DP/CP replicas, TP-replicated params, "
                    r"tied embeddings\); worst \S+layernorm\S*: max abs", failed["equivalence.replicas"].message), \
        failed["equivalence.replicas"].message
    assert not run.passed and run.exit_code == 1


@pytest.mark.slow
def test_context_parallel_layout_matches_with_the_reference_attention():
    run = run_suite("equivalence", "tiny", 2, ["tp1-pp1-cp2-dp1"], backend="gloo")
    assert run.passed, [c.message for c in run.checks if c.failed] + [r.error for r in run.results]


def test_cases_condition_adam_eps_unless_the_user_set_it():
    suite, model = EquivalenceSuite(), load_model("tiny")
    assert {c.options.adam_eps for c in suite.cases(model, 2, None)} == {EQUIVALENCE_ADAM_EPS}
    own = suite.cases(model, 2, None, options=CaseOptions(adam_eps=3e-8))
    assert {c.options.adam_eps for c in own} == {3e-8}


def _cp_fault(engine: str):
    run = run_suite("equivalence", "tiny", 2, ["tp1-pp1-cp2-dp1"], backend="gloo", engine=engine)
    assert all(r.ok for r in run.results), "\n".join(r.error for r in run.results if not r.ok)
    return {c.check: c for c in run.checks if c.failed and "cp2" in c.case_id}


@pytest.mark.slow
def test_wrong_zigzag_chunk_pair_fails_loss_logprobs_and_params_naming_the_tokens():
    failed = _cp_fault("tests.plants.faulty_engines:WrongZigzagChunks")
    assert set(failed) == {"equivalence.loss", "equivalence.logprobs", "equivalence.params"}
    # chunks 2 and 3 of every sample (positions 32-63 at seq 64, cp 2) are computed in the wrong place
    assert failed["equivalence.logprobs"].message.startswith(
        "tp1-pp1-cp2-dp1: step-0 log-probs differ from tp1-pp1-cp1-dp2 at 256/512 tokens (worst rel ")
    assert failed["equivalence.logprobs"].message.endswith("; first: sample 0, positions 32-63")
    assert failed["equivalence.logprobs"].details[0].startswith("  sample 0: 32 tokens off at positions 32-63; position 32: ")


@pytest.mark.slow
def test_contiguous_rope_slice_fails_the_first_step_log_probs():
    failed = _cp_fault("tests.plants.faulty_engines:ContiguousRopeSlice")
    # the loss moves by ~1e-5 only (at the tolerance); the log-probs of the rotated tokens by ~1e-3
    msg = failed["equivalence.logprobs"].message
    assert re.match(r"tp1-pp1-cp2-dp1: step-0 log-probs differ from tp1-pp1-cp1-dp2 at \d+/512 tokens "
                    r"\(worst rel [0-9.e-]+ > 1e-05\); first: sample 0, positions 16", msg), msg
    assert failed["equivalence.logprobs"].value > 1e-4


def test_default_matrix_includes_every_cp_layout():
    ids = [c.layout.id for c in EquivalenceSuite().cases(load_model("tiny"), 4, None)]
    assert ids[0] == "tp1-pp1-cp1-dp4"
    assert {"tp1-pp1-cp2-dp2", "tp1-pp1-cp4-dp1", "tp2-pp1-cp2-dp1", "tp1-pp2-cp2-dp1"} <= set(ids)
    assert len(ids) == 8
