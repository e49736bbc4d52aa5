"""The `fsdp2` engine: the same GPTModel, sharded with torch's `fully_shard` (FSDP2) over all ranks,
trained with torch Adam, and checkpointed either as a sharded state dict (torch.distributed.checkpoint,
every rank writes its shard) or as a full state dict (gathered, written by rank 0) - regression R5.

Only pure-DP layouts (TP = PP = CP = 1): FSDP shards over the data-parallel ranks. megatron's parallel
state is still initialised (the model's layers read it) with TP = 1.
"""

from __future__ import annotations

import os

import torch

from harness.engines import data
from harness.engines.base import StepOutput
from harness.engines.mcore import McoreEngine
from harness.errors import BadInput

FORMATS = ("fsdp2_sharded", "fsdp2_full")


class FSDP2Engine(McoreEngine):
    default_ckpt_format = "fsdp2_sharded"  # what "fsdp2_default" saves

    def build(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        lay = self.case.layout
        if (lay.tp, lay.pp, lay.cp, lay.vpp) != (1, 1, 1, 1):
            raise BadInput(f"engine fsdp2 shards over data parallel only: layout {lay.id} must be tp1-pp1-cp1-dpN")
        self.setup_parallel()
        (chunk,) = self.build_chunks()
        mesh = init_device_mesh("cpu" if self.ctx.on_cpu else "cuda", (lay.dp,))
        for layer in chunk.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(chunk, mesh=mesh)
        self.model = chunk
        self.optimizer = torch.optim.Adam(chunk.parameters(), lr=self.case.options.lr)

    def train_step(self, step: int) -> StepOutput:
        from megatron.core import parallel_state as ps

        mbs = data.microbatches(self.case, step, ps.get_data_parallel_rank())
        dev = self.ctx.device
        loss_sum, tokens = 0.0, 0
        for mb in mbs:
            out = self.model(mb["tokens"].to(dev), mb["position_ids"].to(dev), None, labels=mb["labels"].to(dev))
            loss = out.float().mean() / len(mbs)
            loss.backward()
            loss_sum += float(out.detach().float().sum())
            tokens += out.numel()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepOutput(loss_sum, tokens)

    def resolve_format(self, fmt: str) -> str:
        fmt = self.default_ckpt_format if fmt == "fsdp2_default" else fmt
        if fmt not in FORMATS:
            raise BadInput(f"engine fsdp2 saves {', '.join(FORMATS)} (or fsdp2_default), not {fmt!r}")
        return fmt

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False) -> None:
        """Sharded: DCP, every rank writes its shard. Full: gathered to rank 0 (CPU), torch.save there."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self.resolve_format(fmt) == "fsdp2_sharded":
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
            return
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if dist.get_rank() == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(ckpt_dir, "full_state_dict.pt"))
        dist.barrier()

    @staticmethod
    def saved_metadata(ckpt_dir: str) -> dict:
        """What the checkpoint on disk is: a DCP directory (sharded) or one full state dict file."""
        if os.path.exists(os.path.join(ckpt_dir, ".metadata")):
            return {"format": "fsdp2_sharded"}
        if os.path.exists(os.path.join(ckpt_dir, "full_state_dict.pt")):
            return {"format": "fsdp2_full"}
        return {"format": "?"}
