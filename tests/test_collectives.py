"""The collectives recorder sees torch's functional collectives (DTensor, FSDP2) as well as c10d's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, store_path: str, out: str) -> None:
    import torch.distributed._functional_collectives as funcol

    from harness.probes.collectives import CollectiveRecorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    x = torch.ones(8) * (rank + 1)
    with CollectiveRecorder() as recorder:
        summed = funcol.all_reduce(x, "sum", dist.group.WORLD)
        gathered = funcol.all_gather_single(x, 0, dist.group.WORLD)
        scattered = funcol.reduce_scatter_single(x, "sum", 0, dist.group.WORLD)
        values = [summed.tolist(), gathered.tolist(), scattered.tolist()]  # waits on them
        dist.all_reduce(x)  # the classic path, for comparison
    if rank == 0:
        torch.save({"records": [(r.kind, r.ranks, r.numel, r.op) for r in recorder.by_source("dispatch")],
                    "values": values}, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("funcol")
    out = str(tmp / "records.pt")
    mp.start_processes(_worker, args=(str(tmp / "store"), out), nprocs=WORLD, join=True, start_method="spawn")
    return torch.load(out)


@pytest.mark.slow
def test_functional_collectives_are_recorded_like_c10d_ones(recorded):
    kinds = [(kind, ranks, numel) for kind, ranks, numel, _ in recorded["records"]]
    assert kinds == [("all_reduce", (0, 1), 8), ("all_gather", (0, 1), 8), ("reduce_scatter", (0, 1), 8),
                     ("all_reduce", (0, 1), 8)], recorded["records"]
    assert recorded["values"][0] == [3.0] * 8  # the collectives ran, recorded or not
