"""Each rank's model chunks at every layout of world sizes 1 to 8, built in one process: a rank at a time on
torch's fake process group (collectives that move nothing), parameters on the meta device and left undrawn.
Only names and sizes are read, so a chunk is built once per (TP, PP, VPP, EP, ETP, pipeline rank): DP and CP
shard no weight.

python -m tests.fakes.fake_world MODEL [MODEL ...] prints, as JSON, per model the layouts and builds it judged and
every (layout, rank) whose built chunks hold other parameter sizes than the model spec's arithmetic
(chunk_params), or whose gradient-sync plan from them differs from the arithmetic's (checks/expected_collectives.py).
Run it as a subprocess: it activates the CPU layer and megatron's globals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_WORLD = 8


def fake_process_group_missing() -> str:
    """Why this torch cannot run a rank alone; "" where it can."""
    import importlib.util

    if importlib.util.find_spec("torch.testing._internal.distributed.fake_pg") is None:
        return "this torch has no fake process group (torch.testing._internal.distributed.fake_pg, torch >= 2.1)"
    return ""


def arithmetic_sizes(case, rank: int) -> list[list[int]]:
    """Per model chunk of the rank, the sorted sizes of its trained parameters by the spec's arithmetic: the dense
    buffer's and the experts' (chunk_params)."""
    from harness.checks.expected_collectives import chunk_params
    from harness.layouts import coords_of

    m, lay, pp = case.model, case.layout, coords_of(case.layout, rank).pp
    return [sorted(n for _, n, _ in chunk_params(m, lay, pp, vp) + chunk_params(m, lay, pp, vp, expert_buffer=True))
            for vp in range(lay.vpp)]


def judge(model_name: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.checks.expected_collectives import expected_collectives
    from harness.engines.mcore import McoreEngine
    from harness.launch.context import RankContext
    from harness.layouts import coords_of, default_matrix
    from harness.models import load_model
    from harness.platform.parallel import init_parallel_state
    from harness.spec import Case, CaseOptions

    class Unfilled(McoreEngine):
        def reinit(self, chunk) -> None:  # no values: names and sizes are what is compared
            pass

    layers._initialize_affine_weight_cpu = lambda weight, *a, **k: None  # meta tensors: nothing to fill
    spec = load_model(model_name)
    built: dict[tuple, list[list[tuple[str, int]]]] = {}
    layouts, differ = 0, []
    for world in range(1, MAX_WORLD + 1):
        for lay in default_matrix(spec, world):
            layouts += 1
            case = Case("grad-sync", spec, lay, "mcore", CaseOptions(), "gloo", 300.0)
            for rank in range(world):
                key = (lay.tp, lay.pp, lay.vpp, lay.ep, lay.expert_tp, coords_of(lay, rank).pp)
                if key not in built:
                    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
                    init_parallel_state(lay, on_cpu=True, seed=0, create_gloo_process_groups=False)
                    with torch.device("meta"):
                        chunks = Unfilled(case, RankContext(rank, world, rank, "gloo", Path("."))).build_chunks()
                    built[key] = [[(n, p.numel()) for n, p in c.named_parameters() if p.requires_grad]
                                  for c in chunks]
                    parallel_state.destroy_model_parallel()
                    dist.destroy_process_group()
                arithmetic = arithmetic_sizes(case, rank)
                if [sorted(n for _, n in chunk) for chunk in built[key]] != arithmetic:
                    differ.append(f"{lay.id} rank {rank}: built {[sum(n for _, n in ch) for ch in built[key]]} "
                                  f"elements per chunk, the arithmetic {[sum(ch) for ch in arithmetic]}")
                got, want = expected_collectives(case, rank, built[key]), expected_collectives(case, rank)
                if got != want:
                    differ.append(f"{lay.id} rank {rank}: built {sum(p.numel for p in got)} elements in "
                                  f"{len(got)} reductions, the arithmetic {sum(p.numel for p in want)} in {len(want)}")
    return {"layouts": layouts, "builds": len(built), "differ": differ}


def main(names: list[str]) -> None:
    from harness.platform import cpu_layer

    cpu_layer.activate()  # the CUDA stand-ins megatron's constructors call on CPU ranks
    print(json.dumps({name: judge(name) for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
