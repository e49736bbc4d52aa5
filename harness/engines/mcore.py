"""The `mcore` engine: GPTModel + megatron DDP + Megatron optimizer, built directly from the case."""

from __future__ import annotations

import contextlib
import functools
import re
from typing import TYPE_CHECKING, Any

from harness.dtypes import DType, dtype
from harness.engines import data
from harness.engines.base import ParamShard, StepOutput, TokenLogprobs, partition_dim, tp_shard
from harness.engines.cp_data import zigzag_positions
from harness.engines.experts import EXPERT_RE, drop_routing_graphs, tp_coords
from harness.engines.logprob_head import LogprobHead
from harness.engines.lr_schedule import make_scheduler
from harness.engines.mcore_ckpt import McoreCheckpoints
from harness.engines.model_config import _full_init, in_params_dtype, layer_spec, transformer_config
from harness.engines.offloading import Offloading
from harness.engines.optimizer_offload import offload_config
from harness.engines.rl_cycle import RLCycle
from harness.engines.rl_steps import RLSteps
from harness.engines.weight_export import PerTensorExport
from harness.engines.wrap_config import WrapConfig, ddp_config_dict
from harness.launch.context import RankContext
from harness.platform.parallel import init_parallel_state
from harness.spec import Case
from harness.upstream import split_on_cp_rank

if TYPE_CHECKING:
    import torch

MEGATRON_ADAM_EPS = 1e-8  # OptimizerConfig's default
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_FC1_RE = re.compile(r"(\.mlp|\.local_experts\.\d+|\.shared_experts)\.linear_fc1\.weight$")


class McoreEngine(McoreCheckpoints, RLSteps, RLCycle, PerTensorExport):
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

    def offloading(self) -> Offloading:
        """The engine's offload part, made once."""
        if self._offloading is None:
            self._offloading = self.offload_part(self)
        return self._offloading

    def logprob_head(self) -> LogprobHead:
        """The engine's log-prob part, made once."""
        if self._logprob_head is None:
            self._logprob_head = self.logprob_part(self)
        return self._logprob_head

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
            from harness.adjustments import note

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

        from harness.platform.backend import cpu_share

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

    # -- steps --------------------------------------------------------------------------------
    # Steps whose per-token log-probs are captured (StepOutput.token_logprobs): the first step's forward
    # runs on identical weights on every layout, so a position error shows at the token it hits.
    logprob_steps: frozenset[int] = frozenset({0})

    def forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        output = self.token_losses(model, mb, rl="loss_fn" in mb, capture=self._captured is not None)
        mask = mb["loss_mask"].to(self.ctx.device) if "loss_mask" in mb else None
        loss = mb.get("loss_fn") or functools.partial(self.loss_func, loss_mask=mask)  # an RL step's own (rl_steps)
        if self._captured is not None and "samples" in mb:
            return output, functools.partial(self._capture_then_loss, mb, loss)
        return output, loss

    def token_losses(self, model, mb: dict, rl: bool, capture: bool):
        """A micro-batch's per-token loss ([b, s]; on a stage before the last, what it hands on): the model's own,
        given the labels; in an RL step, minus the log-probs the engine's log-prob head computes from the logits (the
        model called without labels, as RL frameworks call it), the entropy kept in `mb` where captured."""
        import torch
        from megatron.core.utils import get_attr_wrapped_model

        dev = self.ctx.device
        tokens, positions, labels = mb["tokens"].to(dev), mb["position_ids"].to(dev), mb["labels"].to(dev)
        if not rl:
            return model(tokens, positions, None, labels=labels)
        logits = model(tokens, positions, None)
        if not get_attr_wrapped_model(model, "post_process"):
            return logits
        head = self.logprob_head()
        if capture:
            with torch.no_grad():
                mb["entropy"] = head.entropy(logits.detach()).float().cpu()
        return -head.logprobs(logits, labels)

    def _capture_then_loss(self, mb, loss, output_tensor):
        """Keep the micro-batch's per-token log-probs (minus the per-token loss) and entropy, then the loss."""
        n = len(mb["samples"])
        entropy = mb.get("entropy")
        self._captured.append(TokenLogprobs(mb["samples"], mb["positions"],
                                            -output_tensor.detach().float().cpu().reshape(n, -1),
                                            None if entropy is None else entropy.reshape(n, -1)))
        return loss(output_tensor)

    @staticmethod
    def loss_func(output_tensor, loss_mask=None):
        """Sum of per-token losses and the token count (megatron normalises by the count), over the tokens the
        loss mask keeps (all without one)."""
        import torch

        losses = output_tensor.float()
        if loss_mask is None:
            loss_sum, count = losses.sum(), output_tensor.numel()
        else:
            mask = loss_mask.reshape(losses.shape).float()
            loss_sum, count = (losses * mask).sum(), mask.sum()
        num_tokens = torch.as_tensor(count, device=output_tensor.device).to(torch.int)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    def train_step(self, step: int) -> StepOutput:
        out = self._run_batch(step, forward_only=False, capture=step in self.logprob_steps)
        if out.skipped and self.ctx is not None:  # every suite's figures say so, whatever its payload keeps
            self.ctx.result.skipped_steps.append((step, out.grad_norm))
        return out

    def eval_step(self, step: int) -> StepOutput:
        """Forward only on the batch of `step` (no update), capturing every token's log-prob."""
        return self._run_batch(step, forward_only=True, capture=True)

    def _run_batch(self, step: int, forward_only: bool, capture: bool) -> StepOutput:
        import torch
        from megatron.core import parallel_state as ps

        dp_rank = ps.get_data_parallel_rank()
        mbs = data.microbatches(self.case, step, dp_rank)
        if self.case.layout.cp > 1:
            mbs = [split_on_cp_rank(dict(mb)) for mb in mbs]
        firsts = [data.first_sample(self.case, dp_rank, i) for i in range(len(mbs))]
        return self.run_microbatches(mbs, [torch.arange(f, f + mb["tokens"].shape[0]) for f, mb in zip(firsts, mbs)],
                                     forward_only, capture)

    def run_microbatches(self, mbs: list[dict], samples: list, forward_only: bool, capture: bool,
                         loss_fns: list | None = None) -> StepOutput:
        """One forward(-backward) over this rank's micro-batches (already split over CP; `samples`: each one's
        sample indices in the global batch), then the optimizer's step unless forward only. `loss_fns`: each
        micro-batch's own loss function (default: the per-token loss over its loss mask)."""
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cp = self.case.layout.cp
        for i, fn in enumerate(loss_fns or []):
            mbs[i]["loss_fn"] = fn
        self._captured = [] if capture else None
        if self._captured is not None:
            # Where each local token sits in the global batch, by the harness's own arithmetic (DP slice,
            # zigzag CP chunks) - not read back from megatron's split, which is under test. Added after
            # the split: megatron's CP split slices every key it is given.
            seq = self.case.model.seq_length
            positions = zigzag_positions(seq, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(seq)
            for mb, ids in zip(mbs, samples):
                mb["samples"], mb["positions"] = ids, positions
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
                micro_batch_size=max(int(mb["tokens"].shape[0]) for mb in mbs), forward_only=forward_only,
            )
        if self.config.num_moe_experts:
            drop_routing_graphs(self.models)
        reported: dict = {"aux_loss": self._take_aux_loss()}
        if not forward_only:
            lr = self.optimizer.param_groups[0]["lr"]
            updated, grad_norm, num_zeros = self.optimizer.step()
            if updated and self.scheduler is not None:  # megatron's train_step: by the global batch's samples
                self.scheduler.step(increment=self.case.global_batch_size)
            reported.update(grad_norm=None if grad_norm is None else float(grad_norm),
                            num_zeros=None if num_zeros is None else int(num_zeros), lr=float(lr),
                            skipped=not updated)
        captured, self._captured = self._captured, None
        if not losses:
            return StepOutput(None, None, captured, **reported)
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        return StepOutput(float(total[0]), int(total[1]), captured, **reported)

    def _take_aux_loss(self) -> float | None:
        """This rank's load-balancing loss of the batch just run, from megatron's MoE loss tracker, which is then
        zeroed (megatron's training loop zeroes it after logging). None for a dense model."""
        if not self.config.num_moe_experts:
            return None
        from megatron.core.transformer.moe import moe_utils

        entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        value = float(entry["values"].sum()) if entry else 0.0
        moe_utils.clear_aux_losses_tracker()
        return value

    # -- outputs ------------------------------------------------------------------------------
    def grad_buffer_params(self) -> list[list[tuple[str, int]]]:
        """Per chunk, the parameters that train (megatron's DDP must put each in a gradient buffer), in
        registration order."""
        return [[(name, p.numel()) for name, p in model.module.named_parameters() if p.requires_grad]
                for model in self.models]

    def param_shards(self) -> list[ParamShard]:
        out = []
        for model in self.models:
            for name, p in self.global_names(model.module).items():
                tp_rank, tp = tp_coords(name)
                dim = partition_dim(p)
                out.append(ParamShard(name, p.detach().float().cpu().clone(), dim, tp_rank, tp, self.tp_parts(name)))
        return out

