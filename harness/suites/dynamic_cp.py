"""`dynamic-cp`: dynamic (hybrid) CP == static CP == no CP on the same global batch (regression R3).

Per sequence-length mix, four cases: no CP (the reference: every sample whole, DP only), static CP
over THD packs at cp2 and cp4, and megatron's hybrid CP on the pure-DP layout. Judged against the
reference, from tensors: per-token log-probs of every sample (merged by the engine, in the original
order, every sample exactly once), which rank computed each token and at which local CP size, the
per-token loss, and the full gradient of every parameter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from harness.checks import CheckResult
from harness.checks.numeric import beyond, fmt_err, nonfinite_count, nonfinite_summary, severity, within
from harness.checks.tensors import rel_error
from harness.engines import resolve_factory
from harness.engines.dynamic_cp import CPCase, CPEngine, TokenOutputs, check_dynamic_cp_available
from harness.errors import BadInput
from harness.launch.context import RankContext
from harness.launch.results import CaseResult
from harness.layouts import validate
from harness.spec import Case, CaseOptions, Layout, ModelSpec

# fp32 on CPU: CP changes only the reduction order (attention over gathered K/V, gradient sums);
# measured errors are ~1e-7 (log-probs) to ~2e-6 (gradients); a wrong chunk, sample or scale is >= 1e-2.
RTOL = {"fp32": 1e-5, "bf16": 2e-2}
# Samples are at most 120 tokens (128 after padding); megatron's max_seqlen_per_dp_cp_rank is
# 128 / world size, so at world size 4 samples up to 32 tokens run without CP, up to 64 at local
# CP 2 and up to 128 at local CP 4.
MAX_SEQLEN = 120


def max_seqlen_per_rank(world_size: int) -> int:
    return 128 // world_size

# Named regression mixes (lengths of the global batch's samples)
NAMED_MIXES = {
    "cp-1-2-4": (120, 60, 30, 24, 17, 9, 50, 12),
    "fewer-samples-than-dp": (100, 20),
    "one-long-among-short": (118, 5, 7, 9, 11, 6, 13),
    "all-short": (9, 14, 20, 31, 7, 16, 25, 11),
}


def expected_local_cp(length: int, max_per_rank: int) -> int:
    """The smallest local CP size a sample may run at: the next power of two of
    ceil(length / max_seqlen_per_dp_cp_rank) (docs/architecture.md, R3)."""
    cp = 1
    while cp * max_per_rank < length:
        cp *= 2
    return cp


def length_ranges(world_size: int) -> list[tuple[int, int]]:
    """Per local CP size 1, 2, 4, ... <= world size: the sample lengths that need exactly it."""
    m, out, p = max_seqlen_per_rank(world_size), [], 1
    while p <= world_size:
        out.append((1 if p == 1 else m * p // 2 + 1, min(m * p, MAX_SEQLEN)))
        p *= 2
    return out


def random_mix(rng: random.Random, world_size: int) -> tuple[int, ...]:
    """A mix in which every local CP size occurs, plus random lengths."""
    lengths = [rng.randint(lo, hi) for lo, hi in length_ranges(world_size)]
    lengths += [rng.randint(1, MAX_SEQLEN) for _ in range(rng.randint(0, 2 * world_size))]
    rng.shuffle(lengths)
    return tuple(lengths)


def mix_name(lengths: tuple[int, ...]) -> str:
    return "lens-" + ".".join(map(str, lengths))


def check_mix(lengths: tuple[int, ...]) -> None:
    bad = [n for n in lengths if not 1 <= n <= MAX_SEQLEN]
    if not lengths or bad:
        raise BadInput(f"sequence-length mix {lengths}: every length must be in 1..{MAX_SEQLEN} "
                       f"(128 tokens after padding = the whole DP x CP group at max_seqlen_per_dp_cp_rank = 128 / world size)")


@dataclass(frozen=True)
class DynamicCPParams:
    """The dynamic-cp suite's parameters: the sequence-length mixes of its global batches."""

    mixes: dict[str, tuple[int, ...]] | None = None  # None: the named mixes plus `random_mixes` seeded ones
    random_mixes: int = 2


class DynamicCPSuite:
    name = "dynamic-cp"
    default_model = "tiny"  # the CPU tier's model when none is given
    imports = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed",
               "megatron.core.pipeline_parallel")
    Params = DynamicCPParams

    def metrics(self, result: CaseResult) -> dict[str, Any]:
        if not result.ok:
            return {}
        loss = _loss(result)
        return {"cp_mode": result.case.params.cp_mode, "loss": round(loss, 8) if loss is not None else None}

    def cases(self, model: ModelSpec, world_size: int, layouts: list[Layout] | None, *,
              engine: str = "mcore", backend: str = "gloo", options: CaseOptions = CaseOptions(),
              params: DynamicCPParams | None = None) -> list[Case]:
        """Per mix: no CP (reference), static CP at every CP size of the layouts, dynamic CP."""
        p = params or DynamicCPParams()
        check_dynamic_cp_available()
        if world_size % 2:
            raise BadInput(f"dynamic CP needs an even DP x CP size (megatron's hybrid groups); world size {world_size}")
        if layouts is None:
            layouts = [Layout(cp=cp, dp=world_size // cp) for cp in (2, 4) if world_size % cp == 0]
        static = [lay for lay in layouts if lay.cp > 1]
        for lay in static:
            validate(lay, model, world_size)
            if lay.tp != 1 or lay.pp != 1:
                raise BadInput(f"dynamic-cp compares CP only: layout {lay.id} must have tp1 and pp1")
        mixes = dict(p.mixes) if p.mixes is not None else dict(NAMED_MIXES)
        if p.mixes is None:
            rng = random.Random(options.seed)
            for _ in range(p.random_mixes):
                lengths = random_mix(rng, world_size)
                mixes[mix_name(lengths)] = lengths
        out = []
        for name, lengths in mixes.items():
            check_mix(lengths)
            plan = [(Layout(dp=world_size), "none")] + [(lay, "static") for lay in static] + \
                   [(Layout(dp=world_size), "dynamic")]
            for lay, mode in plan:
                out.append(Case(self.name, model, lay, engine, options, backend,
                                params=CPCase(name, tuple(lengths), mode, max_seqlen_per_rank(world_size))))
        return out

    def rank_work(self, case: Case, ctx: RankContext) -> dict[str, Any]:
        engine = make_cp_engine(case, ctx)
        with ctx.phase("build"):
            engine.build()
        with ctx.phase("steps"):
            engine.run()
        with ctx.phase("collect"):
            merged = engine.merge(engine.gather_records(), len(case.params.seqlens))
            data = {"records": [_plain(r) for r in engine.records], "loss_sum": engine.loss_sum,
                    "num_tokens": engine.num_tokens}
            if ctx.rank == 0:
                data["merged"] = merged
                data["grads"] = engine.grads()
        return data

    # -- checks -------------------------------------------------------------------------------
    def check(self, results: list[CaseResult], params: DynamicCPParams | None = None) -> list[CheckResult]:
        out: list[CheckResult] = []
        by_mix: dict[str, list[CaseResult]] = {}
        for res in results:
            by_mix.setdefault(res.case.params.mix, []).append(res)
        for group in by_mix.values():
            ref = next((r for r in group if r.case.params.cp_mode == "none"), None)
            for res in group:
                cid = res.case.id
                if not res.ok:
                    lines = (res.error or "failed").splitlines()
                    out.append(CheckResult("dynamic-cp.run", cid, False, lines[0], lines[1:]))
                    continue
                out.append(self._check_coverage(res))
                if res is ref:
                    continue
                if ref is None or not ref.ok:
                    out.append(CheckResult("dynamic-cp.logprobs", cid, False, "the no-CP reference of this mix did not run"))
                    continue
                rtol = RTOL[res.case.options.dtype]
                out.append(self._check_logprobs(res, ref, rtol))
                out.append(self._check_loss(res, ref, rtol))
                out.append(self._check_grads(res, ref, rtol))
        return out

    @staticmethod
    def _check_coverage(res: CaseResult) -> CheckResult:
        """Every real token of every sample computed exactly once; dynamic: at the expected local CP size."""
        o = res.case.params
        lengths = o.seqlens
        counts = [torch.zeros(n, dtype=torch.long) for n in lengths]
        local_cp: dict[int, set[int]] = {}
        problems = []
        for rank in res.ranks:
            for rec in map(_record, rank.data["records"]):
                if not 0 <= rec.sample < len(lengths):
                    problems.append(f"rank {rank.rank} computed tokens of sample {rec.sample}, which is not in the batch")
                    continue
                counts[rec.sample].index_add_(0, rec.positions, torch.ones_like(rec.positions))
                local_cp.setdefault(rec.sample, set()).add(rec.local_cp)
        for i, c in enumerate(counts):
            if (c != 1).any():
                missing, dup = int((c == 0).sum()), int((c > 1).sum())
                problems.append(f"sample {i} (length {lengths[i]}): {missing} tokens never computed, "
                                f"{dup} computed more than once (max {int(c.max())} times)")
        rows = []
        if o.cp_mode == "dynamic":
            for i, n in enumerate(lengths):
                # The harness's own arithmetic, not the engine's padding (the code under test): the
                # sample padded to a multiple of 2 x world size, as the zigzag split needs.
                padded = n + (-n % (2 * res.case.layout.world_size))
                need = expected_local_cp(padded, o.max_seqlen_per_dp_cp_rank)
                got = sorted(local_cp.get(i, set()))
                rows.append(f"  sample {i}: length {n}, local CP {','.join(map(str, got)) or '-'} (needs >= {need})")
                # The scheduler may give a sample more ranks than it needs (to fill idle ones), never fewer.
                ok = len(got) == 1 and need <= got[0] <= res.case.layout.world_size and got[0] & (got[0] - 1) == 0
                if not ok:
                    problems.append(f"sample {i} (length {n}): ran at local CP size {got or 'never'}, needs one power "
                                    f"of two >= {need} (ceil({padded} / max_seqlen_per_dp_cp_rank="
                                    f"{o.max_seqlen_per_dp_cp_rank}) rounded up)")
        sizes = sorted({s for v in local_cp.values() for s in v})
        if problems:
            return CheckResult("dynamic-cp.coverage", res.case.id, False,
                               f"{res.case.layout.id} {o.cp_mode}: {problems[0]}" +
                               (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
                               [f"  {p}" for p in problems] + rows)
        return CheckResult("dynamic-cp.coverage", res.case.id, True,
                           f"every token of {len(lengths)} samples computed once; local CP sizes {sizes}", rows,
                           show=o.cp_mode == "dynamic")

    @staticmethod
    def _check_logprobs(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
        lengths = res.case.params.seqlens
        got = _rank0(res)["merged"]
        want = _reference_logprobs(ref)
        head = f"{res.case.layout.id} {res.case.params.cp_mode}"
        if len(got) != len(want):
            return CheckResult("dynamic-cp.logprobs", res.case.id, False,
                               f"{head}: the merged output has {len(got)} samples, the batch has {len(want)} "
                               f"(lengths merged {[len(t) for t in got]}, batch {list(lengths)})")
        rows, worst, bad = [], (0.0, -1), []
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape:
                bad.append(i)
                rows.append(f"  sample {i}: {len(g)} log-probs merged, length {len(w)} expected")
                worst = max(worst, (float("inf"), i))
                continue
            abs_err = float((g.double() - w.double()).abs().max()) if len(w) else 0.0
            rel = abs_err / max(float(w.abs().max()), 1e-12) if len(w) else 0.0
            n_bad = nonfinite_count(g) + nonfinite_count(w)
            rows.append(f"  sample {i}: length {len(w)}, max abs {fmt_err(abs_err)}, rel {fmt_err(rel)}"
                        + (f", {n_bad} non-finite log-probs" if n_bad else ""))
            if beyond(rel, rtol):
                bad.append(i)
            worst = max(worst, (rel, i), key=lambda t: severity(t[0]))
        if bad:
            i = bad[0]
            return CheckResult("dynamic-cp.logprobs", res.case.id, False,
                               f"{head}: log-probs of sample {i} differ from no CP: {rows[i].strip()} "
                               f"(tolerance rel {rtol:.0e}; {len(bad)}/{len(want)} samples off)", rows, value=worst[0])
        return CheckResult("dynamic-cp.logprobs", res.case.id, True,
                           f"{head}: log-probs of {len(want)} samples equal no CP, worst sample {worst[1]} rel "
                           f"{worst[0]:.2e} <= {rtol:.0e}", rows, value=worst[0], show=True)

    @staticmethod
    def _check_loss(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
        got, want = _loss(res), _loss(ref)
        rel = abs(got - want) / abs(want) if want else abs(got - want)
        ok = within(rel, rtol)
        return CheckResult("dynamic-cp.loss", res.case.id, ok,
                           f"{res.case.layout.id} {res.case.params.cp_mode}: per-token loss {got:.8f} vs no CP "
                           f"{want:.8f} (tokens {_tokens(res)} vs {_tokens(ref)}), rel {fmt_err(rel)} "
                           f"{'<=' if ok else '>'} {rtol:.0e}", value=rel)

    @staticmethod
    def _check_grads(res: CaseResult, ref: CaseResult, rtol: float) -> CheckResult:
        got, want = _rank0(res)["grads"], _rank0(ref)["grads"]
        head = f"{res.case.layout.id} {res.case.params.cp_mode}"
        if set(got) != set(want):
            return CheckResult("dynamic-cp.grads", res.case.id, False,
                               f"{head}: parameter names differ from no CP: {sorted(set(got) ^ set(want))[:5]}")
        errs = {n: rel_error(got[n], want[n]) for n in want}
        worst = max(errs, key=lambda n: severity(errs[n]))
        bad = sorted((n for n in errs if beyond(errs[n], rtol)), key=lambda n: -severity(errs[n]))
        if bad:
            ratio = float(got[bad[0]].norm() / want[bad[0]].norm().clamp_min(1e-30))
            _, nonfinite = nonfinite_summary({n: got[n] for n in bad})
            return CheckResult("dynamic-cp.grads", res.case.id, False,
                               f"{head}: {len(bad)}/{len(errs)} gradients differ from no CP; worst {bad[0]}: rel "
                               f"{fmt_err(errs[bad[0]])} > {rtol:.0e} (norm ratio {ratio:.4f})"
                               + (f" (non-finite: {nonfinite})" if nonfinite else ""),
                               [f"  {n}: rel {fmt_err(errs[n])}" for n in bad], value=errs[bad[0]])
        return CheckResult("dynamic-cp.grads", res.case.id, True,
                           f"{head}: {len(errs)} gradients equal no CP, worst {worst} rel {errs[worst]:.2e} <= {rtol:.0e}",
                           value=errs[worst])


def make_cp_engine(case: Case, ctx: RankContext) -> CPEngine:
    factory = CPEngine if case.engine == "mcore" else resolve_factory(case.engine)
    if not (isinstance(factory, type) and issubclass(factory, CPEngine)):
        raise BadInput(f"engine {case.engine!r} cannot run the dynamic-cp suite: it must be "
                       f"harness.engines.dynamic_cp:CPEngine or a subclass")
    return factory(case, ctx)


def _plain(r: TokenOutputs) -> tuple:
    return (r.sample, r.positions, r.logprobs, r.local_cp, r.rank)


def _record(t: tuple) -> TokenOutputs:
    return TokenOutputs(*t)


def _rank0(res: CaseResult) -> dict[str, Any]:
    return next(r.data for r in res.ranks if r.rank == 0)


def _reference_logprobs(ref: CaseResult) -> list[torch.Tensor]:
    """The no-CP run's log-probs per sample, assembled here (no engine merge involved)."""
    lengths = ref.case.params.seqlens
    out = [torch.full((n,), float("nan")) for n in lengths]
    for rank in ref.ranks:
        for rec in map(_record, rank.data["records"]):
            if 0 <= rec.sample < len(lengths):
                out[rec.sample][rec.positions] = rec.logprobs
    return out


def _loss(res: CaseResult) -> float:
    s = sum(r.data["loss_sum"] for r in res.ranks)
    return s / max(_tokens(res), 1)


def _tokens(res: CaseResult) -> int:
    return sum(r.data["num_tokens"] for r in res.ranks)
