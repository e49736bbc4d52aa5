"""RL cycle: log-probs with the routing recorded, training with it replayed, the export to the rollout, offload and
reload, again and again - the replayed routing is the recorded one, every export is what the iteration trained and
the rollout's policy the one the trainer scores, the trajectory is the one without offload, an offload leaves the
device no more than a stated residue and nothing grows, and a weights-only load is what the first step starts
from."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def cycle_run(suite_runner):
    return suite_runner("rl-cycle")


def test_every_check_passes(cycle_run, judge):
    judge(cycle_run)


@pytest.mark.parametrize("check", ["logprobs", "refit", "policy", "trajectory", "offload", "reload", "load"])
def test_every_layout_cycles_as_it_trains(cycle_run, judge, check):
    judge(cycle_run, f"rl-cycle.{check}")


@pytest.fixture(scope="module")
def moe_run(suite_runner):
    """tiny-moe with routing replayed at EP 2 (built twice), EP 2 with PP 2, and with aux-loss-free balancing."""
    return suite_runner("rl-cycle", model="tiny-moe", label="rl-cycle-moe")


def test_every_moe_check_passes(moe_run, judge):
    judge(moe_run)


@pytest.mark.parametrize("check", ["replay", "logprobs", "refit", "expert-bias", "upstream-bias", "trajectory", "offload",
                                   "reload"])
def test_every_expert_layout_replays_its_routing(moe_run, judge, check):
    judge(moe_run, f"rl-cycle.{check}")


@pytest.fixture(scope="module")
def lora_run(suite_runner, harness_opts):
    """LoRA in the loop on megatron-bridge (tiny, bf16) at pure DP and TP 2: the merged and adapter-only refits of
    every iteration."""
    if harness_opts["default_models_only"]:
        pytest.skip("LoRA in the loop is an extra path (megatron-bridge): --default-models-only runs each suite's own")
    w = harness_opts["world_size"]
    layouts = [f"tp1-pp1-cp1-dp{w}"] + ([f"tp2-pp1-cp1-dp{w // 2}"] if w % 2 == 0 else [])
    return suite_runner("rl-cycle", engine="megatron-bridge", label="rl-cycle-lora", suite_params={"rl_variant": "lora"},
                        layouts=layouts)


@pytest.mark.parametrize("check", ["refit", "policy", "adapter", "trajectory", "offload", "reload"])
def test_lora_refits_what_each_iteration_trained(lora_run, judge, check):
    judge(lora_run, f"rl-cycle.{check}")
