"""`grad-sync`: the data-parallel gradient reduction that actually ran is the one the user configured."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from harness.backends import Backend
from harness.checks import CheckResult, cannot_tell, case_failed
from harness.checks.expected_collectives import (
    dispatch_records,
    dp_records,
    expected_collectives,
    expected_dispatch,
    match_collectives,
    match_dispatch,
)
from harness.checks.numeric import beyond, severity
from harness.checks.tensors import assemble
from harness.engine_names import EngineName
from harness.engines import is_fsdp2, make_engine
from harness.engines.base import HasGradBuffers, ParamShard
from harness.engines.mcore import McoreEngine
from harness.errors import DoesNotApply
from harness.launch.context import RankContext
from harness.launch.results import CaseResult, RankResult
from harness.layouts import default_matrix, validate
from harness.platform.parallel import layout_coords
from harness.probes.collectives import Collective, CollectiveRecorder, GroupRoles, grad_stats_groups, instrument
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.tables import table as text_table

STEPS = 3  # replica consistency is judged after 3 steps


@dataclass(frozen=True)
class GradSyncRankData:
    """What a grad-sync rank returns: the collectives it issued over the recorded steps and its parameter shards
    after them."""

    coords: dict[str, int]
    collectives: list[Collective]
    params: list[ParamShard]
    # per model chunk, the built model's parameters that train, (name, numel) in registration order (engines with
    # HasGradBuffers); None: planned from the model spec's arithmetic
    buffer_params: list[list[tuple[str, int]]] | None = None


def _data(rank: RankResult) -> GradSyncRankData:
    return rank.payload_as(GradSyncRankData)


class GradSyncSuite:
    name = "grad-sync"
    default_model = "tiny"  # the CPU tier's model when none is given
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = EngineName.MCORE, backend: Backend = Backend.GLOO, options: CaseOptions = CaseOptions(),
              params: None = None) -> list[Case]:
        if is_fsdp2(engine):
            raise DoesNotApply(f"the grad-sync suite judges megatron DDP's gradient-sync modes (all-reduce, or reduce-"
                           f"scatter with the distributed optimizer); engine {engine} reduces with FSDP2's own "
                           "reduce-scatter, whatever those options say: judge it with --suite equivalence, golden "
                           "or ckpt-memory")
        if layouts is None:  # every valid layout (an MoE model's expert ones: the default expert matrix); CP > 1
            # runs the reference CP attention on CPU ranks
            layouts = default_matrix(model, world_size)
        for lay in layouts:
            validate(lay, model, world_size)
        out = []
        for lay in layouts:
            for dist_opt in (False, True):
                for overlap in (False, True):
                    opts = dataclasses.replace(options, steps=STEPS, use_distributed_optimizer=dist_opt,
                                               overlap_grad_reduce=overlap)
                    out.append(Case(self.name, model, lay, engine, opts, backend))
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> GradSyncRankData:
        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        roles = GroupRoles()
        if isinstance(engine, McoreEngine) and engine.optimizer is not None:  # the norm's groups, as megatron built
            roles.add(grad_stats_groups(engine.optimizer), "grad-stats")
        recorder = CollectiveRecorder(roles)
        with instrument(engine, recorder), recorder:
            for step in range(case.options.steps):
                with ctx.phase("steps"), recorder.phase("forward-backward"):
                    engine.train_step(step)
        with ctx.phase("collect"):
            shards = engine.param_shards()
        buffers = engine.grad_buffer_params() if isinstance(engine, HasGradBuffers) else None
        return GradSyncRankData(layout_coords(), recorder.records, shards, buffers)

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        r0 = result.ranks[0]
        seen = Counter(r.op for r in dp_records(_data(r0).collectives) if r.source == "dispatch")
        return {"observed dp ops (rank 0)": " ".join(f"{op}x{n}" for op, n in sorted(seen.items()))}

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        """Bytes each rank moved per group role and collective kind (dispatcher records, all steps)."""
        out: dict[str, dict[str, int]] = {}
        for r in result.ranks:
            per: Counter = Counter()
            for c in _data(r).collectives:
                if c.source == "dispatch":
                    per[f"{c.role}/{c.kind}"] += c.bytes
            out[str(r.rank)] = dict(sorted(per.items()))
        return {"collective_bytes": out}

    def check(self, results: list[CaseResult], params: None = None) -> list[CheckResult]:
        out = []
        for res in results:
            if not res.ok:
                out.append(case_failed("grad-sync.run", res))
                continue
            out += [self._check_plan(res), self._check_recorders(res), self._check_replicas(res)]
            if res.case.model.moe:
                out.append(self._check_dispatch(res))
        return out

    @staticmethod
    def _check_dispatch(res: CaseResult) -> CheckResult:
        """The MoE token dispatcher's collectives: the planned calls on the EP / ETP groups, nothing elsewhere."""
        case = res.case
        problems, rows = [], []
        for r in res.ranks:
            planned = expected_dispatch(case, r.rank)
            records = dispatch_records([x for x in _data(r).collectives if x.source == "dispatch"])
            calls: Counter[tuple] = Counter((x.kind, x.role, x.ranks) for x in records)
            moved: Counter[tuple] = Counter()
            for x in records:
                moved[(x.kind, x.role, x.ranks)] += x.bytes
            rows += [[r.rank, f"{kind} on {role} {ranks}", calls[kind, role, ranks], f"{b / 2**10:.1f} KiB"]
                     for (kind, role, ranks), b in sorted(moved.items(), key=str)]
            if planned is not None:
                problems += [f"rank {r.rank}: {d}" for d in match_dispatch(planned, records)]
        table = text_table(["rank", "dispatcher collective", "calls", "moved"], rows, align=">><>").split("\n")
        what = f"{case.options.moe_dispatcher} dispatcher"
        rank0 = expected_dispatch(case, 0)
        if rank0 is None:
            return cannot_tell("grad-sync.dispatch", case.id,
                               f"no plan for the {what}'s collectives (the all-to-all dispatcher's is known): "
                               f"recorded only", table)
        if problems:
            return CheckResult("grad-sync.dispatch", case.id, False, f"grad-sync: {what}: {problems[0]}",
                               problems[1:] + table)
        return CheckResult("grad-sync.dispatch", case.id, True, f"{what}: the planned collectives on the expert "
                           f"groups ({sum(p.calls for p in rank0)} on rank 0)", table)

    @staticmethod
    def _configured(case: Case) -> str:
        o = case.options
        what = "reduce-scatter + param all-gather" if o.use_distributed_optimizer else "all-reduce"
        return (f"{what} (use_distributed_optimizer={o.use_distributed_optimizer}, "
                f"overlap_grad_reduce={o.overlap_grad_reduce})")

    def _check_plan(self, res: CaseResult) -> CheckResult:
        case = res.case
        problems: list[str] = []
        rows: list[list] = []  # rank, expected, observed (dispatcher), ok
        for r in res.ranks:
            records = dp_records([x for x in _data(r).collectives if x.source == "dispatch"])
            planned = expected_collectives(case, r.rank, _data(r).buffer_params)
            cmp = match_collectives(planned, records)
            by_key: dict[tuple, Counter] = {}
            ops: dict[tuple, str] = {}
            for x in records:
                k = (x.kind, x.ranks, x.numel, x.dtype)
                by_key.setdefault(k, Counter())[x.phase] += 1
                ops[k] = x.op
            for p in planned:
                k = (p.kind, p.ranks, p.numel, p.dtype)
                n = sum(by_key.get(k, Counter()).values())
                obs = f"{ops[k]} x{n} in {','.join(sorted(by_key[k]))}" if n else "-"
                rows.append([r.rank, f"{p.what}: {p.describe()}", obs, "yes" if n == p.calls else "NO"])
            for x, n in cmp.unexpected:
                rows.append([r.rank, "(nothing)", f"{x.op} on {x.role} {x.ranks}, {x.numel} x {x.dtype} x{n}", "NO"])
            first_of_rank = len(problems)  # a rank's expert-group problem leads its own
            for p in cmp.missing:
                wrong = [x for x, _ in cmp.unexpected
                         if x.kind in ("reduce_scatter", "all_reduce") and p.kind in ("reduce_scatter", "all_reduce")]
                if p.role == "edp" and p.kind != "all_gather":
                    instead = "; ".join(f"{x.op} on {x.role} group {x.ranks}, {x.numel} x {x.dtype}" for x in wrong)
                    problems.insert(first_of_rank,
                                    f"rank {r.rank}: the experts' gradients were not reduced over the expert-data-"
                                    f"parallel group {p.ranks} (planned {p.describe()})"
                                    + (f"; observed instead {instead}" if instead else ""))
                elif wrong and p.what == "DP gradient reduction":
                    x = wrong[0]
                    n = sum(1 for y in records
                            if (y.kind, y.ranks, y.numel, y.dtype) == (x.kind, x.ranks, x.numel, x.dtype))
                    problems.append(f"rank {r.rank}: configured {self._configured(case)} but observed {x.op} on "
                                    f"{x.role} group {x.ranks}, {x.numel} x {x.dtype}, {n} call{'s' if n != 1 else ''}")
                else:
                    problems.append(f"rank {r.rank}: configured {self._configured(case)} but the {p.what} "
                                    f"({p.describe()}) was not observed")
            for x, n in cmp.unexpected:
                if not any(x.kind in (q.kind,) for q in cmp.missing):
                    problems.append(f"rank {r.rank}: unexpected {x.op} on {x.role} group {x.ranks}, "
                                    f"{x.numel} x {x.dtype}, {n} call{'s' if n != 1 else ''}")
            for p, phases in cmp.wrong_phase:
                problems.append(f"rank {r.rank}: {p.what} issued in {dict(phases)}, "
                                f"expected only in {sorted(p.phases)}")
            if case.options.overlap_grad_reduce:
                reduce_phases = Counter(x.phase for x in records if x.kind != "all_gather")
                if reduce_phases and "backward" not in reduce_phases:
                    problems.append(f"rank {r.rank}: overlap_grad_reduce=True but every gradient reduction ran in "
                                    f"{sorted(reduce_phases)}, none overlapped with backward")
        table = text_table(["rank", "expected", "observed (dispatcher)", "ok"], rows, align="><<<").split("\n")
        if problems:
            return CheckResult("grad-sync.plan", case.id, False, f"grad-sync: {problems[0]}", problems[1:] + table)
        return CheckResult("grad-sync.plan", case.id, True, f"observed = configured {self._configured(case)}",
                           table, show=True)

    @staticmethod
    def _check_recorders(res: CaseResult) -> CheckResult:
        """The dispatcher and megatron's aliases must see the same DP gradient collectives."""
        per_rank = [(r, dp_records(_data(r).collectives)) for r in res.ranks]
        if not any(recs for _, recs in per_rank):  # grad-sync.plan fails such a case
            return cannot_tell("grad-sync.recorders", res.case.id, "neither recorder saw a DP gradient collective on "
                                                                  "any rank: nothing to compare (the plan check "
                                                                  "names what was expected)")
        for r, recs in per_rank:
            seen = {src: Counter((x.kind, x.ranks, x.numel) for x in recs if x.source == src)
                    for src in ("dispatch", "alias")}
            if seen["dispatch"] != seen["alias"]:
                only_d = seen["dispatch"] - seen["alias"]
                only_a = seen["alias"] - seen["dispatch"]
                return CheckResult("grad-sync.recorders", res.case.id, False,
                                   f"rank {r.rank}: recorders disagree on DP collectives; only at the dispatcher: "
                                   f"{dict(only_d)}; only at megatron's aliases: {dict(only_a)}")
        return CheckResult("grad-sync.recorders", res.case.id, True, "dispatcher and megatron aliases agree")

    @staticmethod
    def _check_replicas(res: CaseResult) -> CheckResult:
        lay = res.case.layout
        if lay.dp * lay.cp == 1:
            return cannot_tell("grad-sync.replicas", res.case.id,
                               f"{lay.id} has no DP replicas (DP x CP = 1), so none can drift apart: "
                               f"needs DP x CP >= 2")
        full = assemble([_data(r).params for r in res.ranks])
        bad = {n: s for n, s in full.replica_spread.items() if beyond(s, 0.0)}
        if not bad:
            return CheckResult("grad-sync.replicas", res.case.id, True,
                               f"{len(full.replica_spread)} params bit-identical across DP replicas after "
                               f"{res.case.options.steps} steps", value=0.0)
        worst = max(bad, key=lambda n: severity(bad[n]))
        return CheckResult(
            "grad-sync.replicas", res.case.id, False,
            f"DP replicas drifted after {res.case.options.steps} steps: {len(bad)} params differ, worst {worst} "
            f"max abs {bad[worst]:.3g} (configured {GradSyncSuite._configured(res.case)}; a reduce-scatter paired "
            f"with a non-distributed optimizer looks like this)",
            [f"  {n}: max abs {s:.3g}" for n, s in sorted(bad.items())], value=bad[worst])
