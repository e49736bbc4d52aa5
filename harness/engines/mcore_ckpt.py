"""Checkpoint I/O of the mcore engine: Adam state shards, sharded state dict, dist_checkpointing save / load."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from harness.adjustments import note
from harness.ckpt_formats import CkptFormat
from harness.engines.base import ParamShard, partition_dim
from harness.engines.experts import data_parallel, tp_coords
from harness.engines.lr_schedule import SCHEDULER_KEY, saved_schedule
from harness.errors import MissingDependency
from harness.upstream import async_save_kwargs, can_save_async

if TYPE_CHECKING:
    import torch


class McoreCheckpoints:
    """McoreEngine's checkpoint methods (a mixin: uses the engine's models, optimizer and global names)."""

    models: list
    optimizer: Any
    scheduler: Any  # megatron's OptimizerParamScheduler, or None
    global_names: Callable[[Any], dict[str, torch.nn.Parameter]]  # McoreEngine's
    tp_parts: Callable[[str], int]

    default_ckpt_format = "dp_reshardable"  # what a save uses when the user names no format
    OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")

    def optimizer_state_shards(self) -> list[ParamShard]:
        """Adam state as `<global name>#<key>` shards (TP-local, whole over DP), from DP rank 0 only (an expert's from
        expert-DP rank 0).

        The distributed optimizer holds a flat range of each parameter per DP x CP rank; the ranges are
        disjoint, so summing zero-filled copies over that group rebuilds every element exactly."""
        import torch
        import torch.distributed as dist

        owner: dict[torch.nn.Parameter, tuple] = {}  # model param -> (its Adam state, flat range or None: all)
        distributed = False
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            index = getattr(opt, "model_param_group_index_map", None)
            if index is None:  # not distributed: the optimizer steps the fp32 model parameters themselves, and
                # for bf16 / fp16 ones (Float16OptimizerWithFloat16Params) their fp32 main copies
                for g in opt.optimizer.param_groups:
                    for p in g["params"]:
                        owner[p] = (adam_state(opt.optimizer, p, g), None)
                # megatron makes one float16 / fp32-main group per param group of the inner optimizer, in order
                for model_group, main_group, g in zip(getattr(opt, "float16_groups", []),
                                                      getattr(opt, "fp32_from_float16_groups", []),
                                                      opt.optimizer.param_groups):
                    for p, main in zip(model_group, main_group):
                        owner[p] = (adam_state(opt.optimizer, main, g), None)
                continue
            distributed = True  # a parameter held wholly by other DP ranks is not in this rank's index
            for p, (group, order) in index.items():
                main = opt.optimizer.param_groups[group]["params"][order]
                rng = opt._get_model_param_range_map(p)["param"]
                owner[p] = (adam_state(opt.optimizer, main, opt.optimizer.param_groups[group]), (rng.start, rng.end))
        out = []
        for model in self.models:
            for name, p in self.global_names(model.module).items():
                state, rng = owner.get(p, ({}, (0, 0)))
                dim = partition_dim(p)
                tp_rank, tp = tp_coords(name)
                # an expert's state is sharded over the expert data-parallel ranks, and reported by the first of
                # them (dense DP rank 0 holds only its own EP rank's experts)
                group, dp_rank = data_parallel(p)
                mine: list[ParamShard] = []
                for key in self.OPTIMIZER_STATE_KEYS:
                    if key == "step":  # one scalar, the same on every DP rank holding a piece of the parameter
                        value = state["step"].detach().float().reshape(1).to(p.device, copy=True) if "step" in state \
                            else torch.full((1,), float("-inf"), device=p.device)
                        if distributed:
                            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
                        mine.append(ParamShard(f"{name}#step", value.cpu(), None, tp_rank, tp))
                        continue
                    full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)  # NCCL needs the device
                    if key in state:
                        lo, hi = rng or (0, p.numel())
                        full[lo:hi] = state[key].detach().float().reshape(-1)
                    if distributed:  # every rank, every parameter: the same collectives in the same order
                        dist.all_reduce(full, group=group)
                    mine.append(ParamShard(f"{name}#{key}", full.cpu().view(p.shape), dim, tp_rank, tp,
                                           self.tp_parts(name)))
                if dp_rank == 0:
                    out += mine
        return out

    def checkpoint_metadata(self, fmt: str) -> dict:
        if fmt == CkptFormat.DEFAULT:
            fmt = self.default_ckpt_format
        sharding = "fully_reshardable" if fmt.startswith("fully_reshardable") else fmt
        # chained_optim_avoid_prefix as megatron's training loop sets it (training/checkpointing.py): a model-space
        # (fully reshardable) state of a ChainedOptimizer - an MoE model's dense and expert optimizers at EP > 1 -
        # is keyed by parameter alone, not chained_<i>., so it loads where one optimizer holds the experts (EP 1)
        return {"distrib_optim_sharding_type": sharding,
                "distrib_optim_fully_reshardable_mem_efficient": fmt == CkptFormat.FULLY_RESHARDABLE_MEM_EFFICIENT,
                "chained_optim_avoid_prefix": True}

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
        if self.scheduler is not None:  # common state, as megatron's save_checkpoint writes it
            sd[SCHEDULER_KEY] = self.scheduler.state_dict()
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
            strategy = FullyParallelSaveStrategyWrapper(strategy,
                                                        ps.get_data_parallel_group(with_context_parallel=True))
        if not async_save:
            dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=strategy,
                                    content_metadata=self.checkpoint_metadata(fmt))
            return

        if not can_save_async():
            raise MissingDependency("async save needs megatron-core with "
                                    "dist_checkpointing.save(async_sharded_save=...) (0.10 or later)")
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
        request = dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=strategy,
                                          content_metadata=self.checkpoint_metadata(fmt), **async_save_kwargs())
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        """dist_checkpointing.load into this engine's layout (which may differ from the saving one)."""
        import torch
        from megatron.core import dist_checkpointing

        self._init_optimizer_state()
        state = dist_checkpointing.load(self.sharded_state_dict(fmt, is_loading=True), ckpt_dir)
        for i, m in enumerate(self.models):
            m.module.load_state_dict(state["model" if len(self.models) == 1 else f"model{i}"])
        # no_grad: the dp_reshardable loader copies into views of parameters without it (0.16)
        with torch.no_grad(), _keep_torch_adam_step():
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:  # after the optimizer, as megatron's load_checkpoint restores them
            self.scheduler.load_state_dict(saved_schedule(state, ckpt_dir))
        # The non-TE/apex load gives every parameter the same 'step' tensor; torch Adam increments it
        # in place once per parameter, so bias corrections would use step + 1, step + 2, ...
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for st in opt.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()

    def _init_optimizer_state(self) -> None:
        """Empty Adam state to load into. megatron's init_state_fn creates no 'step', which the
        distributed optimizer's state_dict asserts on without TE / apex (megatron-core 0.16). With TE's or apex's
        FusedAdam megatron allocates the state at the load itself (their step lives in the param groups), and the
        optimizer CPU offload's HybridDeviceOptimizer gets its state from megatron's own dummy step, as megatron's
        load does where its state is empty: a state filled here lacked the fp32 master copies its load reads."""
        import torch
        from megatron.core.optimizer import distrib_optimizer
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            if isinstance(inner, HybridDeviceOptimizer):
                if not inner.state:
                    inner.dummy_step()
                continue
            if distrib_optimizer.HAVE_APEX_OR_TE:
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                              step=torch.tensor(0.0))


@contextlib.contextmanager
def _keep_torch_adam_step() -> Iterator[None]:
    """Without TE / apex the distributed optimizer wraps torch Adam, whose per-parameter 'step' no
    checkpoint carries: megatron's load_state_dict restores it from param_groups first, then the
    per-parameter loader copies every state key over it (megatron-core 0.16). fully_reshardable has
    no 'step' there (KeyError); dp_reshardable has the *load-time* step (a LocalNonpersistentObject,
    0 in a fresh engine), which silently reset Adam's step and its bias corrections. Either way the
    param_groups step is kept. Scoped to one load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            note("Adam step kept across the checkpoint load (megatron-core's per-parameter loader copies the "
                 "load-time step over the restored one: harness/engines/mcore_ckpt.py _keep_torch_adam_step)")
            tensors = {**tensors, "step": state["step"].clone()}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def adam_state(inner: Any, param: Any, group: dict) -> dict:
    """One parameter's Adam state with its step, wherever the optimizer keeps it: torch's Adam per parameter,
    Transformer Engine's and apex's FusedAdam in the parameter's group (where megatron's distributed optimizer
    reads it for them too); without a step anywhere (no step taken) as it is."""
    import torch

    state = inner.state.get(param, {})
    if "step" in state or "step" not in group:
        return state
    return {**state, "step": torch.tensor(float(group["step"]))}
