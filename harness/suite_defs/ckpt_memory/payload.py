"""What a ckpt-memory save case's rank returns (suite.py writes it; figures.py and judge.py read it). The reshard
contract cases return their own dict (contract.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.probes.ckpt_format import OnDisk
from harness.probes.memory import MemoryPeak


@dataclass(frozen=True)
class SaveRankData:
    save: MemoryPeak  # the measured save: heap peaks of the rank and its forked writers, RSS, pinned, device
    coords: dict[str, int] = field(default_factory=dict)  # the rank's place in the layout
    on_disk: OnDisk | None = None  # global rank 0: what the checkpoint's files are
    content_metadata: dict[str, Any] | None = None  # global rank 0: what the engine says they are
