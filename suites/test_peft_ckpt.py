"""PEFT adapter checkpoint contract (R4): LoRA adapters exported in HF PEFT format load in PEFT, equal
the Megatron model's adapter and log-probs at every layout, and export in adapter-sized memory."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def peft_run(suite_runner):
    return suite_runner("peft-ckpt")


def test_every_check_passes(peft_run, judge):
    judge(peft_run)


@pytest.mark.parametrize("check", ["valid", "tensors", "logprobs", "export", "memory"])
def test_adapter_export(peft_run, judge, check):
    judge(peft_run, f"peft-ckpt.{check}")


# megatron-bridge's expert LoRA on megatron's SequentialMLP experts (the experts without Transformer Engine's
# grouped GEMM), measured on 0.3.1: its adapter export gathers over TP and PP but not EP, its adapter-only
# distributed checkpoint of expert adapters is refused by megatron's sharding validation, and at ETP 2 its expert
# fc2 adapters compute a wrong delta (Megatron-Bridge #5634) (docs/moe.md).
_EXPERT_LORA = ("megatron-bridge <= 0.3.1: expert LoRA on SequentialMLP experts: no EP gather in the export, "
                "an invalid adapter checkpoint, wrong expert fc2 deltas at ETP 2 (#5634) (docs/moe.md)")


def _bridge_at_most_0_3_1() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(x) for x in version("megatron-bridge").split(".")[:3]) <= (0, 3, 1)
    except (PackageNotFoundError, ValueError):
        return False


@pytest.fixture(scope="module")
def peft_moe_run(suite_runner):
    """tiny-qwen3-moe (tiny-moe in Qwen3-MoE's shape, which megatron-bridge converts to HF) on its expert layouts."""
    return suite_runner("peft-ckpt", model="tiny-qwen3-moe", label="peft-ckpt-moe")


def test_moe_pure_dp_export_loads_in_hf(peft_moe_run):
    """The pure-DP case of the MoE run: every expert's adapter exported, loaded by PEFT over Qwen3-MoE, equal to
    the model's and giving its log-probs."""
    pure = [c for c in peft_moe_run.checks if c.case_id == peft_moe_run.results[0].case.id]
    judged = {c.check: c for c in pure if c.check in ("peft-ckpt.valid", "peft-ckpt.tensors", "peft-ckpt.logprobs")}
    assert len(judged) == 3 and all(c.passed for c in judged.values()), [c.message for c in judged.values()]


def test_moe_adapter_replicas(peft_moe_run, judge):
    judge(peft_moe_run, "peft-ckpt.replicas")


def test_every_moe_check_passes(peft_moe_run, judge, request):
    if _bridge_at_most_0_3_1() and any(r.case.layout.ep > 1 or r.case.layout.tp > 1 for r in peft_moe_run.results):
        request.applymarker(pytest.mark.xfail(reason=_EXPERT_LORA, strict=True))
    judge(peft_moe_run)
