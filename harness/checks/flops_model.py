"""FLOPs of a training step from the model config (no torch), and the dense peak a GPU offers per dtype.

The count is what the harness's FLOP counter (harness/probes/flops.py) measures on megatron's local spec,
matmul by matmul, so the two must agree exactly there (tests/test_step_perf.py): per token of a rank's
micro-batches, each transformer layer runs the QKV projection (GQA: the K and V widths of the query
groups), the attention scores and the probabilities times V over the whole key sequence (unfused: the
causal mask does not skip the upper triangle; under CP a rank's queries see every key), the output
projection and the (SwiGLU) MLP; the last stage adds the logits. Backward costs twice the forward, full
activation recompute one more forward of every layer, selective recompute one more of the core attention.
An MoE layer replaces the MLP by the router (hidden x experts, on the tokens of the rank's sequence-parallel
shard), the shared expert (TP-sharded) and the routed experts: top-k copies of each token through an
expert's fc1 and fc2. Which rank computes a token's experts follows the routing, so an MoE rank's expert
FLOPs are the balanced share (as if every expert received as many tokens): the sum over an EP group's ranks
is exact, a rank's own count is not (exact_groups says which totals to compare).
Where kernels run that the counter cannot see (Transformer Engine's GEMMs, fused attention), this count
stands in for it (step-perf says which one it used).
"""

from __future__ import annotations

from harness.checks.expected_collectives import stage_moe_layers
from harness.dtypes import DType
from harness.layouts import coords_of, expert_group
from harness.spec import Layout, ModelSpec, Recompute


def layer_forward_flops_per_token(model: ModelSpec, layout: Layout, seq_length: int,
                                  moe: bool = False) -> dict[str, float]:
    """Matmul FLOPs of one transformer layer's forward per local token, by matmul (an MoE layer's routed
    experts: the balanced share)."""
    t = layout.tp
    h, f, a, kv = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads, model.kv_channels
    q_width, kv_width = a * kv, model.num_query_groups * kv
    gate = 2 if model.swiglu else 1
    out: dict[str, float] = {
        "qkv": 2 * h * (q_width + 2 * kv_width) // t,
        "scores": 2 * (a // t) * kv * seq_length,
        "probs x v": 2 * (a // t) * kv * seq_length,
        "proj": 2 * (q_width // t) * h,
    }
    if not moe:
        return {**out, "fc1": 2 * h * gate * f // t, "fc2": 2 * (f // t) * h}
    fe, fs, k = model.expert_ffn, model.moe_shared_expert_ffn, model.moe_router_topk
    # with TP, megatron's MoE layer runs sequence parallel: a rank routes 1/TP of the tokens; its experts'
    # inputs are gathered over ETP and each ETP rank holds 1/ETP of an expert's width (the two cancel)
    out["router"] = 2 * h * model.num_experts / t
    if fs:
        out["shared fc1"] = 2 * h * gate * fs // t
        out["shared fc2"] = 2 * (fs // t) * h
    out["expert fc1"] = k * 2 * h * gate * fe / t
    out["expert fc2"] = k * 2 * fe * h / t
    return out


def step_flops(model: ModelSpec, layout: Layout, rank: int, *, global_batch_size: int, micro_batch_size: int,
               recompute: str = "") -> int:
    """Matmul FLOPs one rank executes in one training step (forward, backward, recompute)."""

    c = coords_of(layout, rank)
    s = model.seq_length
    tokens = global_batch_size // layout.dp * s // layout.cp  # this rank's tokens of the step
    layers = model.num_layers // layout.pp  # every virtual stage of the rank's pipeline stage
    moe_layers = stage_moe_layers(model, layout, c.pp)
    total = 0.0
    for n, moe in ((layers - moe_layers, False), (moe_layers, True)):
        per_layer = layer_forward_flops_per_token(model, layout, s, moe)
        forward = sum(per_layer.values())
        recomputed: dict[str, float] = {Recompute.FULL: forward,
                                        Recompute.SELECTIVE: per_layer["scores"] + per_layer["probs x v"]}
        extra = recomputed.get(recompute, 0)
        total += n * (3 * forward + extra)
    if c.pp == layout.pp - 1:
        total += 3 * 2 * model.hidden_size * (model.vocab_size // layout.tp)  # logits: forward and backward
    return round(total * tokens)


def exact_groups(model: ModelSpec, layout: Layout) -> list[tuple[int, ...]]:
    """The sets of ranks whose summed FLOPs the analytic count gives exactly: each rank alone for a dense model;
    for an MoE model each ETP x EP group of a stage (the ranks a token's routed copies stay within)."""

    ranks = range(layout.world_size)
    if not model.moe:
        return [(r,) for r in ranks]
    return sorted({expert_group(layout, r, ("etp", "ep")) for r in ranks})


# Dense (no sparsity) peak TFLOP/s per GPU by the dtype its matmuls run in, from the vendors' datasheets.
# tf32: fp32 matmuls on tensor cores (torch's allow_tf32 / float32_matmul_precision "high"); fp32: CUDA cores.
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
}
# torch's device names: "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" the PCIe card.
_ALIASES = (("H100 NVL", "H100 NVL"), ("H100 PCIe", "H100 PCIe"), ("H100", "H100 SXM"), ("H200", "H200"),
            ("A100", "A100"), ("B200", "B200"), ("L40S", "L40S"))


def peak_tflops(device_name: str, matmul_dtype: str) -> tuple[float | None, str]:
    """(dense peak TFLOP/s of the device for matmuls in that dtype, '') or (None, why not)."""
    for needle, key in _ALIASES:
        if needle.lower() in device_name.lower():
            peak = PEAK_TFLOPS[key].get(matmul_dtype)
            return (peak, "") if peak else (None, f"no {matmul_dtype} peak known for {key}")
    return None, f"no peak known for {device_name!r} (known: {', '.join(PEAK_TFLOPS)})"


def matmul_dtype(param_dtype: str, tf32: bool) -> str:
    """The dtype a case's matmuls run in: its param dtype, fp32 on tensor cores (tf32) where torch allows it."""
    return "tf32" if param_dtype == DType.fp32 and tf32 else param_dtype
