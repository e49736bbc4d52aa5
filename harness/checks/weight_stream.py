"""Judging a weight export to a rollout engine (refit's, rl-cycle's per iteration): every key sent once, with the
shapes expected, and equal bit for bit to the trained parameters mapped to Hugging Face names by the harness's own
arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.checks import CheckResult
from harness.engines.hf_weights import hf_state_dict
from harness.probes.weight_stream import Sent, digest

if TYPE_CHECKING:
    import torch

    from harness.spec import ModelSpec

TIED_TO = {"lm_head.weight": "model.embed_tokens.weight"}


@dataclass(frozen=True)
class Expected:
    """What an export must send: the keys and their shapes, the keys HF ties to another (may be sent, equal to it)
    and whose keys they are (HF's own model, or the harness's mapping where no HF model holds the model)."""

    shapes: dict[str, tuple]
    tied: set[str]
    source: str


def reference(full: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """The trained parameters (megatron's global names, assembled) under HF names: what the export must send."""

    return hf_state_dict(full, model)


def first(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def check_complete(name: str, cid: str, at: str, per_rank: list[tuple[int, list[Sent]]],
                   want: Expected) -> CheckResult:
    """Every rank that sends sends each expected key exactly once, over all its buckets, and nothing else (a tied key
    may be sent)."""
    expected = set(want.shapes)
    senders = [(r, sent) for r, sent in per_rank if sent]
    if not senders:
        return CheckResult(name, cid, False, f"{at}: no rank sent anything")
    for r, sent in senders:
        seen: dict[str, list[int]] = {}
        for s in sent:
            seen.setdefault(s.name, []).append(s.bucket)
        missing = sorted(expected - set(seen))
        extra = sorted(set(seen) - expected - want.tied)
        twice = sorted(k for k, b in seen.items() if len(b) > 1)
        if missing or extra or twice:
            buckets = max(s.bucket for s in sent) + 1
            parts = ([f"never sent {first(missing)}"] if missing else []) + \
                ([f"sent twice {first([f'{k} (buckets {seen[k]})' for k in twice])}"] if twice else []) + \
                ([f"sent what {want.source} has no key for: {first([f'{k} (bucket {seen[k][0]})' for k in extra])}"]
                 if extra else [])
            return CheckResult(name, cid, False, f"{at}: rank {r} sent {len(seen)} of the {len(expected)} keys "
                                                 f"({want.source}) in {buckets} buckets: " + "; ".join(parts),
                               [f"  never sent: {k}" for k in missing])
    buckets = max(s.bucket for s in senders[0][1]) + 1
    return CheckResult(name, cid, True, f"{at}: {len(senders)} ranks each sent the {len(expected)} {want.source} keys "
                                        f"once, in {buckets} buckets")


def check_values(name: str, cid: str, at: str, per_rank: list[tuple[int, list[Sent]]], want: Expected,
                 ref: dict[str, torch.Tensor], stream: dict[str, torch.Tensor]) -> CheckResult:
    """Shapes as expected; rank 0's stream (every key) equal to the trained parameters bit for bit; every rank's
    tensor the same as rank 0's."""
    import torch

    for r, sent in per_rank:
        for s in sent:
            shape = want.shapes.get(s.name) or want.shapes.get(TIED_TO.get(s.name, ""))
            if shape is not None and tuple(s.shape) != tuple(shape):
                return CheckResult(name, cid, False, f"{at}: rank {r}, bucket {s.bucket}: {s.name} of shape "
                                                     f"{list(s.shape)}, {want.source} expects {list(shape)}")
    unkept = sorted(set(want.shapes) - set(stream))
    if unkept:
        return CheckResult(name, cid, False, f"{at}: rank 0's stream holds {len(stream)} of {len(want.shapes)} keys, "
                                             f"not {first(unkept)}: their values were not compared with the trained "
                                             "parameters")
    bucket = {s.name: s.bucket for r, sent in per_rank if r == 0 for s in sent}
    for key, t in stream.items():
        wanted = ref.get(key, ref.get(TIED_TO.get(key, "")))
        if wanted is not None and (t.shape != wanted.shape or not torch.equal(t.float(), wanted)):
            diff = float((t.float() - wanted).abs().max()) if t.shape == wanted.shape else float("nan")
            return CheckResult(name, cid, False, f"{at}: rank 0, bucket {bucket.get(key, '?')}: {key} unlike the "
                                                 f"trained parameter (largest difference {diff:.3g}): the rollout "
                                                 "gets other weights")
    digests = {k: digest(t) for k, t in stream.items()}
    for r, sent in per_rank:
        for s in sent:
            if s.name in digests and s.digest != digests[s.name]:
                return CheckResult(name, cid, False, f"{at}: rank {r}, bucket {s.bucket}: {s.name} differs from "
                                                     "rank 0's copy of the trained parameter")
    n = sum(len(sent) for _, sent in per_rank)
    return CheckResult(name, cid, True, f"{at}: {n} tensors sent by {len(per_rank)} ranks have {want.source}'s shapes "
                                        f"and equal the trained parameters bit for bit")
