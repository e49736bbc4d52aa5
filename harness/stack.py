"""The stack a run stands on - Python, the torch build, megatron-core, the bridges - read from the installed
distributions (no torch import), the stacks the harness is tested on, and how two stacks differ.

Per-stack figures (memory peaks, step times) are recorded under the stack's key; figures that must hold across
stacks (numerics) are recorded once ([baselines](../docs/baselines.md#stacks))."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from importlib import metadata

# The components a results file, a baseline's provenance and a history series name, in this order.
COMPONENTS = ("python", "torch", "megatron-core", "megatron-bridge", "mbridge", "transformer-engine")
LABELS = {"python": "Python", "torch": "torch", "megatron-core": "megatron-core", "megatron-bridge": "megatron-bridge",
          "mbridge": "mbridge", "transformer-engine": "Transformer Engine"}


@dataclass(frozen=True)
class TestedStack:
    """A pair of releases the harness's tests and suites run on (noxfile.py installs them)."""

    name: str  # the nox sessions' suffix: "" for the current stack, "-previous" ...
    python: str  # major.minor
    torch: str
    megatron_core: str
    megatron_bridge: str
    mbridge: str
    pins: tuple[str, ...] = ()  # what the bridges need beside them (megatron-bridge's transformers range)


# current: what users run now (megatron-core 0.17 and later need Python >= 3.12; megatron-bridge 0.6.2 imports
# transformers 5 names); previous: what they upgrade from (megatron-bridge 0.3.1 and mbridge on transformers 4)
CURRENT = TestedStack("current", "3.12", "2.13.0", "0.19.2", "0.6.2", "0.15.1",
                      ("transformers>=5.8,<=5.12.1", "huggingface-hub>=1.5,<2"))
PREVIOUS = TestedStack("previous", "3.11", "2.13.0", "0.16.1", "0.3.1", "0.15.1", ("transformers<5",))
TESTED = (CURRENT, PREVIOUS)


def tested_range() -> str:
    """The megatron-core releases the harness is tested on, e.g. "0.16.1 - 0.19.2"."""
    from packaging.version import Version

    versions = sorted({s.megatron_core for s in TESTED}, key=Version)
    return f"{versions[0]} - {versions[-1]}"


def torch_build(version: str | None = None) -> str:
    """"cpu" for a CPU-only wheel (local label +cpu), "cuda" for a build that depends on CUDA's packages, else the
    local label or "" - read from the distribution's metadata, without importing torch."""
    try:
        version = version or metadata.version("torch")
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return ""
    local = version.partition("+")[2]
    if local.startswith("cpu"):
        return "cpu"
    if local.startswith("cu") or any(r.startswith(("nvidia-", "cuda-")) for r in requires):
        return "cuda"
    return local


@functools.cache
def components() -> dict[str, str]:
    """This environment's stack: component -> version ("python" is the interpreter's, torch's carries its build:
    "2.13.0+cpu", "2.13.0 (CUDA build)"); absent components are left out."""
    out = {"python": platform.python_version()}
    for dist in COMPONENTS[1:]:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if "torch" in out and torch_build(out["torch"]) == "cuda" and "+" not in out["torch"]:
        out["torch"] += " (CUDA build)"
    return out


def key(versions: dict[str, str] | None = None) -> str:
    """The directory per-stack baselines are kept under: Python's minor, the torch build, megatron-core, e.g.
    "py3.12-torch2.13.0-cuda-mcore0.19.2". Bridges are named in provenance, not in the key: their figures share
    megatron's entries (engines.baseline_suffix)."""
    v = versions if versions is not None else components()
    py = ".".join(v.get("python", "?").split(".")[:2])
    torch = v.get("torch", "none").replace(" (CUDA build)", "-cuda").replace("+", "-")
    return f"py{py}-torch{torch}-mcore{v.get('megatron-core', 'none')}"


def describe(versions: dict[str, str] | None = None) -> str:
    """One line: "Python 3.12.1, torch 2.13.0 (CUDA build), megatron-core 0.19.2, megatron-bridge 0.6.2"."""
    v = versions if versions is not None else components()
    return ", ".join(f"{LABELS[c]} {v[c]}" for c in COMPONENTS if v.get(c))


def differences(old: dict[str, str], new: dict[str, str] | None = None) -> list[str]:
    """What differs from `old` (e.g. a baseline's provenance) to `new` (default: this stack), one item per
    component: "Python 3.11.7 -> 3.12.1", "megatron-core 0.16.1 -> 0.19.2", "mbridge 0.15.1 -> none"."""
    new = new if new is not None else components()
    out = []
    for c in COMPONENTS:
        a, b = old.get(c), new.get(c)
        if c == "python" and a and b and a.split(".")[:2] == b.split(".")[:2]:
            continue  # a patch release of the interpreter (or a record of its minor only) is the same stack
        if a != b and (a or b):
            out.append(f"{LABELS[c]} {a or 'none'} -> {b or 'none'}")
    return out


def untested_warning(versions: dict[str, str] | None = None) -> str | None:
    """One line where megatron-core is newer (or older) than the tested range; None inside it or without it."""
    from packaging.version import InvalidVersion, Version

    found = (versions if versions is not None else components()).get("megatron-core")
    if not found:
        return None
    lo, _, hi = tested_range().partition(" - ")
    try:
        outside = not Version(lo) <= Version(found) <= Version(hi)
    except InvalidVersion:
        outside = True
    if not outside:
        return None
    return (f"warning: megatron-core {found} is outside the range the harness is tested on ({tested_range()}); "
            "a failure may be the harness's, not megatron's: see docs/stacks.md")
