"""GPU ranks without Transformer Engine: what megatron-core reads of TE is defined (harness/platform/without_te.py)."""

from __future__ import annotations

import pytest
import torch


def test_an_moe_router_runs_without_transformer_engine_once_its_gemm_is_defined():
    """megatron-core 0.16's router_gating_linear reads te_general_gemm, defined only where TE imports: without TE,
    a NameError on every MoE forward (the plant: the name undefined, as on a GPU rank before the definition)."""
    from megatron.core.transformer.moe import moe_utils

    from harness.platform.without_te import define_router_gemm

    had, before = hasattr(moe_utils, "te_general_gemm"), getattr(moe_utils, "te_general_gemm", None)
    if had:
        delattr(moe_utils, "te_general_gemm")  # the CPU layer of an earlier test in this process defines it
    try:
        x, w = torch.randn(4, 8), torch.randn(3, 8)
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(x, w, None, torch.float32)
        assert define_router_gemm() is True and moe_utils.te_general_gemm is None
        torch.testing.assert_close(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)
        assert define_router_gemm() is False  # defined already (as where TE imports): left as it is
    finally:
        if had:
            moe_utils.te_general_gemm = before
        elif hasattr(moe_utils, "te_general_gemm"):
            delattr(moe_utils, "te_general_gemm")


def test_gpu_ranks_define_it_before_their_process_group(monkeypatch):
    """worker.init_distributed on NCCL ranks (CUDA and the process group stood in)."""
    import torch.distributed as dist

    from harness.launch import worker
    from harness.launch.context import RankContext
    from harness.platform import without_te

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(f"device {device}"))
    monkeypatch.setattr(without_te, "define_router_gemm", lambda: calls.append("router gemm"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("process group"))
    monkeypatch.delenv("HARNESS_STORE", raising=False)
    worker.init_distributed(RankContext(0, 1, 0, "nccl", None), 60.0)
    assert calls == ["device 0", "router gemm", "process group"]
