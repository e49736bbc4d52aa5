"""Planted checkpoint-contract bugs: each must make the ckpt-memory suite's reshard checks fail."""

from __future__ import annotations

import torch

from harness.engines.fsdp2 import FSDP2Engine
from harness.engines.mcore import McoreEngine


class LoadSkipsOptimizer(McoreEngine):
    """Loads the model but keeps the fresh optimizer state."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        from megatron.core import dist_checkpointing

        self._init_optimizer_state()
        state = dist_checkpointing.load(self.sharded_state_dict(fmt, is_loading=True), ckpt_dir)
        self.models[0].module.load_state_dict(state["model"])


class LoadCorruptsOneShard(McoreEngine):
    """TP rank 1's shard of the QKV weight is off after the load."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        super().load_checkpoint(ckpt_dir, fmt)
        from megatron.core import parallel_state as ps

        if ps.get_tensor_model_parallel_rank() == 1:
            with torch.no_grad():
                self.models[0].module.decoder.layers[0].self_attention.linear_qkv.weight.mul_(1.001)


class SavesDpReshardableAlways(McoreEngine):
    """Whatever format is asked for, the optimizer is saved dp_reshardable (the metadata still says the asked one)."""

    def sharded_state_dict(self, fmt: str, is_loading: bool = False) -> dict:
        return super().sharded_state_dict("dp_reshardable" if not is_loading else fmt, is_loading)


class SaveScalesOptimizerState(McoreEngine):
    """The save leaves the optimizer's first moment scaled (a side effect of the save path)."""

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False) -> None:
        super().save_checkpoint(ckpt_dir, fmt, fully_parallel)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for st in opt.optimizer.state.values():
                st["exp_avg"].mul_(1.5)


class FullStateDictDefault(FSDP2Engine):
    """R5: the FSDP2 save defaults to the full (gathered) state dict instead of the sharded one."""

    default_ckpt_format = "fsdp2_full"


class LoadResetsAdamStep(McoreEngine):
    """The load leaves torch Adam's per-parameter step at 0 (megatron-core 0.16.1's dp_reshardable load on
    CPU ranks did this: the step it copies is the load-time local one), so bias corrections restart."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        super().load_checkpoint(ckpt_dir, fmt)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for st in opt.optimizer.state.values():
                st["step"].zero_()


class LoadScalesOneDpShard(McoreEngine):
    """DP rank 1's shard of exp_avg_sq is 0.01% off after the load: too small for the next step to show."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        super().load_checkpoint(ckpt_dir, fmt)
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_rank() == 1:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                for st in opt.optimizer.state.values():
                    st["exp_avg_sq"].mul_(1.0001)


class DropsFullyParallelWrapper(McoreEngine):
    """The fully parallel save flag is accepted and ignored: DP rank 0 writes every replicated weight again."""

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False, async_save: bool = False) -> None:
        super().save_checkpoint(ckpt_dir, fmt, False, async_save)


class SavesFullLabelsSharded(FSDP2Engine):
    """Always saves the full (gathered) state dict, and labels the checkpoint with the format asked for."""

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False) -> None:
        super().save_checkpoint(ckpt_dir, "fsdp2_full", fully_parallel)

    @staticmethod
    def saved_metadata(ckpt_dir: str) -> dict:
        return {"format": "fsdp2_sharded"}


class DeletesMemrayCapture(McoreEngine):
    """Removes the rank's memray capture during the save: the heap peak can no longer be measured."""

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False, async_save: bool = False) -> None:
        import glob
        import os

        import torch.distributed as dist

        from harness.probes.memory import captures_dir

        super().save_checkpoint(ckpt_dir, fmt, fully_parallel, async_save)
        for path in glob.glob(str(captures_dir(self.case) / f"memray-save-rank{dist.get_rank()}.bin")):
            os.unlink(path)


class BuildFailsOffTp1(McoreEngine):
    """Cannot even build at TP > 1: a contract target it does not promise must not count as refused."""

    def build(self) -> None:
        if self.case.layout.tp > 1:
            raise RuntimeError(f"this engine cannot build at {self.case.layout.id}")
        super().build()


class NoOptimizerStateShards(McoreEngine):
    """Does not report its optimizer state: the Adam state after a load cannot be compared."""

    optimizer_state_shards = None


_POOL: list = []  # what the first save of a process keeps, as torch's pinned host pool keeps its blocks
ONE_TIME_MIB = 48


class OneTimeCostOnFirstSave(McoreEngine):
    """The first save in a rank process allocates 48 MiB that it keeps for the process's later saves (the
    shape of a GPU save's pinned host blocks, a writer's manager, a lazy import): a one-time cost that must
    land in no case's peak, whichever case runs first. Each payment is written down (HARNESS_ONE_TIME_LOG)."""

    def save_checkpoint(self, ckpt_dir: str, fmt: str, fully_parallel: bool = False, async_save: bool = False) -> None:
        import os

        if not _POOL:
            _POOL.append(bytearray(ONE_TIME_MIB * 2**20))  # zero-filled: memray sees the allocation
            with open(os.environ["HARNESS_ONE_TIME_LOG"], "a") as f:
                f.write(f"{os.getpid()}\n")
        super().save_checkpoint(ckpt_dir, fmt, fully_parallel, async_save)


class LoadLeavesExpertOptimizerFresh(McoreEngine):
    """At EP > 1 the load restores the dense optimizer but leaves the expert optimizer's Adam moments as they
    were before it (zero): a resume that handles the ChainedOptimizer's first sub-optimizer only."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        super().load_checkpoint(ckpt_dir, fmt)
        chained = getattr(self.optimizer, "chained_optimizers", [])
        for opt in chained[1:]:
            for st in opt.optimizer.state.values():
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()


class LoadKeepsASecondCopyOfTheOptimizerState(McoreEngine):
    """The load materialises the optimizer state twice (Megatron-Bridge PR #4936's shape, on the host): a copy of
    every fp32 master parameter and Adam moment it loads into is made before the read and held through it."""

    def _init_optimizer_state(self) -> None:
        super()._init_optimizer_state()
        self._second_copy = [
            t.detach().clone() for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            for group in opt.optimizer.param_groups for p in group["params"]
            for t in (p, *opt.optimizer.state.get(p, {}).values()) if isinstance(t, torch.Tensor) and t.numel() > 1]


class LoadZeroesTheLearningRate(McoreEngine):
    """The load leaves the learning rate at 0 (a scheduler state restored empty, say): every value it loads is the
    saved one, and the next step updates nothing."""

    def load_checkpoint(self, ckpt_dir: str, fmt: str) -> None:
        super().load_checkpoint(ckpt_dir, fmt)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.optimizer.param_groups:
                group["lr"] = 0.0
