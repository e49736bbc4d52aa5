"""The suites' parameters' command-line flags, declared once on the fields of their parameter types
(`harness/option_flags.py`): `timed_steps: int = field(default=20, metadata=flag("--timed-steps", "..."))`.
Its value is checked by the type (`__post_init__`: BadInput) as the flags are read, and again where the suite's
parameters are built for the run. Each suite's spec lists its types (`SuiteSpec.params` in
harness/suite_registry.py: modules that import no torch, which the CLI reads on every call).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from harness.option_flags import FLAG, ParamFlag, declared, flag, flags_of
from harness.suite_registry import SUITES

__all__ = ["ParamFlag", "check_param_values", "flag", "flag_of", "param_flags", "param_types", "variant_flags"]


def param_types() -> list[type]:
    """Every parameter type the registered suites' specs list (SuiteSpec.params), imported."""

    out = []
    for ref in dict.fromkeys(ref for spec in SUITES.values() for ref in spec.params):
        module, _, name = ref.partition(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def _declared(types: list[type] | None = None) -> list[tuple[type, dataclasses.Field]]:
    return declared(param_types() if types is None else types)


def param_flags(types: list[type] | None = None) -> list[ParamFlag]:
    """The options of the suites' parameters, one per flag, in declaration order; ValueError where two types give
    one flag to parameters of different names or kinds."""
    return flags_of(param_types() if types is None else types)


def check_param_values(values: dict[str, Any], types: list[type] | None = None) -> None:
    """Each type that has one of these parameters built with them: its checks (BadInput) before anything runs."""
    for t in param_types() if types is None else types:
        names = {f.name for f in dataclasses.fields(t)}
        given = {k: v for k, v in values.items() if k in names}
        if given:
            t(**given)


def flag_of(name: str, types: list[type] | None = None) -> str:
    """The flag of a parameter by its field name (`--<name with dashes>` where none is declared)."""
    for _, f in _declared(types):
        if f.name == name:
            return f.metadata[FLAG]
    return "--" + name.replace("_", "-")


def variant_flags(types: list[type] | None = None) -> dict[str, str]:
    """Field name -> flag of every declared parameter (a case's variant names its parameters by field)."""
    return {f.name: f.metadata[FLAG] for _, f in _declared(types)}
