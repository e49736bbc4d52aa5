"""A suite parameter's command-line flag, declared once on the field of its parameter type:
`timed_steps: int = field(default=20, metadata=flag("--timed-steps", "step-perf: timed steps per case"))`.

The CLI's options (`commands/case_args.add_case_args`), the suite parameters a selection holds
(`CaseSelection.from_args`), the arguments that give them again (`to_argv`, `variant_argv`) and the flag a refusal
names (`driver.suite_parameters`) all come from these declarations, so adding a parameter touches its type only.
Its value is checked by the type (`__post_init__`: BadInput) as the flags are read, and again where the suite's
parameters are built for the run. The types are listed in
`harness.suite_defs.PARAM_TYPES` (modules that import no torch: the CLI reads them on every call).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

# metadata keys of a field
_FLAG, _HELP, _CLI = "flag", "help", "cli"


def flag(name: str, help: str, *, cli: bool = True, in_id: bool | None = None) -> dict[str, Any]:
    """Field metadata: the parameter's flag and help. cli=False: no option of its own - a case's parameter that
    another option selects (e.g. a case's one checkpoint format, which --ckpt-format names); named here so a case's
    variant gives its flag. in_id: whether the field is part of the case id (default: it is)."""
    meta: dict[str, Any] = {_FLAG: name, _HELP: help, _CLI: cli}
    if in_id is not None:
        meta["in_id"] = in_id
    return meta


@dataclass(frozen=True)
class ParamFlag:
    """One command-line option of the suites' parameters (a flag several suites share is one option)."""

    flag: str
    field: str  # the parameter's name in its type(s)
    help: str
    kind: str  # "bool" (a switch), "list" (repeatable, a tuple field), "int", "float", "str"

    @property
    def dest(self) -> str:
        """argparse's destination of the flag."""
        return self.flag.lstrip("-").replace("-", "_")


def _kind(f: dataclasses.Field) -> str:
    t = str(f.type)
    for kind in ("bool", "tuple", "int", "float"):
        if t.startswith(kind):
            return "list" if kind == "tuple" else kind
    return "str"


def param_types() -> list[type]:
    """Every parameter type of the built-in suites (harness.suite_defs.PARAM_TYPES), imported."""
    from harness.suite_defs import PARAM_TYPES

    out = []
    for ref in PARAM_TYPES:
        module, _, name = ref.partition(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def _declared(types: list[type] | None = None) -> list[tuple[type, dataclasses.Field]]:
    return [(t, f) for t in (param_types() if types is None else types) for f in dataclasses.fields(t)
            if _FLAG in f.metadata]


def param_flags(types: list[type] | None = None) -> list[ParamFlag]:
    """The options of the suites' parameters, one per flag, in declaration order; ValueError where two types give
    one flag to parameters of different names or kinds."""
    out: dict[str, ParamFlag] = {}
    for t, f in _declared(types):
        if not f.metadata[_CLI]:
            continue
        new = ParamFlag(f.metadata[_FLAG], f.name, f.metadata[_HELP], _kind(f))
        old = out.get(new.flag)
        if old is None:
            out[new.flag] = new
        elif (old.field, old.kind) != (new.field, new.kind):
            raise ValueError(f"{new.flag}: {t.__name__}.{f.name} ({new.kind}) and another type's {old.field} "
                             f"({old.kind}) share it")
        elif new.help not in old.help:
            out[new.flag] = dataclasses.replace(old, help=f"{old.help}; {new.help}")
    return list(out.values())


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
            return f.metadata[_FLAG]
    return "--" + name.replace("_", "-")


def variant_flags(types: list[type] | None = None) -> dict[str, str]:
    """Field name -> flag of every declared parameter (a case's variant names its parameters by field)."""
    return {f.name: f.metadata[_FLAG] for _, f in _declared(types)}
