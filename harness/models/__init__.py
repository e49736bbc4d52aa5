"""Reference model configs, one TOML data file per model in this folder."""

from __future__ import annotations

import dataclasses
import tomllib
from functools import cache
from pathlib import Path

from harness.backends import Tier
from harness.errors import BadInput
from harness.spec import ModelSpec

_DIR = Path(__file__).parent


def known_models() -> list[str]:
    """Model names, smallest first."""
    return sorted((p.stem for p in _DIR.glob("*.toml")), key=lambda n: load_model(n).num_params())


@cache
def load_model(name: str) -> ModelSpec:
    """The ModelSpec of a known model; BadInput listing the known ones otherwise."""
    path = _DIR / f"{name}.toml"
    if not name or "/" in name or not path.is_file():
        raise BadInput(f"unknown model {name!r}; known models: {', '.join(known_models())}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"model file {path} is not valid TOML: {exc}") from exc
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = set(data) - fields
    if unknown:
        raise BadInput(f"model file {path} has unknown keys {sorted(unknown)}; allowed: {sorted(fields - {'name'})}")
    if "tier" in data:
        if data["tier"] not in tuple(Tier):
            raise BadInput(f"model file {path}: tier {data['tier']!r} is not one of {', '.join(Tier)}")
        data["tier"] = Tier(data["tier"])
    return ModelSpec(name=name, **data)
