"""The collectives recorder sees torch's functional collectives (DTensor, FSDP2) as well as c10d's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

WORLD = 2


def record(rank: int, world_size: int) -> dict | None:
    """On each rank (tests.support.rank_call): the recorder around functional collectives and a classic one."""
    import torch.distributed._functional_collectives as funcol

    from harness.probes.collectives import CollectiveRecorder

    x = torch.ones(8) * (rank + 1)
    with CollectiveRecorder() as recorder:
        summed = funcol.all_reduce(x, "sum", dist.group.WORLD)
        gathered = funcol.all_gather_single(x, 0, dist.group.WORLD)
        scattered = funcol.reduce_scatter_single(x, "sum", 0, dist.group.WORLD)
        values = [summed.tolist(), gathered.tolist(), scattered.tolist()]  # waits on them
        dist.all_reduce(x)  # the classic path, for comparison
    if rank != 0:
        return None
    return {"records": [(r.kind, r.ranks, r.numel, r.op) for r in recorder.by_source("dispatch")], "values": values}


@pytest.fixture(scope="module")
def recorded():
    from tests.support.rank_call import on_ranks

    return on_ranks("tests.test_collectives:record", WORLD)[0]


@pytest.mark.slow
def test_functional_collectives_are_recorded_like_c10d_ones(recorded):
    kinds = [(kind, ranks, numel) for kind, ranks, numel, _ in recorded["records"]]
    assert kinds == [("all_reduce", (0, 1), 8), ("all_gather", (0, 1), 8), ("reduce_scatter", (0, 1), 8),
                     ("all_reduce", (0, 1), 8)], recorded["records"]
    assert recorded["values"][0] == [3.0] * 8  # the collectives ran, recorded or not
