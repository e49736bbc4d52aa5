"""Ranks of one case meet only each other and leave init only once every rank is connected
(harness/launch/worker.py, all_connected): gloo's connecting side of a pair is done before its peer has accepted,
so a rank that issues no collective could close its sockets under a peer still connecting (on a loaded machine:
"Gloo connectFullMesh failed ... Connection closed by peer")."""

from __future__ import annotations

import os
import time

import pytest

from harness.launch import run_case
from harness.models import load_model
from harness.spec import Case, CaseOptions, Layout
from tests.plants import fake_suites as fs
from tests.plants.slow_init import SLOW_S

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leftover_ranks")]


class NoCollective:
    """A case whose ranks issue no collective of their own: each reports when its init returned and its work began."""

    name = "no-collective"
    imports: tuple[str, ...] = ("tests.plants.slow_init",)

    def rank_work(self, case, ctx):
        return {"init_done": float(os.environ["SLOW_INIT_DONE"]), "work_start": time.time()}


def test_no_rank_leaves_init_before_a_slow_peer_is_connected():
    res = run_case(Case("tests.test_rendezvous:NoCollective", load_model("tiny"), Layout(dp=2), "mcore",
                        CaseOptions(), "gloo", fs.CASE_TIMEOUT_S))
    assert res.status == "ok", res.error
    slow, fast = (r.data for r in res.ranks)
    # Without the barrier rank 1 starts its work (and may finish and close its sockets) SLOW_S before rank 0 is done.
    assert fast["work_start"] >= slow["init_done"], (
        f"rank 1 began its work {slow['init_done'] - fast['work_start']:.2f} s before rank 0 (slowed {SLOW_S} s) "
        "had finished connecting")
