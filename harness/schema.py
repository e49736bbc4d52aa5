"""Schema versions of the files the harness writes and reads back: baseline files and results.json (the history
database keeps its own, harness/history/store.py). A file without one was written before versions were stored; its
layout is version 1's. A newer or unknown version is refused, naming the file, so a format change is never read as
corruption or misread as data."""

from __future__ import annotations

from typing import Any

from harness.errors import BadInput

BASELINES = 1
RESULTS = 1


def checked(data: dict[str, Any], current: int, what: str, source: str, fix: str) -> dict[str, Any]:
    """The file's data at the current schema (migrated from an older one); BadInput for a newer or unknown one.
    `fix`: what the user does about an unknown one (re-record, re-run)."""
    version = data.get("schema", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BadInput(f"{what} {source} has an unknown schema {version!r} (this harness writes {current}); {fix}")
    if version > current:
        raise BadInput(f"{what} {source} was written by a newer harness (schema {version}; this one reads up to "
                       f"{current}): upgrade the harness to read it")
    return {**data, "schema": current}  # versions 1..current share one layout: nothing to migrate yet
