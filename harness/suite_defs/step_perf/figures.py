"""step-perf's figures of a finished case, read from what its ranks returned: step and exposed-communication
times, phase medians, the exact counters, and the baseline key a case is stored under."""

from __future__ import annotations

import statistics

from harness import selection
from harness.checks.flops_model import exact_groups, step_flops
from harness.checks.timing import TIMED_METRICS
from harness.dtypes import DType
from harness.engines import baseline_suffix
from harness.launch.results import CaseResult, RankResult
from harness.probes import cpu_share
from harness.probes.cpu_share import ForeignLoad
from harness.spec import Case
from harness.suite_defs.step_perf.payload import StepPerfRankData

TIMED = (*TIMED_METRICS, "calibration_ms")  # judged by statistics on samples
FOREIGN = "foreign_cpu_share"  # others' share of the machine's CPUs while the steps were timed
NOT_COUNTERS = (*TIMED, FOREIGN)  # the rest of a baseline entry are exact counters


def rank_data(rank: RankResult) -> StepPerfRankData:
    """What the rank returned, as step-perf's payload."""
    return rank.payload_as(StepPerfRankData)


def step_ms(result: CaseResult) -> list[float]:
    """Per timed step: the slowest rank's barrier-to-barrier time, ms."""
    per_rank = [[s.wall_s for s in rank_data(r).steps] for r in result.ranks]
    return [1000 * max(col) for col in zip(*per_rank)]


def plain_ms(result: CaseResult) -> list[float]:
    """Per uninstrumented step (--overhead; paired with the timed step of the same index): the slowest
    rank's barrier-to-barrier time, ms; [] without --overhead."""
    per_rank = [rank_data(r).plain_s for r in result.ranks]
    return [1000 * max(col) for col in zip(*per_rank)]


def exposed_ms(result: CaseResult) -> list[float]:
    """Per timed step: the largest exposed DP communication (grad-sync + param-gather) over ranks, ms."""
    per_rank = [[s.exposed_comm_s for s in rank_data(r).steps] for r in result.ranks]
    return [1000 * max(col) for col in zip(*per_rank)]


def foreign_load(result: CaseResult) -> ForeignLoad | None:
    """Who else used the machine while the case's steps were timed; None where that was not measured."""
    windows = [w for w in (rank_data(r).cpu for r in result.ranks) if w is not None]
    return cpu_share.foreign_load(windows)


def calibration_ms(result: CaseResult) -> float:
    return 1000 * statistics.median(x for r in result.ranks for x in rank_data(r).calibration)


def phase_medians(result: CaseResult) -> dict[int, dict[str, float]]:
    """rank -> phase -> median ms over the timed steps (plus 'compute': busy time minus exposed comm)."""
    out = {}
    for r in result.ranks:
        steps = rank_data(r).steps
        med = {p: 1000 * statistics.median(s.phases.get(p, 0.0) for s in steps) for p in steps[0].phases}
        med["compute"] = 1000 * statistics.median(s.busy_s - s.exposed_comm_s for s in steps)
        out[r.rank] = med
    return out


def slowest_rank(result: CaseResult) -> tuple[int, float, float]:
    """(rank, its compute ms, the median compute ms of the others): who the others wait for."""
    med = phase_medians(result)
    rank = max(med, key=lambda r: med[r]["compute"])
    others = [m["compute"] for r, m in med.items() if r != rank] or [med[rank]["compute"]]
    return rank, med[rank]["compute"], statistics.median(others)


def counters(result: CaseResult) -> dict[str, float]:
    """The exact counters of a case as flat metrics, per rank ("rank0.flops"). An MoE model's are summed over each
    group of ranks a token's routed copies stay within ("ranks0+2.flops"; flops_model.exact_groups): which rank
    computes and moves a token follows the routing, which moves as the weights train, the group's sums do not."""

    per_rank: dict[int, dict[str, float]] = {}
    for r in result.ranks:
        c = rank_data(r).counters
        mine = per_rank[r.rank] = {"flops": float(c.flops),
                                   "dp_reductions_in_backward": float(c.dp_reductions_in_backward)}
        for what, v in c.collectives.items():
            mine[f"{what}.calls"] = float(v["calls"])
            mine[f"{what}.bytes"] = float(v["bytes"])
    model = result.case.model
    out: dict[str, float] = {}
    for group in exact_groups(model, result.case.layout):  # a dense model's: each rank alone
        label = "ranks" + "+".join(str(g) for g in group) if model.moe else f"rank{group[0]}"
        for member in group:
            for m, value in per_rank.get(member, {}).items():
                out[f"{label}.{m}"] = out.get(f"{label}.{m}", 0.0) + value
    return out


def flops_used(result: CaseResult) -> tuple[list[int], str]:
    """Per rank the FLOPs of one step that TFLOP/s and MFU divide by, and where they come from: the counter's
    when it saw every matmul the config implies (megatron's local spec; an MoE model's ranks summed over each
    group a token's experts stay within, as routing decides which rank computes them), else the analytic count
    (harness/checks/flops_model.py) - Transformer Engine's GEMMs and fused attention are invisible to it."""

    case = result.case
    counted = {r.rank: rank_data(r).counters.flops for r in result.ranks}
    analytic = {r.rank: step_flops(case.model, case.layout, r.rank, global_batch_size=case.global_batch_size,
                                   micro_batch_size=case.micro_batch_size, recompute=case.options.recompute)
                for r in result.ranks}
    groups = exact_groups(case.model, case.layout)
    ranks = sorted(counted)
    if all(sum(counted.get(r, 0) for r in g) == sum(analytic.get(r, 0) for r in g) for g in groups):
        return [counted[r] for r in ranks], "counted"
    seen = sum(counted.values()) / sum(analytic.values()) if sum(analytic.values()) else 0.0
    return [analytic[r] for r in ranks], f"analytic (the counter saw {seen:.0%}: kernels it cannot see)"


def key(case: Case) -> str:
    """The case's entry in baselines/<platform>/step-perf.json (its dtype named where it is not fp32, the fsdp2
    path's own entry beside megatron's)."""

    o = case.options
    return (f"{case.model.name}/{case.layout.id}/distopt={int(o.use_distributed_optimizer)}"
            f",overlap={int(o.overlap_grad_reduce)}" + (f"/{o.dtype}" if o.dtype != DType.fp32 else "")
            + baseline_suffix(case.engine))


def record_command(case: Case) -> str:

    return selection.record_command(case, skip=("steps",))  # timed steps are --timed-steps
