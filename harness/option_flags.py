"""A command-line flag declared once, on the dataclass field it sets:
`steps: int = field(default=2, metadata=flag("--steps", "training steps per case"))`.

`CaseOptions`' fields (the core training options) and every suite's parameter types declare theirs this way; the
CLI's options (`commands/case_args.add_case_args`), the pytest options of `suites/`, a selection read from them
(`CaseSelection.from_args`), the arguments that give them again (`to_argv`, `variant_argv`) and the flag a refusal
names all come from these declarations, so an option is added, renamed or documented on its field only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# metadata keys of a field
FLAG, HELP, CLI, CHOICES = "flag", "help", "cli", "choices"


def flag(name: str, help: str, *, cli: bool = True, in_id: bool | None = None,
         choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Field metadata: the field's flag and help. cli=False: no option of its own - a case's parameter that
    another option selects (e.g. a case's one checkpoint format, which --ckpt-format names); named here so a case's
    variant gives its flag. in_id: whether the field is part of the case id (default: it is). choices: the values
    the flag takes."""
    meta: dict[str, Any] = {FLAG: name, HELP: help, CLI: cli}
    if in_id is not None:
        meta["in_id"] = in_id
    if choices is not None:
        meta[CHOICES] = choices
    return meta


@dataclass(frozen=True)
class ParamFlag:
    """One command-line option declared on a field (a flag several types share is one option)."""

    flag: str
    field: str  # the field's name in its type(s)
    help: str
    kind: str  # "bool" (a switch), "list" (repeatable, a tuple field), "int", "float", "str"
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        """argparse's destination of the flag."""
        return self.flag.lstrip("-").replace("-", "_")

    def add_to(self, add: Callable[..., Any]) -> None:
        """The option through `add`: an argparse parser's add_argument or a pytest option group's addoption (they
        take the same keywords); its default is None (False for a switch): not given, so the field's default
        holds."""
        keywords: dict[str, Any] = {"help": self.help.replace("%", "%%")}
        if self.kind == "bool":
            keywords["action"] = "store_true"
        elif self.kind == "list":
            keywords["action"] = "append"
        else:
            keywords.update(type={"int": int, "float": float}.get(self.kind, str), default=None)
            if self.choices:
                keywords["choices"] = list(self.choices)
        add(self.flag, **keywords)


def kind_of(f: dataclasses.Field) -> str:
    t = str(f.type)
    for kind in ("bool", "tuple", "int", "float"):
        if t.startswith(kind):
            return "list" if kind == "tuple" else kind
    return "str"


def declared(types: list[type]) -> list[tuple[type, dataclasses.Field]]:
    """Each field of these types that declares a flag, with its type."""
    return [(t, f) for t in types for f in dataclasses.fields(t) if FLAG in f.metadata]


def flags_of(types: list[type]) -> list[ParamFlag]:
    """The options these types declare, one per flag, in declaration order; ValueError where two types give one
    flag to fields of different names or kinds."""
    out: dict[str, ParamFlag] = {}
    for t, f in declared(types):
        if not f.metadata[CLI]:
            continue
        new = ParamFlag(f.metadata[FLAG], f.name, f.metadata[HELP], kind_of(f), f.metadata.get(CHOICES))
        old = out.get(new.flag)
        if old is None:
            out[new.flag] = new
        elif (old.field, old.kind) != (new.field, new.kind):
            raise ValueError(f"{new.flag}: {t.__name__}.{f.name} ({new.kind}) and another type's {old.field} "
                             f"({old.kind}) share it")
        elif new.help not in old.help:
            out[new.flag] = dataclasses.replace(old, help=f"{old.help}; {new.help}")
    return list(out.values())
