"""The collective backends a case's ranks use (`Case.backend`, `--backend`): one closed vocabulary."""

from enum import StrEnum


class Backend(StrEnum):
    """AUTO is a request only (resolved to one of the others before anything runs, platform.resolve_backend);
    GLOO: CPU ranks; NCCL: one GPU per rank."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


BACKENDS = tuple(Backend)  # argparse choices: "gloo" in BACKENDS holds (a StrEnum equals its value)
