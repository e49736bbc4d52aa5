"""Importing megatron.bridge: the install check, and the scoped stub of its CUDA-only imports on CPU ranks."""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import sys
import types

from harness.adjustments import note
from harness.errors import MissingDependency
from harness.upstream import bridge_transformers_mismatch

INSTALL = ("pip install --no-deps megatron-bridge==RELEASE && pip install -c constraints-cpu.txt -e .[bridge] (each "
           "stack's RELEASE and transformers: docs/stacks.md)")
# import name -> distribution: what this engine imports (megatron-bridge's metadata pins CUDA-only
# packages, so it is installed with --no-deps and its CPU-importable dependencies come from the extra)
_REQUIRED = {"megatron.bridge": "megatron-bridge", "transformers": "transformers", "omegaconf": "omegaconf",
             "accelerate": "accelerate", "rich": "rich"}
# Packages that only exist with CUDA; an unconditional import of one of these is all that may be stubbed.
GPU_ONLY = frozenset({"transformer_engine", "triton", "mamba_ssm", "causal_conv1d", "fla", "flash_attn",
                      "flash_attn_3", "flashattn_hopper", "apex", "nvidia_resiliency_ext", "deep_ep", "grouped_gemm"})

# (importing module, package) pairs that `import_bridge` stubbed in this process, for diagnosis
stubbed_imports: list[tuple[str, str]] = []


def check_available() -> None:
    """MissingDependency naming the install command; cheap enough for the parent (imports nothing heavy)."""

    for module, dist in _REQUIRED.items():
        if importlib.util.find_spec(module) is None:
            raise MissingDependency(f"engine 'megatron-bridge' needs {dist} (no module {module!r}): {INSTALL}")
    why = bridge_transformers_mismatch()
    if why:
        raise MissingDependency(f"engine 'megatron-bridge': {why}")


class _Stub(types.ModuleType):
    """Stand-in for a missing GPU-only package: submodules, classes to subclass, pass-through decorators.

    Never registered in sys.modules: only the import statements it was granted to receive it.
    """

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = type(name, (), {"__init__": lambda self, *a, **k: None, "__module__": self.__name__})
        else:
            value = _Stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else None


@contextlib.contextmanager
def _stubs_for(granted: set[tuple[str, str]]):
    """While active, `import pkg...` of a missing package pkg executed by module M gives M a stub, but
    only for the granted (M, pkg) pairs; every other import (all of megatron.core's optional probes,
    transformers' availability checks, importlib.util.find_spec) sees the package missing."""
    original = builtins.__import__
    stubs: dict[str, _Stub] = {}

    def hooked(name, globals=None, locals=None, fromlist=(), level=0):
        try:
            return original(name, globals, locals, fromlist, level)
        except ModuleNotFoundError as exc:
            top = name.partition(".")[0]
            importer = (globals or {}).get("__name__")
            if level or (exc.name or "").partition(".")[0] != top or (importer, top) not in granted:
                raise
            module = stubs.setdefault(top, _Stub(top))
            if fromlist:  # `from a.b import c` binds from a.b; `import a.b` binds a
                for part in name.split(".")[1:]:
                    module = getattr(module, part)
            return module

    builtins.__import__ = hooked
    try:
        yield
    finally:
        builtins.__import__ = original


_IMPORT_MACHINERY = ("importlib._bootstrap", "importlib._bootstrap_external", "_frozen_importlib",
                     "_frozen_importlib_external")


def _failed_import(exc: ModuleNotFoundError) -> tuple[str | None, str]:
    """(module whose import statement failed, missing top-level package)."""
    importer = None
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name != __name__ and name not in _IMPORT_MACHINERY:
            importer = name
        tb = tb.tb_next
    return importer, (exc.name or "").partition(".")[0]


def import_bridge():
    """`megatron.bridge.AutoBridge`, importing the bridge behind a scoped stub where packages are missing.

    megatron.core is imported first, so its HAVE_TE / triton flags are settled without any stub. The
    bridge import is then retried, each time granting a stub to exactly the (module, package) import
    that failed, as long as the package is GPU-only; a missing ordinary dependency raises
    MissingDependency. Stubs never enter sys.modules and the import hook is removed afterwards, so
    later imports (megatron.core modules imported lazily, transformers' probes) see no stub; the bridge
    modules keep their references. With the GPU packages installed nothing is stubbed.
    """
    import megatron.core  # noqa: F401

    if "megatron.bridge" in sys.modules:  # a warm rank imported it for an earlier case
        _note_stubs()
        return sys.modules["megatron.bridge"].AutoBridge
    granted: set[tuple[str, str]] = set()
    for _ in range(64):
        try:
            with _stubs_for(granted):
                # the models package whole, each time: it registers every model bridge, and a retry after a
                # failed import finds its submodules in sys.modules without running the package again
                import megatron.bridge.models  # noqa: F401
                from megatron.bridge import AutoBridge
            stubbed_imports[:] = sorted(granted)
            _note_stubs()
            return AutoBridge
        except ModuleNotFoundError as exc:
            importer, package = _failed_import(exc)
            if package not in GPU_ONLY:
                raise MissingDependency(f"engine 'megatron-bridge': cannot import {exc.name!r}: {INSTALL}") from exc
            if importer is None or (importer, package) in granted:
                raise
            granted.add((importer, package))
    raise RuntimeError(f"import megatron.bridge still fails after stubbing {sorted(granted)}")


def _note_stubs() -> None:
    if stubbed_imports:
        note("megatron.bridge imported behind stubs of its CUDA-only imports: "
             + ", ".join(f"{pkg} in {mod}" for mod, pkg in stubbed_imports))
