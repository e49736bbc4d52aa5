"""The collective backends a case's ranks use (`Case.backend`, `--backend`): one closed vocabulary."""

from enum import StrEnum


class Backend(StrEnum):
    """AUTO is a request only (resolved to one of the others before anything runs, platform.resolve_backend);
    GLOO: CPU ranks; NCCL: one GPU per rank."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


BACKENDS = tuple(Backend)  # argparse choices: "gloo" in BACKENDS holds (a StrEnum equals its value)


class Tier(StrEnum):
    """Where a case's ranks compute, and what a model is sized for: CPU (gloo ranks, on the host) or GPU (NCCL
    ranks, one GPU each). Minimum effects, the memory model's device terms and time baselines' lifetimes differ by
    tier."""

    CPU = "cpu"
    GPU = "gpu"


def tier_of(backend: Backend) -> Tier:
    """GPU on NCCL ranks, else CPU."""
    return Tier.GPU if backend == Backend.NCCL else Tier.CPU
