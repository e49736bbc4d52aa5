"""Engines build model chunks + optimizer for a case and run steps; pick one by name or import path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from harness.engine_names import EngineName
from harness.engines.base import ChecksAvailability
from harness.errors import BadInput, DoesNotApply, MissingDependency

if TYPE_CHECKING:
    from harness.engines.base import Engine
    from harness.launch.context import RankContext
    from harness.spec import Case

BUILTIN: dict[str, str] = {
    EngineName.MCORE: "harness.engines.mcore:McoreEngine",
    EngineName.MBRIDGE: "harness.engines.mbridge:MbridgeEngine",
    EngineName.MEGATRON_BRIDGE: "harness.engines.megatron_bridge:MegatronBridgeEngine",
    EngineName.FSDP2: "harness.engines.fsdp2:FSDP2Engine",
}


def resolve_factory(name: str) -> Callable[[Case, RankContext], Engine]:
    """A built-in engine name or `package.module:factory`; BadInput when it cannot be imported."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise BadInput(f"unknown engine {name!r}; built-in engines: {', '.join(BUILTIN)}, "
                       "or give an import path package.module:factory")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise MissingDependency(f"engine {name!r}: cannot import {exc.name!r} "
                                f"(install it, or check PYTHONPATH for {module_name!r})") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module, whatever it raises, is bad input
        said = f": {str(exc).splitlines()[0]}" if str(exc).strip() else ""
        raise BadInput(f"engine {name!r}: importing {module_name!r} raised {type(exc).__name__}{said} "
                       "(fix that module)") from None
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise BadInput(f"engine {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise BadInput(f"engine {name!r}: {module_name}.{attr} is a {type(factory).__name__}, not a factory; give a "
                       "class or function called as factory(case, ctx) that returns the engine")
    # An engine whose packages may be missing (the bridges) exposes check_available(), on the factory
    # (so subclasses in other modules inherit it) or on its module: MissingDependency with the install
    # command, raised here in the parent before any rank starts.

    for owner in (factory, module):  # the factory first: subclasses in other modules inherit it
        if isinstance(owner, ChecksAvailability):
            owner.check_available()
            break
    return factory


def engine_class_with(engine: str, capability: type, lacks: str) -> type:
    """The engine's factory where it is a class with the capability a suite needs (a Protocol); else DoesNotApply,
    "engine '<name>' <lacks>" (a factory function cannot be looked into before a rank builds the engine)."""
    factory = resolve_factory(engine)
    if not (isinstance(factory, type) and issubclass(factory, capability)):
        raise DoesNotApply(f"engine {engine!r} {lacks}")
    return factory


def make_engine(case: Case, ctx: RankContext) -> Engine:
    return resolve_factory(case.engine)(case, ctx)


def is_fsdp2(engine: str) -> bool:
    """Whether the engine (name or import path) is the fsdp2 engine or derives from it."""
    if engine == EngineName.FSDP2:
        return True
    if ":" not in engine:
        return False
    from harness.engines.fsdp2 import FSDP2Engine  # here: the package stays light for the suites' parameters

    factory = resolve_factory(engine)
    return isinstance(factory, type) and issubclass(factory, FSDP2Engine)


def baseline_suffix(engine: str) -> str:
    """The part of a baseline entry's key that names the engine's own figures: "/fsdp2" for the fsdp2 path (another
    trainer, with its own collectives, memory and trajectory); "" for megatron's paths (mcore and the bridges build
    the same DDP and share one entry, so a bridge that builds otherwise fails against mcore's figures)."""
    return "/fsdp2" if is_fsdp2(engine) else ""
