"""What a rank imports before its work: megatron-core's modules, once per process, and on CPU ranks without
building torch.compile's wrappers at import time."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from harness.errors import MissingDependency

# megatron-core's modules the suites' rank work uses, and torch's that a rank's first optimizer imports (torch.optim's
# constructors import torch._dynamo through torch._compile: 1.2 s of CPU in every fresh rank, 60% of `small`'s build
# at world size 2): a warm rank and the fork server import them up front
MEGATRON = ("torch._dynamo", "megatron.core", "megatron.core.distributed", "megatron.core.tensor_parallel",
            "megatron.core.pipeline_parallel", "megatron.core.models.gpt", "megatron.core.optimizer")


def import_modules(modules: Iterable[str], *, on_cpu: bool, optional: bool = False) -> None:
    """Import `modules` in order (where `optional`, one that is not installed is passed over); on a CPU rank
    with torch.compile's decorations deferred (`deferred_compile`). An entry `module:function` imports the module and
    calls the function, for a package that is imported through one (megatron-bridge: import_bridge)."""
    with deferred_compile() if on_cpu else contextlib.nullcontext():
        for entry in modules:
            module, _, function = entry.partition(":")
            try:
                imported = importlib.import_module(module)
                if function:
                    getattr(imported, function)()
            except (ImportError, MissingDependency):
                if not optional:
                    raise


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """While this holds, `torch.compile(fn)` of a function returns a stand-in that makes the real call,
    `torch.compile(fn, **options)`, at fn's first call and calls what it returns from then on.

    megatron-core decorates ~35 functions with torch.compile as it is imported (`megatron.core.jit.jit_fuser`),
    and the first decoration imports inductor (its code generator's templates included): 2.3 s of a CPU fork
    server's 6 s of imports, for fused kernels a CPU rank never calls (its fusions are off). torch.compile
    compiles at a function's first call either way, so what runs when one is called is the same. GPU ranks
    import as they are (not deferred). Modules and other non-functions go to torch.compile at once."""
    import torch

    real = torch.compile

    def compile(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): the decorator, deferred in turn
            return functools.partial(compile, **options)
        if not inspect.isfunction(model):
            return real(model, **options)
        return _compiled_at_first_call(real, model, options)

    torch.compile = compile
    try:
        yield
    finally:
        torch.compile = real


def _compiled_at_first_call(real: Callable[..., Any], fn: Callable[..., Any], options: dict[str, Any]) \
        -> Callable[..., Any]:
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def first_call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = real(fn, **options)
        return compiled(*args, **kwargs)

    return first_call
