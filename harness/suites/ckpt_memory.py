"""`ckpt-memory`: per-rank host (and device) memory peaks of a checkpoint save, per optimizer format."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from harness.checks import CheckResult
from harness.engines import make_engine
from harness.errors import BadInput
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.probes.memory import MIB, artifacts_dir, measure
from harness.report.artifacts import flamegraph_path
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suites.ckpt_contract import CkptCase, check_reshard, contract_cases, reshard_work

# fully_sharded_model_space (deprecated) fails in megatron-core 0.16.1 with "ShardedTensor.flattened_range
# is not supported"; it can still be asked for with --ckpt-format.
# "default" is whatever the engine saves when the user names no format: R1 was that default flipping.
# fsdp2_*: the fsdp2 engine (torch fully_shard) on the pure-DP layout; fsdp2_default is whatever it
# saves when no format is named: R5 was that becoming the full (gathered) state dict.
MCORE_FORMATS = ("default", "dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")
FSDP2_FORMATS = ("fsdp2_default", "fsdp2_sharded", "fsdp2_full")
FORMATS = MCORE_FORMATS + FSDP2_FORMATS
ALL_FORMATS = FORMATS + ("fully_sharded_model_space",)
EXPECTED_DEFAULT = "dp_reshardable"  # Megatron-LM / Megatron-Bridge default since R1
# also saved async, and through megatron's fully parallel save wrapper, in the default matrix
ASYNC_FORMATS = FULLY_PARALLEL_FORMATS = ("dp_reshardable", "fully_reshardable")
EXPECTED_DEFAULTS = {"default": EXPECTED_DEFAULT, "fsdp2_default": "fsdp2_sharded"}
DEFAULT_LAYOUTS = ("tp1-pp1-cp1-dp4", "tp2-pp1-cp1-dp2", "tp1-pp2-cp1-dp2")


@dataclass(frozen=True)
class CkptMemoryParams:
    """The ckpt-memory suite's parameters: which formats, how they are saved, against which baselines."""

    formats: tuple[str, ...] = FORMATS  # --ckpt-format
    contract: bool = True  # also the reshard contract cases (harness/suites/ckpt_contract.py), default matrix only
    fully_parallel_save: bool = False
    async_save: bool = False
    baselines_dir: str | None = None  # None: the repository's baselines/

    def __post_init__(self):
        object.__setattr__(self, "formats", tuple(self.formats))
        unknown = sorted(set(self.formats) - set(ALL_FORMATS))
        if unknown:
            raise BadInput(f"unknown checkpoint format(s) {unknown}; known: {', '.join(ALL_FORMATS)}")


class CkptMemorySuite:
    name = "ckpt-memory"
    default_model = "small"  # the CPU tier's model when none is given
    Params = CkptMemoryParams
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
               "memray")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: CkptMemoryParams | None = None) -> list[Case]:
        p = params or CkptMemoryParams()
        # the contract cases come with the default matrix (not with hand-picked layouts or formats)
        contract = p.contract and layouts is None and p.formats == FORMATS
        if layouts is None:
            layouts = [Layout.parse(i) for i in DEFAULT_LAYOUTS if Layout.parse(i).world_size == world_size] \
                or [Layout(dp=world_size)]
        for lay in layouts:
            validate(lay, model, world_size)
        fsdp2 = _is_fsdp2(engine)
        mcore_engine, fsdp2_engine = ("mcore", engine) if fsdp2 else (engine, "fsdp2")
        memory = []
        for lay in layouts:
            for fmt in p.formats:
                is_fsdp2_format = fmt.startswith("fsdp2")
                megatron_only = p.fully_parallel_save or p.async_save
                if is_fsdp2_format and ((lay.tp, lay.pp, lay.cp, lay.vpp) != (1, 1, 1, 1) or megatron_only):
                    continue  # FSDP2 shards over DP only; the fully parallel wrapper and async save are megatron's
                opts = dataclasses.replace(options, steps=1, use_distributed_optimizer=not is_fsdp2_format)
                memory.append(Case(self.name, model, lay, fsdp2_engine if is_fsdp2_format else mcore_engine, opts,
                                   backend, params=CkptCase(fmt, p.fully_parallel_save, p.async_save)))
        if contract:  # the default matrix: async and fully parallel saves of both main formats at the first layout
            opts = dataclasses.replace(options, steps=1, use_distributed_optimizer=True)
            for variant, formats in (("async_save", ASYNC_FORMATS), ("fully_parallel_save", FULLY_PARALLEL_FORMATS)):
                for fmt in formats:
                    memory.append(Case(self.name, model, layouts[0], mcore_engine, opts, backend,
                                       params=CkptCase(fmt, **{variant: True})))
        return memory + (contract_cases(self.name, model, world_size, mcore_engine, backend, options)
                         if contract else [])

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        import torch.distributed as dist

        if case.params.ckpt_role:
            return reshard_work(case, ctx)
        from harness.suites import layout_coords

        engine = make_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        with ctx.phase("steps"):
            engine.train_step(0)  # creates the optimizer state the checkpoint holds
        warm_up_checkpointing(ctx)
        ckpt_dir = ctx.workdir / "ckpt"
        if ctx.rank == 0:
            ckpt_dir.mkdir(exist_ok=True)
        dist.barrier()
        captures = artifacts_dir(case.id)
        with ctx.phase("save"), measure("save", captures, ctx.rank, device=not ctx.on_cpu) as peak:
            if case.params.async_save:
                engine.save_checkpoint(str(ckpt_dir), case.params.ckpt_format, case.params.fully_parallel_save,
                                       async_save=True)
            else:
                engine.save_checkpoint(str(ckpt_dir), case.params.ckpt_format, case.params.fully_parallel_save)
        dist.barrier()
        out = {"coords": layout_coords(), "save": peak}
        if ctx.rank == 0:
            from harness.probes.ckpt_format import inspect

            out["on_disk"] = inspect(ckpt_dir)  # what the files are
            out["content_metadata"] = _label(engine, ckpt_dir)  # what the engine says they are
        return out

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok or result.case.params.ckpt_role:
            return {}
        peaks = [r.data["save"] for r in result.ranks]
        return {"host peak MiB/rank": " ".join(f"{p.host_peak / MIB:.0f}" for p in peaks),
                "rss peak MiB/rank": " ".join(f"{(p.rss_peak - p.rss_before) / MIB:.0f}" for p in peaks)}

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        """Per-rank peaks of the save (bytes) and the rank's RSS timeline during it, for plots."""
        if result.case.params.ckpt_role:
            return {}
        from dataclasses import asdict

        return {"save": {str(r.rank): asdict(r.data["save"]) for r in result.ranks}}

    @staticmethod
    def key(case: Case) -> str:
        return f"{case.model.name}/{case.layout.id}/{case.params.ckpt_format}" + \
            ("/fully-parallel" if case.params.fully_parallel_save else "") + ("/async" if case.params.async_save else "")

    @staticmethod
    def record_command(case: Case) -> str:
        """The command that records exactly this case's baseline."""
        from harness import baselines

        o = case.params
        engine = "" if case.engine in ("mcore", "fsdp2") else f" --engine {case.engine}"
        return (baselines.record_command(case.suite, case.model.name, case.layout.world_size)
                + f" --layout {case.layout.id} --ckpt-format {o.ckpt_format}{engine}"
                + (" --fully-parallel-save" if o.fully_parallel_save else "") + (" --async-save" if o.async_save else ""))

    @staticmethod
    def samples(result: CaseResult) -> dict[str, float]:
        """The baselined metrics of a case, MiB: per rank, the save's heap peak in the rank itself and in
        its forked writer processes (judged apart: the writers' peak depends on fork timing)."""
        out = {}
        if result.case.params.ckpt_role:
            return out  # checkpoint contract cases: judged on values, not baselined
        for r in result.ranks:
            if result.case.params.ckpt_format == "fsdp2_full" and r.rank != 0:
                # Only gathers pass through these ranks; their peak is bimodal across reruns (8 or 12 MiB
                # for `small`: one more full tensor alive or not), so only the model band judges them.
                continue
            out[f"rank{r.rank}.save_heap_peak_mib"] = r.data["save"].heap_peak / MIB
            out[f"rank{r.rank}.save_writer_peak_mib"] = r.data["save"].children_heap_peak / MIB
        return out

    def check(self, results: list[CaseResult], params: CkptMemoryParams | None = None) -> list[CheckResult]:
        from harness import baselines
        from harness.platform import detect_platform

        p = params or CkptMemoryParams()
        out: list[CheckResult] = []
        data_by_platform: dict[str, dict] = {}
        out.extend(check_reshard(results))
        for res in results:
            case = res.case
            if case.params.ckpt_role:
                continue
            if not res.ok:
                lines = res.error.splitlines() or ["failed"]
                out.append(CheckResult("ckpt-memory.run", case.id, False, lines[0], lines[1:]))
                continue
            platform = detect_platform(case.backend).key
            path = baselines.baseline_path(p.baselines_dir, platform, self.name)
            if platform not in data_by_platform:
                data_by_platform[platform] = baselines.load(path)
            out.append(self._check_contract(res))
            out.append(self._check_model(res))
            out.append(self._check_baseline(res, data_by_platform[platform], path))
        return out

    @staticmethod
    def labelled_format(res: CaseResult) -> str:
        """The format the engine's own label says (content metadata / the engine's saved_metadata)."""
        meta = next((r.data.get("content_metadata") for r in res.ranks if r.data.get("content_metadata")), None) or {}
        if "format" in meta:
            return meta["format"]
        sharding = meta.get("distrib_optim_sharding_type", "?")
        if sharding == "fully_reshardable" and meta.get("distrib_optim_fully_reshardable_mem_efficient"):
            return "fully_reshardable_mem_efficient"
        return sharding

    def _check_contract(self, res: CaseResult) -> CheckResult:
        """The format asked for against what is on disk (and, for mem_efficient, what the memory shows)."""
        from harness.probes.ckpt_format import EXPECTED_ON_DISK

        asked = res.case.params.ckpt_format
        expected = EXPECTED_DEFAULTS.get(asked, asked)
        disk = next(r.data["on_disk"] for r in res.ranks if "on_disk" in r.data)
        label = self.labelled_format(res)
        what = f"{res.case.engine} default format (expected {expected})" if asked in EXPECTED_DEFAULTS else f"format {asked}"
        rows = [f"on disk: {disk.layout}: {disk.evidence}",
                f"label written by the engine: {label} ({'agrees' if label == expected else 'DISAGREES'}; "
                f"secondary: the files decide)"]
        want = EXPECTED_ON_DISK.get(expected, expected)
        if disk.layout != want:
            return CheckResult("ckpt-memory.contract", res.case.id, False,
                               f"{what}: the checkpoint on disk is {disk.layout}, not {want} ({disk.evidence})", rows)
        note = ""
        if want == "fully_reshardable" and expected in ("fully_reshardable", "fully_reshardable_mem_efficient"):
            gathered, why = _gathered_off_dp_rank0(res)
            rows.append(f"mem_efficient or not (byte-identical on disk), from the measured peaks: {why}")
            if gathered is not None and gathered != (expected == "fully_reshardable"):
                measured = "fully_reshardable" if gathered else "fully_reshardable_mem_efficient"
                return CheckResult("ckpt-memory.contract", res.case.id, False,
                                   f"{what}: on disk fully_reshardable, by the measured peaks {measured}: {why}", rows)
            note = f"; mem_efficient: {why}" if gathered is None else f"; by the measured peaks {expected}"
        return CheckResult("ckpt-memory.contract", res.case.id, True,
                           f"{what}: the checkpoint on disk is {disk.layout}{note}", rows)

    def _check_model(self, res: CaseResult) -> CheckResult:
        """Every rank's peak inside the band of the format asked for; says where the band cannot tell
        that format from its rival (12N too small against the fixed cost, or no DP to gather over)."""
        from harness.checks.memory_model import discrimination, rival, save_band

        case = res.case
        fmt = EXPECTED_DEFAULTS.get(case.params.ckpt_format, case.params.ckpt_format)
        rows, bad, blind = [], [], []
        judged = [r.rank for r in res.ranks if rival(fmt, case.layout, r.rank)]  # ranks where a rival exists
        for r in res.ranks:
            band = save_band(fmt, case.model, case.layout, r.rank, case.params.fully_parallel_save)
            why = discrimination(fmt, case.model, case.layout, r.rank, case.params.fully_parallel_save)
            peak = r.data["save"].host_peak
            ok = band.contains(peak)
            rows.append(f"rank {r.rank}: host peak {peak / MIB:.1f} MiB, model {band.describe()} "
                        f"{'ok' if ok else 'OUTSIDE'}" + (f" - cannot tell it from {rival(fmt, case.layout, r.rank)}"
                                                          if why else ""))
            if not ok:
                bad.append((r, peak, band))
            if why:
                blind.append((r.rank, why))
        if bad:
            r, peak, band = bad[0]
            return CheckResult("ckpt-memory.model", case.id, False,
                               f"rank {r.rank} save host peak {peak / MIB:.1f} MiB outside the {fmt} model band "
                               f"{band.describe()}", rows)
        if judged and len(blind) == len(judged):
            return CheckResult("ckpt-memory.model", case.id, True,
                               f"cannot discriminate formats for this model and layout (every rank's peak is inside "
                               f"the {fmt} band, which proves nothing here): {blind[0][1]}", rows, show=True)
        told = [r for r in judged if r not in dict(blind)]
        return CheckResult("ckpt-memory.model", case.id, True,
                           f"every rank inside the {fmt} band; it rules out the rival format on ranks {told}"
                           + (f" (not on {[b[0] for b in blind]}: 12N too small or D = 1)" if blind else ""), rows)

    def _check_baseline(self, res: CaseResult, data: dict, path) -> CheckResult:
        from harness import baselines

        key = self.key(res.case)
        rows, verdicts, figures = [], {}, {}
        for metric, value in self.samples(res).items():
            v = verdicts[metric] = baselines.compare(data, key, metric, value)
            base = "-" if v.baseline is None else f"{v.baseline:.2f} +- {v.tolerance:.2f}"
            rows.append(f"{metric}: {value:.2f} MiB, baseline {base}, delta {v.delta:+.2f} MiB: {v.status}"
                        + (f"; detects {_detects(v)}" if v.baseline is not None else ""))
            figures[metric] = {"measured": value, "baseline": v.baseline, "tolerance": v.tolerance, "status": v.status}
        figures = {"key": key, "metrics": figures}
        by_status = {st: [m for m, v in verdicts.items() if v.status == st] for st in ("missing", "regression", "improvement")}
        # the report stage deletes the captures of a pass and renders the flamegraph of a failure
        figures["captures"] = [r.data["save"].capture for r in res.ranks if r.data["save"].capture]
        if not any(by_status.values()):
            coarsest = max(verdicts, key=lambda m: _relative_tolerance(verdicts[m]), default=None)
            sees = f"; coarsest: {coarsest} detects {_detects(verdicts[coarsest])}" if coarsest else ""
            return CheckResult("ckpt-memory.baseline", res.case.id, True, f"within baseline ({key}){sees}", rows,
                               show=True, data=figures)
        if by_status["missing"]:
            return CheckResult("ckpt-memory.baseline", res.case.id, False,
                               f"no baseline for {key} {by_status['missing'][0]} in {path}; record it with: "
                               f"{self.record_command(res.case)}", rows, data=figures)
        # a regression anywhere outranks improvements elsewhere; a non-finite figure, then the largest delta
        metric = max(by_status["regression"] or by_status["improvement"],
                     key=lambda m: (not math.isfinite(verdicts[m].measured), abs(verdicts[m].delta)))
        v = verdicts[metric]
        capture = res.ranks[int(metric.split(".")[0][4:])].data["save"].capture
        figures["flamegraph_of"] = capture
        flame = flamegraph_path(capture)
        if not math.isfinite(v.measured):
            return CheckResult("ckpt-memory.baseline", res.case.id, False,
                               f"{metric} measured {v.measured} MiB (not a finite number) against baseline "
                               f"{v.baseline:.2f} +- {v.tolerance:.2f} MiB; flamegraph: {flame}", rows, data=figures)
        verb = "above" if v.status == "regression" else "below (improvement: refresh the baseline with " \
            f"`{self.record_command(res.case)}`)"
        return CheckResult("ckpt-memory.baseline", res.case.id, False,
                           f"{metric} {v.measured:.2f} MiB is {v.delta:+.2f} MiB {verb} baseline "
                           f"{v.baseline:.2f} +- {v.tolerance:.2f} MiB; flamegraph: {flame}", rows,
                           improvement=not by_status["regression"], data=figures)


def _relative_tolerance(v) -> float:
    return v.tolerance / v.baseline if v.baseline else math.inf


def _detects(v) -> str:
    """The smallest rise over the baseline that fails, in MiB and relative to the baseline."""
    rel = f" (+{v.tolerance / v.baseline:.0%})" if v.baseline else ""
    return f"> +{v.tolerance:.2f} MiB{rel}"


def _label(engine, ckpt_dir) -> dict:
    """The engine's own label of the checkpoint (kept as a secondary row of the contract)."""
    if hasattr(engine, "saved_metadata"):
        return engine.saved_metadata(str(ckpt_dir))
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_content_metadata(str(ckpt_dir)) or {}


def _gathered_off_dp_rank0(res: CaseResult) -> tuple[bool | None, str]:
    """Whether the ranks off DP rank 0 gathered the whole state during the save (fully_reshardable) or
    not (mem_efficient), from their measured peaks against 12N; None where the model cannot tell."""
    from harness.checks.memory_model import discrimination, gathers, save_band

    mem_eff, case = "fully_reshardable_mem_efficient", res.case
    fp = case.params.fully_parallel_save
    off = [r for r in res.ranks if not gathers(mem_eff, case.layout, r.rank)]
    if not off:
        return None, "cannot tell: every rank is a DP rank 0 (D = 1)"
    told = [r for r in off if not discrimination(mem_eff, case.model, case.layout, r.rank, fp)]
    if not told:
        return None, "cannot tell: " + discrimination(mem_eff, case.model, case.layout, off[0].rank, fp)
    s = {r.rank: save_band("fully_reshardable", case.model, case.layout, r.rank, fp).low for r in told}
    gathered = [r for r in told if r.data["save"].host_peak >= s[r.rank]]
    r = (gathered or told)[0]
    peak = r.data["save"].host_peak / MIB
    if gathered:
        return True, (f"ranks off DP rank 0 gathered the state: rank {r.rank} peak {peak:.1f} MiB >= "
                      f"12N = {s[r.rank] / MIB:.1f} MiB ({len(gathered)} of {len(told)} ranks)")
    return False, (f"ranks off DP rank 0 did not gather: rank {r.rank} peak {peak:.1f} MiB < "
                   f"12N = {s[r.rank] / MIB:.1f} MiB")


_WARM = False


def warm_up_checkpointing(ctx: RankContext) -> None:
    """One tiny save per process before any measured one, so one-time costs of the first save in a
    process (the writer's result-queue manager, lazy imports, caches) are in no measurement, and a
    case measures the same on fresh and warm ranks."""
    global _WARM
    if _WARM:
        return
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    path = ctx.workdir / "warm-up-ckpt"
    if ctx.rank == 0:
        path.mkdir(exist_ok=True)
    dist.barrier()
    sd = {f"w{ctx.rank}": ShardedTensor.from_rank_offsets(f"w{ctx.rank}", torch.zeros(16))}
    dist_checkpointing.save(sd, str(path))
    dist.barrier()
    # The fsdp2 engine's path: its first get_state_dict + DCP save of a fully_shard model in a process
    # cost every rank 1-2 MiB more than later ones (fsdp2_default repeats: 2.4, 0.36, 0.36 MiB).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(ctx.device)
    fully_shard(model, mesh=init_device_mesh(ctx.device.type, (dist.get_world_size(),)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8, device=ctx.device)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
    dist.barrier()
    _WARM = True


def _is_fsdp2(engine: str) -> bool:
    """Whether the engine (name or import path) is the fsdp2 engine or derives from it."""
    if engine == "fsdp2":
        return True
    if ":" not in engine:
        return False
    from harness.engines import resolve_factory
    from harness.engines.fsdp2 import FSDP2Engine

    factory = resolve_factory(engine)
    return isinstance(factory, type) and issubclass(factory, FSDP2Engine)
