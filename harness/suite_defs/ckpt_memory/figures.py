"""ckpt-memory's figures of a finished case: the baselined peaks, and the key a case is stored under."""

from __future__ import annotations

from harness.launch.results import CaseResult, RankResult
from harness.probes.memory import MIB
from harness.spec import Case
from harness.suite_defs.ckpt_memory.payload import SaveRankData


def save_data(rank: RankResult) -> SaveRankData:
    """What a save case's rank returned, as ckpt-memory's payload."""
    return rank.payload_as(SaveRankData)


def key(case: Case) -> str:
    return f"{case.model.name}/{case.layout.id}/{case.params.ckpt_format}" + \
        ("/fully-parallel" if case.params.fully_parallel_save else "") + \
        ("/async" if case.params.async_save else "")


def record_command(case: Case) -> str:
    """The command that records exactly this case's baseline."""
    from harness import baselines

    o = case.params
    engine = "" if case.engine in ("mcore", "fsdp2") else f" --engine {case.engine}"
    return (baselines.record_command(case.suite, case.model.name, case.layout.world_size, case.backend)
            + f" --layout {case.layout.id} --ckpt-format {o.ckpt_format}{engine}"
            + (" --fully-parallel-save" if o.fully_parallel_save else "")
            + (" --async-save" if o.async_save else ""))


def samples(result: CaseResult) -> dict[str, float]:
    """The baselined metrics of a case, MiB: per rank, the save's heap peak in the rank itself and in
    its forked writer processes (judged apart: the writers' peak depends on fork timing); on device
    ranks also the pinned host staging it held and its device peak above what was allocated before."""
    out: dict[str, float] = {}
    if result.case.params.ckpt_role:
        return out  # checkpoint contract cases: judged on values, not baselined
    for r in result.ranks:
        if result.case.params.ckpt_format == "fsdp2_full" and r.rank != 0:
            # Only gathers pass through these ranks; their peak is bimodal across reruns (8 or 12 MiB
            # for `small`: one more full tensor alive or not), so only the model band judges them.
            continue
        out[f"rank{r.rank}.save_heap_peak_mib"] = save_data(r).save.heap_peak / MIB
        out[f"rank{r.rank}.save_writer_peak_mib"] = save_data(r).save.children_heap_peak / MIB
        if result.case.backend == "nccl":
            out[f"rank{r.rank}.save_pinned_peak_mib"] = save_data(r).save.pinned_peak / MIB
            out[f"rank{r.rank}.save_device_peak_mib"] = save_data(r).save.device_peak / MIB
    return out
