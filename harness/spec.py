"""What a case is: a model spec, a layout, an engine and options."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harness.backends import Backend, Tier
from harness.dtypes import DType
from harness.dtypes import dtype as dtype_of
from harness.engine_names import EngineName
from harness.errors import BadInput
from harness.option_flags import flag


class Recompute(StrEnum):
    """Activation recompute: off, full (every layer, megatron's uniform method) or selective (core attention)."""

    OFF = ""
    FULL = "full"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-like decoder, as data (see harness/models/*.toml); with num_experts > 0 a mixture of experts
    (megatron's MoE layer: a top-k router with the load-balancing auxiliary loss, SwiGLU experts, optionally a
    shared expert and dense layers first, as DeepSeek-style models have)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    tie_embeddings: bool = True
    normalization: str = "RMSNorm"
    swiglu: bool = True
    global_batch_size: int = 8
    micro_batch_size: int = 1
    tier: Tier = Tier.CPU  # what it is sized for
    description: str = ""
    num_experts: int = 0  # 0: dense
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0  # each expert's; 0: ffn_hidden_size
    moe_shared_expert_ffn: int = 0  # the shared expert's FFN size (0: none)
    moe_first_dense_layers: int = 0  # this many layers first keep the dense MLP
    moe_aux_loss_coeff: float = 1e-2  # the load-balancing auxiliary loss (megatron's "aux_loss")
    qk_layernorm: bool = False  # a norm over each head's queries and keys before RoPE (Qwen3's)
    # aux-loss-free balancing (DeepSeek-V3's): a sigmoid router whose per-expert bias, updated from each step's
    # expert loads, shifts the top-k choice
    moe_expert_bias: bool = False
    # megatron's vocabulary padding (its training scripts' --make-vocab-size-divisible-by): the embedding and output
    # layer built with padded_vocab_size(tp) rows, the ones past vocab_size no token's; 0 pads nothing
    make_vocab_size_divisible_by: int = 0
    # megatron's multi-token prediction: this many MTP layers after the decoder, their heads detached from the main
    # model (TransformerConfig.mtp_detach_heads), as RL frameworks train it; 0: none
    mtp_num_layers: int = 0

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def padded_vocab_size(self, tp: int) -> int:
        """The rows of the embedding and output layer at TP `tp`: the vocabulary padded to a multiple of
        make_vocab_size_divisible_by x TP, as megatron pads it (the vocabulary itself where nothing pads it)."""
        step = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // step) * step if step else self.vocab_size

    def moe_layers(self) -> int:
        """How many layers hold an MoE MLP."""
        return max(0, self.num_layers - self.moe_first_dense_layers) if self.moe else 0

    def num_params(self) -> int:
        """Parameter count of the whole model (no TP padding)."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        kv = self.kv_channels * self.num_query_groups
        attn = h * (h + 2 * kv) + h * h + (2 * self.kv_channels if self.qk_layernorm else 0)
        per_ffn = h * (3 if self.swiglu else 2)
        mlp = per_ffn * f
        moe = h * self.num_experts + per_ffn * (self.num_experts * self.expert_ffn + self.moe_shared_expert_ffn)
        norms = 2 * h * (1 if self.normalization == "RMSNorm" else 2)
        embed = self.vocab_size * h
        output = 0 if self.tie_embeddings else self.vocab_size * h
        final_norm = h * (1 if self.normalization == "RMSNorm" else 2)
        mlps = (L - self.moe_layers()) * mlp + self.moe_layers() * moe
        return embed + output + L * (attn + norms) + mlps + final_norm


_LAYOUT_RE = re.compile(r"^tp(\d+)-pp(\d+)-cp(\d+)-dp(\d+)(?:-vpp(\d+))?(?:-ep(\d+)(?:-etp(\d+))?)?$")


@dataclass(frozen=True, order=True)
class Layout:
    """A TP x PP x CP x DP factorisation of the world; vpp > 1 means interleaved pipeline stages. The experts of
    an MoE model lie on their own grid of each pipeline stage, megatron's TP x CP x DP = ETP x EP x EDP: expert
    parallel size ep, expert tensor parallel size etp (0: megatron's default, the TP size) and the expert data
    parallel size that follows."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 0

    def __post_init__(self) -> None:
        if self.etp == self.tp:  # one layout, one id: ETP = TP is megatron's default
            object.__setattr__(self, "etp", 0)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """Expert data parallel size: the ranks of a stage that hold the same experts (0: the grid does not fit)."""
        grid = self.tp * self.cp * self.dp
        return grid // (self.expert_tp * self.ep) if grid % (self.expert_tp * self.ep) == 0 else 0

    @property
    def expert_parallel(self) -> bool:
        """Whether the id names an expert layout (EP > 1 or an ETP other than TP)."""
        return self.ep > 1 or self.etp > 0

    @property
    def id(self) -> str:
        base = f"tp{self.tp}-pp{self.pp}-cp{self.cp}-dp{self.dp}" + (f"-vpp{self.vpp}" if self.vpp > 1 else "")
        if self.expert_parallel:
            base += f"-ep{self.ep}" + (f"-etp{self.etp}" if self.etp else "")
        return base

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str) -> Layout:
        m = _LAYOUT_RE.match(text.strip())
        if not m:
            raise BadInput(
                f"layout {text!r} is not of the form tpT-ppP-cpC-dpD[-vppV][-epE[-etpT]] (e.g. tp2-pp1-cp1-dp2, "
                f"tp2-pp1-cp1-dp2-ep2-etp1)"
            )
        tp, pp, cp, dp = (int(g) for g in m.groups()[:4])
        vpp, ep = int(m.group(5) or 1), int(m.group(6) or 1)
        etp = int(m.group(7)) if m.group(7) else tp
        if min(tp, pp, cp, dp, vpp, ep, etp) < 1:
            raise BadInput(f"layout {text!r}: every size must be >= 1")
        return cls(tp, pp, cp, dp, vpp, ep, etp)


def id_fragment(params: Any) -> str:
    """The non-default fields of a dataclass as a compact case-id fragment (`name=value,...`); "" for None."""
    if params is None:
        return ""
    parts = []
    for f in dataclasses.fields(params):
        if not f.metadata.get("in_id", True):
            continue
        value = getattr(params, f.name)
        if value != f.default:
            parts.append(f"{f.name}={value}")
    return ",".join(parts)


@dataclass(frozen=True)
class CaseOptions:
    """The training options every suite shares (steps, seed, dtype, DDP, optimizer, batch); what a
    single suite needs lives in its own parameter type (`Case.params`). Expected plans are derived
    from these, never from engine objects."""

    steps: int = field(default=2, metadata=flag("--steps", "training steps per case (default 2)"))
    warmup_steps: int = 0  # untimed steps before the `steps` a suite measures (step-perf)
    seed: int = field(default=1234, metadata=flag("--seed", "the seed of weights and data (default 1234)"))
    # a name given ("bf16") becomes its DType; an unknown one is BadInput. Not given on the command line: the
    # suite's for the backend (suite_registry.default_dtype)
    dtype: DType = field(default=DType.fp32, metadata=flag(
        "--dtype", "default fp32; step-perf on NCCL ranks bf16 (mixed precision, as Megatron users train)",
        choices=("fp32", "bf16")))
    use_distributed_optimizer: bool = field(default=False, metadata=flag("--distributed-optimizer",
                                                                         "use_distributed_optimizer=True"))
    overlap_grad_reduce: bool = field(default=False, metadata=flag("--overlap-grad-reduce",
                                                                   "overlap_grad_reduce=True"))
    grad_reduce_in_fp32: bool = False
    lr: float = 1e-3
    # megatron's OptimizerParamScheduler (lr_decay_steps 0: none, the constant `lr`): from lr_warmup_init a linear
    # warm-up to `lr` over lr_warmup_steps steps, then lr_decay_style decay ("cosine", "linear") to min_lr at
    # lr_decay_steps; stepped after every optimizer step by the global batch's samples and saved with every
    # checkpoint, as megatron's training loop does (golden turns it on, harness/engines/lr_schedule.py)
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    lr_decay_style: str = "cosine"
    lr_warmup_init: float = 0.0
    min_lr: float = 0.0
    adam_eps: float = 1e-8  # megatron's default
    clip_grad: float = 1.0  # megatron's default: clip the global gradient norm at 1.0 (0: off)
    recompute: str = field(default=Recompute.OFF, metadata=flag(  # a Recompute
        "--recompute", "activation recompute: full (every layer) or selective (core attention); default off",
        choices=tuple(Recompute)))
    bucket_size: int | None = None  # DDP gradient bucket size in elements (None: megatron's default)
    global_batch_size: int | None = None  # None: the model spec's
    micro_batch_size: int | None = field(default=None, metadata=flag(
        "--micro-batch-size", "samples per micro-batch (default: the model's)"))
    # LoRA fine-tuning (megatron-bridge's LoRA on every linear, rank `lora_dim`, scaling alpha / dim;
    # 0 = full training): what trains is a training option, whichever suite runs it (peft-ckpt does)
    lora_dim: int = 0
    lora_alpha: int = 0
    # the MoE token dispatcher (megatron's moe_token_dispatcher_type): "alltoall" or "allgather", the two that run
    # without Transformer Engine / DeepEP ("flex" needs them)
    moe_dispatcher: str = "alltoall"
    # megatron's OptimizerConfig flag: count the zero gradient elements at each step (golden records them);
    # off elsewhere: the count is one more model-parallel all-reduce per step in step-perf's counters
    log_num_zeros_in_grad: bool = False
    # mask a tail of each sample out of the loss (its length a function of the sample's index in the global
    # batch) and normalise the loss per token (megatron's calculate_per_token_loss), as a real data pipeline
    # with padding does: per-token and per-micro-batch normalisation then differ (golden turns it on)
    loss_mask: bool = False
    # megatron's optimizer CPU offload (OptimizerConfig.optimizer_cpu_offload: its HybridDeviceOptimizer with the
    # whole state on the host, offload fraction 1.0; with the precision-aware optimizer where Transformer Engine is
    # installed, engines/mcore.py), as long jobs that resume run it (Megatron-LM #1842); needs the distributed
    # optimizer and CUDA (NCCL ranks)
    optimizer_cpu_offload: bool = False
    # RL: megatron's routing replay (TransformerConfig.moe_enable_routing_replay, megatron-core >= 0.16: a
    # RouterReplay per MoE router, its top-k recorded in one pass and replayed in another), and the routers frozen
    # (their weights do not train, as RL recipes freeze them)
    routing_replay: bool = False
    freeze_router: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_of(self.dtype))
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            raise BadInput("optimizer_cpu_offload needs use_distributed_optimizer (the harness offloads the "
                           "distributed optimizer's state, as megatron's precision-aware optimizer requires)")
        if self.lr_decay_steps and not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise BadInput(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0 and below lr_decay_steps="
                           f"{self.lr_decay_steps} (megatron's OptimizerParamScheduler decays after the warm-up)")
        if self.lr_decay_steps and not (0 <= self.lr_warmup_init <= self.lr and 0 <= self.min_lr <= self.lr):
            raise BadInput(f"lr_warmup_init={self.lr_warmup_init:g} and min_lr={self.min_lr:g} must lie in [0, "
                           f"lr={self.lr:g}]")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise BadInput(f"lr_decay_style {self.lr_decay_style!r}: use cosine, linear or constant")


@dataclass(frozen=True)
class Case:
    """One unit of work: a model on a layout through an engine, run on layout.world_size ranks."""

    suite: str
    model: ModelSpec
    layout: Layout
    engine: str = EngineName.MCORE
    options: CaseOptions = field(default_factory=CaseOptions)
    backend: Backend = Backend.GLOO
    timeout_s: float = 300.0
    # ids of cases whose artefacts this case reads: the driver runs them first, shuffled or not, and
    # hands this case their output directories as `inputs` (same order)
    after: tuple[str, ...] = field(default=(), compare=False)
    # the suite's own parameters of this case: a frozen dataclass of the suite's module (part of the id)
    params: Any = None
    # set by the driver: this case's output directory (private to the run, outside any rank's workdir;
    # later cases read it) and the output directories of the cases in `after`
    out_dir: str = field(default="", compare=False)
    inputs: tuple[str, ...] = field(default=(), compare=False)
    # set by the driver: `module:Class` of the suite object that planned the case, which the ranks load
    # (so a suite registered only in the parent, or passed as an object, runs the same); "": by `suite`
    suite_ref: str = field(default="", compare=False)
    # why this case cannot run here (e.g. it needs more ranks than the world size gives, naming how many):
    # the driver reports it skipped without starting a rank
    skip_reason: str = field(default="", compare=False)

    def to_skip(self, reason: str) -> Case:
        """This case, to be reported skipped for `reason` instead of run."""
        return dataclasses.replace(self, skip_reason=reason)

    @property
    def variant(self) -> str:
        """The non-default options and suite parameters as a compact fragment ("" when all are default)."""
        return ",".join(x for x in (id_fragment(self.options), id_fragment(self.params)) if x)

    @property
    def id(self) -> str:
        opts = self.variant
        return f"{self.suite}/{self.engine}/{self.model.name}/{self.layout.id}" + (f"[{opts}]" if opts else "")

    @property
    def te_spec(self) -> bool:
        """Whether megatron's engines build Transformer Engine's layer spec for this case: on NCCL ranks where
        transformer_engine is installed (harness.engines.model_config.layer_spec); the local spec otherwise."""
        import importlib.util

        return self.backend == Backend.NCCL and importlib.util.find_spec("transformer_engine") is not None

    @property
    def foreach_adam(self) -> bool:
        """Whether megatron steps with torch's AdamW on GPU tensors, i.e. its foreach path: on NCCL ranks where
        neither Transformer Engine's nor apex's FusedAdam (megatron-core's first choices) is installed."""
        import importlib.util

        fused = ("transformer_engine", "apex")
        return self.backend == Backend.NCCL and all(importlib.util.find_spec(m) is None for m in fused)

    @property
    def global_batch_size(self) -> int:
        return self.options.global_batch_size or self.model.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.options.micro_batch_size or self.model.micro_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.layout.dp)
