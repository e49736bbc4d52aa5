"""ckpt-memory's figures of a finished case: the baselined peaks, and the key a case is stored under."""

from __future__ import annotations

from harness import selection
from harness.backends import Backend
from harness.baselines import ABS_FLOOR
from harness.ckpt_formats import CkptFormat
from harness.launch.results import CaseResult, RankResult
from harness.probes.memory import MIB
from harness.spec import Case
from harness.suite_defs.ckpt_memory.params import CkptRole
from harness.suite_defs.ckpt_memory.payload import ContractRankData, SaveRankData


def save_data(rank: RankResult) -> SaveRankData:
    """What a save case's rank returned, as ckpt-memory's payload."""
    return rank.payload_as(SaveRankData)


def key(case: Case) -> str:
    """A save case's entry; a contract case's (its loads' peaks) ends in its role."""
    return f"{case.model.name}/{case.layout.id}/{case.params.ckpt_format}" + \
        ("/fully-parallel" if case.params.fully_parallel_save else "") + \
        ("/async" if case.params.async_save else "") + \
        (f"/{case.params.ckpt_role}" if case.params.ckpt_role else "")


def record_command(case: Case) -> str:
    """The command that records exactly this case's baseline."""

    o = case.params
    if o.ckpt_role:  # the contract comes with the default matrix only; a reshard-load case runs at half the DP
        world_size = case.layout.world_size * (2 if o.ckpt_role == CkptRole.RESHARD_LOAD else 1)
        return selection.record_command(case, layout=False, world_size=world_size, params=False, skip=("steps",))
    return selection.record_command(case, skip=("steps",))  # the suite's own


# The absolute floor of `retained_per_save_mib`'s tolerance: the cache a rank process fills once over a few saves
# (judge.py, RETAINED_PER_SAVE) moves it by up to 0.39 MiB per save depending on which case ran first; the
# analytic bound beside it is 1 MiB per save.
RETAINED_FLOOR = 0.5


def floor(metric: str) -> float:
    """A metric's absolute tolerance floor, MiB."""

    return RETAINED_FLOOR if metric.endswith("retained_per_save_mib") else ABS_FLOOR


def samples(result: CaseResult) -> dict[str, float]:
    """The baselined metrics of a case, MiB: per rank, the save's heap peak in the rank itself and in
    its forked writer processes (judged apart: the writers' peak depends on fork timing), what later saves
    of the same state kept per save; on device ranks also the pinned host staging it held and its device
    peak above what was allocated before. A contract case's: its loads' peaks (load_samples)."""
    out: dict[str, float] = {}
    if result.case.params.ckpt_role:
        return load_samples(result)
    for r in result.ranks:
        if result.case.params.ckpt_format == CkptFormat.FSDP2_FULL and r.rank != 0:
            # Only gathers pass through these ranks; their peak is bimodal across reruns (8 or 12 MiB
            # for `small`: one more full tensor alive or not), so only the model band judges them.
            continue
        out[f"rank{r.rank}.save_heap_peak_mib"] = save_data(r).save.heap_peak / MIB
        out[f"rank{r.rank}.save_writer_peak_mib"] = save_data(r).save.children_heap_peak / MIB
        if (kept := save_data(r).retention) is not None:
            out[f"rank{r.rank}.retained_per_save_mib"] = kept.per_save / MIB
        if result.case.backend == Backend.NCCL:
            out[f"rank{r.rank}.save_pinned_peak_mib"] = save_data(r).save.pinned_peak / MIB
            out[f"rank{r.rank}.save_device_peak_mib"] = save_data(r).save.device_peak / MIB
    return out


def load_samples(result: CaseResult) -> dict[str, float]:
    """A contract case's baselined metrics, MiB: per load that every rank completed, each rank's host peak
    (`load-<layout>.rank<r>.host_peak_mib`) and on device ranks its device peak above the load's start."""
    out: dict[str, float] = {}
    loads = [r.payload_as(ContractRankData).targets for r in result.ranks]
    for i in range(len(loads[0]) if loads else 0):
        per_rank = [rank_loads[i] for rank_loads in loads]
        if any(d.error or d.load is None for d in per_rank):
            continue  # a refused or failed load has no peak to keep
        for r, d in zip(result.ranks, per_rank):
            assert d.load is not None
            head = f"load-{d.layout}.rank{r.rank}"
            out[f"{head}.host_peak_mib"] = d.load.host_peak / MIB
            if result.case.backend == Backend.NCCL:
                out[f"{head}.device_peak_mib"] = d.load.device_peak / MIB
    return out
