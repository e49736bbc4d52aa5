"""What every process the harness starts (ranks, the fork server) shares: it dies with its parent and imports
whatever the parent can."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent: int) -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # A parent that died between our fork and the prctl sends no signal: we would live on as an orphan.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def import_path() -> str:
    """This process's sys.path as PYTHONPATH: ranks import whatever the parent can (user engines, test fault
    plugins)."""
    return os.pathsep.join(p for p in sys.path if p)
