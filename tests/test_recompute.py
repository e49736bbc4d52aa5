"""Activation recompute on CPU ranks: the same steps with and without it give the same training.

With dropout 0 the recomputed forward repeats the forward bit for bit, so the losses and the parameters
after the steps are compared for exact equality (measured: bitwise equal on every layout at world size
2 for full and for selective recompute, megatron-core 0.16.1, torch 2.13 CPU).
"""

from __future__ import annotations

import functools

import pytest
import torch

from harness.checks.tensors import assemble
from harness.driver import run_suite
from harness.spec import CaseOptions
from harness.checks.step_outputs import step_losses, trained

# Every layout of world size 2: DP (the reference), TP, PP and CP (the harness's reference CP
# attention, which selective recompute checkpoints in place of megatron's local core attention).
LAYOUTS = ["tp1-pp1-cp1-dp2", "tp2-pp1-cp1-dp1", "tp1-pp2-cp1-dp1", "tp1-pp1-cp2-dp1"]


@functools.lru_cache(maxsize=None)
def _run(recompute: str):
    run = run_suite("equivalence", "tiny", 2, LAYOUTS, backend="gloo", options=CaseOptions(recompute=recompute))
    assert [r.case.layout.id for r in run.results] == LAYOUTS
    assert run.passed, [c.message for c in run.checks if c.failed] + [r.error for r in run.results if r.error]
    return run


def _worst_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.double().abs().max()) or 1.0
    return float((a.double() - b.double()).abs().max()) / scale


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_trains_exactly_like_no_recompute(recompute):
    plain, recomputed = _run(""), _run(recompute)
    for off, on in zip(plain.results, recomputed.results):
        lay = on.case.layout.id
        assert on.case.options.recompute == recompute and off.case.options.recompute == ""
        assert step_losses(on) == step_losses(off), (lay, step_losses(on), step_losses(off))
        got = assemble([trained(r).params for r in on.ranks]).tensors
        want = assemble([trained(r).params for r in off.ranks]).tensors
        assert set(got) == set(want), (lay, set(got) ^ set(want))
        differ = {n: _worst_rel(got[n], want[n]) for n in want if not torch.equal(got[n], want[n])}
        assert not differ, f"{lay}: {len(differ)}/{len(want)} params differ after {on.case.options.steps} steps " \
                           f"with recompute={recompute}: {differ}"
