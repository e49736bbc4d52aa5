"""train-memory's figures of a finished case: bytes per rank and phase, and the key it is stored under."""

from __future__ import annotations

from harness import selection
from harness.backends import Backend
from harness.engines import baseline_suffix
from harness.launch.results import CaseResult, RankResult
from harness.probes.memory import MIB
from harness.spec import Case
from harness.suite_defs.train_memory.payload import TrainMemoryRankData


def phase_figures(rank: RankResult, backend: Backend) -> dict[str, int]:
    """The measured bytes of each phase of one rank: heap (CPU) or device allocated (GPU) above its start."""
    data = rank.payload_as(TrainMemoryRankData)
    pick = (lambda p: p.device_peak) if backend == Backend.NCCL else (lambda p: p.heap_peak)
    return {"build": pick(data.build), **{f"step{i}": pick(p) for i, p in enumerate(data.steps)}}


def key(case: Case) -> str:
    """The case's entry in baselines/<platform>/train-memory.json (the fsdp2 path's own entry beside megatron's)."""

    o = case.options
    return (f"{case.model.name}/{case.layout.id}/{o.dtype}/mbs{case.micro_batch_size}/"
            f"distopt={int(o.use_distributed_optimizer)}" + (f",recompute={o.recompute}" if o.recompute else "")
            + baseline_suffix(case.engine))


def record_command(case: Case) -> str:

    return selection.record_command(case, skip=("steps",))  # the suite's own


def samples(result: CaseResult) -> dict[str, float]:
    """Per rank and phase, MiB: the heap high-water on CPU ranks, the device's allocated peak on GPUs."""
    return {f"rank{r.rank}.{phase}_mib": value / MIB for r in result.ranks
            for phase, value in phase_figures(r, result.case.backend).items()}
