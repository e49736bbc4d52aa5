"""The `mcore` engine: GPTModel + megatron DDP + Megatron optimizer, built directly from the case."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from harness.adjustments import note
from harness.dtypes import DType, dtype
from harness.engines.base import ParamShard, TokenLogprobs, partition_dim, tp_shard
from harness.engines.experts import EXPERT_RE, tp_coords
from harness.engines.logprob_head import LogprobHead, case_temperature
from harness.engines.lr_schedule import make_scheduler
from harness.engines.mcore_ckpt import McoreCheckpoints
from harness.engines.mcore_steps import McoreSteps
from harness.engines.model_config import (
    _full_init,
    in_params_dtype,
    layer_spec,
    transformer_config,
    uses_transformer_engine,
)
from harness.engines.mtp import MTPProbe, block_spec, probe
from harness.engines.offloading import Offloading
from harness.engines.optimizer_offload import offload_config
from harness.engines.rl_batch import RLBatch
from harness.engines.rl_cycle import RLCycle
from harness.engines.rl_steps import RLSteps
from harness.engines.weight_export import PerTensorExport
from harness.engines.wrap_config import WrapConfig, ddp_config_dict
from harness.launch.context import RankContext
from harness.platform.backend import cpu_share
from harness.platform.parallel import init_parallel_state
from harness.spec import Case

if TYPE_CHECKING:
    import torch

MEGATRON_ADAM_EPS = 1e-8  # OptimizerConfig's default
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_FC1_RE = re.compile(r"(\.mlp|\.local_experts\.\d+|\.shared_experts)\.linear_fc1\.weight$")


class McoreEngine(McoreCheckpoints, McoreSteps, RLSteps, RLCycle, PerTensorExport):
    """megatron-core directly: the reference construction path. Its parts, which a framework's engine replaces with
    its own subclasses: `offload_part` (rl-cycle's offload and reload, harness/engines/offloading.py) and
    `logprob_part` (the RL steps' log-probs and entropy from the logits, harness/engines/logprob_head.py)."""

    offload_part: type[Offloading] = Offloading
    logprob_part: type[LogprobHead] = LogprobHead

    def __init__(self, case: Case, ctx: RankContext):
        self.case, self.ctx = case, ctx
        self.models: list = []
        self.optimizer = None
        self.scheduler: Any = None  # megatron's OptimizerParamScheduler where the case has an lr schedule
        self.config: Any = None  # megatron's TransformerConfig, once built
        self._captured: list[TokenLogprobs] | None = None  # the current step's log-probs, when captured
        self.init_seed: int | None = None  # the weights' initial values drawn from this seed (None: the case's)
        self._offloading: Offloading | None = None
        self._logprob_head: LogprobHead | None = None

    def padded_vocab_rows(self) -> int:
        """The rows of the embedding and output layer this engine builds: the vocabulary padded as megatron pads it."""
        return self.case.model.padded_vocab_size(self.case.layout.tp)

    def offloading(self) -> Offloading:
        """The engine's offload part, made once."""
        if self._offloading is None:
            self._offloading = self.offload_part(self)
        return self._offloading

    def logprob_head(self) -> LogprobHead:
        """The engine's log-prob part, made once, at the case's sampling temperature."""
        if self._logprob_head is None:
            self._logprob_head = self.logprob_part(self, case_temperature(self.case))
        return self._logprob_head

    def mtp_probe(self, batch: RLBatch, microbatches: list[list[int]], mode: str) -> MTPProbe:
        """The first step's gradients with the model's MTP layers on and off, and what megatron's MTP loss took
        (harness/engines/mtp.py); no update."""
        return probe(self, batch, microbatches, mode)

    # -- build --------------------------------------------------------------------------------
    def setup_parallel(self) -> None:
        init_parallel_state(self.case.layout, on_cpu=self.ctx.on_cpu, seed=self.case.options.seed)

    def ddp_config(self):
        """DDP config from the options the user configured for the case."""
        from megatron.core.distributed import DistributedDataParallelConfig

        return DistributedDataParallelConfig(**ddp_config_dict(WrapConfig.from_options(self.case.options)))

    def optimizer_config(self, use_distributed_optimizer: bool):
        from megatron.core.optimizer import OptimizerConfig

        o = self.case.options
        if o.adam_eps != MEGATRON_ADAM_EPS:
            note(f"Adam eps {o.adam_eps:g} (megatron-core's default {MEGATRON_ADAM_EPS:g}), from the case options")
        return OptimizerConfig(
            optimizer="adam", lr=o.lr, adam_eps=o.adam_eps, weight_decay=0.0, clip_grad=o.clip_grad,
            log_num_zeros_in_grad=o.log_num_zeros_in_grad,
            bf16=o.dtype == DType.bf16, fp16=o.dtype == DType.fp16, params_dtype=dtype(o.dtype).torch,
            use_distributed_optimizer=use_distributed_optimizer, min_lr=o.min_lr,
            **(offload_config() if o.optimizer_cpu_offload else {}),
        )

    def build_chunks(self, params_dtype: str | None = None) -> list:
        """Unwrapped GPTModel chunks of this rank (one per virtual pipeline stage), their parameters in
        `params_dtype` where given, else the case's."""
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel

        self.before_build()
        self.config = transformer_config(self.case, self.ctx.on_cpu, params_dtype)
        vpp = self.case.layout.vpp
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            spec = layer_spec(self.ctx.on_cpu, self.case.model.normalization, self.case.layout.cp, self.config,
                              vp_stage)
            chunks.append(GPTModel(
                config=self.config, transformer_layer_spec=spec, vocab_size=self.padded_vocab_rows(),
                max_sequence_length=self.case.model.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=self.case.model.tie_embeddings,
                position_embedding_type="rope", vp_stage=vp_stage,
                mtp_block_spec=block_spec(self.config, spec, uses_transformer_engine(self.ctx.on_cpu), vp_stage),
            ))
        for chunk in chunks:
            self.reinit(chunk)
            if not self.ctx.on_cpu:
                chunk.cuda(torch.cuda.current_device())
        self.after_build(chunks)
        return chunks

    def wrap(self, chunks: list, ddp_config) -> list:
        from megatron.core.distributed import DistributedDataParallel

        return [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]

    def make_optimizer(self, models: list, use_distributed_optimizer: bool):
        from megatron.core.optimizer import get_megatron_optimizer

        return get_megatron_optimizer(self.optimizer_config(use_distributed_optimizer), models)

    def build(self) -> None:
        self.setup_parallel()
        self.build_model()

    def build_model(self) -> None:
        """The model chunks, DDP and the optimizer on the parallel state already set up."""
        chunks = self.build_chunks()
        ddp_config = self.ddp_config()
        self.models = self.wrap(chunks, ddp_config)
        self.optimizer = self.make_optimizer(self.models, ddp_config.use_distributed_optimizer)
        self.after_optimizer()

    def after_optimizer(self) -> None:
        """What every construction path does once its models and optimizer exist: the case's learning-rate
        schedule over the optimizer, and the config's hooks into the models."""
        self.scheduler = make_scheduler(self.optimizer, self.case.options, self.case.global_batch_size)
        self._wire_config()

    def _wire_config(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        cfg = self.config
        cfg.finalize_model_grads_func = finalize_model_grads
        no_sync = [m.no_sync for m in self.models]
        cfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if self.models[0].ddp_config.overlap_grad_reduce:
            grad_sync = [m.start_grad_sync for m in self.models]
            cfg.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync

    # -- names and init -----------------------------------------------------------------------
    @staticmethod
    def global_names(chunk) -> dict[str, torch.nn.Parameter]:
        """Parameters of an unwrapped chunk under layout-independent names: global layer indices, and global
        expert indices (this EP rank's local expert i is expert ep_rank x local experts + i)."""
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        out = {}
        first_expert = None
        for name, p in chunk.named_parameters():
            m = _LAYER_RE.match(name)
            if m:
                global_idx = layers[int(m.group(1))].layer_number - 1
                name = f"decoder.layers.{global_idx}." + name[m.end():]
            e = EXPERT_RE.search(name)
            if e:
                if first_expert is None:
                    from megatron.core import parallel_state as ps

                    local = chunk.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
                    first_expert = ps.get_expert_model_parallel_rank() * local
                expert = first_expert + int(e.group(1))
                name = name[:e.start()] + f".mlp.experts.local_experts.{expert}." + name[e.end():]
            if name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
                if getattr(chunk, "mtp_process", False):
                    continue  # a last stage with MTP layers holds the embedding: its output layer takes that weight
                name = "embedding.word_embeddings.weight"  # the tied copy on the last stage
            out[name] = p
        return out

    def reinit(self, chunk) -> None:
        """The chunk in its parameter dtype, then every weight matrix overwritten from its global name so all layouts
        start equal."""
        in_params_dtype(chunk)
        seed = self.case.options.seed if self.init_seed is None else self.init_seed
        # norms keep their deterministic ones / zeros; LoRA's B starts at zero (the adapted model starts
        # as the base model)
        self.set_full(chunk, lambda name, shape: None if len(shape) < 2 or name.endswith(".adapter.linear_out.weight")
                      else _full_init(name, shape, seed))

    def set_full(self, chunk, full_value) -> list[str]:
        """Copy full (TP-unsharded) values into this rank's shards: full_value(global name, full shape)
        gives the tensor or None (left as it is). Returns the names it set."""
        from concurrent.futures import ThreadPoolExecutor

        import torch

        def set_one(name: str, p) -> str | None:
            tp_rank, tp = tp_coords(name)
            dim = partition_dim(p)
            full_shape = list(p.shape)
            if dim is not None:
                full_shape[dim] *= tp
            full = full_value(name, tuple(full_shape))
            if full is None:
                return None
            if tuple(full.shape) != tuple(full_shape):
                raise ValueError(f"{name}: a full value of shape {tuple(full.shape)} for a parameter of full "
                                 f"shape {tuple(full_shape)}")
            if dim is not None:
                full = tp_shard(full, dim, tp, tp_rank, self.tp_parts(name))
            with torch.no_grad():  # grad mode is per thread
                p.copy_(full)
            return name

        # torch's generators and copies let go of the GIL: the rank's threads fill its parameters side by side,
        # each drawn from its own generator, so the values do not depend on the order. With megatron drawing
        # nothing (model_config.undrawn), 1b-2k's build_chunks took 12.5-12.9 s instead of 23.6-25.2 s on a
        # 2-core VM with no GPU (3 runs each, 2 threads). As many threads as the rank has cores (a gloo rank's
        # ATen runs on one thread, so these start no OpenMP pool: harness/platform/backend.py).
        params = self.global_names(chunk)
        with ThreadPoolExecutor(max_workers=cpu_share()) as pool:
            return [name for name in pool.map(set_one, params, params.values()) if name is not None]

    def tp_parts(self, name: str) -> int:
        """SwiGLU fc1 holds [gate; up], each block sharded over TP separately - and so do the weights
        that act on its output: a LoRA-wrapped fc1 (`.to_wrap.`) and its adapter's B (`linear_out`)."""
        fc1_out = bool(_FC1_RE.search(name.replace(".to_wrap.", ".").replace(".adapter.linear_out.", ".")))
        return 2 if self.case.model.swiglu and fc1_out else 1

    # -- outputs ------------------------------------------------------------------------------
    def grad_buffer_params(self) -> list[list[tuple[str, int]]]:
        """Per chunk, the parameters that train (megatron's DDP must put each in a gradient buffer), in
        registration order."""
        return [[(name, p.numel()) for name, p in model.module.named_parameters() if p.requires_grad]
                for model in self.models]

    def main_grads(self) -> dict[str, torch.Tensor]:
        """Each trainable parameter's gradient as megatron's DDP left it in its buffer (main_grad), by global name,
        on the host."""
        params: dict[str, Any] = {n: p for m in self.models for n, p in self.global_names(m.module).items()}
        return {name: p.main_grad.detach().float().cpu().clone() for name, p in params.items() if p.requires_grad}

    def param_shards(self) -> list[ParamShard]:
        out = []
        for model in self.models:
            for name, p in self.global_names(model.module).items():
                tp_rank, tp = tp_coords(name)
                dim = partition_dim(p)
                out.append(ParamShard(name, p.detach().float().cpu().clone(), dim, tp_rank, tp, self.tp_parts(name)))
        return out

