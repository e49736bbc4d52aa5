"""Bridge construction paths: they build the same model as mcore, and R2 on the vanilla bridge is caught."""

from __future__ import annotations

import importlib.util

import pytest

from harness.driver import run_suite
from harness.engines.wrap_config import WrapConfig, ddp_config_dict

needs_mbridge = pytest.mark.skipif(
    importlib.util.find_spec("mbridge") is None or importlib.util.find_spec("transformers") is None,
    reason="mbridge path not installed: pip install -c constraints-cpu.txt -e .[mbridge]",
)


needs_megatron_bridge = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None or importlib.util.find_spec("omegaconf") is None,
    reason="megatron-bridge path not installed: pip install --no-deps megatron-bridge==0.3.1 && "
           "pip install -c constraints-cpu.txt -e .[bridge]",
)


@needs_megatron_bridge
@pytest.mark.slow
def test_megatron_bridge_provider_path_passes_equivalence_and_grad_sync():
    eq = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo", engine="megatron-bridge")
    assert eq.passed, [c.message for c in eq.checks if not c.passed] + [r.error for r in eq.results]
    gs = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", engine="megatron-bridge")
    assert gs.passed, [c.message for c in gs.checks if not c.passed] + [r.error for r in gs.results]


def test_wrap_config_merges_overrides_on_top():
    wrap = WrapConfig(use_distributed_optimizer=False, overlap_grad_reduce=True, grad_reduce_in_fp32=False)
    merged = ddp_config_dict(wrap, {"overlap_grad_reduce": False})
    assert merged["use_distributed_optimizer"] is False and merged["overlap_grad_reduce"] is False


@needs_mbridge
@pytest.mark.slow
def test_mbridge_matches_mcore():
    bridge = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo", engine="mbridge")
    mcore = run_suite("equivalence", "tiny", 2, ["tp2-pp1-cp1-dp1"], backend="gloo", engine="mcore")
    assert bridge.passed, [c.message for c in bridge.checks if not c.passed] + [r.error for r in bridge.results]
    assert [bridge.suite.metrics(r) for r in bridge.results] == [mcore.suite.metrics(r) for r in mcore.results]


@needs_mbridge
@pytest.mark.slow
def test_mbridge_grad_sync_passes():
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo", engine="mbridge")
    assert run.passed, [c.message for c in run.checks if not c.passed] + [r.error for r in run.results]


@needs_mbridge
@pytest.mark.slow
def test_r2_override_only_ddp_config_is_caught():
    run = run_suite("grad-sync", "tiny", 2, ["tp1-pp1-cp1-dp2"], backend="gloo",
                    engine="tests.faulty_engines:MbridgeOverrideOnly")
    off = [r.case.id for r in run.results if not r.case.options.use_distributed_optimizer]
    plan = {c.case_id: c.message for c in run.checks if c.check == "grad-sync.plan" and not c.passed}
    drift = {c.case_id for c in run.checks if c.check == "grad-sync.replicas" and not c.passed}
    for cid in off:
        assert plan[cid].startswith("grad-sync: rank 0: configured all-reduce (use_distributed_optimizer=False")
        assert "but observed reduce_scatter_tensor_coalesced_ on dp-cp group (0, 1)" in plan[cid]
        assert cid in drift
