"""Files written whole or not at all: a reader (another process, the next run, CI after a kill) sees the old
file or the complete new one, never half of it, and no temporary file is left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write data to path atomically: a temporary file in the same directory, fsync'ed, then os.replace'd
    over path (the parent directory is created; the mode of the file replaced is kept). str is written as
    UTF-8. On any failure, an interrupt included, the old file stays and the temporary one is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:  # mkstemp makes it 0600: keep the mode of the file it replaces, else rw-r--r--
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            mode = 0o644
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A directory written whole or not at all: yields a temporary sibling to fill; on a clean exit it takes
    path's place (an existing directory there is removed after the swap), on any failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield tmp
        aside = None
        if path.exists() or path.is_symlink():
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old.")) / path.name
            os.replace(path, aside)
        try:
            os.replace(tmp, path)
        except BaseException:
            if aside is not None:
                os.replace(aside, path)
            raise
        if aside is not None:
            shutil.rmtree(aside.parent, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def locked_dir(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive lock on a directory (made if missing) for a read-merge-write of a file in it: two processes
    merging into one file take turns, so neither writes over what the other added. The lock is the
    directory's own (flock), so nothing is left beside the file."""
    import fcntl

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock
