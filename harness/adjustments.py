"""What the harness changed in the engine under test, recorded where it happens so results can say it.

A verdict over megatron-core releases judged a *patched* setup when, e.g., the CPU layer stood in for
CUDA or the harness kept Adam's step over megatron's loader; results.json, the printed report and
bisect verdicts list these. Notes are per process and taken by the rank after each case.
"""

from __future__ import annotations

_NOTES: list[str] = []


def note(what: str) -> None:
    """Record one change the harness made to the code or configuration under test (deduplicated)."""
    if what not in _NOTES:
        _NOTES.append(what)


def take() -> list[str]:
    """The notes since the last take(), plus the standing CPU-layer patches when the layer is active."""
    from harness.platform import cpu_layer

    out = list(_NOTES)
    _NOTES.clear()
    if cpu_layer.is_active():
        out.append("CPU layer (CUDA stand-ins on gloo ranks): " + ", ".join(cpu_layer.patched_points()))
    return out
