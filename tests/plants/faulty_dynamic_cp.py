"""Planted dynamic-CP bugs (regression R3 and its relatives): each must make the dynamic-cp suite fail."""

from __future__ import annotations

from typing import Any

import torch

from harness.engines.cp_modes import CPEngine, TokenOutputs


class WrongZigzagOnOneRank(CPEngine):
    """Rank 1 of every local CP group holds its two zigzag chunks in the wrong order."""

    def split_dynamic(self, sample: dict[str, Any], local_cp: int):
        batch, params = super().split_dynamic(sample, local_cp)
        if local_cp > 1 and params.cp_group.rank() == 1:
            for key in ("tokens", "labels", "loss_mask"):
                first, second = batch[key].chunk(2, dim=1)
                batch[key] = torch.cat([second, first], dim=1)
        return batch, params


class MergeDropsSample(CPEngine):
    """The merge loses the last sample of the batch."""

    def merge(self, records: list[TokenOutputs], num_samples: int) -> list[torch.Tensor]:
        return super().merge(records, num_samples)[:-1]


class MergeDuplicatesSample(CPEngine):
    """The merge emits the first sample twice (and drops the last to keep the count)."""

    def merge(self, records: list[TokenOutputs], num_samples: int) -> list[torch.Tensor]:
        merged = super().merge(records, num_samples)
        return [merged[0], *merged[:-1]]


class MergeKeepsScheduledOrder(CPEngine):
    """The merge returns samples in the order the ranks ran them, not the original order."""

    def merge(self, records: list[TokenOutputs], num_samples: int) -> list[torch.Tensor]:
        by_id = dict(zip(range(num_samples), super().merge(records, num_samples)))
        scheduled = list(dict.fromkeys(r.sample for r in records if r.sample >= 0))
        return [by_id[i] for i in scheduled]


class TokenCountOverDP(CPEngine):
    """R3: the token count is all-reduced over DP although dynamic CP replicated the batch, so every
    count is DP times too large and the loss (and the gradients) are scaled by 1/DP."""

    def token_count(self, loss_mask: torch.Tensor) -> torch.Tensor:
        count = super().token_count(loss_mask)
        return count * self.dp_size if self.mode == "dynamic" else count


class FewerSamplesEarlyReturn(CPEngine):
    """The early return for 'fewer samples than DP ranks' never sets the local CP size: every
    partner runs the whole sample without CP."""

    def local_cp_size(self, sample: dict[str, Any]) -> int:
        if len(self.case.params.seqlens) < self.dp_size:
            sample.pop("local_cp_size", None)
            return 1
        return super().local_cp_size(sample)
