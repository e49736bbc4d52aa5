"""The context-parallel engine of the dynamic-cp suite: one global batch of variable-length samples,
run with no CP, static CP or dynamic (hybrid) CP, returning per-token log-probs, loss and gradients.

Modes (CPCaseParams.cp_mode):
- "none": every sample whole, as its own micro-batch, on DP rank (i mod DP): the reference.
- "static": each DP rank packs its samples into one THD micro-batch (per sequence padded to a
  multiple of 2*CP), split over the layout's CP group by the pure-torch THD split.
- "dynamic": megatron-core's released hybrid CP (0.16-0.19; the dev branch's `dynamic_context_parallel`
  names are probed too, see `harness.upstream.dynamic_cp_api`): `hybrid_context_parallel` groups,
  `BalancedCPScheduler` groups the samples and picks each one's local CP size from
  `max_seqlen_per_dp_cp_rank`, megatron's `hybrid_context_parallel_forward_backward` runs them,
  `get_batch_on_this_hybrid_cp_rank` splits each over its local CP group. Every rank generates
  the same global batch, so samples are looked up locally instead of being moved by
  `HybridCPDataLoaderWrapper`'s all-to-all (whose reroute reads `batch[0].keys()`, so it cannot run
  on a DP rank that holds no sample - the "fewer samples than DP ranks" mix).

Losses are per-token (calculate_per_token_loss): loss sums and token counts per micro-batch, the
gradients divided by the global token count in finalize_model_grads. After one forward-backward
the engine reports its raw per-rank outputs (which rank computed which positions of which sample,
at which local CP size), the merged log-probs (gathered over all ranks, restored to the original
sample order) and the full gradients. The methods a fault injection replaces are `split_dynamic`,
`split_static`, `merge`, `token_count` and `local_cp_size`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from harness.engines.cp_data import pack_thd, thd_batch_on_this_cp_rank
from harness.engines.mcore import McoreEngine
from harness.engines.model_config import layer_spec, transformer_config
from harness.errors import BadInput
from harness.platform.parallel import init_parallel_state
from harness.spec import Case
from harness.upstream import DynamicCPApi, dynamic_cp_api


class CPMode(StrEnum):
    """How a dynamic-cp case lays its samples over the ranks."""

    NONE = "none"  # whole samples
    STATIC = "static"  # THD packs over the layout's CP
    DYNAMIC = "dynamic"  # megatron's hybrid CP


MODES = tuple(CPMode)


@dataclass(frozen=True)
class CPCaseParams:
    """A dynamic-cp case's own parameters (`Case.params`)."""

    mix: str = ""  # the name of the global batch's sequence-length mix
    seqlens: tuple[int, ...] = field(default=(), metadata={"in_id": False})  # named by `mix`
    cp_mode: str = ""  # a CPMode
    # megatron's max_seqlen_per_dp_cp_rank (the dynamic local CP size follows from it)
    max_seqlen_per_dp_cp_rank: int | None = None


@dataclass
class TokenOutputs:
    """Log-probs one rank computed for part of one sample."""

    sample: int
    positions: torch.Tensor  # positions within the sample
    logprobs: torch.Tensor
    local_cp: int  # CP size the sample ran with (1: whole sample on this rank)
    rank: int


def samples(case: Case) -> list[dict[str, torch.Tensor]]:
    """The global batch: one dict of [L_i] tensors per sample, the same on every rank and layout."""
    out = []
    for i, n in enumerate(case.params.seqlens):
        gen = torch.Generator().manual_seed(case.options.seed * 7919 + i)
        ids = torch.randint(0, case.model.vocab_size, (n + 1,), generator=gen)
        out.append({"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(n),
                    "position_ids": torch.arange(n), "sample_id": torch.full((n,), i)})
    return out


def pad_sample(sample: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Pad at the end to a multiple of `multiple` tokens (loss_mask 0): hybrid CP's zigzag needs 2*cp | L."""
    n = sample["tokens"].shape[0]
    pad = -n % multiple
    if not pad:
        return dict(sample)
    out = {k: torch.cat([v, v.new_zeros(pad)]) for k, v in sample.items()}
    out["position_ids"] = torch.arange(n + pad)
    out["sample_id"] = torch.full((n + pad,), int(sample["sample_id"][0]))
    return out


class CPEngine(McoreEngine):
    """GPTModel + DDP (no optimizer step): one forward-backward of the global batch in a CP mode."""

    def __init__(self, case: Case, ctx):
        super().__init__(case, ctx)
        self.mode = case.params.cp_mode or "none"
        if self.mode not in MODES:
            raise BadInput(f"cp_mode {self.mode!r}: expected one of {', '.join(MODES)}")
        self.records: list[TokenOutputs] = []
        self.loss_sum = 0.0
        self.num_tokens = 0

    # -- build --------------------------------------------------------------------------------
    def build(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel

        lay, o = self.case.layout, self.case.options
        if self.mode == CPMode.DYNAMIC and (lay.tp, lay.pp, lay.cp) != (1, 1, 1):
            raise BadInput(f"dynamic CP runs on pure-DP layouts (it regroups the DP ranks), not {lay.id}")
        self.api = dynamic_cp_api() if self.mode == CPMode.DYNAMIC else None
        init_parallel_state(lay, on_cpu=self.ctx.on_cpu, seed=o.seed,
                            dynamic_cp_flag=self.api.flag if self.api else None)
        config = transformer_config(self.case, self.ctx.on_cpu)
        config.calculate_per_token_loss = True
        if self.api:
            setattr(config, self.api.flag, True)  # selects megatron's dynamic-CP forward-backward
            config.max_seqlen_per_dp_cp_rank = self.case.params.max_seqlen_per_dp_cp_rank
        self.config = config
        # the CP attention wherever a CP group may be larger than 1 (static CP, or per sample)
        cp_attention = self.mode == CPMode.DYNAMIC or lay.cp > 1
        spec = layer_spec(self.ctx.on_cpu, self.case.model.normalization, 2 if cp_attention else 1,
                          qk_layernorm=self.case.model.qk_layernorm)
        chunk = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=self.padded_vocab_rows(),
                         max_sequence_length=max(self.case.model.seq_length, *self.case.params.seqlens, 1),
                         pre_process=True, post_process=True,
                         share_embeddings_and_output_weights=self.case.model.tie_embeddings,
                         position_embedding_type="rope")
        self.reinit(chunk)
        if not self.ctx.on_cpu:
            chunk.cuda(torch.cuda.current_device())
        self.models = self.wrap([chunk], self.ddp_config())
        self.after_optimizer()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

    def ddp_config(self):
        from megatron.core.distributed import DistributedDataParallelConfig

        # a plain all-reduce leaves the full gradient on every rank
        return DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=False)

    # -- the step -----------------------------------------------------------------------------
    def run(self) -> None:
        """One forward-backward of the global batch (gradients finalized, no optimizer step)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = samples(self.case)
        for m in self.models:
            m.zero_grad_buffer()
        if self.mode == CPMode.DYNAMIC:
            mbs: Any = iter([self.schedule(batch)])
            count = 1
        else:
            mine = [s for i, s in enumerate(batch) if i % self.dp_size == self.dp_rank]
            if not mine:  # fewer samples than DP ranks: a fully masked dummy keeps the collectives matched
                mine = [{**pad_sample({k: v[:1] for k, v in batch[0].items()}, 8), "loss_mask": torch.zeros(8),
                         "sample_id": torch.full((8,), -1)}]
            mbs = [self.pack(mine)] if self.mode == CPMode.STATIC else [dict(s) for s in mine]
            count = len(mbs)
            mbs = iter(mbs)
        get_forward_backward_func()(
            forward_step_func=self.forward_step, data_iterator=mbs, model=self.models[0],
            num_microbatches=count, seq_length=max(self.case.params.seqlens), micro_batch_size=1,
            forward_only=False,
        )

    def schedule(self, batch: list[dict[str, torch.Tensor]]):
        """(this rank's samples by id, sample_id_groups): what HybridCPDataLoaderWrapper yields."""
        import importlib

        from megatron.core import parallel_state as ps

        BalancedCPScheduler = importlib.import_module(self.dynamic_api.schedule_module).BalancedCPScheduler
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        padded = [pad_sample(s, 2 * dp_cp.size()) for s in batch]
        scheduler = BalancedCPScheduler(self.config.max_seqlen_per_dp_cp_rank, dp_cp)
        _, sample_id_groups = scheduler.get_groups_and_subsamples(
            [(i, int(s["tokens"].shape[0])) for i, s in enumerate(padded)], self.config)
        me = dp_cp.rank()
        return {i: dict(padded[i]) for group in sample_id_groups for i in group[me]}, sample_id_groups

    def pack(self, mine: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        batch, cu, cu_padded = pack_thd(mine, self.case.layout.cp)
        return {**batch, "cu_seqlens": cu, "cu_seqlens_padded": cu_padded}

    def split_static(self, mb: dict[str, Any]):
        """A THD pack -> this CP rank's tokens and PackedSeqParams."""
        from megatron.core import parallel_state as ps

        cu, cu_padded = mb.pop("cu_seqlens"), mb.pop("cu_seqlens_padded")
        return thd_batch_on_this_cp_rank(mb, cu, cu_padded, ps.get_context_parallel_world_size(),
                                         ps.get_context_parallel_rank())

    def local_cp_size(self, sample: dict[str, Any]) -> int:
        """The local CP size megatron's schedule set for this sample."""
        return int(sample.pop("local_cp_size"))

    @property
    def dynamic_api(self) -> DynamicCPApi:
        """megatron's dynamic-CP names (a case in the "dynamic" mode only)."""
        if self.api is None:
            raise RuntimeError(f"cp_mode {self.mode!r}: megatron's dynamic-CP API is used in the 'dynamic' mode only")
        return self.api

    def split_dynamic(self, sample: dict[str, Any], local_cp: int):
        """One sample -> this rank's zigzag share over its local CP group, PackedSeqParams."""
        return self.dynamic_api.split(sample, local_cp)

    def forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        if self.mode == CPMode.DYNAMIC:
            local_cp = self.local_cp_size(mb)
            mb, params = self.split_dynamic(mb, local_cp)
        elif self.mode == CPMode.STATIC:
            mb, params = self.split_static(mb)
            local_cp = self.case.layout.cp
        else:
            mb, params = {k: v.unsqueeze(0) for k, v in mb.items()}, None
            local_cp = 1
        dev = self.ctx.device
        output = model(mb["tokens"].to(dev), mb["position_ids"].to(dev), None, labels=mb["labels"].to(dev),
                       packed_seq_params=params)
        self._record(mb, output, local_cp)
        loss_mask = mb["loss_mask"].to(dev).float()
        return output, lambda out: self.per_token_loss(loss_mask, out)

    def _record(self, mb, output, local_cp: int) -> None:
        keep = mb["loss_mask"].reshape(-1) > 0
        ids = mb["sample_id"].reshape(-1)[keep]
        pos = mb["position_ids"].reshape(-1)[keep]
        logprobs = -output.detach().float().reshape(-1)[keep].cpu()
        for sid in ids.unique().tolist():
            sel = ids == sid
            self.records.append(TokenOutputs(int(sid), pos[sel].clone(), logprobs[sel].clone(), local_cp,
                                             dist.get_rank()))

    def per_token_loss(self, loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        """Per-token loss: the masked loss sum and its token count (normalised over the global batch)."""
        loss_sum = (output_tensor.float().reshape(-1) * loss_mask.reshape(-1)).sum()
        num_tokens = self.token_count(loss_mask)
        self.loss_sum += float(loss_sum.detach())
        self.num_tokens += int(num_tokens)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    def token_count(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """Tokens this rank's micro-batch contributes to the global count (its unmasked local tokens)."""
        return loss_mask.sum().to(torch.int)

    # -- outputs ------------------------------------------------------------------------------
    def merge(self, records: list[TokenOutputs], num_samples: int) -> list[torch.Tensor]:
        """All ranks' outputs -> one log-prob tensor per sample, in the original sample order."""
        by_sample: dict[int, list[TokenOutputs]] = {}
        for r in records:
            if r.sample >= 0:
                by_sample.setdefault(r.sample, []).append(r)
        merged = []
        for sid in range(num_samples):
            parts = by_sample.get(sid, [])
            if not parts:
                continue
            pos = torch.cat([p.positions for p in parts])
            val = torch.cat([p.logprobs for p in parts])
            merged.append(val[pos.argsort()])
        return merged

    def gather_records(self) -> list[TokenOutputs]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [dataclasses.astuple(r) for r in self.records])
        return [TokenOutputs(*t) for rank_records in gathered for t in rank_records]

