"""RL-shaped global batches and the ways RL frameworks cut them into micro-batches (the batch-split suite).

A sample is a prompt and a response; the loss counts the response's valid tokens only (its response mask), and
valid lengths span 0 (a fully masked sample: a response the reward filtered out) to the whole remaining sequence.
One seed gives the same global batch on every layout and every cut.

A cut says how each DP rank's samples become micro-batches:
- `mbs<N>`: contiguous slices of N samples, each DP rank its contiguous share (megatron's own data path);
- `tokens<B>`: dynamic micro-batches by a token budget of B valid tokens (verl's `use_dynamic_bsz`, NeMo-RL's dynamic
  batching): the samples first balanced over the DP ranks by their token counts, equal in number per rank; per rank
  the number of micro-batches is what its tokens need under the budget, the largest over the DP ranks (they must
  agree) and at least the pipeline size (megatron's schedule needs as many); each rank's samples are then spread
  over that many micro-batches by tokens, so micro-batches hold different numbers of samples.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.errors import BadInput

if TYPE_CHECKING:
    import torch

    from harness.spec import ModelSpec

_CUT_RE = re.compile(r"^(mbs|tokens)([1-9][0-9]*)$")


@dataclass(frozen=True)
class Cut:
    """How a DP rank's samples become micro-batches: `mbs<N>` or `tokens<B>` (see the module's docstring)."""

    kind: str  # "mbs" | "tokens"
    size: int  # samples per micro-batch, or the token budget

    @classmethod
    def parse(cls, text: str) -> Cut:
        m = _CUT_RE.match(text)
        if not m:
            raise BadInput(f"cut {text!r}: give mbs<N> (N samples per micro-batch) or tokens<B> (dynamic micro-batches "
                           "of at most B valid tokens each), e.g. mbs2 or tokens96")
        return cls(m.group(1), int(m.group(2)))

    @property
    def id(self) -> str:
        return f"{self.kind}{self.size}"

    @property
    def dynamic(self) -> bool:
        return self.kind == "tokens"

    def __str__(self) -> str:
        return self.id


@dataclass
class RLBatch:
    """A global batch of prompt + response samples."""

    tokens: torch.Tensor  # [G, seq + 1] token ids
    prompt_len: list[int]  # per sample
    response_len: list[int]  # valid response tokens per sample (0: fully masked)

    @property
    def size(self) -> int:
        return len(self.prompt_len)

    def response_mask(self, sample: int, seq: int) -> torch.Tensor:
        """[seq] 1.0 at the label positions of the sample's valid response tokens (label t predicts token t + 1)."""
        import torch

        mask = torch.zeros(seq)
        start = self.prompt_len[sample] - 1
        mask[start:start + self.response_len[sample]] = 1.0
        return mask

    def response_masks(self, samples: list[int], seq: int) -> torch.Tensor:
        """[len(samples), seq] the samples' response masks."""
        import torch

        return torch.stack([self.response_mask(i, seq) for i in samples])

    def valid_tokens(self, sample: int) -> int:
        """What frameworks balance micro-batches on: the prompt and the valid response (its attention mask)."""
        return self.prompt_len[sample] + self.response_len[sample]


def rl_batch(model: ModelSpec, global_batch_size: int, seed: int, step: int) -> RLBatch:
    """The step's global batch: prompts of 1/8 to 1/4 of the sequence; sample 0 fully masked, sample 1 a response to the
    end of the sequence, the others' valid response lengths drawn from 0 to the rest."""
    import torch

    seq = model.seq_length
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7_919)
    tokens = torch.randint(0, model.vocab_size, (global_batch_size, seq + 1), generator=gen)
    lo, hi = max(1, seq // 8), max(2, seq // 4)
    prompts = torch.randint(lo, hi + 1, (global_batch_size,), generator=gen).tolist()
    responses = []
    for i, p in enumerate(prompts):
        room = seq - p + 1  # label positions p-1 .. seq-1
        drawn = int(torch.randint(0, room + 1, (1,), generator=gen))
        responses.append(0 if i == 0 else room if i == 1 else drawn)
    return RLBatch(tokens, prompts, responses)


def dp_samples(batch: RLBatch, cut: Cut, dp: int) -> list[list[int]]:
    """Per DP rank, its samples (indices into the global batch)."""
    per = batch.size // dp
    if not cut.dynamic:
        return [list(range(r * per, (r + 1) * per)) for r in range(dp)]
    # the longest samples first, each to the rank with the fewest tokens among those with room (equal counts)
    order = sorted(range(batch.size), key=lambda i: (-batch.valid_tokens(i), i))
    ranks: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in order:
        r = min((r for r in range(dp) if len(ranks[r]) < per), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += batch.valid_tokens(i)
    return [sorted(r) for r in ranks]


def num_microbatches(batch: RLBatch, cut: Cut, dp: int, pp: int, shares: list[list[int]] | None = None) -> int:
    """Micro-batches per DP rank, the same on every rank (`shares`: dp_samples's, where the caller has them)."""
    shares = shares or dp_samples(batch, cut, dp)
    per = len(shares[0])
    if not cut.dynamic:
        return per // cut.size
    need = max(math.ceil(sum(batch.valid_tokens(i) for i in s) / cut.size) for s in shares)
    return min(per, max(need, pp))  # no micro-batch empty; a sample over the budget still gets one


def microbatch_samples(batch: RLBatch, cut: Cut, dp: int, pp: int, dp_rank: int) -> list[list[int]]:
    """This DP rank's micro-batches, each a list of sample indices into the global batch."""
    shares = dp_samples(batch, cut, dp)
    mine, m = shares[dp_rank], num_microbatches(batch, cut, dp, pp, shares)
    if not cut.dynamic:
        return [mine[i * cut.size:(i + 1) * cut.size] for i in range(m)]
    # every micro-batch gets one sample first (none may be empty), then the rest by tokens, longest first
    order = sorted(mine, key=lambda i: (-batch.valid_tokens(i), i))
    groups: list[list[int]] = [[i] for i in order[:m]]
    load = [batch.valid_tokens(i) for i in order[:m]]
    for i in order[m:]:
        g = min(range(m), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += batch.valid_tokens(i)
    return [sorted(g) for g in groups]


def check_cut(cut: Cut, global_batch_size: int, dp: int) -> None:
    """BadInput where a static cut does not divide a DP rank's samples."""
    per = global_batch_size // dp
    if not cut.dynamic and per % cut.size:
        raise BadInput(f"cut {cut}: a DP rank's {per} samples (global batch {global_batch_size} over DP {dp}) do not "
                       f"split into micro-batches of {cut.size}: pick a micro-batch size dividing {per}")


def microbatch_tensors(batch: RLBatch, samples: list[int], seq: int) -> dict[str, torch.Tensor]:
    """One micro-batch: tokens, labels, position ids and the response mask ([n, seq] each)."""
    import torch

    ids = batch.tokens[samples]
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(len(samples), seq).contiguous(),
            "loss_mask": batch.response_masks(samples, seq)}
