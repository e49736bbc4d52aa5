"""Engines with planted regressions, given to suites by import path (--engine tests.faulty_engines:...)."""

from __future__ import annotations

from harness.engines.mcore import McoreEngine


class _DoneHandle:
    def wait(self):
        pass

    def is_completed(self):
        return True


class SkipOneTpGradReduce(McoreEngine):
    """Skips the first TP all-reduce of an input gradient (column-parallel dgrad) in the whole run."""

    def build(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import layers

        original = dist.all_reduce
        skipped = []

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            tp_group = ps.get_tensor_model_parallel_group()
            if not skipped and group is tp_group and dist.get_world_size(group) > 1:
                skipped.append(True)
                return _DoneHandle() if async_op else None
            return original(tensor, op=op, group=group, async_op=async_op)

        # megatron's linear layers call torch.distributed.all_reduce through the module attribute
        layers.torch.distributed.all_reduce = all_reduce
        super().build()
