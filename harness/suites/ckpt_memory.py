"""`ckpt-memory`: per-rank host (and device) memory peaks of a checkpoint save, per optimizer format."""

from __future__ import annotations

import glob
import os
from typing import Any

from harness.checks import CheckResult
from harness.engines import make_engine
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.probes.memory import MIB, artifacts_dir, measure
from harness.spec import Case, CaseOptions, Layout, ModelSpec
from harness.suites.ckpt_contract import check_reshard, contract_cases, reshard_work

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


class CkptMemorySuite:
    name = "ckpt-memory"
    default_model = "small"  # the CPU tier's model when none is given
    formats = FORMATS
    contract = True  # also the reshard contract cases (harness/suites/ckpt_contract.py)
    ALL_FORMATS = ALL_FORMATS
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
               "memray")

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions()) -> list[Case]:
        # the contract cases come with the default matrix (not with hand-picked layouts or formats)
        contract = self.contract and layouts is None and self.formats == FORMATS
        if layouts is None:
            layouts = [Layout.parse(i) for i in DEFAULT_LAYOUTS if Layout.parse(i).world_size == world_size] \
                or [Layout(dp=world_size)]
        for lay in layouts:
            validate(lay, model, world_size)
        fsdp2 = _is_fsdp2(engine)
        mcore_engine, fsdp2_engine = ("mcore", engine) if fsdp2 else (engine, "fsdp2")
        memory = []
        for lay in layouts:
            for fmt in self.formats:
                is_fsdp2_format = fmt.startswith("fsdp2")
                megatron_only = options.fully_parallel_save or options.async_save
                if is_fsdp2_format and ((lay.tp, lay.pp, lay.cp, lay.vpp) != (1, 1, 1, 1) or megatron_only):
                    continue  # FSDP2 shards over DP only; the fully parallel wrapper and async save are megatron's
                opts = CaseOptions(**{**options.__dict__, "steps": 1, "use_distributed_optimizer": not is_fsdp2_format,
                                      "ckpt_format": fmt})
                memory.append(Case(self.name, model, lay, fsdp2_engine if is_fsdp2_format else mcore_engine, opts,
                                   backend))
        if contract:  # the default matrix: async and fully parallel saves of both main formats at the first layout
            for variant, formats in (("async_save", ASYNC_FORMATS), ("fully_parallel_save", FULLY_PARALLEL_FORMATS)):
                for fmt in formats:
                    opts = CaseOptions(**{**options.__dict__, "steps": 1, "use_distributed_optimizer": True,
                                          "ckpt_format": fmt, variant: True})
                    memory.append(Case(self.name, model, layouts[0], mcore_engine, opts, backend))
        return memory + (contract_cases(self.name, model, world_size, mcore_engine, backend, options)
                         if contract else [])

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        import torch.distributed as dist

        if case.options.ckpt_role:
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
            if case.options.async_save:
                engine.save_checkpoint(str(ckpt_dir), case.options.ckpt_format, case.options.fully_parallel_save,
                                       async_save=True)
            else:
                engine.save_checkpoint(str(ckpt_dir), case.options.ckpt_format, case.options.fully_parallel_save)
        dist.barrier()
        saved = None
        if ctx.rank == 0:  # what the checkpoint itself says it is
            if hasattr(engine, "saved_metadata"):
                saved = engine.saved_metadata(str(ckpt_dir))
            else:
                from megatron.core import dist_checkpointing

                saved = dist_checkpointing.load_content_metadata(str(ckpt_dir))
        return {"coords": layout_coords(), "save": peak, "content_metadata": saved}

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok or result.case.options.ckpt_role:
            return {}
        peaks = [r.data["save"] for r in result.ranks]
        return {"host peak MiB/rank": " ".join(f"{p.host_peak / MIB:.0f}" for p in peaks),
                "rss peak MiB/rank": " ".join(f"{(p.rss_peak - p.rss_before) / MIB:.0f}" for p in peaks)}

    @staticmethod
    def report_data(result: CaseResult) -> dict[str, Any]:
        """Per-rank peaks of the save (bytes) and the rank's RSS timeline during it, for plots."""
        if result.case.options.ckpt_role:
            return {}
        from dataclasses import asdict

        return {"save": {str(r.rank): asdict(r.data["save"]) for r in result.ranks}}

    baselines_dir = None  # set by the driver (--baselines-dir); None: the repository's baselines/

    @staticmethod
    def key(case: Case) -> str:
        return f"{case.model.name}/{case.layout.id}/{case.options.ckpt_format}" + \
            ("/fully-parallel" if case.options.fully_parallel_save else "") + ("/async" if case.options.async_save else "")

    @staticmethod
    def record_command(case: Case) -> str:
        """The command that records exactly this case's baseline."""
        from harness import baselines

        o = case.options
        engine = "" if case.engine in ("mcore", "fsdp2") else f" --engine {case.engine}"
        return (baselines.record_command(case.suite, case.model.name, case.layout.world_size)
                + f" --layout {case.layout.id} --ckpt-format {o.ckpt_format}{engine}"
                + (" --fully-parallel-save" if o.fully_parallel_save else "") + (" --async-save" if o.async_save else ""))

    @staticmethod
    def samples(result: CaseResult) -> dict[str, float]:
        """The baselined metrics of a case, MiB: per rank, the save's heap peak in the rank itself and in
        its forked writer processes (judged apart: the writers' peak depends on fork timing)."""
        out = {}
        if result.case.options.ckpt_role:
            return out  # checkpoint contract cases: judged on values, not baselined
        for r in result.ranks:
            if result.case.options.ckpt_format == "fsdp2_full" and r.rank != 0:
                # Only gathers pass through these ranks; their peak is bimodal across reruns (8 or 12 MiB
                # for `small`: one more full tensor alive or not), so only the model band judges them.
                continue
            out[f"rank{r.rank}.save_heap_peak_mib"] = r.data["save"].heap_peak / MIB
            out[f"rank{r.rank}.save_writer_peak_mib"] = r.data["save"].children_heap_peak / MIB
        return out

    def check(self, results: list[CaseResult]) -> list[CheckResult]:
        from harness import baselines
        from harness.platform import detect_platform

        out: list[CheckResult] = []
        data_by_platform: dict[str, dict] = {}
        out.extend(check_reshard(results))
        for res in results:
            case = res.case
            if case.options.ckpt_role:
                continue
            if not res.ok:
                lines = res.error.splitlines() or ["failed"]
                out.append(CheckResult("ckpt-memory.run", case.id, False, lines[0], lines[1:]))
                continue
            platform = detect_platform(case.backend).key
            path = baselines.baseline_path(self.baselines_dir, platform, self.name)
            if platform not in data_by_platform:
                data_by_platform[platform] = baselines.load(path)
            out.append(self._check_contract(res))
            out.append(self._check_model(res))
            out.append(self._check_baseline(res, data_by_platform[platform], path))
        return out

    @staticmethod
    def saved_format(res: CaseResult) -> str:
        meta = next((r.data.get("content_metadata") for r in res.ranks if r.data.get("content_metadata")), None) or {}
        if "format" in meta:
            return meta["format"]
        sharding = meta.get("distrib_optim_sharding_type", "?")
        if sharding == "fully_reshardable" and meta.get("distrib_optim_fully_reshardable_mem_efficient"):
            return "fully_reshardable_mem_efficient"
        return sharding

    def _check_contract(self, res: CaseResult) -> CheckResult:
        asked = res.case.options.ckpt_format
        expected = EXPECTED_DEFAULTS.get(asked, asked)
        saved = self.saved_format(res)
        ok = saved == expected
        what = f"{res.case.engine} default format (expected {expected})" if asked in EXPECTED_DEFAULTS else f"format {asked}"
        return CheckResult("ckpt-memory.contract", res.case.id, ok,
                           f"{what}: checkpoint content metadata says {saved}" +
                           ("" if ok else " - the saved sharding type is not the one asked for"))

    def _check_model(self, res: CaseResult) -> CheckResult:
        from harness.checks.memory_model import save_band

        fmt = self.saved_format(res)
        rows, bad = [], []
        for r in res.ranks:
            band = save_band(fmt, res.case.model, res.case.layout, r.rank, res.case.options.fully_parallel_save)
            peak = r.data["save"].host_peak
            ok = band.contains(peak)
            rows.append(f"rank {r.rank}: host peak {peak / MIB:.1f} MiB, model {band.describe()} {'ok' if ok else 'OUTSIDE'}")
            if not ok:
                bad.append((r, peak, band))
        if not bad:
            return CheckResult("ckpt-memory.model", res.case.id, True, f"every rank inside the {fmt} band", rows)
        r, peak, band = bad[0]
        return CheckResult("ckpt-memory.model", res.case.id, False,
                           f"rank {r.rank} save host peak {peak / MIB:.1f} MiB outside the {fmt} model band "
                           f"{band.describe()}", rows)

    def _check_baseline(self, res: CaseResult, data: dict, path) -> CheckResult:
        from harness import baselines

        key = self.key(res.case)
        rows, verdicts, figures = [], {}, {}
        for metric, value in self.samples(res).items():
            v = verdicts[metric] = baselines.compare(data, key, metric, value)
            base = "-" if v.baseline is None else f"{v.baseline:.1f} +- {v.tolerance:.1f}"
            rows.append(f"{metric}: {value:.1f} MiB, baseline {base}, delta {v.delta:+.1f} MiB: {v.status}")
            figures[metric] = {"measured": value, "baseline": v.baseline, "tolerance": v.tolerance, "status": v.status}
        figures = {"key": key, "metrics": figures}
        by_status = {st: [m for m, v in verdicts.items() if v.status == st] for st in ("missing", "regression", "improvement")}
        if not any(by_status.values()):
            for r in res.ranks:  # nothing to look at: drop the captures
                for f in glob.glob(r.data["save"].capture + "*"):
                    os.unlink(f)
            return CheckResult("ckpt-memory.baseline", res.case.id, True, f"within baseline ({key})", rows, show=True,
                               data=figures)
        if by_status["missing"]:
            return CheckResult("ckpt-memory.baseline", res.case.id, False,
                               f"no baseline for {key} {by_status['missing'][0]} in {path}; record it with: "
                               f"{self.record_command(res.case)}", rows, data=figures)
        # a regression anywhere outranks improvements elsewhere; the largest delta is named
        metric = max(by_status["regression"] or by_status["improvement"], key=lambda m: abs(verdicts[m].delta))
        v = verdicts[metric]
        flame = flamegraph(res.ranks[int(metric.split(".")[0][4:])].data["save"].capture)
        verb = "above" if v.status == "regression" else "below (improvement: refresh the baseline with " \
            f"`{self.record_command(res.case)}`)"
        return CheckResult("ckpt-memory.baseline", res.case.id, False,
                           f"{metric} {v.measured:.1f} MiB is {v.delta:+.1f} MiB {verb} baseline "
                           f"{v.baseline:.1f} +- {v.tolerance:.1f} MiB; flamegraph: {flame}", rows,
                           improvement=not by_status["regression"], data=figures)


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


def flamegraph(capture: str) -> str:
    """Render memray's flamegraph of a capture next to it; returns its path (or why not)."""
    import subprocess
    import sys

    if not capture:
        return "(no capture)"
    out = capture.replace(".bin", ".html")
    proc = subprocess.run([sys.executable, "-m", "memray", "flamegraph", "-f", "-o", out, capture],
                          capture_output=True, text=True, timeout=120)
    return out if proc.returncode == 0 else f"(memray flamegraph failed: {proc.stderr.strip()[-200:]})"


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
