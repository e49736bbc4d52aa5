"""A one-GPU node's shape (world size 1) on CPU: suites and cases that need more ranks are skipped naming how
many, before any rank starts; what can be judged is; what cannot tell right from wrong there says so."""

from __future__ import annotations

import pytest
import torch

from harness import cli
from harness.driver import plan
from harness.engines.base import ParamShard
from harness.launch.results import CaseResult, RankResult
from harness.models import load_model
from harness.probes.memory import MIB, MemoryPeak
from harness.spec import Case, CaseOptions, Layout
from harness.suite_defs.grad_sync import GradSyncRankData, GradSyncSuite


def test_equivalence_at_world_size_1_is_skipped_with_the_ranks_it_needs():
    cases = plan("equivalence", "tiny", 1, backend="gloo").cases
    (case,) = cases
    assert case.skip_reason == ("equivalence compares every layout with pure DP, and world size 1 has no other valid layout "
                         "for tiny: needs world size 2 or more (e.g. --world-size 2 or 4)")


@pytest.mark.parametrize("world_size", [1, 3])
def test_dynamic_cp_needs_an_even_world_size_of_at_least_2(world_size):
    cases = plan("dynamic-cp", "tiny", world_size, backend="gloo").cases
    (case,) = cases
    assert case.skip_reason.startswith(f"dynamic CP needs an even DP x CP size of at least 2 (megatron's hybrid CP groups), "
                                f"world size {world_size} has none: needs world size 2 or more, even")


def test_ckpt_memory_at_world_size_1_runs_its_contract_except_the_dp_only_load():
    cases = plan("ckpt-memory", "small", 1, backend="gloo").cases
    roles = [(c.params.ckpt_role, c.layout.id, bool(c.skip_reason)) for c in cases if c.params.ckpt_role]
    assert roles == [("reshard", "tp1-pp1-cp1-dp1", False), ("reshard-load", "tp1-pp1-cp1-dp1", True)] * 2
    skipped = next(c for c in cases if c.skip_reason)
    assert skipped.skip_reason.endswith("world size 1 cannot be halved: needs world size 2 or more, even")
    assert not [c for c in cases if not c.params.ckpt_role and c.skip_reason]  # every save case runs


def test_ckpt_memory_contract_at_world_size_2_loads_at_tp2_pp2_and_dp1():
    from harness.suite_defs.ckpt_memory.contract import dp_only_target, targets

    assert [lay.id for lay in targets(load_model("small"), 2)] == ["tp1-pp1-cp1-dp2", "tp2-pp1-cp1-dp1",
                                                                 "tp1-pp2-cp1-dp1"]
    assert [lay.id for lay in targets(load_model("small"), 4)] == ["tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2",
                                                                 "tp1-pp2-cp1-dp2"]
    assert dp_only_target(4) == Layout(dp=2) and dp_only_target(1) is None


def test_harness_run_of_a_suite_that_needs_more_ranks_judges_nothing(tmp_path, capsys):
    code = cli.main(["run", "--suite", "equivalence", "--world-size", "1", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 5, out
    assert "skipped in 0.0s: equivalence compares every layout with pure DP" in err
    assert "equivalence: NOTHING JUDGED" in out


def test_grad_sync_replicas_cannot_tell_without_dp_replicas():
    case = Case("grad-sync", load_model("tiny"), Layout(tp=2), "mcore", CaseOptions(steps=3))
    res = CaseResult(case, [RankResult(0), RankResult(1)], "ok")
    check = GradSyncSuite._check_replicas(res)
    assert check.inconclusive and check.message == ("cannot tell: tp2-pp1-cp1-dp1 has no DP replicas (DP x CP = 1), "
                                                    "so none can drift apart: needs DP x CP >= 2")
    shards = [ParamShard("w", torch.ones(2), None, 0, 1)]
    dp2 = CaseResult(Case("grad-sync", load_model("tiny"), Layout(dp=2), "mcore", CaseOptions(steps=3)),
                     [RankResult(0, data=GradSyncRankData({}, [], shards)),
                      RankResult(1, data=GradSyncRankData({}, [], shards))], "ok")
    assert GradSyncSuite._check_replicas(dp2).passed


def test_peft_export_at_one_layout_cannot_tell_and_the_memory_check_on_tiny_neither():
    from harness.suite_defs.peft_ckpt import judge as peft_ckpt

    case = Case("peft-ckpt", load_model("tiny"), Layout(), "megatron-bridge", CaseOptions(lora_dim=8, lora_alpha=16))
    export = MemoryPeak("export", heap_peak=MIB)
    res = CaseResult(case, [RankResult(0, data=peft_ckpt.PeftRankData({}, [], export=export))], "ok")
    memory = peft_ckpt._check_memory(res)
    assert memory.inconclusive and "a whole-model export would fit that bound too" in memory.message
    alone = peft_ckpt.export_alone(res)  # what check() files for a run of one layout (its HF side needs real ranks)
    assert alone.inconclusive and alone.message.endswith("needs world size 2 or more")


@pytest.mark.slow  # starts an interpreter that imports torch and megatron (seconds each)
def test_a_suites_session_in_which_nothing_was_judged_does_not_pass(tmp_path):
    """`pytest suites` where every selected suite needs more ranks: each test skips naming them, and the
    session exits 5 (pytest's "no tests"), not 0 - on a pytest-xdist worker, as `nox -s cpu-suite` runs them (on
    two), whose skipped runs reach the controller that decides (one worker: the same path, 10 s less CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/test_equivalence.py", "suites/test_dynamic_cp.py",
                           "--world-size", "1", "--backend", "gloo", "-rs", "-p", "no:cacheprovider", "-n", "1"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 5, proc.stdout[-3000:]
    assert "harness: NOTHING JUDGED" in proc.stdout
    assert "SKIPPED" in proc.stdout and "needs world size 2 or more" in proc.stdout
