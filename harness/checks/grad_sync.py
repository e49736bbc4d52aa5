"""The grad-sync plan a case's configuration implies, and the comparison with what a rank issued.

The plan is derived from the model spec, the layout and the options the user configured - never
from the DDP config the engine built, which is exactly what regression R2 gets wrong. Buffer sizes
follow megatron-core's padding rules (param_and_grad_buffer.py): with the distributed optimizer,
each parameter starts on a 64-element boundary and each bucket ends on a multiple of
lcm(dp*cp, 128); a tied embedding shared across pipeline stages gets a bucket of its own.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.layouts import coords_of, dp_cp_ranks
from harness.spec import Case, Layout, ModelSpec

if TYPE_CHECKING:  # records are only read here; harness.probes.collectives imports torch, and the
    # arithmetic below (chunk_params, chunk_buckets) serves `harness project-memory`, which must not
    from harness.probes.collectives import Collective

DEFAULT_BUCKET_ELEMS = 40_000_000  # megatron DDP: max(40M, 1M * dp) when overlap_grad_reduce
GRAD_OPS = {"reduce_scatter", "all_reduce", "all_gather"}


def chunk_params(model: ModelSpec, layout: Layout, pp_rank: int, vp_stage: int,
                 te: bool = False) -> list[tuple[str, int, bool]]:
    """(name, local numel, shared_embedding) of one model chunk, in registration order.

    te: Transformer Engine's layer spec, whose norms live inside the following linear
    (TELayerNormColumnParallelLinear registers `layer_norm_weight` / `layer_norm_bias` before `weight`);
    the local spec has separate input / pre-MLP norm modules. The order decides where megatron's
    bucket boundaries and the distributed optimizer's 64-element alignment fall.
    """
    tp, h, kv = layout.tp, model.hidden_size, model.kv_channels
    stages = layout.pp * layout.vpp
    per_stage = model.num_layers // stages
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == layout.pp - 1 and vp_stage == layout.vpp - 1
    norm_params = ("weight",) if model.normalization == "RMSNorm" else ("weight", "bias")
    shared = layout.pp > 1 and model.tie_embeddings
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * kv // tp * h
    proj = h * (model.num_attention_heads * kv // tp)
    fc1 = (2 if model.swiglu else 1) * model.ffn_hidden_size // tp * h
    fc2 = h * (model.ffn_hidden_size // tp)
    out: list[tuple[str, int, bool]] = []
    if first:
        out.append(("embedding.word_embeddings.weight", model.vocab_size // tp * h, shared and not last))
    for _ in range(per_stage):
        if te:
            fused_norm = [f"layer_norm_{p}" for p in norm_params]
            out += [("self_attention.linear_proj.weight", proj, False)]
            out += [(f"self_attention.linear_qkv.{p}", h, False) for p in fused_norm]
            out += [("self_attention.linear_qkv.weight", qkv, False)]
            out += [(f"mlp.linear_fc1.{p}", h, False) for p in fused_norm]
            out += [("mlp.linear_fc1.weight", fc1, False), ("mlp.linear_fc2.weight", fc2, False)]
            continue
        out += [(f"input_layernorm.{p}", h, False) for p in norm_params]
        out += [("self_attention.linear_proj.weight", proj, False),
                ("self_attention.linear_qkv.weight", qkv, False)]
        out += [(f"pre_mlp_layernorm.{p}", h, False) for p in norm_params]
        out += [("mlp.linear_fc1.weight", fc1, False), ("mlp.linear_fc2.weight", fc2, False)]
    if last:
        out += [(f"decoder.final_layernorm.{p}", h, False) for p in norm_params]
        if not model.tie_embeddings or (shared and not first):
            out.append(("output_layer.weight", model.vocab_size // tp * h, shared and not first))
    return out


def _pad(n: int, divisor: int) -> int:
    return int(math.ceil(n / divisor) * divisor)


def chunk_buckets(params: list[tuple[str, int, bool]], *, distopt: bool, dp_cp: int,
                  bucket_size: int | None) -> list[int]:
    """Padded element count of each gradient bucket of one chunk, in communication order."""
    buckets: list[int] = []
    start = bucket_start = 0
    n_in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, n_in_bucket
        padded = _pad(end, math.lcm(dp_cp, 128)) if distopt else end
        buckets.append(padded - bucket_start)
        bucket_start, n_in_bucket = padded, 0
        return padded

    for _, numel, shared in reversed(params):  # megatron fills buffers in reverse (backprop) order
        if distopt:
            start = _pad(start, 64)
        if shared and distopt and n_in_bucket:
            start = close(start)
        end = start + numel
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or (shared and distopt):
            start = close(end)
        else:
            start = end
    if n_in_bucket:
        close(start)
    return buckets


@dataclass(frozen=True)
class Planned:
    """One expected collective of a rank over a run: kind, group, size and count."""

    what: str  # e.g. "DP gradient reduction"
    kind: str
    ranks: tuple[int, ...]
    numel: int  # elements per call
    dtype: str
    calls: int  # over the whole run
    phases: frozenset[str]

    def describe(self) -> str:
        return (f"{self.kind} on dp-cp group {self.ranks}, {self.numel} x {self.dtype}, "
                f"{self.calls} call{'s' if self.calls != 1 else ''}")


def plan(case: Case, rank: int) -> list[Planned]:
    """Expected DP-group collectives of this rank over case.options.steps steps."""
    o, lay, m = case.options, case.layout, case.model
    c = coords_of(lay, rank)
    dp_cp = lay.dp * lay.cp
    group = dp_cp_ranks(lay, rank)
    param_dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[o.dtype]
    grad_dtype = "fp32" if (o.grad_reduce_in_fp32 or param_dtype == "fp32") else param_dtype
    reduce_kind = "reduce_scatter" if o.use_distributed_optimizer else "all_reduce"
    reduce_phases = frozenset({"backward", "grad-finalize"}) if o.overlap_grad_reduce else frozenset({"grad-finalize"})
    out: list[Planned] = []
    sizes: Counter[int] = Counter()
    for vp in range(lay.vpp):
        bucket_size = None
        if o.overlap_grad_reduce and c.pp == 0 and vp == 0:
            bucket_size = o.bucket_size or max(DEFAULT_BUCKET_ELEMS, 1_000_000 * dp_cp)
        for numel in chunk_buckets(chunk_params(m, lay, c.pp, vp, te=case.te_spec), distopt=o.use_distributed_optimizer,
                                   dp_cp=dp_cp, bucket_size=bucket_size):
            sizes[numel] += o.steps
    for numel, calls in sorted(sizes.items(), reverse=True):
        out.append(Planned("DP gradient reduction", reduce_kind, group, numel, grad_dtype, calls, reduce_phases))
        if o.use_distributed_optimizer:
            out.append(Planned("DP parameter all-gather", "all_gather", group, numel, param_dtype, calls,
                               frozenset({"param-gather"})))
    return out


@dataclass
class Comparison:
    missing: list[Planned]  # planned, not observed (or observed a different number of times)
    unexpected: list[tuple[Collective, int]]  # observed on the DP group, not planned: (record, count)
    wrong_phase: list[tuple[Planned, Counter]]
    matched: list[tuple[Planned, int]]


# Groups whose collectives are not data-parallel gradient sync even when their ranks coincide with
# the DP x CP ranks (e.g. at TP=PP=1): TP cross-entropy, embedding grads, the grad-norm reduction.
NOT_DP_ROLES = {"tp", "pp", "cp", "embedding", "position-embedding", "tp-cp", "mp", "tp-dp-cp", "tp-dp",
                "distopt-instance"}


def dp_records(records: list[Collective]) -> list[Collective]:
    """Gradient-sync-kind collectives on any group but the known non-DP ones (so a gradient
    reduction issued on the wrong group - world, DP without CP - still shows up)."""
    return [r for r in records if r.kind in GRAD_OPS and r.role not in NOT_DP_ROLES]


def compare(planned: list[Planned], records: list[Collective]) -> Comparison:
    """Match planned collectives with observed ones by (kind, ranks, numel, dtype)."""
    pool = Counter((r.kind, r.ranks, r.numel, r.dtype) for r in records)
    phases: dict[tuple, Counter] = {}
    for r in records:
        phases.setdefault((r.kind, r.ranks, r.numel, r.dtype), Counter())[r.phase] += 1
    cmp = Comparison([], [], [], [])
    for p in planned:
        key = (p.kind, p.ranks, p.numel, p.dtype)
        seen = pool.get(key, 0)
        if seen < p.calls:
            cmp.missing.append(p)
        else:
            cmp.matched.append((p, p.calls))
            if set(phases.get(key, {})) - p.phases:
                cmp.wrong_phase.append((p, phases[key]))
        pool[key] = max(0, seen - p.calls)
    leftovers = {k: n for k, n in pool.items() if n > 0}
    examples = {}
    for r in records:
        k = (r.kind, r.ranks, r.numel, r.dtype)
        if k in leftovers and k not in examples:
            examples[k] = r
    cmp.unexpected = [(examples[k], n) for k, n in leftovers.items()]
    return cmp
