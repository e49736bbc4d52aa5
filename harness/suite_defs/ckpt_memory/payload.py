"""What a ckpt-memory rank returns: a save case's SaveRankData (suite.py writes it; figures.py and judge.py read it),
a reshard contract case's ContractRankData (contract.py writes it, contract_judge.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.engines.base import ParamShard
from harness.probes.ckpt_format import OnDisk
from harness.probes.memory import MemoryPeak
from harness.probes.retention import Retention


@dataclass(frozen=True)
class SaveRankData:
    save: MemoryPeak  # the measured save: heap peaks of the rank and its forked writers, RSS, pinned, device
    coords: dict[str, int] = field(default_factory=dict)  # the rank's place in the layout
    on_disk: OnDisk | None = None  # global rank 0: what the checkpoint's files are
    content_metadata: dict[str, Any] | None = None  # global rank 0: what the engine says they are
    retention: Retention | None = None  # what RESAVES more saves of the same state left behind


@dataclass(frozen=True)
class LoadTarget:
    """One load of the contract at `layout`: the measured load, the parameters and Adam state it gave and the
    parameters after one more step; or the phase it failed in (build, load, after the load), why, and whether
    it is the refusal a format gives for a layout it does not promise."""

    layout: str
    load: MemoryPeak | None = None
    loaded: list[ParamShard] = field(default_factory=list)
    loaded_optim: list[ParamShard] | None = None  # None: the engine hands out no optimizer state
    stepped: list[ParamShard] = field(default_factory=list)
    error: str = ""
    phase: str = ""
    refusal: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class ContractRankData:
    """A contract case's loads; the case that saves also the parameters and Adam state it saved, its parameters
    after one more step (a save must not change training) and those of the same two steps without a save."""

    targets: list[LoadTarget]
    saved: list[ParamShard] = field(default_factory=list)
    saved_optim: list[ParamShard] | None = None
    continued: list[ParamShard] = field(default_factory=list)
    reference: list[ParamShard] = field(default_factory=list)
