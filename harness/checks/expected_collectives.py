"""The collectives a case's configuration implies (its expected gradient syncs and dispatcher calls), and the match
with what a rank issued.

What is expected is derived from the model spec, the layout and the options the user configured - never
from the DDP config the engine built, which is exactly what regression R2 gets wrong. Buffer sizes
follow megatron-core's padding rules (param_and_grad_buffer.py): with the distributed optimizer,
each parameter starts on a 64-element boundary and each bucket ends on a multiple of
lcm(dp*cp, 128); a tied embedding shared across pipeline stages gets a bucket of its own.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.dtypes import DType, dtype
from harness.layouts import coords_of, dp_cp_ranks, expert_dp_ranks, expert_group
from harness.spec import Case, Layout, ModelSpec

if TYPE_CHECKING:  # records are only read here; harness.probes.collectives imports torch, and the
    # arithmetic below (chunk_params, chunk_buckets) serves `harness project-memory`, which must not
    from harness.probes.collectives import Collective

DEFAULT_BUCKET_ELEMS = 40_000_000  # megatron DDP: max(40M, 1M * dp) when overlap_grad_reduce
GRAD_OPS = {"reduce_scatter", "all_reduce", "all_gather"}


def chunk_params(model: ModelSpec, layout: Layout, pp_rank: int, vp_stage: int,
                 te: bool = False, expert_buffer: bool = False) -> list[tuple[str, int, bool]]:
    """(name, local numel, shared_embedding) of one model chunk, in registration order.

    expert_buffer: the parameters of the chunk's expert-parallel buffer instead - the experts of an MoE layer,
    which megatron marks `allreduce=False` and reduces over the expert-data-parallel group, but only at EP > 1
    (at EP 1 they sit in the dense buffer).

    te: Transformer Engine's layer spec, whose norms live inside the following linear
    (TELayerNormColumnParallelLinear registers `layer_norm_weight` / `layer_norm_bias` before `weight`);
    the local spec has separate input / pre-MLP norm modules. The order decides where megatron's
    bucket boundaries and the distributed optimizer's 64-element alignment fall.
    """
    tp, h, kv = layout.tp, model.hidden_size, model.kv_channels
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == layout.pp - 1 and vp_stage == layout.vpp - 1
    norm_params = ("weight",) if model.normalization == "RMSNorm" else ("weight", "bias")
    shared = layout.pp > 1 and model.tie_embeddings
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * kv // tp * h
    proj = h * (model.num_attention_heads * kv // tp)
    gate = 2 if model.swiglu else 1
    fc1 = gate * model.ffn_hidden_size // tp * h
    fc2 = h * (model.ffn_hidden_size // tp)
    layers = moe_layer_flags(model, layout, pp_rank, vp_stage)
    if expert_buffer:
        return [p for is_moe in layers if is_moe and layout.ep > 1 for p in _experts(model, layout)]
    out: list[tuple[str, int, bool]] = []
    if first:
        out.append(("embedding.word_embeddings.weight", model.vocab_size // tp * h, shared and not last))
    for is_moe in layers:
        out += [] if te else [(f"input_layernorm.{p}", h, False) for p in norm_params]
        out += [("self_attention.linear_proj.weight", proj, False)]
        out += [(f"self_attention.linear_qkv.layer_norm_{p}", h, False) for p in norm_params] if te else []
        out += [("self_attention.linear_qkv.weight", qkv, False)]
        if model.qk_layernorm:  # per head, replicated over TP, registered after linear_qkv
            out += [(f"self_attention.{qk}_layernorm.{p}", kv, False) for qk in "qk" for p in norm_params]
        if not is_moe:
            pre_mlp = "mlp.linear_fc1.layer_norm_" if te else "pre_mlp_layernorm."
            out += [(f"{pre_mlp}{p}", h, False) for p in norm_params]
            out += [("mlp.linear_fc1.weight", fc1, False), ("mlp.linear_fc2.weight", fc2, False)]
            continue
        # an MoE layer keeps its pre-MLP norm module under either spec (the router reads its output)
        out += [(f"pre_mlp_layernorm.{p}", h, False) for p in norm_params]
        out += [("mlp.router.weight", model.num_experts * h, False)]
        if layout.ep == 1:
            out += _experts(model, layout)
        if model.moe_shared_expert_ffn:
            sh = model.moe_shared_expert_ffn // tp
            out += [("mlp.shared_experts.linear_fc1.weight", gate * sh * h, False),
                    ("mlp.shared_experts.linear_fc2.weight", h * sh, False)]
    if last:
        out += [(f"decoder.final_layernorm.{p}", h, False) for p in norm_params]
        if not model.tie_embeddings or (shared and not first):
            out.append(("output_layer.weight", model.vocab_size // tp * h, shared and not first))
    return out


def moe_layer_flags(model: ModelSpec, layout: Layout, pp_rank: int, vp_stage: int) -> list[bool]:
    """Per layer of one model chunk, whether it is an MoE layer (megatron's layer offset of the chunk; an MoE
    model's first moe_first_dense_layers keep the dense MLP)."""
    per_chunk = model.num_layers // (layout.pp * layout.vpp)
    offset = vp_stage * (model.num_layers // layout.vpp) + pp_rank * per_chunk
    return [model.moe and offset + i >= model.moe_first_dense_layers for i in range(per_chunk)]


def _experts(model: ModelSpec, layout: Layout) -> list[tuple[str, int, bool]]:
    """One MoE layer's local experts (megatron's SequentialMLP): num_experts / EP of them, split over ETP."""
    f, h = model.expert_ffn // layout.expert_tp, model.hidden_size
    out = []
    for e in range(model.num_experts // layout.ep):
        out += [(f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 if model.swiglu else 1) * f * h, False),
                (f"mlp.experts.local_experts.{e}.linear_fc2.weight", h * f, False)]
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
class ExpectedCollective:
    """One expected collective of a rank over a run: kind, group, size and count."""

    what: str  # e.g. "DP gradient reduction"
    kind: str
    ranks: tuple[int, ...]
    numel: int  # elements per call
    dtype: str
    calls: int  # over the whole run
    phases: frozenset[str]
    role: str = "dp-cp"  # the group's role: dp-cp (dense parameters), edp (experts at EP > 1), ep, etp-ep

    def describe(self) -> str:
        return (f"{self.kind} on {self.role} group {self.ranks}, {self.numel} x {self.dtype}, "
                f"{self.calls} call{'s' if self.calls != 1 else ''}")


# One trained parameter of a built model chunk, in registration order: (name, local numel)
ChunkParam = tuple[str, int]
# A routed expert's weight in megatron's MoE layer: SequentialMLP's local_experts.E.*, TEGroupedMLP's linear_fcN.weightE
ROUTED_EXPERT = re.compile(r"(^|\.)mlp\.experts\.")


def expected_collectives(case: Case, rank: int,
                         chunks: list[list[ChunkParam]] | None = None) -> list[ExpectedCollective]:
    """Expected gradient-sync collectives of this rank over case.options.steps steps: the dense parameters' buffer
    over the DP x CP group and, for an MoE model at EP > 1, the experts' buffer over the expert-data-parallel
    group (megatron's DDP keeps them apart).

    chunks: the parameters of the rank's built model chunks, names and sizes in registration order (what its
    gradient buffers must hold, whatever kinds of weight the model has); None: from the model spec's arithmetic
    (chunk_params). Which buffer and bucket a parameter belongs in is megatron's rule applied here, never read
    from the built model (whose marks a regression may have moved): the routed experts go to the expert-data-
    parallel buffer at EP > 1, a tied embedding shared across pipeline stages to a bucket of its own. The
    collectives' kind and group come from the options the user configured, never from the engine's DDP config."""
    o, lay, m = case.options, case.layout, case.model
    c = coords_of(lay, rank)

    def params_of(vp: int, experts: bool) -> list[tuple[str, int, bool]]:
        if chunks is None:
            return chunk_params(m, lay, c.pp, vp, te=case.te_spec, expert_buffer=experts)
        first = c.pp == 0 and vp == 0
        last = c.pp == lay.pp - 1 and vp == lay.vpp - 1
        tied = lay.pp > 1 and m.tie_embeddings
        return [(name, numel, tied and ((name == "embedding.word_embeddings.weight" and not last)
                                        or (name == "output_layer.weight" and not first)))
                for name, numel in chunks[vp] if (lay.ep > 1 and bool(ROUTED_EXPERT.search(name))) == experts]

    param_dtype = dtype(o.dtype).name
    grad_dtype = "fp32" if (o.grad_reduce_in_fp32 or param_dtype == DType.fp32) else param_dtype
    reduce_kind = "reduce_scatter" if o.use_distributed_optimizer else "all_reduce"
    reduce_phases = frozenset({"backward", "grad-finalize"}) if o.overlap_grad_reduce else frozenset({"grad-finalize"})
    dp_cp = lay.dp * lay.cp
    buffers = [("DP", "dp-cp", dp_cp_ranks(lay, rank), False)]
    if any(params_of(vp, True) for vp in range(lay.vpp)):  # experts on this stage
        buffers.append(("expert DP", "edp", expert_dp_ranks(lay, rank), True))
    # Where a stage holds experts at EP > 1 megatron's ChainedOptimizer steps a dense and an expert
    # DistributedOptimizer, and each all-gathers every bucket of the model chunk (step_with_ready_grads without
    # overlap_param_gather): the parameters are gathered twice per step (megatron-core 0.16.1 and main of 2026-08)
    gathers = 2 if len(buffers) > 1 else 1
    out: list[ExpectedCollective] = []
    for label, role, group, experts in buffers:
        sizes: Counter[int] = Counter()
        for vp in range(lay.vpp):
            bucket_size = None
            if o.overlap_grad_reduce and c.pp == 0 and vp == 0:
                bucket_size = o.bucket_size or max(DEFAULT_BUCKET_ELEMS, 1_000_000 * dp_cp)
            for numel in chunk_buckets(params_of(vp, experts), distopt=o.use_distributed_optimizer, dp_cp=len(group),
                                       bucket_size=bucket_size):
                sizes[numel] += o.steps
        for numel, calls in sorted(sizes.items(), reverse=True):
            out.append(ExpectedCollective(f"{label} gradient reduction", reduce_kind, group, numel, grad_dtype, calls,
                               reduce_phases, role))
            if o.use_distributed_optimizer:
                out.append(ExpectedCollective(f"{label} parameter all-gather", "all_gather", group, numel, param_dtype,
                                   calls * gathers, frozenset({"param-gather"}), role))
    return out


def stage_moe_layers(model: ModelSpec, layout: Layout, pp_rank: int) -> int:
    """How many MoE layers the pipeline stage holds (all its virtual chunks)."""
    return sum(sum(moe_layer_flags(model, layout, pp_rank, vp)) for vp in range(layout.vpp))


def expected_dispatch(case: Case, rank: int) -> list[ExpectedCollective] | None:
    """The token dispatcher's collectives of this rank over the run, per group and phase (their sizes follow the
    routing, so only the calls are planned); None where the harness has no plan for the dispatcher (allgather).

    megatron's all-to-all dispatcher, per MoE layer and micro-batch: with EP > 1 three all-to-alls over the EP
    group in forward (tokens, their routing probabilities, the combine) and three in backward; with ETP x EP > 1
    one all-gather of the tokens-per-expert counts over the ETP x EP group; with ETP > 1 the tokens and
    probabilities gathered over ETP (two all-gathers, one reduce-scatter) and the reverse in backward."""
    lay, m = case.layout, case.model
    if not m.moe or case.options.moe_dispatcher != "alltoall":
        return None
    n = stage_moe_layers(m, lay, coords_of(lay, rank).pp) * case.num_microbatches * case.options.steps
    if not n:
        return []
    out: list[ExpectedCollective] = []

    def add(what: str, kind: str, role: str, per: int, phase: str) -> None:
        group = expert_group(lay, rank, tuple(role.split("-")))  # the role names its expert-grid axes
        out.append(ExpectedCollective(what, kind, group, 0, "any", per * n, frozenset({phase}), role))

    if lay.ep > 1:
        add("token all-to-all (tokens, probabilities, combine)", "all_to_all", "ep", 3, "forward")
        add("token all-to-all (gradients)", "all_to_all", "ep", 3, "backward")
    if lay.ep * lay.expert_tp > 1:
        add("tokens-per-expert all-gather", "all_gather", "etp-ep", 1, "forward")
    if lay.expert_tp > 1:
        add("ETP token all-gather", "all_gather", "etp", 2, "forward")
        add("ETP token reduce-scatter", "reduce_scatter", "etp", 1, "forward")
        add("ETP token all-gather", "all_gather", "etp", 1, "backward")
        add("ETP token reduce-scatter", "reduce_scatter", "etp", 2, "backward")
    return out


DISPATCH_ROLES = {"ep", "etp", "etp-ep"}


def dispatch_records(records: list[Collective]) -> list[Collective]:
    """The collectives the token dispatcher issues: any all-to-all, and whatever runs on the expert grid's
    EP / ETP groups during forward and backward."""
    return [r for r in records if r.kind == "all_to_all"
            or (r.role in DISPATCH_ROLES and r.phase in ("forward", "backward"))]


def match_dispatch(planned: list[ExpectedCollective], records: list[Collective]) -> list[str]:
    """What differs between the dispatcher's planned and observed calls, per (kind, group, phase)."""
    seen = Counter((r.kind, r.ranks, r.phase) for r in records)
    want: Counter = Counter()
    what: dict[tuple, str] = {}
    roles: dict[tuple, str] = {}
    for p in planned:
        key = (p.kind, p.ranks, next(iter(p.phases)))
        want[key] += p.calls
        what.setdefault(key, p.what)
        roles[key] = p.role
    roles.update({(r.kind, r.ranks, r.phase): r.role for r in records})
    return [f"{kind} on {roles[key]} group {ranks} in {phase}: {seen[key]} calls, planned {want[key]} "
            f"({what.get(key, 'nothing planned')})"
            for key in sorted(set(want) | set(seen), key=str) if want[key] != seen[key]
            for kind, ranks, phase in [key]]


@dataclass
class CollectiveMatch:
    missing: list[ExpectedCollective]  # planned, not observed (or observed a different number of times)
    unexpected: list[tuple[Collective, int]]  # observed on the DP group, not planned: (record, count)
    wrong_phase: list[tuple[ExpectedCollective, Counter]]
    matched: list[tuple[ExpectedCollective, int]]


# Groups whose collectives are not data-parallel gradient sync even when their ranks coincide with
# the DP x CP ranks (e.g. at TP=PP=1): TP cross-entropy, embedding grads, the grad-norm reduction.
NOT_DP_ROLES = {"tp", "pp", "cp", "embedding", "position-embedding", "tp-cp", "mp", "tp-dp-cp", "tp-dp",
                "distopt-instance", "ep", "etp", "etp-ep", "etp-ep-pp", "grad-stats"}


def dp_records(records: list[Collective]) -> list[Collective]:
    """Gradient-sync-kind collectives on any group but the known non-DP ones (so a gradient
    reduction issued on the wrong group - world, DP without CP - still shows up)."""
    return [r for r in records if r.kind in GRAD_OPS and r.role not in NOT_DP_ROLES]


def match_collectives(planned: list[ExpectedCollective], records: list[Collective]) -> CollectiveMatch:
    """Match planned collectives with observed ones by (kind, ranks, numel, dtype)."""
    pool = Counter((r.kind, r.ranks, r.numel, r.dtype) for r in records)
    phases: dict[tuple, Counter] = {}
    for r in records:
        phases.setdefault((r.kind, r.ranks, r.numel, r.dtype), Counter())[r.phase] += 1
    cmp = CollectiveMatch([], [], [], [])
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
