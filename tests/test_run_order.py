"""Cases that pass artefacts to each other declare it (Case.after) and get a directory private to their
run: shuffled runs keep every dependency first, and two runs never share a checkpoint directory."""

from __future__ import annotations

import pytest

from harness.driver import new_run_dir, run_order, run_suite
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from harness.suite_defs.ckpt_memory.contract import contract_cases
from harness.suite_defs.ckpt_memory import CkptMemorySuite


def _cases() -> list[Case]:
    model = load_model("tiny")
    a = Case("s", model, Layout(dp=4), options=CaseOptions(seed=1))
    b = Case("s", model, Layout(dp=2), options=CaseOptions(seed=2), after=(a.id,))
    c = Case("s", model, Layout(dp=1), options=CaseOptions(seed=3), after=(b.id,))
    d = Case("s", model, Layout(tp=2), options=CaseOptions(seed=4))
    return [c, d, b, a]  # planned in an order that breaks every dependency


def test_dependencies_run_first_in_plan_order_and_under_every_shuffle():
    cases = _cases()
    assert run_order(cases) == [1, 3, 2, 0]  # d (free), then a, b, c
    orders = set()
    for seed in range(50):
        order = run_order(cases, seed)
        pos = {cases[i].id: n for n, i in enumerate(order)}
        assert sorted(order) == [0, 1, 2, 3]
        assert all(pos[dep] < pos[c.id] for c in cases for dep in c.after), order
        orders.add(tuple(order))
    assert len(orders) > 1  # shuffling still shuffles what is free to move


def test_every_run_gets_its_own_directory():
    first, second = new_run_dir(), new_run_dir()
    try:
        assert first != second and first.is_dir() and second.is_dir()
    finally:
        first.rmdir()
        second.rmdir()


def test_contract_load_case_declares_the_save_it_reads():
    saver, loader = contract_cases("ckpt-memory", load_model("tiny"), 4, "mcore", "gloo", CaseOptions(),
                                   formats=("dp_reshardable",))
    assert loader.after == (saver.id,) and saver.after == ()


class ContractOnly(CkptMemorySuite):
    """The dp_reshardable contract cases alone, planned load-case first."""

    def cases(self, model, world_size, layouts, *, engine="mcore", backend="gloo", options=CaseOptions(), params=None):
        return contract_cases(self.name, model, world_size, engine, backend, options, formats=("dp_reshardable",))[::-1]


@pytest.mark.slow
def test_contract_cases_pass_shuffled():
    run = run_suite(ContractOnly(), "tiny", 4, backend="gloo", shuffle_seed=3)
    assert [r.case.params.ckpt_role for r in run.results] == ["reshard-load", "reshard"]  # plan order kept
    assert run.passed, [c.message for c in run.checks if c.failed] + [r.error for r in run.results if r.error]
    loads = [c for c in run.checks if c.check == "ckpt-memory.reshard" and c.target == "tp1-pp1-cp1-dp2"]
    assert loads and all(c.passed for c in loads)
