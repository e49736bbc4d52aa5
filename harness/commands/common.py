"""Small helpers the command bodies share."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.errors import BadInput
from harness.report.directory import prepare_out_dir


def say(msg: str) -> None:
    """Progress for the user, on stderr (stdout holds the tables)."""
    print(msg, file=sys.stderr, flush=True)


def out_dir(path: str | None, flag: str = "--out") -> Path | None:
    """The output directory, created and shown writable before anything runs (BadInput otherwise)."""
    if not path:
        return None

    return prepare_out_dir(Path(path), flag)


def existing_baselines_dir(path: str | None, suite: str) -> None:
    """A --baselines-dir to compare against must exist: a mistyped one would read every case as a regression
    with no baseline."""
    if path and not Path(path).is_dir():
        raise BadInput(f"--baselines-dir {path} does not exist: give the directory that holds <platform>/{suite}.json "
                       "(default: the repository's baselines/)")
