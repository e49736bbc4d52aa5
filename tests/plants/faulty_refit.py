"""Weight exporters with planted refit regressions, each one seen in 2026's RL frameworks (the refit suite)."""

from __future__ import annotations

import re

from harness.engines.mcore import McoreEngine
from harness.engines.weight_export import buckets

_EXPERT_LAYER = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.")


class ExpertBucketNeverYielded(McoreEngine):
    """SkyRL #1471: a layer's experts are one export task whose tensors are accumulated and yielded together; where a
    bucket ends inside the task, the bucket it started in yields none of them (never synced)."""

    def export_buckets(self, bucket_bytes: int):
        pending = None
        for bucket in buckets(self.hf_weight_stream(), bucket_bytes):
            if pending is not None:
                started = {m.group(1) for name, _ in pending if (m := _EXPERT_LAYER.match(name))}
                spans = {m.group(1) for name, _ in bucket if (m := _EXPERT_LAYER.match(name))} & started
                yield [(n, t) for n, t in pending if not ((m := _EXPERT_LAYER.match(n)) and m.group(1) in spans)]
            pending = bucket
        if pending is not None:
            yield pending


class ETPLocalShard(McoreEngine):
    """slime #2307: at ETP 2 an expert's weight is sent as this rank's shard (256 of 512 rows), not gathered."""

    def _gather(self, shard, e, group):
        return shard if e.expert is not None else super()._gather(shard, e, group)


class DropsExpertBias(McoreEngine):
    """SkyRL #1505, Model-Optimizer #1305: the router's expert_bias (a buffer, not a parameter) left out of the
    export, so the rollout routes without aux-loss-free balancing's bias."""

    def _local_entries(self):
        return [(e, t) for e, t in super()._local_entries() if not e.name.endswith(".router.expert_bias")]


class FusedExpertsBuiltWhole(McoreEngine):
    """verl #6691: each layer's experts gathered into one fused tensor (the grouped-GEMM layout, all experts at once)
    and cut from it, where the export can stream expert by expert."""

    def _full(self, e, shard):
        import torch

        out = super()._full(e, shard)
        if e.expert is None:
            return out
        fused = torch.cat([t.unsqueeze(0) for t in out.values()])  # [experts and parts, rows, cols]
        return {name: fused[i].clone() for i, name in enumerate(out)}


class KeepsBucketsAlive(McoreEngine):
    """An exporter that keeps every bucket it yielded (a send queue never drained), so each refit holds the model
    again."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list = []

    def export_buckets(self, bucket_bytes: int):
        for bucket in super().export_buckets(bucket_bytes):
            self.sent.append(bucket)
            yield bucket


class StaleWeights(McoreEngine):
    """A refit that streams the weights as they were when the engine was built (a copy refreshed once, never after
    a step): the rollout samples from the initial policy."""

    def build(self):
        super().build()
        self.initial = {name: t.clone() for name, t in self.hf_weight_stream()}

    def export_buckets(self, bucket_bytes: int):
        return buckets(iter(self.initial.items()), bucket_bytes)


class OneBucketWithTiedHead(McoreEngine):
    """NeMo-RL #630's shape: every tensor packed into one bucket whatever the bucket size. It also sends a tied model's
    lm_head (the embedding again), which HF and the rollout engines accept: not a fault."""

    def export_buckets(self, bucket_bytes: int):
        stream = list(self.hf_weight_stream())
        head = [("lm_head.weight", t) for name, t in stream if name == "model.embed_tokens.weight"]
        yield stream + (head if self.case.model.tie_embeddings else [])


class ExportKeepsThePaddedVocabulary(McoreEngine):
    """The embedding and output layer exported with megatron's padded vocabulary rows (the padding not cut after the
    gather, the issue's miles #1031 shape): the rollout is sent a vocabulary larger than its own."""

    def _full(self, e, shard):
        import dataclasses

        kept = self.case
        padded = kept.model.padded_vocab_size(kept.layout.tp)
        self.case = dataclasses.replace(kept, model=dataclasses.replace(kept.model, vocab_size=padded))
        try:
            return super()._full(e, shard)
        finally:
            self.case = kept
