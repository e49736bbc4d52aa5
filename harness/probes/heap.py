"""The process's live heap: the bytes malloc has handed out and not had back (glibc's mallinfo2), the figure that
shows what a piece of code kept whatever holds it - tensors on CPU ranks, numpy arrays, bytes, buffers a C extension
allocated - while the RSS also moves with what malloc caches for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in _FIELDS]


@cache
def _mallinfo2() -> object | None:
    """glibc's mallinfo2 (glibc >= 2.33), or None where libc has none (musl, older glibc, macOS)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    return fn


def live_heap() -> int | None:
    """Bytes allocated through malloc and not yet freed, in every arena and every mmapped chunk (uordblks + hblkhd);
    None where libc cannot say (glibc >= 2.33 can)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()  # type: ignore[operator]
    return int(info.uordblks + info.hblkhd)
