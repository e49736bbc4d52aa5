"""The `mcore` engine: GPTModel + megatron DDP + Megatron optimizer, built directly from the case."""

from __future__ import annotations

import contextlib
import functools
import re
import zlib

import torch
import torch.nn.functional as F

from harness.engines import data
from harness.engines.base import ParamShard, StepOutput, TokenLogprobs, tp_shard
from harness.engines.cp_data import zigzag_positions
from harness.launch.context import RankContext
from harness.platform.parallel import init_parallel_state
from harness.spec import Case

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MEGATRON_ADAM_EPS = 1e-8  # OptimizerConfig's default
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def transformer_config(case: Case, on_cpu: bool):
    """TransformerConfig for the model spec and layout (no dropout: the CPU RNG tracker cannot fork)."""
    from megatron.core.transformer import TransformerConfig

    m, lay, dtype = case.model, case.layout, _DTYPES[case.options.dtype]
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels, normalization=m.normalization, gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
        context_parallel_size=lay.cp, sequence_parallel=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        # Interleaved PP with batched p2p swaps messages on gloo (docs/architecture.md).
        batch_p2p_comm=not (lay.vpp > 1), deallocate_pipeline_outputs=True,
        **recompute_config(case.options.recompute),
    )


def recompute_config(recompute: str) -> dict:
    """TransformerConfig fields of the case's activation-recompute option."""
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective")
    if recompute:
        from harness.errors import BadInput

        raise BadInput(f"recompute {recompute!r}: expected full or selective")
    return {}


def layer_spec(on_cpu: bool, normalization: str, cp: int = 1):
    """Local spec on CPU ranks; the Transformer Engine spec on GPU when transformer_engine imports.

    Without TE and with CP > 1, the local spec's core attention (which asserts CP == 1) is replaced
    by the reference context-parallel attention.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if not on_cpu:
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    from harness.adjustments import note

    note("layer spec: megatron's local spec (Transformer Engine's needs CUDA)")
    spec = specs.get_gpt_layer_local_spec(normalization=normalization)
    if cp > 1:
        from harness.engines.cp_attention import ReferenceCPAttention

        note("core attention: the harness's reference CP attention (megatron's local attention asserts CP == 1)")
        spec.submodules.self_attention.submodules.core_attention = ReferenceCPAttention
    return spec


def _full_init(name: str, full_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Layout-independent initial value of a parameter: a function of its global name only."""
    gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    return torch.randn(full_shape, generator=gen) * 0.02


class McoreEngine:
    """megatron-core directly: the reference construction path."""

    def __init__(self, case: Case, ctx: RankContext):
        self.case, self.ctx = case, ctx
        self.models: list = []
        self.optimizer = None
        self.config = None
        self._captured: list[TokenLogprobs] | None = None  # the current step's log-probs, when captured

    # -- build --------------------------------------------------------------------------------
    def setup_parallel(self) -> None:
        init_parallel_state(self.case.layout, on_cpu=self.ctx.on_cpu, seed=self.case.options.seed)

    def ddp_config(self):
        """DDP config from the options the user configured for the case."""
        from megatron.core.distributed import DistributedDataParallelConfig

        o = self.case.options
        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=o.grad_reduce_in_fp32, overlap_grad_reduce=o.overlap_grad_reduce,
            use_distributed_optimizer=o.use_distributed_optimizer,
            **({"bucket_size": o.bucket_size} if o.bucket_size else {}),
        )

    def optimizer_config(self, use_distributed_optimizer: bool):
        from megatron.core.optimizer import OptimizerConfig

        o = self.case.options
        if o.adam_eps != MEGATRON_ADAM_EPS:
            from harness.adjustments import note

            note(f"Adam eps {o.adam_eps:g} (megatron-core's default {MEGATRON_ADAM_EPS:g}), from the case options")
        return OptimizerConfig(
            optimizer="adam", lr=o.lr, adam_eps=o.adam_eps, weight_decay=0.0, clip_grad=1.0,
            bf16=o.dtype == "bf16", fp16=o.dtype == "fp16", params_dtype=_DTYPES[o.dtype],
            use_distributed_optimizer=use_distributed_optimizer,
        )

    def build_chunks(self) -> list:
        """Unwrapped GPTModel chunks of this rank (one per virtual pipeline stage)."""
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel

        self.config = transformer_config(self.case, self.ctx.on_cpu)
        spec = layer_spec(self.ctx.on_cpu, self.case.model.normalization, self.case.layout.cp)
        vpp = self.case.layout.vpp
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            chunks.append(GPTModel(
                config=self.config, transformer_layer_spec=spec, vocab_size=self.case.model.vocab_size,
                max_sequence_length=self.case.model.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=self.case.model.tie_embeddings,
                position_embedding_type="rope", vp_stage=vp_stage,
            ))
        for chunk in chunks:
            self.reinit(chunk)
            if not self.ctx.on_cpu:
                chunk.cuda(torch.cuda.current_device())
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
        chunks = self.build_chunks()
        ddp_config = self.ddp_config()
        self.models = self.wrap(chunks, ddp_config)
        self.optimizer = self.make_optimizer(self.models, ddp_config.use_distributed_optimizer)
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
        """Parameters of an unwrapped chunk under layout-independent names."""
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        out = {}
        for name, p in chunk.named_parameters():
            m = _LAYER_RE.match(name)
            if m:
                global_idx = layers[int(m.group(1))].layer_number - 1
                name = f"decoder.layers.{global_idx}." + name[m.end():]
            if name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
                name = "embedding.word_embeddings.weight"  # the tied copy on the last stage
            out[name] = p
        return out

    def reinit(self, chunk) -> None:
        """Overwrite every weight matrix from its global name so all layouts start equal."""
        seed = self.case.options.seed
        # norms keep their deterministic ones / zeros; LoRA's B starts at zero (the adapted model starts
        # as the base model)
        self.set_full(chunk, lambda name, shape: None if len(shape) < 2 or name.endswith(".adapter.linear_out.weight")
                      else _full_init(name, shape, seed))

    def set_full(self, chunk, full_value) -> list[str]:
        """Copy full (TP-unsharded) values into this rank's shards: full_value(global name, full shape)
        gives the tensor or None (left as it is). Returns the names it set."""
        from megatron.core import parallel_state as ps

        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        done = []
        with torch.no_grad():
            for name, p in self.global_names(chunk).items():
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                full_shape = list(p.shape)
                if dim is not None:
                    full_shape[dim] *= tp
                full = full_value(name, tuple(full_shape))
                if full is None:
                    continue
                if tuple(full.shape) != tuple(full_shape):
                    raise ValueError(f"{name}: a full value of shape {tuple(full.shape)} for a parameter of full "
                                     f"shape {tuple(full_shape)}")
                if dim is not None:
                    full = tp_shard(full, dim, tp, tp_rank, self.tp_parts(name))
                p.copy_(full)
                done.append(name)
        return done

    def tp_parts(self, name: str) -> int:
        """SwiGLU fc1 holds [gate; up], each block sharded over TP separately - and so do the weights
        that act on its output: a LoRA-wrapped fc1 (`.to_wrap.`) and its adapter's B (`linear_out`)."""
        fc1_out = name.replace(".to_wrap.", ".").endswith("mlp.linear_fc1.weight") \
            or name.endswith("mlp.linear_fc1.adapter.linear_out.weight")
        return 2 if self.case.model.swiglu and fc1_out else 1

    # -- steps --------------------------------------------------------------------------------
    # Steps whose per-token log-probs are captured (StepOutput.token_logprobs): the first step's forward
    # runs on identical weights on every layout, so a position error shows at the token it hits.
    logprob_steps: frozenset[int] = frozenset({0})

    def forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        dev = self.ctx.device
        output = model(mb["tokens"].to(dev), mb["position_ids"].to(dev), None, labels=mb["labels"].to(dev))
        if self._captured is not None and "samples" in mb:
            return output, functools.partial(self._capture_then_loss, mb)
        return output, self.loss_func

    def _capture_then_loss(self, mb, output_tensor):
        """Keep the micro-batch's per-token log-probs (minus the per-token loss), then megatron's loss."""
        self._captured.append(TokenLogprobs(mb["samples"], mb["positions"],
                                            -output_tensor.detach().float().cpu().reshape(len(mb["samples"]), -1)))
        return self.loss_func(output_tensor)

    @staticmethod
    def loss_func(output_tensor):
        """Sum of per-token losses and the token count (megatron normalises by the count)."""
        loss_sum = output_tensor.float().sum()
        num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int, device=output_tensor.device)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    def train_step(self, step: int) -> StepOutput:
        return self._run_batch(step, forward_only=False, capture=step in self.logprob_steps)

    def eval_step(self, step: int) -> StepOutput:
        """Forward only on the batch of `step` (no update), capturing every token's log-prob."""
        return self._run_batch(step, forward_only=True, capture=True)

    def _run_batch(self, step: int, forward_only: bool, capture: bool) -> StepOutput:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        dp_rank, cp = ps.get_data_parallel_rank(), self.case.layout.cp
        mbs = data.microbatches(self.case, step, dp_rank)
        if cp > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank

            mbs = [get_batch_on_this_cp_rank(dict(mb)) for mb in mbs]
        self._captured = [] if capture else None
        if self._captured is not None:
            # Where each local token sits in the global batch, by the harness's own arithmetic (DP slice,
            # zigzag CP chunks) - not read back from megatron's split, which is under test. Added after
            # the split: get_batch_on_this_cp_rank slices every key it is given.
            seq = self.case.model.seq_length
            positions = zigzag_positions(seq, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(seq)
            for i, mb in enumerate(mbs):
                first = data.first_sample(self.case, dp_rank, i)
                mb["samples"] = torch.arange(first, first + mb["tokens"].shape[0])
                mb["positions"] = positions
        iters = [iter(mbs) for _ in self.models]
        if not forward_only:
            for m in self.models:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            losses = get_forward_backward_func()(
                forward_step_func=self.forward_step,
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=self.models if len(self.models) > 1 else self.models[0],
                num_microbatches=len(mbs), seq_length=self.case.model.seq_length,
                micro_batch_size=self.case.micro_batch_size, forward_only=forward_only,
            )
        if not forward_only:
            self.optimizer.step()
        captured, self._captured = self._captured, None
        if not losses:
            return StepOutput(None, None, captured)
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        return StepOutput(float(total[0]), int(total[1]), captured)

    # -- outputs ------------------------------------------------------------------------------
    def param_shards(self) -> list[ParamShard]:
        from megatron.core import parallel_state as ps

        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        out = []
        for model in self.models:
            for name, p in self.global_names(model.module).items():
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                out.append(ParamShard(name, p.detach().float().cpu().clone(), dim, tp_rank, tp, self.tp_parts(name)))
        return out

    # -- checkpoints --------------------------------------------------------------------------
    default_ckpt_format = "dp_reshardable"  # what a save uses when the user names no format
    OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")

    def optimizer_state_shards(self) -> list[ParamShard]:
        """Adam state as `<global name>#<key>` shards (TP-local, whole over DP), from DP rank 0 only.

        The distributed optimizer holds a flat range of each parameter per DP x CP rank; the ranges are
        disjoint, so summing zero-filled copies over that group rebuilds every element exactly."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        owner: dict[torch.nn.Parameter, tuple] = {}  # model param -> (its Adam state, flat range or None: all)
        distributed = False
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            index = getattr(opt, "model_param_group_index_map", None)
            if index is None:  # not distributed (fp32): the optimizer steps the model parameters themselves
                for g in opt.optimizer.param_groups:
                    for p in g["params"]:
                        owner[p] = (opt.optimizer.state.get(p, {}), None)
                continue
            distributed = True  # a parameter held wholly by other DP ranks is not in this rank's index
            for p, (group, order) in index.items():
                main = opt.optimizer.param_groups[group]["params"][order]
                rng = opt._get_model_param_range_map(p)["param"]
                owner[p] = (opt.optimizer.state.get(main, {}), (rng.start, rng.end))
        group = ps.get_data_parallel_group(with_context_parallel=True)
        out = []
        for model in self.models:
            for name, p in self.global_names(model.module).items():
                state, rng = owner.get(p, ({}, (0, 0)))
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                for key in self.OPTIMIZER_STATE_KEYS:
                    if key == "step":  # one scalar, the same on every DP rank holding a piece of the parameter
                        value = state["step"].detach().float().reshape(1).to(p.device, copy=True) if "step" in state \
                            else torch.full((1,), float("-inf"), device=p.device)
                        if distributed:
                            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
                        out.append(ParamShard(f"{name}#step", value.cpu(), None, tp_rank, tp))
                        continue
                    full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)  # NCCL needs the device
                    if key in state:
                        lo, hi = rng or (0, p.numel())
                        full[lo:hi] = state[key].detach().float().reshape(-1)
                    if distributed:  # every rank, every parameter: the same collectives in the same order
                        dist.all_reduce(full, group=group)
                    out.append(ParamShard(f"{name}#{key}", full.cpu().view(p.shape), dim, tp_rank, tp,
                                          self.tp_parts(name)))
        return out if ps.get_data_parallel_rank(with_context_parallel=True) == 0 else []

    def checkpoint_metadata(self, fmt: str) -> dict:
        if fmt == "default":
            fmt = self.default_ckpt_format
        sharding = "fully_reshardable" if fmt.startswith("fully_reshardable") else fmt
        return {"distrib_optim_sharding_type": sharding,
                "distrib_optim_fully_reshardable_mem_efficient": fmt == "fully_reshardable_mem_efficient"}

    def sharded_state_dict(self, fmt: str, is_loading: bool = False) -> dict:
        metadata = self.checkpoint_metadata(fmt)
        model_sd = {}
        for i, m in enumerate(self.models):
            key = "model" if len(self.models) == 1 else f"model{i}"
            model_sd[key] = m.module.sharded_state_dict(metadata=metadata)
        merged = {}
        for part in model_sd.values():
            merged.update(part)
        sd = dict(model_sd)
        sd["optimizer"] = self.optimizer.sharded_state_dict(merged, is_loading=is_loading, metadata=metadata)
        return sd

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False, async_save: bool = False) -> None:
        """dist_checkpointing.save in the given distributed-optimizer format.

        async_save: megatron's async save (the write runs in a forked process), finalized before returning.
        """
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        sd = self.sharded_state_dict(fmt)
        strategy = get_default_save_sharded_strategy()
        if fully_parallel:
            strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True))
        if not async_save:
            dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=strategy, content_metadata=self.checkpoint_metadata(fmt))
            return
        import inspect

        if "async_sharded_save" not in inspect.signature(dist_checkpointing.save).parameters:
            from harness.errors import MissingDependency

            raise MissingDependency("async save needs megatron-core with dist_checkpointing.save(async_sharded_save=...)"
                                    " (0.10 or later)")
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        request = dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=strategy,
                                          content_metadata=self.checkpoint_metadata(fmt), async_sharded_save=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        """dist_checkpointing.load into this engine's layout (which may differ from the saving one)."""
        from megatron.core import dist_checkpointing

        self._init_optimizer_state()
        state = dist_checkpointing.load(self.sharded_state_dict(fmt, is_loading=True), ckpt_dir)
        for i, m in enumerate(self.models):
            m.module.load_state_dict(state["model" if len(self.models) == 1 else f"model{i}"])
        # no_grad: the dp_reshardable loader copies into views of parameters without it (0.16)
        with torch.no_grad(), _keep_torch_adam_step():
            self.optimizer.load_state_dict(state["optimizer"])
        # The non-TE/apex load gives every parameter the same 'step' tensor; torch Adam increments it
        # in place once per parameter, so bias corrections would use step + 1, step + 2, ...
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for st in opt.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()

    def _init_optimizer_state(self) -> None:
        """Empty Adam state to load into. megatron's init_state_fn creates no 'step', which the
        distributed optimizer's state_dict asserts on without TE / apex (megatron-core 0.16)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                              step=torch.tensor(0.0))


@contextlib.contextmanager
def _keep_torch_adam_step():
    """Without TE / apex the distributed optimizer wraps torch Adam, whose per-parameter 'step' no
    checkpoint carries: megatron's load_state_dict restores it from param_groups first, then the
    per-parameter loader copies every state key over it (megatron-core 0.16). fully_reshardable has
    no 'step' there (KeyError); dp_reshardable has the *load-time* step (a LocalNonpersistentObject,
    0 in a fresh engine), which silently reset Adam's step and its bias corrections. Either way the
    param_groups step is kept. Scoped to one load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from harness.adjustments import note

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            note("Adam step kept across the checkpoint load (megatron-core's per-parameter loader copies the "
                 "load-time step over the restored one: harness/engines/mcore.py _keep_torch_adam_step)")
            tensors = {**tensors, "step": state["step"].clone()}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
