"""Where a run's figures came from: the stack (harness.stack: Python, the torch build, megatron-core, the bridges),
the other packages' versions and the harness's commit, the engine's distribution, the time."""

from __future__ import annotations

import functools
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from harness.engine_names import EngineName
from harness.engines import BUILTIN
from harness.stack import components


def versions() -> dict[str, str]:
    """The versions a results file records (a copy: callers may add to it)."""
    return dict(_versions())


@functools.cache  # read once per process: results.json is written after every case (22 ms a call here, with
def _versions() -> dict[str, str]:  # `git status`); what a run records is the code it started with anyway
    out = dict(components())  # the stack: Python, the torch build, megatron-core, the bridges, Transformer Engine
    for dist in ("transformers", "peft"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["harness"] = metadata.version("megatron-regression-harness") if _installed() else "src"
    commit = _git_commit()
    if commit:
        out["harness_commit"] = commit
    return out


@functools.cache  # results.json is written after every case; the installed set does not change
def engine_distribution(engine: str) -> dict[str, str | None]:
    """The installed distribution that provides an engine, and its version: for `pkg.mod:factory` the
    distribution of `pkg` (None when it is not installed as one, e.g. a module on PYTHONPATH)."""
    if engine in BUILTIN:  # a built-in engine: what is judged is the package it builds with
        dists: dict[str, str] = {EngineName.MBRIDGE: "mbridge", EngineName.MEGATRON_BRIDGE: "megatron-bridge",
                                 EngineName.FSDP2: "torch"}
        name = dists.get(engine, "megatron-core")
    else:
        top = engine.partition(":")[0].split(".")[0]
        name = (metadata.packages_distributions().get(top) or [""])[0]
    try:
        return {"name": name, "version": metadata.version(name) if name else None}
    except metadata.PackageNotFoundError:
        return {"name": name, "version": None}


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _installed() -> bool:
    try:
        metadata.version("megatron-regression-harness")
        return True
    except metadata.PackageNotFoundError:
        return False


def _git_commit() -> str:
    """Short HEAD of the harness checkout, '-dirty' when it has uncommitted changes; '' outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              timeout=5).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if head and git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return ""
