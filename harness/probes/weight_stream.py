"""The rollout side of a weight export, inside a rank: each tensor named, shaped and hashed as it arrives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sent:
    """One tensor a rank handed to the rollout engine."""

    name: str
    bucket: int  # the bucket's index in the export
    shape: tuple[int, ...]
    dtype: str
    digest: str  # blake2b of its bytes


def digest(t: torch.Tensor) -> str:
    """A tensor's bytes hashed in place (no copy of a contiguous host tensor). Read through ctypes, not numpy:
    `Tensor.numpy()` marks the storage not resizable for good, and an offload frees a parameter's storage by
    resizing it to 0 (on CPU ranks `.cpu()` is the parameter itself)."""
    import ctypes
    import hashlib

    import torch

    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not flat.numel():
        return hashlib.blake2b(b"", digest_size=16).hexdigest()
    return hashlib.blake2b((ctypes.c_char * flat.numel()).from_address(flat.data_ptr()), digest_size=16).hexdigest()


def receive(buckets: Any, keep: dict[str, Any] | None = None) -> list[Sent]:
    """The rollout side of one export: each bucket read (named, shaped, hashed) and let go of before the next;
    `keep`: also a copy of every tensor, on the host, by name."""
    sent: list[Sent] = []
    for i, bucket in enumerate(buckets):
        sent += [Sent(name, i, tuple(t.shape), str(t.dtype).removeprefix("torch."), digest(t)) for name, t in bucket]
        if keep is not None:
            keep.update((name, t.detach().cpu().clone()) for name, t in bucket)
        del bucket
    return sent
