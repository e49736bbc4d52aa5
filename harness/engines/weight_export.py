"""A trained model's weights streamed to a rollout engine under Hugging Face names, in buckets (the refit suite).

After every training step an RL framework hands the policy to its rollout engine (vLLM, SGLang): a generator of
(HF name, full tensor) pairs, collective over the ranks, that gathers each parameter over TP / PP / EP / ETP and
converts it to HF layout, cut into buckets of a byte budget that the rollout engine loads one at a time.

`buckets` is how frameworks cut a stream; `PerTensorExport` is McoreEngine's stream, a framework's own per-tensor
generator (as verl's and slime's): each parameter in turn is broadcast from its pipeline stage, gathered over TP (an
expert's over ETP, then its EP ranks' experts), and mapped to HF names by the harness's arithmetic
(harness/engines/hf_weights.py). One parameter is built at a time, so a rank's extra memory is a bucket plus the
largest parameter's gathered pieces. The bridges' engines stream through their bridge's own export instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.backends import Backend
from harness.engines.base import ParamShard, partition_dim, tp_unshard
from harness.engines.experts import EXPERT_RE
from harness.engines.hf_weights import hf_state_dict
from harness.engines.model_config import grouped_experts

if TYPE_CHECKING:
    import torch

    from harness.spec import ModelSpec

Stream = Iterator[tuple[str, "torch.Tensor"]]
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(stream: Stream, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream cut into buckets of at most bucket_bytes (a tensor larger than that alone in its own), in
    order; a bucket is let go of once yielded."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in stream:
        n = tensor_bytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


@dataclass(frozen=True)
class _Entry:
    """A parameter (or the router's expert bias) of a rank, under a name every EP rank shares (its local expert
    index) and what rebuilding the full tensor takes."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    dim: int | None  # the TP (an expert's ETP) partition dim; None: replicated
    parts: int  # blocks along dim, each sharded (SwiGLU fc1)
    expert: int | None  # the local expert index of a routed expert's weight


def export_refusal(model: ModelSpec, backend: Backend) -> str | None:
    """The harness's exporter knows megatron's SequentialMLP experts (`local_experts.N.`); GPU ranks with
    Transformer Engine build grouped-GEMM experts (`experts.linear_fc1.weightN`), which it does not gather."""

    if model.moe and grouped_experts(on_cpu=backend != Backend.NCCL):
        return ("the harness's own exporter gathers megatron's SequentialMLP experts only, and ranks with "
                "Transformer Engine build grouped-GEMM experts: run the MoE model with --engine megatron-bridge, "
                "or your engine's exporter")
    return None


class PerTensorExport:
    """Mixin of McoreEngine: `hf_weight_stream` (every rank yields every tensor, once) and `export_buckets`
    (the `ExportsWeights` protocol)."""

    case: Any
    ctx: Any
    models: list

    def global_names(self, chunk) -> dict[str, Any]:
        raise NotImplementedError  # McoreEngine's

    def tp_parts(self, name: str) -> int:
        raise NotImplementedError  # McoreEngine's

    export_refusal = staticmethod(export_refusal)

    def export_chunks(self) -> list:
        """The unwrapped model chunks whose weights are exported, in order."""
        return [m.module for m in self.models]

    def export_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The HF-named weights in buckets of at most bucket_bytes (collective: every rank iterates to the end)."""
        return buckets(self.hf_weight_stream(), bucket_bytes)

    def hf_weight_stream(self) -> Stream:
        """Every weight under its HF name, full, on every rank; one megatron parameter gathered at a time."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        local = self._local_entries()
        pp_group = ps.get_pipeline_model_parallel_group()
        per_stage: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(per_stage, [e for e, _ in local], group=pp_group)
        mine = ps.get_pipeline_model_parallel_rank()
        sent: set[str] = set()
        for stage, entries in enumerate(per_stage):
            for i, e in enumerate(entries):
                if e.name in sent:  # a tied embedding's copy on the last stage
                    continue
                sent.add(e.name)
                t = local[i][1] if stage == mine else torch.empty(e.shape, dtype=e.dtype, device=self.ctx.device)
                dist.broadcast(t, dist.get_global_rank(pp_group, stage), group=pp_group)
                yield from self._full(e, t).items()

    def _full(self, e: _Entry, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors of one entry from this rank's shard: gathered over TP (an expert's over ETP, then its EP
        ranks' copies of the same local expert, which are other experts)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_expert_tensor_parallel_group() if e.expert is not None else \
            ps.get_tensor_model_parallel_group()
        full = self._gather(shard, e, group) if e.dim is not None and dist.get_world_size(group) > 1 else shard
        if e.expert is None:
            return hf_state_dict({e.name: full}, self.case.model)
        ep_group = ps.get_expert_model_parallel_group()
        ep = dist.get_world_size(ep_group)
        experts = [full] if ep == 1 else _all_gather(full, ep_group)
        per_rank = self.case.model.num_experts // ep
        out: dict[str, torch.Tensor] = {}
        for r, t in enumerate(experts):
            name = _with_expert(e.name, r * per_rank + e.expert)
            out.update(hf_state_dict({name: t}, self.case.model))
        return out

    def _gather(self, shard: torch.Tensor, e: _Entry, group) -> torch.Tensor:
        """The full tensor of a TP (ETP) shard."""
        assert e.dim is not None
        return tp_unshard(_all_gather(shard, group), e.dim, e.parts)

    def _local_entries(self) -> list[tuple[_Entry, torch.Tensor]]:
        """This rank's parameters and routers' expert biases, in its chunks' order, with an expert under its local
        index (the same name on every EP rank)."""
        from megatron.core import parallel_state as ps

        out = []
        for chunk in self.export_chunks():
            named = dict(self.global_names(chunk))
            named.update(expert_biases(chunk))
            local_experts = (self.case.model.num_experts // ps.get_expert_model_parallel_world_size()
                             if self.case.model.moe else 1)
            for name, p in named.items():
                m = EXPERT_RE.search(name)
                expert = int(m.group(1)) % local_experts if m else None
                key = _with_expert(name, expert) if expert is not None else name
                dim = partition_dim(p)
                t = p.detach()
                out.append((_Entry(key, tuple(t.shape), t.dtype, dim, self.tp_parts(name), expert), t))
        return out


def expert_biases(chunk) -> dict[str, torch.Tensor]:
    """The routers' expert biases of a chunk (aux-loss-free balancing; buffers, not parameters) under global layer
    indices."""
    layers = chunk.decoder.layers
    out = {}
    for name, b in chunk.named_buffers():
        m = _LAYER_RE.match(name)
        if m and name.endswith(".mlp.router.expert_bias") and b is not None:
            out[f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}." + name[m.end():]] = b
    return out


def export_reference(engine: Any) -> list[ParamShard]:
    """What an export must equal: the engine's parameter shards and, for the harness's exporter, the routers' expert
    biases of its chunks as replicated shards."""
    biases = [ParamShard(name, b.detach().float().cpu().clone(), None, 0, 1)
              for chunk in engine.export_chunks() for name, b in expert_biases(chunk).items()] \
        if isinstance(engine, PerTensorExport) else []
    return engine.param_shards() + biases


def _with_expert(name: str, index: int) -> str:
    m = EXPERT_RE.search(name)
    assert m is not None
    return name[:m.start()] + f".mlp.experts.local_experts.{index}." + name[m.end():]


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts
