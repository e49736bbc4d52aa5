"""The `fsdp2` engine: the same GPTModel, sharded with torch's `fully_shard` (FSDP2) over all ranks,
trained with torch Adam (gradient norm clipped at the case's clip_grad), and checkpointed either as a sharded
state dict (torch.distributed.checkpoint, every rank writes its shard) or as a full state dict (gathered,
written by rank 0) - regression R5. It loads both, which the golden suite's resume cases judge.

Only pure-DP layouts (TP = PP = CP = 1): FSDP shards over the data-parallel ranks. megatron's parallel
state is still initialised (the model's layers read it) with TP = 1.
"""

from __future__ import annotations

import os
from typing import Any

from harness.ckpt_formats import CkptFormat
from harness.dtypes import DType, dtype
from harness.engines import data
from harness.engines.base import ParamShard, StepOutput, TokenLogprobs
from harness.engines.experts import drop_routing_graphs
from harness.engines.hf_weights import hf_state_dict
from harness.engines.lr_schedule import SCHEDULER_KEY, make_scheduler, saved_schedule
from harness.engines.mcore import McoreEngine
from harness.engines.mcore_steps import captured
from harness.engines.policy_loss import PolicyStats
from harness.engines.weight_export import expert_biases
from harness.errors import BadInput
from harness.spec import Layout, ModelSpec

FORMATS = ("fsdp2_sharded", "fsdp2_full")


class FSDP2Engine(McoreEngine):
    default_ckpt_format = "fsdp2_sharded"  # what "fsdp2_default" saves
    mtp_probe = None  # type: ignore[assignment]  # its gradients are FSDP2's, not megatron's buffers: no ProbesMTP

    @staticmethod
    def refusal(model: ModelSpec, layout: Layout) -> str | None:
        """fully_shard over one data-parallel mesh: no TP, PP, CP, and no expert grid (experts that differ between
        EP ranks would be sharded as if replicated)."""
        if (layout.tp, layout.pp, layout.cp, layout.vpp, layout.ep, layout.expert_tp) != (1, 1, 1, 1, 1, 1):
            return f"engine fsdp2 shards over data parallel only: layout {layout.id} must be tp1-pp1-cp1-dpN"
        return None

    def build(self) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        lay = self.case.layout
        why = self.refusal(self.case.model, lay)
        if why:
            raise BadInput(why)
        self.setup_parallel()
        mp, built_in = MixedPrecisionPolicy(), None
        if self.case.options.dtype != DType.fp32:
            # FSDP2's mixed precision, as it trains in bf16: fp32 parameters sharded (the optimizer's master
            # weights), gathered in the case's dtype for forward and backward, gradients reduced in fp32. (A model
            # built in bf16 keeps some fp32 parameters, and fully_shard refuses mixed dtypes: "FSDP expects
            # uniform original parameter dtype".)
            built_in = "fp32"
            mp = MixedPrecisionPolicy(param_dtype=dtype(self.case.options.dtype).torch, reduce_dtype=torch.float32)
        (chunk,) = self.build_chunks(built_in)
        mesh = init_device_mesh("cpu" if self.ctx.on_cpu else "cuda", (lay.dp,))
        for layer in chunk.decoder.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(chunk, mesh=mesh, mp_policy=mp)
        self.model = chunk
        self.optimizer = torch.optim.Adam(chunk.parameters(), lr=self.case.options.lr, eps=self.case.options.adam_eps)
        self.scheduler = make_scheduler(self.optimizer, self.case.options, self.case.global_batch_size)

    def train_step(self, step: int) -> StepOutput:
        from megatron.core import parallel_state as ps

        mbs = data.microbatches(self.case, step, ps.get_data_parallel_rank())
        dev = self.ctx.device
        self._aux_loss_over(len(mbs))
        loss_sum, tokens = 0.0, 0
        for mb in mbs:
            out = self.model(mb["tokens"].to(dev), mb["position_ids"].to(dev), None, labels=mb["labels"].to(dev))
            loss = out.float().mean() / len(mbs)
            loss.backward()
            loss_sum += float(out.detach().float().sum())
            tokens += out.numel()
        if self.config.num_moe_experts:
            drop_routing_graphs([self.model])  # FSDP's post-backward hooks close the same cycle as DDP's
        return StepOutput(loss_sum, tokens, **self._optimizer_step())

    def _aux_loss_over(self, num_microbatches: int) -> None:
        """As megatron's schedule does every step: the load-balancing loss's gradient is a mean over the micro-batches,
        like the loss's, and not whatever scale an earlier case in this rank left."""
        if not self.config.num_moe_experts:
            return
        import torch
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=self.ctx.device) / num_microbatches)

    def _optimizer_step(self) -> dict[str, Any]:
        """Clip, count, step the optimizer and the schedule: what megatron's optimizer step reports (StepOutput's
        grad_norm, num_zeros and the lr it applied)."""
        grad_norm, num_zeros = self._clip_and_count()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step(increment=self.case.global_batch_size)
        return {"grad_norm": grad_norm, "num_zeros": num_zeros, "lr": lr}

    def run_microbatches(self, mbs: list[dict], samples: list, forward_only: bool, capture: bool,
                         loss_fns: list | None = None, update: bool = True) -> StepOutput:
        """The RL steps' loop (rl_steps.py) without megatron's schedule: each micro-batch's loss as its function
        hands it over (to_schedule), backward, then the clipped optimizer step unless forward only or not to
        `update`."""
        import contextlib

        import torch

        self._aux_loss_over(len(mbs))
        kept: list[TokenLogprobs] = []
        reported, policy = [], []
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            for i, mb in enumerate(mbs):
                out = self.token_losses(self.model, mb, rl=loss_fns is not None or "head" in mb, capture=capture)
                if capture:
                    kept.append(captured(mb, samples[i], torch.arange(out.shape[1]), out))
                loss, report = loss_fns[i](out) if loss_fns else (out.float().mean() / len(mbs), None)
                if not forward_only:
                    loss.backward()
                if report is not None:
                    reported.append(report["lm loss"])
                    policy += [report["policy"]] if "policy" in report else []
        if self.config.num_moe_experts:
            drop_routing_graphs([self.model])
        stepped = not forward_only and update
        step: dict = {"aux_loss": self._take_aux_loss(), **(self._optimizer_step() if stepped else {})}
        total = torch.stack(reported).sum(0) if reported else None
        return StepOutput(None if total is None else float(total[0]), None if total is None else int(total[1]),
                          kept if capture else None, **step, policy=PolicyStats.of(policy) if policy else None)

    def to_schedule(self, share, num_microbatches: int):
        """FSDP2 averages gradients over the DP ranks; no schedule divides by the micro-batches."""
        from megatron.core import parallel_state as ps

        return share * ps.get_data_parallel_world_size()

    def _clip_and_count(self) -> tuple[float, int | None]:
        """The global gradient norm before clipping (clipped at clip_grad; 0: not clipped) and, where the case
        logs it, the number of zero gradient elements - what megatron's optimizer step reports."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.case.options.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if not self.case.options.log_num_zeros_in_grad:
            return float(norm), None
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        zeros = torch.tensor([sum(int((g == 0).sum()) for g in local)], dtype=torch.float64, device=norm.device)
        dist.all_reduce(zeros)
        return float(norm), int(zeros.item())

    def resolve_format(self, fmt: str) -> str:
        fmt = self.default_ckpt_format if fmt == CkptFormat.FSDP2_DEFAULT else fmt
        if fmt not in FORMATS:
            raise BadInput(f"engine fsdp2 saves {', '.join(FORMATS)} (or fsdp2_default), not {fmt!r}")
        return fmt

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False,
                        async_save: bool = False) -> None:
        """Sharded: DCP, every rank writes its shard. Full: gathered to rank 0 (CPU), torch.save there."""
        if async_save:
            raise BadInput("engine fsdp2 saves synchronously: its formats have no --async-save")
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        schedule = {SCHEDULER_KEY: self.scheduler.state_dict()} if self.scheduler is not None else {}
        if self.resolve_format(fmt) == CkptFormat.FSDP2_SHARDED:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd, **schedule}, checkpoint_id=ckpt_dir)
            return
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if dist.get_rank() == 0:
            torch.save({"model": model_sd, "optim": optim_sd, **schedule}, os.path.join(ckpt_dir, "full_state_dict.pt"))
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        """Either format into this engine's (fresh) model and optimizer: model weights, Adam moments and step."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        if self.resolve_format(fmt) == CkptFormat.FSDP2_SHARDED:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # initialises the Adam state to fill
            state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
            if self.scheduler is not None:
                state[SCHEDULER_KEY] = self.scheduler.state_dict()  # filled in place by the load
            dcp.load(state, checkpoint_id=ckpt_dir)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            # every rank reads the one file and keeps its shard (torch's broadcast_from_rank0 hangs on gloo, 2.13)
            state = torch.load(os.path.join(ckpt_dir, "full_state_dict.pt"), weights_only=False)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=StateDictOptions(full_state_dict=True))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved_schedule(state, ckpt_dir))

    def param_shards(self) -> list[ParamShard]:
        """Every parameter whole (gathered from its FSDP shards), under its global name, from every rank."""
        from torch.distributed.tensor import DTensor

        out = []
        for name, p in self.global_names(self.model).items():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out.append(ParamShard(name, full.detach().float().cpu().clone(), None, 0, 1))
        return out

    def export_chunks(self) -> list:
        return [self.model]

    def hf_weight_stream(self):
        """Every weight whole under its HF name, one at a time, on every rank: each parameter gathered from its FSDP
        shards (DTensor.full_tensor, collective), as FSDP frameworks refit."""
        import torch
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        named = {**self.global_names(self.model), **expert_biases(self.model)}
        for name, p in named.items():
            with torch.no_grad():
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if isinstance(full, AsyncCollectiveTensor):  # the gather waited for, its work let go of
                full = full.wait()
            yield from hf_state_dict({name: full}, self.case.model).items()

    def optimizer_state_shards(self) -> list[ParamShard]:
        """torch Adam's state (exp_avg, exp_avg_sq gathered whole; step) per global name, from rank 0 only."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        out = []
        for name, p in self.global_names(self.model).items():
            state = self.optimizer.state.get(p, {})
            for key in self.OPTIMIZER_STATE_KEYS:
                value = state.get(key)
                if key == "step":
                    step = float(value) if value is not None else float("-inf")
                    out.append(ParamShard(f"{name}#step", torch.tensor([step]), None, 0, 1))
                    continue
                if value is None:  # every rank alike: no state before the first step
                    full = torch.zeros(p.shape)
                else:
                    full = value.full_tensor() if isinstance(value, DTensor) else value
                out.append(ParamShard(f"{name}#{key}", full.detach().float().cpu().clone(), None, 0, 1))
        return out if dist.get_rank() == 0 else []

    @staticmethod
    def saved_metadata(ckpt_dir: str) -> dict:
        """What the checkpoint on disk is: a DCP directory (sharded) or one full state dict file."""
        if os.path.exists(os.path.join(ckpt_dir, ".metadata")):
            return {"format": "fsdp2_sharded"}
        if os.path.exists(os.path.join(ckpt_dir, "full_state_dict.pt")):
            return {"format": "fsdp2_full"}
        return {"format": "?"}
