"""An analytic model of the memory a training rank holds: weights, gradient buffers, optimizer state,
activations of the micro-batches in flight, and a fixed overhead; pure arithmetic (no torch), so
`harness project-memory --training` runs anywhere and the driver can refuse a case before any rank starts.

Counted per rank from its TP x PP shard (`memory_model.shard_params`: every virtual stage it holds), in the
dtypes megatron-core uses:

- weights: N x bytes of the param dtype;
- gradients: megatron DDP's grad buffer, N x (4 if grad_reduce_in_fp32 or fp32 params, else the param
  dtype's bytes);
- optimizer: Adam's exp_avg and exp_avg_sq in fp32 (8N) plus, for bf16 / fp16 params, the fp32 master
  copy (4N); with the distributed optimizer all of it is sharded over the DP x CP ranks (/D);
- activations: what autograd keeps of one transformer layer for one micro-batch, counted tensor by tensor
  for the layer megatron builds (RMSNorm, QKV with GQA, unfused core attention: the softmax output of
  a x s_q x s_k per sample, the output projection, SwiGLU), divided by TP for the TP-split tensors and by
  CP for the sequence; full recompute keeps only each layer's input (plus one layer's activations while
  it is recomputed); selective recompute drops the core attention's; times the layers of the stage
  and the micro-batches in flight on the first pipeline stage (1F1B: min(PP, micro-batches); interleaved:
  megatron's penalty 1 + (PP - 1) / (PP x VPP)); plus the embedding output, and on the last stage the logits
  (in the param dtype and their fp32 softmax in the vocab-parallel cross entropy);
- the optimizer step's fp32 copies of the gradients it steps where the gradient buffer is in bf16 / fp16
  (megatron's `main_grad.float()`: 4 bytes per parameter, /D with the distributed optimizer), made at every
  step and freed by the next step's zero_grad;
- transients: the distributed optimizer's parameter buffer while DDP builds (the weights once more), the
  optimizer's per-parameter temporaries (the largest parameter shard: Adam's, and on CPU ranks the float64
  copy of the CPU layer's norms; on GPUs without Transformer Engine or apex megatron steps with torch's
  AdamW, whose foreach path makes one fp32 temporary as large as every parameter it steps - sqrt(exp_avg_sq)
  - measured on one H200: 23.0 MiB for `small`'s 6.03M parameters), and on gloo ranks the flat copy a
  coalesced collective makes of a gradient bucket (reduce / reduce-scatter) or a parameter bucket (the
  distributed optimizer's all-gather) - NCCL works in place;
- a fixed overhead (FIXED_OVERHEAD: a measured constant per device kind).

What a phase adds (`phases`): build = weights + gradient buffers + the larger of the parameter buffer's copy
and the master copies (made after the buffer replaced the weights' first copies); a step = the largest of
its forward-backward (activations, one layer's transient, logits), its gradient sync (the collective copy)
and its optimizer step (the fp32 gradient copies, next to the all-gather's copy or the optimizer's
temporaries; the first step also creates Adam's moments) - measured on CPU ranks, the three do not overlap
in time without overlap_grad_reduce.

The Korthikanti et al. count ("Reducing Activation Recomputation in Large Transformer Models", Table 2:
s b h (34 + 5 a s / h) bytes per layer in fp16 with dropout masks) and Megatron-LM's
`theoretical_memory_usage.py` (18 bytes per parameter for bf16 without the distributed optimizer) were read
for the structure; the per-tensor count here follows the modules this harness builds (no dropout: p = 0,
GQA, SwiGLU with its own FFN size), and `tests/test_training_memory.py` holds it against measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.backends import Tier, tier_of
from harness.checks.expected_collectives import DEFAULT_BUCKET_ELEMS, chunk_buckets, chunk_params, stage_moe_layers
from harness.checks.memory_model import expert_shard_params, shard_params
from harness.dtypes import DType, dtype
from harness.layouts import coords_of, violations
from harness.spec import Layout, ModelSpec, Recompute

GIB = 1024 ** 3
MIB = 1024 ** 2
# What a rank holds beyond the model's tensors. GPU: the CUDA context, cuBLAS / NCCL workspaces and the
# caching allocator's fragmentation, outside torch's allocated bytes (not yet measured on a GPU with this
# model: a conservative 2 GiB). CPU: nothing beyond the heap figures the model is judged against.
FIXED_OVERHEAD = {Tier.GPU: 2 * GIB, Tier.CPU: 0}
# What a gloo rank process holds before any tensor of the case: the interpreter with torch and megatron-core
# imported (~350 MB RSS measured) - counted when deciding whether a case fits the host.
CPU_PROCESS = GIB // 2
# A prediction within 5% of the memory available is not a fit: the allocator's fragmentation and workspaces
# are not counted tensor by tensor (the first H100 run OOMed `1b` at seq 4096, predicted 79.3 of 79.6 GiB).
FIT_MARGIN = 0.95


@dataclass(frozen=True)
class Training:
    """What sets a rank's training memory beside the model and the layout."""

    dtype: str = "bf16"
    micro_batch_size: int = 1
    num_microbatches: int = 1  # per DP rank and step
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = False
    recompute: str = ""  # "", "full", "selective"
    seq_length: int | None = None  # None: the model's
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None  # DDP bucket size in elements (None: megatron's default)
    # a fused / flash attention kernel (Transformer Engine) keeps no a x s x s probabilities; megatron's local
    # spec (what the harness builds without TE) keeps them, and so does TE in fp32: its flash and fused kernels
    # take fp16 / bf16 only, fp32 runs its unfused attention
    fused_attention: bool = False
    # Transformer Engine's layer spec: its parameters (e.g. the layer norms fused into the linears)
    te_spec: bool = False
    # sequence parallelism: what TP replicates (norms, residuals, layer inputs) is split over TP as well; the
    # harness runs without it, projections of users' configs may ask for it
    sequence_parallel: bool = False
    # megatron's optimizer is torch's AdamW (neither Transformer Engine's nor apex's FusedAdam is installed)
    # and the parameters are on a GPU: torch then takes its foreach path (CPU ranks loop per parameter)
    foreach_adam: bool = False

    def seq(self, model: ModelSpec) -> int:
        return self.seq_length or model.seq_length


@dataclass(frozen=True)
class TrainingMemory:
    """Predicted bytes of one rank by component; `peak` is what the device must hold at once."""

    rank: int
    weights: int
    gradients: int
    optimizer: int  # Adam's moments and the master copies
    activations: int  # of every micro-batch in flight, the first stage's schedule
    transient: int  # one layer's activations more while a layer is recomputed / its backward runs
    logits: int
    masters: int = 0  # of `optimizer`: the fp32 master copies (bf16 / fp16 params), made when the optimizer is built
    build_transient: int = 0  # the distributed optimizer's parameter buffer filled from the weights
    collective: int = 0  # gloo ranks: the flat copy of the largest bucket a coalesced collective makes
    optimizer_transient: int = 0  # the optimizer step's temporaries
    # the fp32 copies of the gradients the optimizer steps (fp16 / bf16 params whose gradient buffer is not
    # fp32: megatron's `main_grad.float()`), made at each step and freed at the next step's zero_grad
    main_grads: int = 0
    # the device kind: its fixed overhead, and what a phase's figure counts: "cpu", the heap a phase allocates
    # itself (memray: a free of what was allocated before the phase does not lower it); "gpu", the device's
    # allocated bytes above the phase's start
    device: Tier = Tier.GPU
    parts: dict[str, int] = field(default_factory=dict)  # the activation count's terms, for the report

    @property
    def overhead(self) -> int:
        return FIXED_OVERHEAD[self.device]

    @property
    def static(self) -> int:
        """What the rank holds between steps: weights, gradient buffers, optimizer state."""
        return self.weights + self.gradients + self.optimizer

    @property
    def forward_backward(self) -> int:
        return self.activations + self.transient + self.logits

    @property
    def build(self) -> int:
        """The build's peak: weights and gradient buffers, then the distributed optimizer's parameter buffer
        filled from the weights (whose first copies go) or the master copies the optimizer makes after it."""
        return self.weights + self.gradients + max(self.masters, self.build_transient)

    @property
    def optimizer_step(self) -> int:
        """What a step's optimizer adds beside the state: the fp32 gradient copies, and next to them the
        optimizer's temporaries or the distributed optimizer's parameter all-gather right after the step (its
        copy on gloo)."""
        beside = max(self.collective, self.optimizer_transient) if self.build_transient else self.optimizer_transient
        return self.main_grads + beside

    @property
    def peak(self) -> int:
        """The most the rank holds at once: after the build, every step's largest sub-phase on top of the
        state it keeps; or the build's own peak."""
        step = max(self.forward_backward, self.collective, self.optimizer_step)
        return max(self.static + step, self.build) + self.overhead

    def phases(self, steps: int) -> dict[str, int]:
        """What each measured phase adds on top of what the rank held before it: build, step0, step1, ..."""
        moments = self.optimizer - self.masters
        out = {"build": self.build,  # the first step creates the moments
               "step0": max(self.forward_backward, self.collective, moments + self.optimizer_step)}
        # a later step starts holding the previous step's gradient copies, freed by its zero_grad: a device's
        # figure counts that free, a heap figure (only what the phase allocates) does not
        freed = self.main_grads if self.device == Tier.GPU else 0
        later = max(self.forward_backward, self.collective, self.optimizer_step) - freed
        out.update({f"step{i}": later for i in range(1, steps)})
        return out

    def rows(self) -> list[tuple[str, int]]:
        return [("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("transient", self.transient), ("logits", self.logits),
                ("fixed overhead", self.overhead)]


def training_of(case) -> Training:
    """The model's view of a case's options (the harness builds megatron's local spec: unfused attention,
    unless Transformer Engine's spec is in use on a GPU and the case trains in fp16 / bf16)."""
    o = case.options
    te = case.te_spec
    return Training(dtype=o.dtype, micro_batch_size=case.micro_batch_size, num_microbatches=case.num_microbatches,
                    use_distributed_optimizer=o.use_distributed_optimizer, grad_reduce_in_fp32=o.grad_reduce_in_fp32,
                    recompute=o.recompute, overlap_grad_reduce=o.overlap_grad_reduce, bucket_size=o.bucket_size,
                    fused_attention=te and o.dtype in (DType.bf16, DType.fp16), te_spec=te,
                    foreach_adam=case.foreach_adam,
                    sequence_parallel=case.model.moe and case.layout.tp > 1)  # megatron's MoE layer needs it


def _stage(layout: Layout, rank: int) -> int:
    return coords_of(layout, rank).pp


def layer_activation_bytes(model: ModelSpec, layout: Layout, training: Training) -> dict[str, float]:
    """Bytes autograd keeps of one transformer layer for one micro-batch on one rank, by tensor."""
    t, cp = layout.tp, layout.cp
    s, b = training.seq(model), training.micro_batch_size
    tokens = s * b / cp  # this rank's tokens of the micro-batch
    h, f, a = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    kv = model.kv_channels
    q_width, kv_width = a * kv, model.num_query_groups * kv
    gate = 2 if model.swiglu else 1
    e = dtype(training.dtype).bytes
    # unfused core attention: megatron's softmax runs in fp32 (attention_softmax_in_fp32) and keeps its fp32
    # output, the batched matmul with V keeps the probabilities in the param dtype: 4 (+2 in bf16) bytes per
    # element of a x s_q x s_k per sample (the scores are freed once softmaxed); under CP each rank's queries
    # see the whole sequence's keys. A fused kernel keeps only the softmax statistics (a x s_q, fp32).
    probs = 4 * a / t * tokens if training.fused_attention else a / t * (s / cp) * s * b * (4 + (e if e != 4 else 0))
    rep = h * tokens * e / (t if training.sequence_parallel else 1)  # one TP-replicated [tokens, h] tensor
    parts = {
        "input norm (input, normalised)": 2 * rep,
        "qkv projection output (q, k, v)": (q_width + 2 * kv_width) / t * tokens * e,
        "rotary q, k": (q_width + kv_width) / t * tokens * e,
        "attention probabilities": probs,
        "attention context": q_width / t * tokens * e,
        "pre-MLP norm (input, normalised)": 2 * rep,
        "fc1 output": gate * f / t * tokens * e,
        "activation output (fc2 input)": f / t * tokens * e,
        "residual sums (after attention, after MLP)": 2 * rep,
    }
    if cp > 1:  # the reference CP attention keeps the all-gathered K and V
        parts["gathered k, v (CP)"] = 2 * kv_width / t * s * b * e
    if training.recompute == Recompute.SELECTIVE:
        for k in ("attention probabilities", "attention context", "gathered k, v (CP)"):
            parts.pop(k, None)
    return parts


MLP_PARTS = ("pre-MLP norm (input, normalised)", "fc1 output", "activation output (fc2 input)")


def moe_layer_activation_bytes(model: ModelSpec, layout: Layout, training: Training) -> dict[str, float]:
    """Bytes autograd keeps of one MoE layer for one micro-batch on one rank: the attention half as a dense
    layer's, then megatron's MoE MLP with the all-to-all dispatcher and SequentialMLP experts - the router's
    logits, scores and probabilities (fp32, tokens x experts), and for the routed token copies this rank's
    experts receive (tokens x top-k on average over the EP ranks; all ETP ranks' under ETP > 1, as megatron
    gathers them) each expert's input, fc1 output, activation output and fc2 output (kept for the routing
    probabilities' product), plus a shared expert's fc1 and activation outputs."""
    parts = layer_activation_bytes(model, layout, training)
    for k in MLP_PARTS[1:]:
        parts.pop(k)
    t, cp, etp = layout.tp, layout.cp, layout.expert_tp
    tokens = training.seq(model) * training.micro_batch_size / cp
    h, e, f = model.hidden_size, dtype(training.dtype).bytes, model.expert_ffn // etp
    gate = 2 if model.swiglu else 1
    routed = tokens / t * model.moe_router_topk * etp  # with TP, MoE runs sequence parallel: tokens / TP route
    parts["router (logits, scores, probabilities)"] = 3 * tokens / t * model.num_experts * 4
    parts["expert inputs (routed tokens)"] = routed * h * e
    parts["expert fc1 output"] = routed * gate * f * e
    parts["expert activation output (fc2 input)"] = routed * f * e
    parts["expert fc2 output (times the probabilities)"] = routed * h * e
    if model.moe_shared_expert_ffn:
        fs = model.moe_shared_expert_ffn // t
        parts["shared expert fc1 and activation outputs"] = (gate + 1) * fs * tokens * e
    return parts


def stage_layers(model: ModelSpec, layout: Layout, rank: int) -> tuple[int, int]:
    """(dense layers, MoE layers) the rank's pipeline stage holds (every virtual chunk)."""

    layers = model.num_layers // (layout.pp * layout.vpp) * layout.vpp
    moe = stage_moe_layers(model, layout, _stage(layout, rank))
    return layers - moe, moe


def predict(model: ModelSpec, layout: Layout, training: Training, rank: int = 0,
            device: Tier = Tier.GPU) -> TrainingMemory:
    """The model's prediction for one rank."""
    n = shard_params(model, layout, rank)
    pbytes = dtype(training.dtype).bytes
    gbytes = 4 if (training.grad_reduce_in_fp32 or training.dtype == DType.fp32) else pbytes
    d = layout.dp * layout.cp
    # an MoE model's experts at EP > 1 have an optimizer of their own, sharded over the expert-DP group
    ne = expert_shard_params(model, layout, rank)
    share, expert_share = (d, layout.edp) if training.use_distributed_optimizer else (1, 1)
    masters = 0 if training.dtype == DType.fp32 else 4 * (n - ne) // share + 4 * ne // expert_share
    optimizer = 8 * (n - ne) // share + 8 * ne // expert_share + masters
    parts = layer_activation_bytes(model, layout, training)
    dense_layers, moe_layers = stage_layers(model, layout, rank)
    moe_parts = moe_layer_activation_bytes(model, layout, training) if moe_layers else {}
    # the stage's layers kept per micro-batch, and the largest one (the transient)
    per_layer = (dense_layers * sum(parts.values()) + moe_layers * sum(moe_parts.values())) / (dense_layers
                                                                                               + moe_layers)
    largest_layer = max(sum(parts.values()) if dense_layers else 0, sum(moe_parts.values()))
    if moe_parts:
        parts = {**(parts if dense_layers else {}), **{f"MoE: {k}": v for k, v in moe_parts.items()}}
    s, b, t, cp = training.seq(model), training.micro_batch_size, layout.tp, layout.cp
    tokens = s * b / cp
    layer_input = model.hidden_size * tokens * pbytes / (t if training.sequence_parallel else 1)
    stages = layout.pp * layout.vpp
    layers = model.num_layers // stages * layout.vpp  # every virtual stage of this rank
    stage = _stage(layout, rank)
    if layout.pp == 1:
        in_flight = 1.0
    elif layout.vpp > 1:
        in_flight = layout.pp * (1 + (layout.pp - 1) / (layout.pp * layout.vpp))
    else:
        in_flight = min(layout.pp - stage, training.num_microbatches)
    kept = layer_input if training.recompute == Recompute.FULL else per_layer
    activations = int(kept * layers * in_flight / layout.vpp if layout.vpp > 1 else kept * layers * in_flight)
    embedding = layer_input * (in_flight if stage == 0 else 0)
    transient = int(largest_layer)  # a layer recomputed, or the gradients of the one in backward
    last = stage == layout.pp - 1
    logits = int(model.vocab_size / t * tokens * (pbytes + 4)) if last else 0
    buckets, largest = _buckets(model, layout, training, rank)
    collective = 0
    if device == Tier.CPU:  # gloo's coalesced collectives flatten a bucket into a new tensor; NCCL works in place
        collective = largest * max(gbytes, pbytes if training.use_distributed_optimizer else 0)
    build_transient = n * pbytes if training.use_distributed_optimizer else 0
    optimizer_transient = buckets * (12 if device == Tier.CPU else 8)
    if device == Tier.GPU and training.foreach_adam:
        optimizer_transient = max(optimizer_transient, 4 * n // share)
    # megatron's optimizer steps fp32 copies of the gradients where the buffer holds them in the param dtype
    main_grads = masters if gbytes < 4 else 0
    return TrainingMemory(rank, n * pbytes, n * gbytes, optimizer, activations + int(embedding), transient, logits,
                          masters, build_transient, collective, optimizer_transient, main_grads, device,
                          {k: int(v) for k, v in parts.items()})


def _buckets(model: ModelSpec, layout: Layout, training: Training, rank: int) -> tuple[int, int]:
    """(elements of the rank's largest parameter shard, elements of its largest gradient bucket), by the
    grad-sync plan's own arithmetic of megatron's buffers."""

    c = coords_of(layout, rank)
    d = layout.dp * layout.cp
    largest_param, largest_bucket = 0, 0
    for vp in range(layout.vpp):
        for experts, group in ((False, d), (True, layout.edp)):  # the dense buffer; an MoE model's experts at EP > 1
            params = chunk_params(model, layout, c.pp, vp, te=training.te_spec, expert_buffer=experts)
            if not params:
                continue
            largest_param = max([largest_param, *(numel for _, numel, _ in params)])
            size = None
            if training.overlap_grad_reduce and c.pp == 0 and vp == 0:
                size = training.bucket_size or max(DEFAULT_BUCKET_ELEMS, 1_000_000 * d)
            largest_bucket = max([largest_bucket, *chunk_buckets(params, distopt=training.use_distributed_optimizer,
                                                                 dp_cp=group, bucket_size=size)])
    return largest_param, largest_bucket


def worst_rank(model: ModelSpec, layout: Layout, training: Training, device: Tier = Tier.GPU) -> TrainingMemory:
    """The rank predicted to need the most."""
    return max((predict(model, layout, training, r, device) for r in range(layout.world_size)), key=lambda m: m.peak)


def fits(model: ModelSpec, layout: Layout, training: Training, available: int, device: Tier = Tier.GPU
         ) -> tuple[bool, TrainingMemory]:
    m = worst_rank(model, layout, training, device)
    need = m.peak + (CPU_PROCESS if device == Tier.CPU else 0)
    return need <= FIT_MARGIN * available, m


def nearest_fitting(model: ModelSpec, layout: Layout, training: Training, available: int, world_size: int,
                    device: Tier = Tier.GPU) -> str:
    """The nearest setting that the model predicts will fit: recompute, a smaller micro-batch, a larger
    TP or PP at the same world size; '' where none of them does."""
    import dataclasses

    tries: list[tuple[str, Layout, Training]] = []
    if training.recompute != Recompute.SELECTIVE:
        tries.append(("selective activation recompute (--recompute selective)", layout,
                      dataclasses.replace(training, recompute=Recompute.SELECTIVE)))
    if training.recompute != Recompute.FULL:
        tries.append(("full activation recompute (--recompute full)", layout,
                      dataclasses.replace(training, recompute=Recompute.FULL)))
    if training.micro_batch_size > 1:
        tries.append((f"micro-batch {training.micro_batch_size // 2} (--micro-batch-size)", layout,
                      dataclasses.replace(training, micro_batch_size=training.micro_batch_size // 2)))
    if not training.use_distributed_optimizer and layout.dp * layout.cp > 1:
        tries.append(("the distributed optimizer", layout,
                      dataclasses.replace(training, use_distributed_optimizer=True)))
    for grow in ("tp", "pp"):
        for k in (2, 4, 8):
            if layout.dp % k:
                continue
            bigger = dataclasses.replace(layout, dp=layout.dp // k, **{grow: getattr(layout, grow) * k})
            if not violations(bigger, model, world_size):
                tries.append((f"layout {bigger.id}", bigger, training))
    for what, lay, tr in tries:
        ok, m = fits(model, lay, tr, available, device)
        if ok:
            return f"{what} ({m.peak / GIB:.1f} GiB)"
    return ""


def refusal(case, available: int) -> str:
    """'' when the model predicts the case fits `available` bytes per rank; else one line naming the predicted
    and the available GiB and the nearest setting that fits."""
    device = tier_of(case.backend)
    training = training_of(case)
    ok, m = fits(case.model, case.layout, training, available, device)
    if ok:
        return ""
    fix = nearest_fitting(case.model, case.layout, training, available, case.layout.world_size, device)
    where = "its GPU" if device == Tier.GPU else "its share of the host's available memory"
    return (f"case {case.id} will not fit: the training-memory model predicts {m.peak / GIB:.1f} GiB on rank {m.rank} "
            f"(weights {m.weights / GIB:.1f}, gradients {m.gradients / GIB:.1f}, optimizer {m.optimizer / GIB:.1f}, "
            f"activations {(m.activations + m.transient + m.logits) / GIB:.1f}) against {available / GIB:.1f} GiB of "
            f"{where} (fit margin {FIT_MARGIN:.0%}); " + (f"nearest setting that fits: {fix}" if fix else
                                                          "no nearby setting fits: use more ranks"))
